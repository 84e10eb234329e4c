"""Message bubbles as rendered: Markdown without raw HTML (text after a ``<`` stays), the user's own
words as typed, a streamed answer parsed a tail at a time (complete blocks once) and ending exactly
as a whole render, and the stats line while an answer is still being written."""

from __future__ import annotations

import re

from hearth.app.gui.markdown import COPY_SCHEME, FEATURES, code_blocks, stable_end, with_copy_links
from hearth.app.gui.message_widget import GENERATING, MessageView, MessageWidget
from hearth.app.gui.qt import QGuiApplication, QTextDocument, QUrl
from hearth.app.store.chats import Message, MessageStats

PARAGRAPH = ("Streaming prose with `inline code`, **bold** words, a <Tab> key and vector<int> in it, "
             "long enough to wrap across the bubble a couple of times. ")
SECTION = (f"## Part {{n}}\n\n{PARAGRAPH * 3}\n\n```python\ndef step_{{n}}(x):\n\n    return x * {{n}}  # twice\n"
           "```\n\n"
           f"- one\n- two\n\n  more of two\n\n1. first\n\n2. second\n\n| a | b |\n|---|---|\n| {{n}} | 2 |\n\n"
           f"> a quote\n\n")


def _message(role: str, content: str = "", *, complete: bool = True, finish: str | None = "stop") -> Message:
    assistant = role == "assistant"
    return Message(1, 1, None, role, content, "demo" if assistant else None, 0.0, complete,
                   finish if assistant else None,
                   MessageStats(tokens_per_s=12.0, completion_tokens=40) if assistant else None)


def _bubble(qtbot, role: str, content: str = "", **kwargs) -> MessageWidget:
    widget = MessageWidget(MessageView(_message(role, content, **kwargs), (1,)))
    qtbot.addWidget(widget)
    widget.resize(900, 400)
    return widget


def test_text_after_a_less_than_sign_stays(qtbot):
    text = ("Use vector<int> x; if a<b and c>d.\n\nPress <Enter> then <Tab>.\n\n"
            "Raw <b>tags</b> are text <img src=x.png> too.\n\n1. one\n2. two")
    shown = _bubble(qtbot, "assistant", text).body.toPlainText()
    for part in ("Use vector<int> x; if a<b and c>d.", "Press <Enter> then <Tab>.",
                 "Raw <b>tags</b> are text <img src=x.png> too.", "one\ntwo"):
        assert part in shown, shown
    markdown = _bubble(qtbot, "assistant", "# Title\n\n**bold** and ~~struck~~ and https://example.org")
    document = markdown.body.document()
    assert document.firstBlock().blockFormat().headingLevel() == 1  # still Markdown (GitHub's dialect)
    assert "bold and struck and https://example.org" in document.toPlainText()


def test_the_users_own_words_are_shown_as_typed(qtbot):
    text = "# note to self\n*not emphasis*, <Enter> and 1) not a list\n    indented"
    body = _bubble(qtbot, "user", text).body
    assert body.toPlainText() == text
    assert body.document().firstBlock().blockFormat().headingLevel() == 0


def test_a_streamed_answer_parses_its_tail_only_and_ends_as_a_whole_render(qtbot):
    text = "".join(SECTION.format(n=n) for n in range(80))
    assert len(text) > 40_000
    widget = _bubble(qtbot, "assistant", "", complete=False, finish=None)
    parsed: list[int] = []
    shown = 0
    while shown < len(text):
        shown = min(len(text), shown + 97)  # chunks that end mid-word, mid-fence, mid-table
        before = widget.body.rendered_chars
        widget.stream_text(text[:shown])
        parsed.append(widget.body.rendered_chars - before)
    # Each batch parses the tail after the last complete block: about one section, whatever came before.
    assert max(parsed) < 2 * len(SECTION.format(n=79)) + 100, max(parsed)
    assert sum(parsed) < 4 * len(text)  # a whole render per batch would be ~ len(text)**2 / 194
    streamed = widget.body.document()
    whole = QTextDocument()
    whole.setMarkdown(with_copy_links(text), FEATURES)
    # The same blocks while streaming (tables leave an empty line after them until the end).
    assert _lines(streamed.toMarkdown()) == _lines(whole.toMarkdown())
    links = [int(n) for n in re.findall(rf"{COPY_SCHEME}:(\d+)", streamed.toHtml())]
    assert links == list(range(len(code_blocks(text)))) == list(range(80))
    widget._on_link(QUrl(f"{COPY_SCHEME}:7"))
    assert QGuiApplication.clipboard().text() == code_blocks(text)[7]

    widget.set_text(text)  # the answer ended: one render of the whole text, exactly as a fresh one
    assert widget.body.document().toMarkdown() == whole.toMarkdown()


def _lines(markdown: str) -> list[str]:
    return [line for line in markdown.replace("\u200b", "").splitlines() if line.strip()]


def test_complete_blocks_end_before_lists_indented_lines_and_open_fences():
    text = "Intro.\n\n- a\n\n- b\n\nAfter.\n\n```\ncode\n\nstill code\n```\n\nLast\n"
    assert stable_end(text) == text.index("Last")
    assert stable_end(text[:-1]) == text.index("```")  # "Last" may still grow (into "Last:", say)
    assert stable_end("Intro.\n\n- a\n\n- b\n") == 0  # a list may still grow: it stays in the tail
    assert stable_end("Intro.\n\n    code\n\n    more\n") == 0  # indented: part of what came before
    assert stable_end("Intro.\n\n```\na\n\nb\n") == len("Intro.\n\n")  # inside an open fence: not yet
    assert stable_end("Intro.\n\nNext") == 0  # "Next" may still become "Next:" or a list item ("1")
    table = "| a |\n|---|\n| 1 |\n\nAfter\n\nMore\n"
    assert stable_end(table) == table.index("More")  # never right after a table (or a rule)


def test_a_running_answer_says_generating_not_stopped(qtbot):
    widget = _bubble(qtbot, "assistant", "Half an answer", complete=False, finish=None)
    widget.set_live(True)
    assert GENERATING in widget.stats_label.text() and "stopped" not in widget.stats_label.text()
    widget.set_live(False)  # what is left of an answer that never finished
    assert "stopped" in widget.stats_label.text() and GENERATING not in widget.stats_label.text()
    done = _bubble(qtbot, "assistant", "Whole", complete=True, finish="stop")
    assert done.stats_label.text() == "12.0 tok/s · 40 tokens"
