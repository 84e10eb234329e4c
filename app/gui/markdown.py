"""Markdown for chat messages: a per-code-block copy link, the split of a growing answer into
complete blocks and a tail, and a small syntax highlighter.

``QTextDocument.setMarkdown`` (md4c) does the parsing, always with ``FEATURES``: GitHub's dialect
without raw HTML, since a model's ``vector<int>`` or ``<Enter>`` is text, not a tag to swallow.
Fenced code blocks keep their fence information as block properties, so ``CodeHighlighter`` colours
only those blocks: keywords, strings, comments and numbers, with a rule set that suits most C-like
and script languages. Each code block is followed by a ``copy-code:N`` link that the message widget
turns into a copy. ``stable_end`` finds where a streaming answer's complete blocks end, so they are
rendered once and only the tail again.
"""

from __future__ import annotations

import re

from hearth.app.gui.qt import QColor, QFont, QSyntaxHighlighter, QTextCharFormat, QTextDocument, QTextFormat

COPY_SCHEME = "copy-code"
FEATURES = QTextDocument.MarkdownFeature.MarkdownDialectGitHub | QTextDocument.MarkdownFeature.MarkdownNoHTML
_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})([^\n`]*)$")
_LIST_ITEM = re.compile(r"^(?:[-*+]|\d{1,9}[.)])(?:[ \t]|$)")
_RULE = re.compile(r"^ {0,3}([-*_=])(?:[ \t]*\1){2,}[ \t]*$")  # a thematic break, or a setext underline
_KEYWORDS = frozenset({
    "and", "as", "assert", "async", "await", "break", "case", "catch", "class", "const", "continue", "def",
    "default", "del", "do", "elif", "else", "enum", "except", "export", "extends", "false", "final",
    "finally", "fn", "for", "from", "func", "function", "go", "if", "impl", "import", "in", "interface", "is",
    "lambda", "let", "match", "mod", "mut", "new", "nil", "none", "None", "not", "null", "or", "package",
    "pass", "private", "pub", "public", "raise", "return", "self", "static", "struct", "super", "switch",
    "this", "throw", "true", "True", "False", "try", "type", "typeof", "use", "var", "void", "while", "with",
    "yield",
})


def code_blocks(markdown: str) -> list[str]:
    """The contents of the fenced code blocks, in order (an unclosed last block counts too)."""
    blocks: list[str] = []
    current: list[str] | None = None
    fence = ""
    for line in markdown.split("\n"):
        match = _FENCE.match(line)
        if current is None and match:
            current, fence = [], match.group(2)
        elif current is not None and line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            blocks.append("\n".join(current))
            current = None
        elif current is not None:
            current.append(line)
    if current is not None:
        blocks.append("\n".join(current))
    return blocks


def with_copy_links(markdown: str, first_index: int = 0) -> str:
    """``markdown`` with a "Copy code" link after each closed fenced code block, numbered from
    ``first_index`` (a part of a longer text counts on from the code blocks before it)."""
    out: list[str] = []
    fence: str | None = None
    index = first_index
    for line in markdown.split("\n"):
        out.append(line)
        stripped = line.strip()
        if fence is None:
            match = _FENCE.match(line)
            fence = match.group(2) if match else None
        elif stripped.startswith(fence) and not stripped.strip(fence[0]):
            out.append(f"\n[Copy code]({COPY_SCHEME}:{index})\n")
            index += 1
            fence = None
    return "\n".join(out)


def stable_end(markdown: str, start: int = 0) -> int:
    """Where the complete top-level blocks of a growing ``markdown`` end, looking from ``start`` (a
    line start outside any code fence, as every value this returns is): the start of the last
    complete line that opens a new block after a blank line, outside code fences, unindented and not
    a list item, after a block that is no table and no rule. What comes before renders the same
    whatever text follows; a list stays in the tail (a later item may join it, or a loose item may
    continue it), as does an unclosed code block. Returns ``start`` when no such line has arrived yet.

    NOTE: a table or a rule as the last block before the cut would render wrongly in a document
    appended to (see ``MarkdownBrowser._append``), so a cut waits until a later block follows them.
    """
    end = start
    fence: str | None = None
    after_blank = False
    last = ""  # the last non-blank line outside code fences
    pos = start
    while (newline := markdown.find("\n", pos)) >= 0:
        line = markdown[pos:newline]
        stripped = line.strip()
        if fence is not None:
            if stripped.startswith(fence) and not stripped.strip(fence[0]):
                fence = None
        elif not stripped:
            after_blank = True
        else:
            if (after_blank and line[0] not in " \t" and not _LIST_ITEM.match(line) and "|" not in last
                    and not _RULE.match(last)):
                end = pos
            match = _FENCE.match(line)
            fence = match.group(2) if match else None
            after_blank = False
            last = line
        pos = newline + 1
    return end


class CodeHighlighter(QSyntaxHighlighter):
    """Colours the code blocks of a Markdown document; prose is left alone."""

    def __init__(self, document: QTextDocument, dark: bool = False) -> None:
        super().__init__(document)
        self.set_dark(dark, rehighlight=False)
        words = "|".join(_KEYWORDS)
        self._rules = [
            (re.compile(rf"\b(?:{words})\b"), "keyword"),
            (re.compile(r"\b\d+(?:\.\d+)?\b"), "number"),
            (re.compile(r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'"), "string"),
            (re.compile(r"(?:#|//).*$"), "comment"),
        ]

    def set_dark(self, dark: bool, *, rehighlight: bool = True) -> None:
        """Colours for a dark (or light) background; ``rehighlight`` recolours the document now."""
        self.dark = dark
        palette = {"keyword": "#ff7b72" if dark else "#cf222e", "string": "#a5d6ff" if dark else "#0a3069",
                   "comment": "#8b949e" if dark else "#6e7781", "number": "#79c0ff" if dark else "#0550ae"}
        self._formats = {name: _format(colour, bold=name == "keyword") for name, colour in palette.items()}
        if rehighlight:
            self.rehighlight()

    def format_of(self, name: str) -> QTextCharFormat:
        """The format of ``name`` ("keyword", "string", "comment", "number") in the current colours."""
        return self._formats[name]

    def highlightBlock(self, text: str) -> None:  # noqa: N802 - Qt's virtual
        block_format = self.currentBlock().blockFormat()
        if not block_format.hasProperty(QTextFormat.Property.BlockCodeFence):
            return
        for pattern, name in self._rules:
            for match in pattern.finditer(text):
                self.setFormat(match.start(), match.end() - match.start(), self._formats[name])


def _format(colour: str, *, bold: bool = False) -> QTextCharFormat:
    fmt = QTextCharFormat()
    fmt.setForeground(QColor(colour))
    if bold:
        fmt.setFontWeight(QFont.Weight.Bold)
    return fmt
