"""The chat store: message trees with versions, stats, presets, search (FTS5 and the LIKE
fallback), export, and persistence across reopening (WAL, schema version)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from hearth.app.store import chats
from hearth.app.store.chats import ChatStore, MessageStats, Preset


@pytest.fixture
def store(tmp_path: Path):
    s = ChatStore(tmp_path / "chats.sqlite3")
    yield s
    s.close()


def _exchange(store: ChatStore, question: str, answer: str) -> tuple[int, int, int]:
    conv = store.create_conversation("Greetings", system_prompt="Be brief.")
    user = store.add_message(conv.id, "user", question, parent_id=None)
    reply = store.add_message(conv.id, "assistant", answer, parent_id=user.id, model="demo",
                              stats=MessageStats(12.5, 0.25, 30, 9), finish_reason="stop")
    return conv.id, user.id, reply.id


def test_default_path_is_under_hearth_home(isolated_home: Path):
    s = ChatStore()
    try:
        assert s.path == isolated_home / "data" / "chats.sqlite3"
        assert s._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert s._db.execute("SELECT version FROM schema_version").fetchone()[0] == chats.SCHEMA_VERSION
    finally:
        s.close()


def test_regenerate_and_edit_keep_every_version(store: ChatStore):
    conv_id, user_id, first = _exchange(store, "Hello", "Hi there")
    second = store.add_message(conv_id, "assistant", "Hello!", parent_id=user_id).id
    assert [m.id for m in store.versions(second)] == [first, second]
    assert [m.content for m in store.thread(conv_id)] == ["Hello", "Hello!"]

    edited = store.add_message(conv_id, "user", "Hello, again", parent_id=None)
    answer = store.add_message(conv_id, "assistant", "Again hi", parent_id=edited.id)
    assert [m.id for m in store.versions(edited.id)] == [user_id, edited.id]
    assert [m.id for m in store.thread(conv_id)] == [edited.id, answer.id]

    # Switching the user message back shows its newest answer; switching the answer shows the first.
    assert [m.id for m in store.select_version(user_id)] == [user_id, second]
    assert [m.id for m in store.select_version(first)] == [user_id, first]
    assert store.conversation(conv_id).current_leaf_id == first


def test_partial_answer_and_stats_are_stored(store: ChatStore):
    conv = store.create_conversation()
    user = store.add_message(conv.id, "user", "Count", parent_id=None)
    answer = store.add_message(conv.id, "assistant", "", parent_id=user.id, is_complete=False)
    store.finish_message(answer.id, "1 2 3", stats=MessageStats(5.0, 0.1, 3, 4), finish_reason="abort",
                         is_complete=False)
    saved = store.message(answer.id)
    assert (saved.content, saved.is_complete, saved.finish_reason) == ("1 2 3", False, "abort")
    assert saved.stats == MessageStats(5.0, 0.1, 3, 4)


def test_survives_reopen(tmp_path: Path):
    path = tmp_path / "c.sqlite3"
    first = ChatStore(path)
    conv_id, _, _ = _exchange(first, "Remember me", "I will")
    first.rename(conv_id, "Memory")
    first.save_preset(Preset("Terse", "Answer in one line.", {"temperature": 0.2}))
    first.save_model_sampling("demo", {"top_k": 5})
    first.close()
    again = ChatStore(path)
    try:
        assert [c.title for c in again.conversations()] == ["Memory"]
        assert [m.content for m in again.thread(conv_id)] == ["Remember me", "I will"]
        assert again.presets() == [Preset("Terse", "Answer in one line.", {"temperature": 0.2})]
        assert again.model_sampling("demo") == {"top_k": 5}
    finally:
        again.close()


def test_rename_and_delete(store: ChatStore):
    conv_id, _, answer = _exchange(store, "a", "b")
    assert store.rename(conv_id, "  ").title == "Untitled"
    store.delete_conversation(conv_id)
    assert store.conversations() == []
    with pytest.raises(KeyError):
        store.message(answer)


@pytest.mark.parametrize("use_fts", [True, False])
def test_search_titles_and_all_versions(store: ChatStore, use_fts: bool):
    store.has_fts = store.has_fts and use_fts
    conv_id, user_id, _ = _exchange(store, "Tell me about zebras", "Striped horses of Africa")
    store.add_message(conv_id, "assistant", "Quagga facts", parent_id=user_id)  # an older version is searchable
    other = store.create_conversation("Weather talk")
    store.add_message(other.id, "user", "Rain tomorrow?", parent_id=None)

    assert [h.conversation_id for h in store.search("striped")] == [conv_id]
    assert [h.conversation_id for h in store.search("zebra")] == [conv_id]  # prefix / substring
    assert [h.conversation_id for h in store.search("weather")] == [other.id]  # title
    assert "Striped" in store.search("striped AFRICA")[0].snippet
    assert store.search("striped rain") == []
    assert store.search("100%") == [] and store.search('"') == []


def test_fts_index_follows_updates(store: ChatStore):
    conv = store.create_conversation()
    answer = store.add_message(conv.id, "assistant", "", parent_id=None, is_complete=False)
    store.finish_message(answer.id, "photosynthesis explained")
    assert [h.message_id for h in store.search("photosynthesis")] == [answer.id]


def test_export_markdown_and_json(store: ChatStore):
    conv_id, user_id, first = _exchange(store, "Hello", "Hi **there**")
    store.add_message(conv_id, "assistant", "Second try", parent_id=user_id)
    store.select_version(first)
    markdown = store.export_markdown(conv_id)
    assert markdown.startswith("# Greetings\n")
    assert "**System**\n\nBe brief." in markdown
    assert "**User**\n\nHello" in markdown and "**Assistant**\n\nHi **there**" in markdown
    assert "12.5 tok/s" in markdown and "first token 0.25 s" in markdown
    assert "Second try" not in markdown  # only the thread shown

    data = json.loads(json.dumps(store.export_json(conv_id)))
    assert data["conversation"]["title"] == "Greetings"
    assert data["thread"] == [user_id, first]
    assert sorted(m["content"] for m in data["messages"]) == ["Hello", "Hi **there**", "Second try"]


def test_newer_schema_is_refused(tmp_path: Path):
    path = tmp_path / "future.sqlite3"
    ChatStore(path).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE schema_version SET version = 99")
    db.commit()
    db.close()
    with pytest.raises(RuntimeError, match="newer Hearth"):
        ChatStore(path)
