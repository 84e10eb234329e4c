"""Markdown for chat messages: a per-code-block copy link, and a small syntax highlighter.

``QTextDocument.setMarkdown`` (md4c) does the parsing. Fenced code blocks keep their fence
information as block properties, so ``CodeHighlighter`` colours only those blocks: keywords,
strings, comments and numbers, with a rule set that suits most C-like and script languages.
Each code block is followed by a ``copy-code:N`` link that the message widget turns into a copy.
"""

from __future__ import annotations

import re

from hearth.app.gui.qt import QColor, QFont, QSyntaxHighlighter, QTextCharFormat, QTextDocument, QTextFormat

COPY_SCHEME = "copy-code"
_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})([^\n`]*)$")
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


def with_copy_links(markdown: str) -> str:
    """``markdown`` with a "Copy code" link after each closed fenced code block."""
    out: list[str] = []
    fence: str | None = None
    index = 0
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


class CodeHighlighter(QSyntaxHighlighter):
    """Colours the code blocks of a Markdown document; prose is left alone."""

    def __init__(self, document: QTextDocument, dark: bool = False) -> None:
        super().__init__(document)
        palette = {"keyword": "#ff7b72" if dark else "#cf222e", "string": "#a5d6ff" if dark else "#0a3069",
                   "comment": "#8b949e" if dark else "#6e7781", "number": "#79c0ff" if dark else "#0550ae"}
        self._formats = {name: _format(colour, bold=name == "keyword") for name, colour in palette.items()}
        words = "|".join(_KEYWORDS)
        self._rules = [
            (re.compile(rf"\b(?:{words})\b"), "keyword"),
            (re.compile(r"\b\d+(?:\.\d+)?\b"), "number"),
            (re.compile(r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'"), "string"),
            (re.compile(r"(?:#|//).*$"), "comment"),
        ]

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
