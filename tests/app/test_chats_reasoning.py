"""Reasoning in the chat store: kept with the answer, exported, and a file written before the
column existed (schema 1) opens with its chats intact and takes reasoning from then on."""

from __future__ import annotations

import sqlite3

from hearth.app.store.chats import SCHEMA_VERSION, ChatStore, MessageStats

# The schema Hearth wrote before reasoning was stored (version 1).
_V1_SCHEMA = """
CREATE TABLE schema_version (version INTEGER NOT NULL);
INSERT INTO schema_version VALUES (1);
CREATE TABLE conversations (
    id INTEGER PRIMARY KEY, title TEXT NOT NULL, system_prompt TEXT NOT NULL DEFAULT '',
    model TEXT, sampling TEXT NOT NULL DEFAULT '{}', current_leaf_id INTEGER,
    created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE,
    role TEXT NOT NULL, content TEXT NOT NULL DEFAULT '', model TEXT, created_at REAL NOT NULL,
    is_complete INTEGER NOT NULL DEFAULT 1, finish_reason TEXT, stats TEXT);
INSERT INTO conversations VALUES (1, 'Old chat', '', NULL, '{}', 2, 0, 0);
INSERT INTO messages VALUES (1, 1, NULL, 'user', 'hi', NULL, 0, 1, NULL, NULL);
INSERT INTO messages VALUES (2, 1, 1, 'assistant', 'hello', 'm', 0, 1, 'stop', '{"tokens_per_s": 9.5}');
"""


def test_a_schema_1_file_is_migrated_and_keeps_its_chats(tmp_path):
    path = tmp_path / "chats.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript(_V1_SCHEMA)
    store = ChatStore(path)
    thread = store.thread(1)
    assert [(m.content, m.reasoning) for m in thread] == [("hi", ""), ("hello", "")]
    assert thread[1].stats == MessageStats(tokens_per_s=9.5)
    answer = store.add_message(1, "assistant", "", parent_id=1, is_complete=False)
    store.finish_message(answer.id, "sure", reasoning="they greet", stats=MessageStats(thinking_s=1.25))
    store.close()
    reopened = ChatStore(path)
    assert reopened.message(answer.id).reasoning == "they greet"
    assert reopened._db.execute("SELECT version FROM schema_version").fetchone()[0] == SCHEMA_VERSION == 2
    assert "<details><summary>Thought for 1.2 s</summary>" in reopened.export_markdown(1)
    reopened.close()


def test_an_answer_with_only_reasoning_is_not_discarded(tmp_path):
    store = ChatStore(tmp_path / "chats.sqlite3")
    conversation = store.create_conversation()
    user = store.add_message(conversation.id, "user", "q", parent_id=None)
    answer = store.add_message(conversation.id, "assistant", "", parent_id=user.id, reasoning="thinking so far")
    store.discard_empty_answer(answer.id)
    assert store.message(answer.id).reasoning == "thinking so far"
    store.close()
