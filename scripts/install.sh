# Sourced by run.sh and test.sh: install Hearth into a venv once, and again only when what the
# install depends on changes (pyproject.toml, setup.py / setup.cfg if present, the torch pin). The
# install is editable, so code changes need no reinstall.
#
#   . scripts/install.sh
#   hearth_ensure_installed .venv "$PWD" ""         # the app
#   hearth_ensure_installed .venv "$PWD" "[test]"   # the app and its test extras
#
# The stamp VENV/.hearth-install holds the hash of those inputs on its first line and then the
# extras installed with it (the plain install is implied by any of them). pip's output goes to
# VENV/hearth-install.log; the terminal sees one line, or the log's tail when the install fails.

HEARTH_TORCH_PIN="torch==2.13.0"
HEARTH_STAMP=".hearth-install"

hearth_install_key() {  # PROJECT -> the hash of the install's inputs, on stdout
    local project="$1" name
    {
        printf '%s\n' "$HEARTH_TORCH_PIN"
        for name in pyproject.toml setup.py setup.cfg; do
            if [ -f "$project/$name" ]; then
                printf '== %s\n' "$name"
                cat "$project/$name"
            fi
        done
    } | python3 -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())'
}

hearth_needs_install() {  # VENV KEY EXTRAS -> status 0 when an install is needed
    local stamp="$1/$HEARTH_STAMP"
    [ -x "$1/bin/python" ] && [ -f "$stamp" ] || return 0
    [ "$(head -n 1 "$stamp")" = "$2" ] || return 0
    [ -z "$3" ] && return 1
    ! tail -n +2 "$stamp" | grep -qxF -- "$3"
}

hearth_ensure_installed() {  # VENV PROJECT EXTRAS
    local venv="$1" project="$2" extras="$3" key log
    key="$(hearth_install_key "$project")"
    hearth_needs_install "$venv" "$key" "$extras" || return 0
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    log="$venv/hearth-install.log"
    echo "Installing Hearth${extras:+ with $extras} into $venv (only when pyproject.toml changes; log: $log)" >&2
    if ! { "$venv/bin/python" -m pip install -q --upgrade pip &&
           "$venv/bin/python" -m pip install -q "$HEARTH_TORCH_PIN" -e "$project$extras"; } >"$log" 2>&1; then
        tail -n 20 "$log" >&2
        echo "error: installing Hearth failed (full log: $log)" >&2
        return 1
    fi
    if [ -f "$venv/$HEARTH_STAMP" ] && [ "$(head -n 1 "$venv/$HEARTH_STAMP")" = "$key" ]; then
        [ -z "$extras" ] || printf '%s\n' "$extras" >> "$venv/$HEARTH_STAMP"
    else
        { printf '%s\n' "$key"; [ -z "$extras" ] || printf '%s\n' "$extras"; } > "$venv/$HEARTH_STAMP"
    fi
}
