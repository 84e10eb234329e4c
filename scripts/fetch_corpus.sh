#!/usr/bin/env bash
# Fetch the demo model's training corpus into .corpus/ (ignored by git): Debian's python3.11-doc
# package (the Python documentation, PSF License Agreement; code examples also 0BSD), its
# reStructuredText sources reduced to prose, a 4096-entry byte-level BPE trained on them, and the
# token stream (tokens.npy). Needs apt-get (Debian) and the repo's Python with numpy + tokenizers.
#
#   bash scripts/fetch_corpus.sh [OUT_DIR]      # default .corpus
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-.corpus}"
PACKAGE="${CORPUS_PACKAGE:-python3.11-doc}"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY="${PYTHON:-.venv/bin/python}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if [ -z "$(apt-cache policy "$PACKAGE" 2>/dev/null | grep Candidate || true)" ]; then
    apt-get update -qq
fi
(cd "$work" && apt-get download "$PACKAGE" >/dev/null 2>&1)
deb="$(ls "$work"/*.deb)"
version="$(dpkg-deb -f "$deb" Version)"
dpkg -x "$deb" "$work/x"
docs="$(ls -d "$work"/x/usr/share/doc/python3*/html/_sources | head -n 1)"
mkdir -p "$OUT"
cp "$work"/x/usr/share/doc/"$PACKAGE"/copyright "$OUT/COPYRIGHT.debian"
cp "$docs/license.rst.txt" "$OUT/LICENSE.python-docs.rst"
"$PY" -m train.corpus --docs "$docs" --out "$OUT"
cat > "$OUT/source.json" <<JSON
{
  "package": "$PACKAGE",
  "version": "$version",
  "license": "PSF License Agreement (Python documentation; its code examples are dual-licensed PSF and Zero-Clause BSD), see COPYRIGHT.debian and LICENSE.python-docs.rst",
  "description": "The Python 3.11 documentation (tutorial, library and language reference, HOWTOs, FAQs, What's New) from its reStructuredText sources in Debian's $PACKAGE, reduced to prose by train/corpus.py: code blocks, doctests, tables and index directives dropped, inline markup turned into its text.",
  "command": "apt-get download $PACKAGE && dpkg -x ${PACKAGE}_*.deb x && python -m train.corpus --docs x/usr/share/doc/python3.11/html/_sources --out .corpus (scripts/fetch_corpus.sh)"
}
JSON
echo "corpus ready in $OUT: $(cat "$OUT/summary.json")"
