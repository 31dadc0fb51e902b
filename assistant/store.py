"""The conversation store: conversations, messages (a tree, for edits and regeneration), usage.

SQLAlchemy Core over a SQLite file in the data dir by default; a PostgreSQL URL
(`postgresql+psycopg://...`) goes through exactly the same code. Every write is its own committed
transaction, so a crash mid-answer loses at most the part of the answer not yet flushed.

Messages form a tree through `parent_id`; a conversation's `head_id` points at the newest message of
the active branch, and its history is the path from the root to the head. Editing a user message adds
a sibling (a new branch) and moves the head; the old branch stays in the table, reachable by id.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import (
    JSON,
    Column,
    Float,
    ForeignKey,
    Index,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    event,
    select,
    update,
)
from sqlalchemy.engine import Engine as SqlEngine
from sqlalchemy.pool import StaticPool

from assistant.errors import StoreError

metadata = MetaData()

conversations = Table(
    "conversations",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("title", Text, nullable=False, default=""),
    Column("head_id", String(32), nullable=True),  # newest message of the active branch
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
)

messages = Table(
    "messages",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("conversation_id", String(32), ForeignKey("conversations.id", ondelete="CASCADE"), nullable=False),
    Column("parent_id", String(32), nullable=True),
    Column("role", String(16), nullable=False),  # system | user | assistant | tool
    Column("content", Text, nullable=False, default=""),
    Column("status", String(16), nullable=False, default="complete"),  # complete | partial | error | blocked (refused by the input guard)
    Column("meta", JSON, nullable=False, default=dict),  # tool calls, sources, usage, ...
    Column("created_at", Float, nullable=False),
    Index("ix_messages_conversation", "conversation_id"),
)


@dataclass(frozen=True)
class Conversation:
    id: str
    title: str
    head_id: str | None
    created_at: float
    updated_at: float


@dataclass(frozen=True)
class StoredMessage:
    id: str
    conversation_id: str
    parent_id: str | None
    role: str
    content: str
    status: str
    meta: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0

    def as_chat(self) -> dict[str, Any]:
        """The message as the model sees it: descriptions of the turn's images come before the text."""
        images = self.meta.get("images") if self.meta else None
        content = "\n".join(f"[{d}]" for d in images) + "\n" + self.content if images else self.content
        return {"role": self.role, "content": content}


def _new_id() -> str:
    return uuid.uuid4().hex


class OneAtATimePool(StaticPool):
    """An in-memory SQLite store is one DBAPI connection shared by every thread (StaticPool), so one
    thread ending its read (a rollback on that connection) could undo another thread's transaction half
    way: a message insert rolled back, the head update that followed it kept. This pool lends the
    connection to one thread at a time, from checkout to checkin.

    The turn is taken in `_do_get`, before SQLAlchemy wraps the shared record for the caller, and given
    back in `_do_return_conn`. (Taking it in the pool's checkout event was too late: a waiting thread
    had already re-pointed the shared record at its own wrapper, so the holder's checkin made the
    waiter's later checkin look like a double checkin, which SQLAlchemy skips, and the turn was never
    given back: every later request hung.) A plain Lock, not an RLock: a connection returned by the
    garbage collector is checked in from whichever thread runs it."""

    WAIT_S = 120.0  # far longer than any store call; past it a bug of ours, not a hang

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._turn = threading.Lock()

    def _do_get(self) -> Any:
        if not self._turn.acquire(timeout=self.WAIT_S):
            raise StoreError(f"The in-memory store's connection was not given back within {self.WAIT_S:.0f} s "
                             "(a connection left open across threads).")
        try:
            return super()._do_get()
        except BaseException:
            self._turn.release()
            raise

    def _do_return_conn(self, record: Any) -> None:
        try:
            super()._do_return_conn(record)
        finally:
            self._turn.release()


class Store:
    def __init__(self, url: str) -> None:
        self.url = url
        try:
            if url.startswith("sqlite"):
                in_memory = url in ("sqlite://", "sqlite:///:memory:")  # one shared connection, or each sees an empty db
                if not in_memory and url.startswith("sqlite:///"):  # a new data dir: make its folder
                    Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
                self.db: SqlEngine = create_engine(url, connect_args={"check_same_thread": False},
                                                   poolclass=OneAtATimePool if in_memory else None)
                event.listen(self.db, "connect", _sqlite_pragmas)
            else:
                self.db = create_engine(url, pool_pre_ping=True)
            metadata.create_all(self.db)
        except ModuleNotFoundError as e:
            raise StoreError(f"The database driver for {_redact(url)} is not installed ({e.name}): for PostgreSQL "
                             "run pip install -e '.[postgres]' (make does it).") from e
        except Exception as e:  # server down, bad URL, no permission
            raise StoreError(f"Cannot open the store at {_redact(url)}: {e}") from e

    # -- conversations --------------------------------------------------------------------------
    def create_conversation(self, title: str = "", conversation_id: str | None = None) -> Conversation:
        now = time.time()
        row = {"id": conversation_id or _new_id(), "title": title, "head_id": None, "created_at": now, "updated_at": now}
        with self.db.begin() as c:
            c.execute(conversations.insert().values(**row))
        return Conversation(**row)

    def get_conversation(self, conversation_id: str) -> Conversation:
        with self.db.connect() as c:
            row = c.execute(select(conversations).where(conversations.c.id == conversation_id)).mappings().first()
        if row is None:
            raise StoreError(f"No conversation with id {conversation_id!r}: list them with `assistant conversations`.")
        return Conversation(**row)

    def get_or_create(self, conversation_id: str | None, title: str = "") -> Conversation:
        if conversation_id:
            try:
                return self.get_conversation(conversation_id)
            except StoreError:
                return self.create_conversation(title, conversation_id)
        return self.create_conversation(title)

    def list_conversations(self) -> list[Conversation]:
        with self.db.connect() as c:
            rows = c.execute(select(conversations).order_by(conversations.c.updated_at.desc())).mappings().all()
        return [Conversation(**r) for r in rows]

    def rename_conversation(self, conversation_id: str, title: str) -> None:
        self._update_conversation(conversation_id, title=title)

    def delete_conversation(self, conversation_id: str) -> None:
        self.get_conversation(conversation_id)
        with self.db.begin() as c:
            c.execute(messages.delete().where(messages.c.conversation_id == conversation_id))
            c.execute(conversations.delete().where(conversations.c.id == conversation_id))

    def set_head(self, conversation_id: str, message_id: str | None) -> None:
        self._update_conversation(conversation_id, head_id=message_id)

    def _update_conversation(self, conversation_id: str, **values: Any) -> None:
        with self.db.begin() as c:
            result = c.execute(
                update(conversations).where(conversations.c.id == conversation_id).values(updated_at=time.time(), **values)
            )
        if result.rowcount == 0:
            raise StoreError(f"No conversation with id {conversation_id!r}.")

    # -- messages -------------------------------------------------------------------------------
    def add_message(
        self,
        conversation_id: str,
        role: str,
        content: str,
        *,
        parent_id: str | None = ...,  # type: ignore[assignment]  # default: the current head
        status: str = "complete",
        meta: dict[str, Any] | None = None,
    ) -> StoredMessage:
        """Append a message under `parent_id` (default: the head) and make it the new head, atomically."""
        with self.db.begin() as c:
            head = c.execute(select(conversations.c.head_id).where(conversations.c.id == conversation_id)).first()
            if head is None:
                raise StoreError(f"No conversation with id {conversation_id!r}.")
            parent = head[0] if parent_id is ... else parent_id
            row = {"id": _new_id(), "conversation_id": conversation_id, "parent_id": parent, "role": role,
                   "content": content, "status": status, "meta": meta or {}, "created_at": time.time()}
            c.execute(messages.insert().values(**row))
            c.execute(update(conversations).where(conversations.c.id == conversation_id)
                      .values(head_id=row["id"], updated_at=row["created_at"]))
        return StoredMessage(**row)

    def update_message(self, message_id: str, *, content: str | None = None, status: str | None = None,
                       meta: dict[str, Any] | None = None) -> None:
        values = {k: v for k, v in (("content", content), ("status", status), ("meta", meta)) if v is not None}
        with self.db.begin() as c:
            result = c.execute(update(messages).where(messages.c.id == message_id).values(**values))
        if result.rowcount == 0:
            raise StoreError(f"No message with id {message_id!r}.")

    def get_message(self, message_id: str) -> StoredMessage:
        with self.db.connect() as c:
            row = c.execute(select(messages).where(messages.c.id == message_id)).mappings().first()
        if row is None:
            raise StoreError(f"No message with id {message_id!r}.")
        return StoredMessage(**row)

    def history(self, conversation_id: str, head_id: str | None = ...) -> list[StoredMessage]:  # type: ignore[assignment]
        """Messages from the root to `head_id` (default: the conversation's head), oldest first."""
        head = self.get_conversation(conversation_id).head_id if head_id is ... else head_id
        with self.db.connect() as c:
            rows = c.execute(select(messages).where(messages.c.conversation_id == conversation_id)).mappings().all()
        by_id = {r["id"]: StoredMessage(**r) for r in rows}
        path: list[StoredMessage] = []
        while head is not None:
            message = by_id.get(head)
            if message is None:
                raise StoreError(f"Conversation {conversation_id} is broken: message {head} is missing.")
            path.append(message)
            head = message.parent_id
        return path[::-1]

    def children(self, conversation_id: str, parent_id: str | None) -> list[StoredMessage]:
        """Messages directly under `parent_id` (None: the roots), oldest first: the branches at that point."""
        with self.db.connect() as c:
            rows = c.execute(select(messages).where(messages.c.conversation_id == conversation_id)
                             .where(messages.c.parent_id == parent_id if parent_id is not None
                                    else messages.c.parent_id.is_(None))
                             .order_by(messages.c.created_at)).mappings().all()
        return [StoredMessage(**r) for r in rows]

    def siblings(self, message_id: str) -> list[StoredMessage]:
        """The message and its alternatives (edits of a question, regenerated answers), oldest first."""
        message = self.get_message(message_id)
        return self.children(message.conversation_id, message.parent_id)

    def switch_branch(self, conversation_id: str, message_id: str) -> StoredMessage:
        """Make the branch through `message_id` active: the head moves to its newest descendant leaf."""
        message = self.get_message(message_id)
        if message.conversation_id != conversation_id:
            raise StoreError(f"Message {message_id} is not part of conversation {conversation_id}.")
        while True:
            below = self.children(conversation_id, message.id)
            if not below:
                break
            message = below[-1]
        self.set_head(conversation_id, message.id)
        return message

    def export(self, conversation_id: str) -> dict[str, Any]:
        conv = self.get_conversation(conversation_id)
        return {"id": conv.id, "title": conv.title, "created_at": conv.created_at,
                "messages": [json.loads(json.dumps(m.__dict__)) for m in self.history(conversation_id)]}

    def close(self) -> None:
        self.db.dispose()


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
    cursor.execute("PRAGMA synchronous=NORMAL")  # durable at checkpoints, safe against app crashes
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _redact(url: str) -> str:
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url
