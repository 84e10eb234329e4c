"""An unreadable chat database never stops Hearth: random bytes, a truncated file and a file with
damaged pages are set aside (nothing deleted), a fresh store starts, and what can still be read is
copied into it. A locked database is not mistaken for a corrupt one. The files are private (0600)."""

from __future__ import annotations

import logging
import os
import random
import sqlite3
import stat
from pathlib import Path

import pytest

from hearth.app.store.chats import ChatStore, _is_corrupt

CONVERSATIONS = 300


def _fill(path: Path) -> dict[int, list[str]]:
    """A store with many conversations of two messages each; returns each one's thread texts."""
    store = ChatStore(path)
    threads = {}
    for i in range(CONVERSATIONS):
        conv = store.create_conversation(f"Conversation {i}")
        user = store.add_message(conv.id, "user", f"question {i} " * 20, parent_id=None)
        store.add_message(conv.id, "assistant", f"answer {i} " * 40, parent_id=user.id)
        threads[conv.id] = [m.content for m in store.thread(conv.id)]
    store.close()
    return threads


def _aside(path: Path) -> list[Path]:
    return sorted(p for p in path.parent.iterdir() if ".corrupt-" in p.name and p.name.count("-") <= 3)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_random_bytes_are_set_aside_and_a_fresh_store_starts(tmp_path: Path, caplog):
    path = tmp_path / "chats.sqlite3"
    garbage = random.Random(0).randbytes(64 * 1024)
    path.write_bytes(garbage)
    with caplog.at_level(logging.WARNING):
        store = ChatStore(path)
    try:
        assert store.recovery is not None and store.recovery.conversations == 0
        assert "not a database" in store.recovery.reason
        [aside] = _aside(path)
        assert aside == store.recovery.aside and aside.read_bytes() == garbage  # kept as it was
        assert store.conversations() == []
        store.create_conversation("works again")
        assert [r.getMessage() for r in caplog.records] == [store.recovery.describe()]
    finally:
        store.close()
    again = ChatStore(path)  # told once: the next start finds a healthy file
    try:
        assert again.recovery is None and [c.title for c in again.conversations()] == ["works again"]
    finally:
        again.close()


def test_a_truncated_file_keeps_what_is_readable(tmp_path: Path):
    path = tmp_path / "chats.sqlite3"
    threads = _fill(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    store = ChatStore(path)
    try:
        recovery = store.recovery
        assert recovery is not None and "malformed" in recovery.reason
        assert _aside(path)[0].read_bytes() == data[: len(data) // 2]
        kept = store.conversations()
        assert 0 < recovery.conversations == len(kept) < CONVERSATIONS
        assert 0 < recovery.messages < 2 * CONVERSATIONS
        with_messages = [c for c in kept if c.current_leaf_id is not None]
        assert with_messages
        for conv in kept:  # every surviving thread can be shown; whatever it holds is what was stored
            full = threads[conv.id]
            assert [m.content for m in store.thread(conv.id)] in ([], full, full[:1], full[1:])
    finally:
        store.close()


def test_damaged_pages_in_the_middle_keep_rows_on_both_sides(tmp_path: Path):
    path = tmp_path / "chats.sqlite3"
    threads = _fill(path)
    size = path.stat().st_size
    with open(path, "r+b") as f:  # scribble over a run of pages in the middle of the file
        f.seek(size // 2 - size // 2 % 4096)
        f.write(random.Random(1).randbytes(8 * 4096))
    store = ChatStore(path)
    try:
        assert store.recovery is not None
        ids = {c.id for c in store.conversations()}
        assert 0 < len(ids) <= CONVERSATIONS
        complete = [cid for cid in ids if [m.content for m in store.thread(cid)] == threads[cid]]
        assert complete and min(complete) == 1  # rows before the damage
        assert max(complete) > 1  # and rows found by the backwards scan or beyond the damage
        hits = store.search("answer")
        assert hits and {h.conversation_id for h in hits} <= ids  # the search index was rebuilt
    finally:
        store.close()


def test_only_corruption_counts_as_corrupt(tmp_path: Path):
    """A busy or locked file is someone else's moment, not damage: it must never be set aside."""
    path = tmp_path / "plain.sqlite3"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(sqlite3.OperationalError, match="locked") as locked:
            sqlite3.connect(path, timeout=0).execute("SELECT * FROM t")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert not _is_corrupt(locked.value)
    garbage = tmp_path / "garbage.sqlite3"
    garbage.write_bytes(b"x" * 4096)
    with pytest.raises(sqlite3.DatabaseError) as not_a_db:
        sqlite3.connect(garbage).execute("SELECT * FROM sqlite_master")
    assert _is_corrupt(not_a_db.value)


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
def test_the_database_and_its_folder_are_private(isolated_home: Path):
    store = ChatStore()
    try:
        store.create_conversation("secret")
        files = [store.path, store.path.with_name(store.path.name + "-wal"),
                 store.path.with_name(store.path.name + "-shm")]
        assert all(f.exists() for f in files)
        assert [_mode(f) for f in files] == [0o600] * 3
        assert _mode(store.path.parent) == 0o700
    finally:
        store.close()


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
def test_an_existing_database_becomes_private(tmp_path: Path):
    path = tmp_path / "chats.sqlite3"
    ChatStore(path).close()
    os.chmod(path, 0o644)
    ChatStore(path).close()
    assert _mode(path) == 0o600
