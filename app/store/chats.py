"""The chat store: conversations, message trees with versions, stats, presets, search and export.

One SQLite file (``chats.sqlite3`` under the data folder) in WAL mode, with a ``schema_version``
table for future migrations. Qt-free, so the CLI and tests use it without a ``QApplication``.

Messages form a tree: every message names its ``parent_id`` (None for the first of a thread).
Regenerating an answer adds a sibling under the same user message; editing and resending a user
message adds a sibling under the same parent. Nothing is overwritten, so every earlier version stays
reachable. A conversation remembers its ``current_leaf_id``; the thread shown is the path from the
root to that leaf. Switching a message to another version moves the leaf to the newest message in
that version's subtree.

Full-text search uses FTS5 when SQLite has it, else ``LIKE``. Writes happen when a message starts
(an empty, incomplete row) and when it completes or is stopped (content + stats), so a partial
answer survives a stop or a quit.

A file SQLite cannot read (random bytes, a truncated copy, a failed integrity check) never stops
the app: it is renamed aside (``chats.sqlite3.corrupt-<time>``, with its -wal/-shm), a fresh store
takes its place, and every row that can still be read from the old file is copied into it
(``ChatStore.recovery`` says what happened, so the GUI can tell the user once). The file and its
-wal/-shm are the owner's only (0600): SQLite gives the -wal/-shm the database file's mode.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from hearth.app.paths import PRIVATE_FILE_MODE, data_dir, private_file

logger = logging.getLogger(__name__)
SCHEMA_VERSION = 2
# Schema changes, applied in order to a file written at an older version (version -> its SQL).
_MIGRATIONS = {
    2: "ALTER TABLE messages ADD COLUMN reasoning TEXT NOT NULL DEFAULT ''",  # a thinking model's reasoning
}
SIDE_FILES = ("-wal", "-shm", "-journal")
# Recovered in this order, so messages find their conversations. Table -> its columns.
_RECOVERED_TABLES = {
    "conversations": ("id", "title", "system_prompt", "model", "sampling", "current_leaf_id", "created_at",
                      "updated_at"),
    "messages": ("id", "conversation_id", "parent_id", "role", "content", "model", "created_at", "is_complete",
                 "finish_reason", "stats", "reasoning"),
    "presets": ("name", "system_prompt", "sampling"),
    "model_sampling": ("model", "sampling"),
}
Role = Literal["system", "user", "assistant"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY, title TEXT NOT NULL, system_prompt TEXT NOT NULL DEFAULT '',
    model TEXT, sampling TEXT NOT NULL DEFAULT '{}', current_leaf_id INTEGER,
    created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE,
    role TEXT NOT NULL, content TEXT NOT NULL DEFAULT '', model TEXT, created_at REAL NOT NULL,
    is_complete INTEGER NOT NULL DEFAULT 1, finish_reason TEXT, stats TEXT, reasoning TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS messages_by_parent ON messages(conversation_id, parent_id);
CREATE TABLE IF NOT EXISTS presets (
    name TEXT PRIMARY KEY, system_prompt TEXT NOT NULL, sampling TEXT NOT NULL DEFAULT '{}');
CREATE TABLE IF NOT EXISTS model_sampling (model TEXT PRIMARY KEY, sampling TEXT NOT NULL);
"""

_FTS_SCHEMA = """
CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts USING fts5(content, content='messages', content_rowid='id');
CREATE TRIGGER IF NOT EXISTS messages_ai AFTER INSERT ON messages BEGIN
    INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END;
CREATE TRIGGER IF NOT EXISTS messages_ad AFTER DELETE ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content); END;
CREATE TRIGGER IF NOT EXISTS messages_au AFTER UPDATE OF content ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
    INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END;
"""


@dataclass(frozen=True)
class MessageStats:
    """How an answer was produced; any figure may be unknown (None)."""

    tokens_per_s: float | None = None
    time_to_first_token_s: float | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    context_start_id: int | None = None  # the first message the model saw (older ones were dropped)
    thinking_s: float | None = None  # from the first reasoning token to the first answer token


@dataclass(frozen=True)
class Message:
    id: int
    conversation_id: int
    parent_id: int | None
    role: Role
    content: str
    model: str | None
    created_at: float
    is_complete: bool
    finish_reason: str | None
    stats: MessageStats | None
    reasoning: str = ""  # a thinking model's reasoning before the answer; never sent back to it


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    system_prompt: str
    model: str | None
    sampling: dict[str, Any]
    current_leaf_id: int | None
    created_at: float
    updated_at: float


@dataclass(frozen=True)
class Preset:
    name: str
    system_prompt: str
    sampling: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SearchHit:
    conversation_id: int
    title: str
    message_id: int | None
    snippet: str


@dataclass(frozen=True)
class Recovery:
    """What happened to an unreadable chat file: where it went and what was copied back."""

    aside: Path
    reason: str
    conversations: int
    messages: int

    def describe(self) -> str:
        return (f"The chat history could not be read ({self.reason}); it was moved to {self.aside} and a fresh "
                f"one started. Recovered {self.conversations} conversations and {self.messages} messages.")


def default_path() -> Path:
    return data_dir() / "chats.sqlite3"


class ChatStore:
    """All chats of one user. Use from one thread at a time; every call commits."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path) if path else default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.has_fts = False
        self.recovery: Recovery | None = None  # set when an unreadable file was replaced
        try:
            self._open()
        except sqlite3.DatabaseError as exc:
            if not _is_corrupt(exc):  # locked, permissions, disk full...: not the file's fault
                raise
            self._db.close()
            self.recovery = self._replace_unreadable(str(exc))
            logger.warning("%s", self.recovery.describe())

    def _open(self) -> None:
        _make_private(self.path)  # before SQLite creates the -wal/-shm: they copy its mode
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        # Checked before anything writes to the file (switching to WAL does). O(file size), which for
        # chats is milliseconds.
        problem = self._db.execute("PRAGMA quick_check(1)").fetchone()[0]
        if problem != "ok":
            raise _FailedCheck(f"integrity check: {problem}")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._migrate()

    def _replace_unreadable(self, reason: str) -> Recovery:
        """Move the file (and its -wal/-shm) aside, open a fresh store, copy in what is readable."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        for n in range(2, 1000):  # never over an earlier set-aside file
            if not aside.exists():
                break
            aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
        for suffix in ("", *SIDE_FILES):
            source = self.path.with_name(self.path.name + suffix)
            if source.exists():
                os.replace(source, aside.with_name(aside.name + suffix))  # SQLite finds the -wal by name
        self._open()
        copied = _copy_readable_rows(aside, self._db)
        return Recovery(aside, reason.splitlines()[0][:200], copied["conversations"], copied["messages"])

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _migrate(self) -> None:
        self._db.executescript(_SCHEMA)  # idempotent: every statement is IF NOT EXISTS
        with self._tx() as db:
            row = db.execute("SELECT version FROM schema_version").fetchone()
            if row is None:  # a new file: _SCHEMA made it at the current version
                db.execute("INSERT INTO schema_version(version) VALUES (?)", (SCHEMA_VERSION,))
            elif row["version"] > SCHEMA_VERSION:
                raise RuntimeError(f"{self.path} was written by a newer Hearth (schema {row['version']})")
            elif row["version"] < SCHEMA_VERSION:
                for version in range(row["version"] + 1, SCHEMA_VERSION + 1):
                    db.execute(_MIGRATIONS[version])
                db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))
        try:
            self._db.executescript(_FTS_SCHEMA)
            self.has_fts = True
        except sqlite3.OperationalError:  # SQLite built without FTS5: search falls back to LIKE
            self.has_fts = False

    # ---- conversations ----------------------------------------------------------------------
    def create_conversation(self, title: str = "New chat", *, system_prompt: str = "",
                            model: str | None = None, sampling: dict[str, Any] | None = None) -> Conversation:
        now = time.time()
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO conversations(title, system_prompt, model, sampling, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?)", (title, system_prompt, model, json.dumps(sampling or {}), now, now))
        return self.conversation(int(cur.lastrowid))

    def conversation(self, conversation_id: int) -> Conversation:
        row = self._db.execute("SELECT * FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        if row is None:
            raise KeyError(f"no conversation {conversation_id}")
        return _conversation(row)

    def conversations(self, limit: int | None = None, offset: int = 0) -> list[Conversation]:
        """Conversations, most recently updated first: all of them, or ``limit`` from ``offset``."""
        rows = self._db.execute("SELECT * FROM conversations ORDER BY updated_at DESC, id DESC LIMIT ? OFFSET ?",
                                (-1 if limit is None else limit, offset))
        return [_conversation(r) for r in rows]

    def count_conversations(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM conversations").fetchone()[0])

    def update_conversation(self, conversation_id: int, **changes: Any) -> Conversation:
        """Change ``title``, ``system_prompt``, ``model`` or ``sampling`` (a dict)."""
        allowed = {"title", "system_prompt", "model", "sampling"}
        unknown = set(changes) - allowed
        if unknown:
            raise ValueError(f"cannot change {', '.join(sorted(unknown))}")
        if "sampling" in changes:
            changes["sampling"] = json.dumps(changes["sampling"] or {})
        sets = ", ".join(f"{name} = ?" for name in changes)
        with self._tx() as db:
            db.execute(f"UPDATE conversations SET {sets}, updated_at = ? WHERE id = ?",
                       (*changes.values(), time.time(), conversation_id))
        return self.conversation(conversation_id)

    def rename(self, conversation_id: int, title: str) -> Conversation:
        return self.update_conversation(conversation_id, title=title.strip() or "Untitled")

    def delete_conversation(self, conversation_id: int) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM messages WHERE conversation_id = ?", (conversation_id,))
            db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # ---- messages ---------------------------------------------------------------------------
    def add_message(self, conversation_id: int, role: Role, content: str, *, parent_id: int | None,
                    model: str | None = None, is_complete: bool = True,
                    stats: MessageStats | None = None, finish_reason: str | None = None,
                    reasoning: str = "") -> Message:
        """Append a message under ``parent_id``; it becomes the conversation's current leaf."""
        now = time.time()
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO messages(conversation_id, parent_id, role, content, model, created_at, is_complete, "
                "finish_reason, stats, reasoning) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, parent_id, role, content, model, now, int(is_complete), finish_reason,
                 _stats_json(stats), reasoning))
            db.execute("UPDATE conversations SET current_leaf_id = ?, updated_at = ? WHERE id = ?",
                       (cur.lastrowid, now, conversation_id))
        return self.message(int(cur.lastrowid))

    def finish_message(self, message_id: int, content: str, *, stats: MessageStats | None = None,
                       finish_reason: str | None = None, is_complete: bool = True, reasoning: str = "") -> Message:
        """Store an answer's final (or partial, when stopped) text, reasoning and stats."""
        with self._tx() as db:
            db.execute("UPDATE messages SET content = ?, stats = ?, finish_reason = ?, is_complete = ?, reasoning = ? "
                       "WHERE id = ?", (content, _stats_json(stats), finish_reason, int(is_complete), reasoning,
                                        message_id))
            db.execute("UPDATE conversations SET updated_at = ? WHERE id = "
                       "(SELECT conversation_id FROM messages WHERE id = ?)", (time.time(), message_id))
        return self.message(message_id)

    def discard_empty_answer(self, message_id: int) -> None:
        """Remove an answer that never got a word (the request was refused before it started);
        its parent becomes the current leaf again. Anything else is left alone."""
        with self._tx() as db:
            row = db.execute("SELECT conversation_id, parent_id, content, reasoning FROM messages WHERE id = ? "
                             "AND role = 'assistant' AND NOT EXISTS (SELECT 1 FROM messages c WHERE c.parent_id = ?)",
                             (message_id, message_id)).fetchone()
            if row is None or row["content"] or row["reasoning"]:
                return
            db.execute("DELETE FROM messages WHERE id = ?", (message_id,))
            db.execute("UPDATE conversations SET current_leaf_id = ? WHERE id = ? AND current_leaf_id = ?",
                       (row["parent_id"], row["conversation_id"], message_id))

    def message(self, message_id: int) -> Message:
        row = self._db.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            raise KeyError(f"no message {message_id}")
        return _message(row)

    def thread(self, conversation_id: int, leaf_id: int | None = None) -> list[Message]:
        """The messages from the root to ``leaf_id`` (default: the current leaf), oldest first."""
        if leaf_id is None:
            leaf_id = self.conversation(conversation_id).current_leaf_id
        path: list[Message] = []
        while leaf_id is not None:
            message = self.message(leaf_id)
            path.append(message)
            leaf_id = message.parent_id
        return path[::-1]

    def versions(self, message_id: int) -> list[Message]:
        """A message and its siblings (same parent, same role), oldest first."""
        message = self.message(message_id)
        parent_clause = "parent_id IS NULL" if message.parent_id is None else "parent_id = ?"
        params: tuple[Any, ...] = (message.conversation_id, message.role)
        if message.parent_id is not None:
            params += (message.parent_id,)
        rows = self._db.execute(f"SELECT * FROM messages WHERE conversation_id = ? AND role = ? AND {parent_clause} "
                                "ORDER BY id", params)
        return [_message(r) for r in rows]

    def select_version(self, message_id: int) -> list[Message]:
        """Show ``message_id`` in its conversation: the leaf becomes its newest descendant."""
        leaf = message_id
        while True:
            row = self._db.execute("SELECT id FROM messages WHERE parent_id = ? ORDER BY id DESC LIMIT 1",
                                   (leaf,)).fetchone()
            if row is None:
                break
            leaf = row["id"]
        conversation_id = self.message(message_id).conversation_id
        with self._tx() as db:
            db.execute("UPDATE conversations SET current_leaf_id = ? WHERE id = ?", (leaf, conversation_id))
        return self.thread(conversation_id, leaf)

    def all_messages(self, conversation_id: int) -> list[Message]:
        rows = self._db.execute("SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,))
        return [_message(r) for r in rows]

    # ---- presets ----------------------------------------------------------------------------
    def save_preset(self, preset: Preset) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO presets(name, system_prompt, sampling) VALUES (?, ?, ?)",
                       (preset.name, preset.system_prompt, json.dumps(preset.sampling)))

    def presets(self) -> list[Preset]:
        rows = self._db.execute("SELECT * FROM presets ORDER BY name COLLATE NOCASE")
        return [Preset(r["name"], r["system_prompt"], json.loads(r["sampling"])) for r in rows]

    def delete_preset(self, name: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM presets WHERE name = ?", (name,))

    def model_sampling(self, model: str) -> dict[str, Any]:
        """The sampling settings last used with ``model`` (empty: the defaults)."""
        row = self._db.execute("SELECT sampling FROM model_sampling WHERE model = ?", (model,)).fetchone()
        return json.loads(row["sampling"]) if row else {}

    def save_model_sampling(self, model: str, sampling: dict[str, Any]) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO model_sampling(model, sampling) VALUES (?, ?)",
                       (model, json.dumps(sampling)))

    # ---- search and export ------------------------------------------------------------------
    def search(self, query: str, limit: int = 50) -> list[SearchHit]:
        """Conversations whose title or any message (any version) matches every word of ``query``."""
        words = query.split()
        if not words:
            return []
        hits: dict[int, SearchHit] = {}
        title_sql = "SELECT id, title FROM conversations WHERE " + _all_like("title", len(words))
        for row in self._db.execute(title_sql, [_like(w) for w in words]):
            hits[row["id"]] = SearchHit(row["id"], row["title"], None, row["title"])
        for row in self._message_matches(words, limit):
            hits.setdefault(row["conversation_id"], SearchHit(row["conversation_id"], row["title"], row["id"],
                                                              _snippet(row["content"], words)))
        return list(hits.values())[:limit]

    def _message_matches(self, words: list[str], limit: int) -> list[sqlite3.Row]:
        select = ("SELECT m.id, m.conversation_id, m.content, c.title FROM messages m "
                  "JOIN conversations c ON c.id = m.conversation_id ")
        if self.has_fts:
            match = " ".join('"' + w.replace('"', '""') + '"*' for w in words)
            sql = select + "JOIN messages_fts f ON f.rowid = m.id WHERE messages_fts MATCH ? ORDER BY rank LIMIT ?"
            return self._db.execute(sql, (match, limit)).fetchall()
        sql = select + "WHERE " + _all_like("m.content", len(words)) + " ORDER BY m.id DESC LIMIT ?"
        return self._db.execute(sql, (*[_like(w) for w in words], limit)).fetchall()

    def export_markdown(self, conversation_id: int) -> str:
        """The shown thread as Markdown: a title, the system prompt, then each turn."""
        conv = self.conversation(conversation_id)
        lines = [f"# {conv.title}", ""]
        if conv.system_prompt:
            lines += ["**System**", "", conv.system_prompt, ""]
        for message in self.thread(conversation_id):
            lines += [f"**{message.role.capitalize()}**", ""]
            if message.reasoning:
                # A <details> block: folded like the chat's Thinking block where Markdown renders HTML.
                lines += [f"<details><summary>{thinking_title(message)}</summary>", "", message.reasoning, "",
                          "</details>", ""]
            lines += [message.content, ""]
            note = _stats_note(message)
            if note:
                lines += [f"*{note}*", ""]
        return "\n".join(lines).rstrip() + "\n"

    def export_json(self, conversation_id: int) -> dict[str, Any]:
        """Everything about a conversation: settings, the shown thread and every version."""
        conv = self.conversation(conversation_id)
        thread_ids = [m.id for m in self.thread(conversation_id)]
        return {"format": "hearth-chat", "version": SCHEMA_VERSION, "conversation": asdict(conv),
                "thread": thread_ids, "messages": [asdict(m) for m in self.all_messages(conversation_id)]}


class _FailedCheck(sqlite3.DatabaseError):
    """SQLite opened the file, but its integrity check found damage."""


def _is_corrupt(exc: sqlite3.DatabaseError) -> bool:
    # SQLITE_CORRUPT (11) and SQLITE_NOTADB (26), with any extended code in the high bits.
    return isinstance(exc, _FailedCheck) or getattr(exc, "sqlite_errorcode", 0) & 0xFF in (11, 26)


def _make_private(path: Path) -> None:
    private_file(path)
    for suffix in SIDE_FILES:
        side = path.with_name(path.name + suffix)
        if side.exists() and os.name == "posix":
            os.chmod(side, PRIVATE_FILE_MODE)


def _copy_readable_rows(source: Path, target: sqlite3.Connection) -> dict[str, int]:
    """Best effort, like the sqlite3 shell's ``.recover`` but with what Python's module offers: on a
    scratch copy of the file (the set-aside file stays as it was), read each table forwards and then
    backwards by rowid until a damaged page stops the scan, insert every row read, then repair the
    references a lost row broke. Returns rows copied per table."""
    copied = dict.fromkeys(_RECOVERED_TABLES, 0)
    with tempfile.TemporaryDirectory(prefix=".recover-", dir=source.parent) as scratch:
        copy = Path(scratch) / "chats.sqlite3"
        for suffix in ("", "-wal"):
            if source.with_name(source.name + suffix).exists():
                shutil.copyfile(source.with_name(source.name + suffix), copy.with_name(copy.name + suffix))
        _trust_file_size(copy)
        old = sqlite3.connect(copy)
        target.execute("PRAGMA foreign_keys=OFF")  # parents may be among the lost rows; repaired below
        try:
            for table, wanted in _RECOVERED_TABLES.items():
                columns = _present_columns(old, table, wanted)
                insert = (f"INSERT OR IGNORE INTO {table}({', '.join(columns)}) "
                          f"VALUES ({', '.join('?' * len(columns))})")
                for row in _readable_rows(old, table, columns):
                    copied[table] += target.execute(insert, row).rowcount
            _repair_references(target)
        finally:
            target.execute("PRAGMA foreign_keys=ON")
            old.close()
    return copied


def _trust_file_size(path: Path) -> None:
    """A truncated file still claims its old page count in its header, and SQLite then refuses to
    read any of it. Zero that field (SQLite falls back to the file's size) and cut the last partial
    page, so the pages that survived can be read."""
    with open(path, "r+b") as f:
        header = f.read(100)
        if len(header) < 100 or not header.startswith(b"SQLite format 3\0"):
            return  # not an SQLite file at all: nothing to read
        page_size = int.from_bytes(header[16:18], "big")
        page_size = 65536 if page_size == 1 else page_size
        f.seek(28)
        f.write(bytes(4))
        size = f.seek(0, os.SEEK_END)
        f.truncate(size - size % page_size if page_size else size)


def _present_columns(db: sqlite3.Connection, table: str, columns: tuple[str, ...]) -> tuple[str, ...]:
    """The ``columns`` the old file's table has (a file of an older schema lacks the newer ones);
    all of them when its schema cannot be read."""
    try:
        names = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
    except sqlite3.DatabaseError:
        return columns
    return tuple(c for c in columns if c in names) or columns


def _readable_rows(db: sqlite3.Connection, table: str, columns: tuple[str, ...]) -> Iterator[tuple[Any, ...]]:
    seen: set[int] = set()
    for order in ("ASC", "DESC"):
        try:
            query = f"SELECT rowid, {', '.join(columns)} FROM {table} ORDER BY rowid {order}"
            for rowid, *values in db.execute(query):
                if rowid in seen:
                    return  # the two scans met: everything readable was read
                seen.add(rowid)
                yield tuple(values)
        except sqlite3.DatabaseError:
            continue  # a damaged page (or no such table): try from the other end


def _repair_references(db: sqlite3.Connection) -> None:
    """Drop messages of lost conversations; a message whose parent was lost starts its thread;
    a conversation's current leaf that was lost becomes its newest surviving message."""
    db.execute("DELETE FROM messages WHERE conversation_id NOT IN (SELECT id FROM conversations)")
    db.execute("UPDATE messages SET parent_id = NULL WHERE parent_id IS NOT NULL "
               "AND parent_id NOT IN (SELECT id FROM messages)")
    db.execute("UPDATE conversations SET current_leaf_id = (SELECT MAX(id) FROM messages m "
               "WHERE m.conversation_id = conversations.id) WHERE current_leaf_id IS NULL "
               "OR current_leaf_id NOT IN (SELECT id FROM messages)")


def _conversation(row: sqlite3.Row) -> Conversation:
    return Conversation(row["id"], row["title"], row["system_prompt"], row["model"], json.loads(row["sampling"]),
                        row["current_leaf_id"], row["created_at"], row["updated_at"])


def _message(row: sqlite3.Row) -> Message:
    stats = _stats(row["stats"])
    return Message(row["id"], row["conversation_id"], row["parent_id"], row["role"], row["content"], row["model"],
                   row["created_at"], bool(row["is_complete"]), row["finish_reason"], stats, row["reasoning"])


def _stats(text: str | None) -> MessageStats | None:
    """Stats from their JSON; keys this version does not know (a newer Hearth's) are ignored."""
    if not text:
        return None
    known = {f.name for f in fields(MessageStats)}
    return MessageStats(**{k: v for k, v in json.loads(text).items() if k in known})


def _stats_json(stats: MessageStats | None) -> str | None:
    return json.dumps(asdict(stats)) if stats is not None else None


def thinking_title(message: Message) -> str:
    """"Thought for 3.2 s" (or "Thinking" when the time is unknown)."""
    seconds = message.stats.thinking_s if message.stats is not None else None
    return "Thinking" if seconds is None else f"Thought for {seconds:.1f} s"


def _stats_note(message: Message) -> str:
    parts = []
    if message.model and message.role == "assistant":
        parts.append(message.model)
    stats = message.stats
    if stats is not None and stats.tokens_per_s is not None:
        parts.append(f"{stats.tokens_per_s:.1f} tok/s")
    if stats is not None and stats.time_to_first_token_s is not None:
        parts.append(f"first token {stats.time_to_first_token_s:.2f} s")
    if message.role == "assistant" and not message.is_complete:
        parts.append("stopped")
    return " · ".join(parts)


def _all_like(column: str, count: int) -> str:
    return " AND ".join([f"{column} LIKE ? ESCAPE '\\'"] * count)


def _like(word: str) -> str:
    escaped = word.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def _snippet(content: str, words: list[str], width: int = 80) -> str:
    lowered = content.lower()
    at = min((i for i in (lowered.find(w.lower()) for w in words) if i >= 0), default=0)
    start = max(at - width // 3, 0)
    text = content[start:start + width].replace("\n", " ")
    return ("…" if start else "") + text + ("…" if start + width < len(content) else "")
