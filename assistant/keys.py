"""API keys and what they own: created, listed, revoked and verified; only a hash is ever stored.

A key reads `sk-asst-<id>-<secret>`: `id` (12 hex digits) is public and names the key in listings and
in the usage ledger, `secret` is 32 random bytes. The store keeps sha256(key) and compares it in
constant time (`hmac.compare_digest`); the key itself is shown once, by `assistant keys create`.

Design note: the tables live in the store's database (SQLite file or PostgreSQL, through the same
SQLAlchemy engine as conversations), so every replica of the server sees a key the moment it is
created or revoked; there is no cache to go stale. A lookup is one primary-key read.

Ownership: `Owners` maps a resource (`conversation:<id>`, `document:<doc id>`) to the key that
created it. A resource created without a key (the CLI, the open loopback server's local user) has no
owner row and is visible only to key-less callers; the server answers 404 for anything another key
owns. A document may also belong to one conversation (`document_links`): it is searched only in that
conversation's turns and deleted with it.

Documents: `DocumentAccess` is the one rule for which documents a caller may list, remove and search
— the REST routes, the web chat and every turn's document scope (tools/retrieval.py) apply it:
  * a key's documents are those it uploaded; the key-less local user's are those no key owns;
  * documents no key owns and no conversation holds (the operator's library, ingested with the CLI)
    are also seen by every key — read-only — when `server.shared_library` is on (off by default);
  * a conversation's document is searched only in that conversation's turns (it is still listed,
    so its owner can see and remove it).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

from sqlalchemy import Column, Float, MetaData, String, Table, Text, select, update
from sqlalchemy.engine import Engine as SqlEngine

from assistant.errors import AssistantError

PREFIX = "sk-asst-"
ID_HEX = 12

metadata = MetaData()

api_keys = Table(
    "api_keys",
    metadata,
    Column("id", String(16), primary_key=True),  # public part of the key
    Column("name", Text, nullable=False),
    Column("tier", String(64), nullable=False),
    Column("hash", String(64), nullable=False),  # sha256 hex of the whole key
    Column("created_at", Float, nullable=False),
    Column("revoked_at", Float, nullable=True),
)

owners = Table(
    "owners",
    metadata,
    Column("resource", String(96), primary_key=True),  # "<kind>:<id>", e.g. conversation:ab12...
    Column("key_id", String(16), nullable=False),
)


document_links = Table(
    "document_links",
    metadata,
    Column("doc_id", String(96), primary_key=True),  # a document that belongs to one conversation only
    Column("conversation_id", String(64), nullable=False, index=True),
)


def upload_folder(data_dir: str | Path, key_id: str, conversation_id: str | None = None) -> Path:
    """Where a caller's uploaded documents are saved: <data_dir>/uploads/documents/<key id, or "local">/,
    and a conversation's own files under conversations/<id>/ there (a document's id is its path's, so
    each key's, and each conversation's, file of one name is a document of its own)."""
    folder = Path(data_dir).resolve() / "uploads" / "documents" / (key_id or "local")
    return folder / "conversations" / conversation_id if conversation_id else folder


def slug(conversation_id: str) -> str:
    """A conversation id as a file or container name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", conversation_id).strip(".") or "_"


def conversation_files(data_dir: str | Path, conversation_id: str) -> Path:
    """A conversation's own files: <data_dir>/uploads/<id>/ holds its recordings and pictures and a
    copy of every file attached in it, and is mounted read-only at /data in its code sandbox.
    Raises ValueError for an id that does not name a folder directly under uploads/."""
    root = (Path(data_dir) / "uploads").resolve()
    path = (root / slug(conversation_id)).resolve()
    if path.parent != root:
        raise ValueError(f"conversation id {conversation_id!r} does not name a directory under uploads")
    return path


def artifact_file(data_dir: str | Path, conversation_id: str, ref: str) -> Path | None:
    """A file the code tool made in a conversation, by the content id its events carry
    (<data_dir>/artifacts/<conversation>/<id>-<name>, tools/code_interpreter.py); None when there is none."""
    if not ref.isalnum():
        return None
    folder = Path(data_dir).resolve() / "artifacts" / slug(conversation_id)
    return next(iter(sorted(folder.glob(f"{ref}-*"))), None) if folder.is_dir() else None


def share_with_sandbox(data_dir: str | Path, conversation_id: str, paths: Iterable[Path]) -> list[Path]:
    """Put the files attached in a conversation where its code sandbox reads them (/data): hard links
    into conversation_files (copies across file systems), so "plot column B of the CSV I uploaded"
    works. Returns the sandbox's copies."""
    import os

    folder = conversation_files(data_dir, conversation_id)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for path in paths:
        target = folder / Path(path).name
        target.unlink(missing_ok=True)  # a newer upload of the same name replaces the older
        try:
            os.link(path, target)
        except OSError:
            shutil.copy2(path, target)
        out.append(target)
    return out


def remove_conversation_files(data_dir: str | Path, key_id: str, conversation_id: str) -> None:
    """Everything saved for a deleted conversation: its uploaded documents and its own files."""
    shutil.rmtree(upload_folder(data_dir, key_id, conversation_id), ignore_errors=True)
    shutil.rmtree(conversation_files(data_dir, conversation_id), ignore_errors=True)


class ApiKeyError(AssistantError):
    """A key operation the user asked for cannot be done (unknown id, unknown tier)."""


@dataclass(frozen=True)
class ApiKey:
    id: str
    name: str
    tier: str
    created_at: float
    revoked_at: float | None = None

    @property
    def active(self) -> bool:
        return self.revoked_at is None


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _parse(key: str) -> str | None:
    """The id part of a well-formed key, else None."""
    if not key.startswith(PREFIX):
        return None
    key_id, sep, secret = key[len(PREFIX):].partition("-")
    if not sep or len(key_id) != ID_HEX or not secret or any(c not in "0123456789abcdef" for c in key_id):
        return None
    return key_id


_DUMMY_HASH = hash_key(PREFIX + "0" * ID_HEX + "-dummy")


class Keys:
    """The key table over the store's database (see the module docstring)."""

    def __init__(self, db: SqlEngine, tiers: tuple[str, ...] = ()) -> None:
        self._db = db
        self._tiers = tiers  # known tier names; () = accept any
        metadata.create_all(db)

    def create(self, name: str, tier: str) -> tuple[ApiKey, str]:
        """A new key: its record and the key itself (to show once; it cannot be recovered)."""
        if self._tiers and tier not in self._tiers:
            raise ApiKeyError(f"Unknown tier {tier!r}: use one of {', '.join(self._tiers)} or define "
                            f"[server.tiers.{tier}] in the config file.")
        if not name.strip():
            raise ApiKeyError("A key needs a name (--name), e.g. the person or service that will use it.")
        key_id = secrets.token_hex(ID_HEX // 2)
        key = f"{PREFIX}{key_id}-{secrets.token_urlsafe(32)}"
        record = ApiKey(key_id, name.strip(), tier, time.time())
        with self._db.begin() as c:
            c.execute(api_keys.insert().values(id=record.id, name=record.name, tier=tier, hash=hash_key(key),
                                               created_at=record.created_at, revoked_at=None))
        return record, key

    def list(self, *, include_revoked: bool = True) -> list[ApiKey]:
        query = select(api_keys).order_by(api_keys.c.created_at)
        if not include_revoked:
            query = query.where(api_keys.c.revoked_at.is_(None))
        with self._db.connect() as c:
            rows = c.execute(query).mappings().all()
        return [ApiKey(r["id"], r["name"], r["tier"], r["created_at"], r["revoked_at"]) for r in rows]

    def revoke(self, key_id: str) -> ApiKey:
        key_id = key_id.removeprefix(PREFIX).split("-", 1)[0]
        with self._db.begin() as c:
            result = c.execute(update(api_keys).where(api_keys.c.id == key_id).where(api_keys.c.revoked_at.is_(None))
                               .values(revoked_at=time.time()))
        if result.rowcount == 0:
            known = {k.id: k for k in self.list()}
            if key_id in known:
                return known[key_id]  # revoked already: revoking twice is not an error
            raise ApiKeyError(f"No key with id {key_id!r}: see `assistant keys list`.")
        return next(k for k in self.list() if k.id == key_id)

    def any(self) -> bool:
        """Whether any key was ever created. Revoked ones count: revoking a leaked key must never
        reopen the server to callers without a key."""
        with self._db.connect() as c:
            return c.execute(select(api_keys.c.id).limit(1)).first() is not None

    def verify(self, key: str) -> ApiKey | None:
        """The active key record for `key`, or None (unknown, malformed or revoked)."""
        key_id = _parse(key)
        row = None
        if key_id is not None:
            with self._db.connect() as c:
                row = c.execute(select(api_keys).where(api_keys.c.id == key_id)).mappings().first()
        stored = row["hash"] if row is not None else _DUMMY_HASH
        matches = hmac.compare_digest(hash_key(key), stored)  # always compared: timing says nothing
        if row is None or not matches or row["revoked_at"] is not None:
            return None
        return ApiKey(row["id"], row["name"], row["tier"], row["created_at"], None)


class Owners:
    """Which key created a resource (a conversation, a document)."""

    def __init__(self, db: SqlEngine) -> None:
        self._db = db
        metadata.create_all(db)

    def claim(self, kind: str, resource_id: str, key_id: str) -> None:
        with self._db.begin() as c:
            c.execute(owners.insert().values(resource=f"{kind}:{resource_id}", key_id=key_id))

    def owner(self, kind: str, resource_id: str) -> str | None:
        with self._db.connect() as c:
            row = c.execute(select(owners.c.key_id).where(owners.c.resource == f"{kind}:{resource_id}")).first()
        return row[0] if row is not None else None

    def owned_by(self, kind: str, key_id: str) -> set[str]:
        with self._db.connect() as c:
            rows = c.execute(select(owners.c.resource).where(owners.c.key_id == key_id)
                             .where(owners.c.resource.like(f"{kind}:%"))).all()
        return {r[0].split(":", 1)[1] for r in rows}

    def forget(self, kind: str, resource_id: str) -> None:
        with self._db.begin() as c:
            c.execute(owners.delete().where(owners.c.resource == f"{kind}:{resource_id}"))

    def owners_of(self, kind: str) -> dict[str, str]:
        """Every owned resource of `kind`: id -> key id."""
        with self._db.connect() as c:
            rows = c.execute(select(owners.c.resource, owners.c.key_id)
                             .where(owners.c.resource.like(f"{kind}:%"))).all()
        return {r[0].split(":", 1)[1]: r[1] for r in rows}

    # -- documents of one conversation ------------------------------------------------------------
    def link(self, doc_id: str, conversation_id: str) -> None:
        """Make `doc_id` a document of `conversation_id` only."""
        with self._db.begin() as c:
            c.execute(document_links.delete().where(document_links.c.doc_id == doc_id))
            c.execute(document_links.insert().values(doc_id=doc_id, conversation_id=conversation_id))

    def unlink(self, doc_id: str) -> None:
        with self._db.begin() as c:
            c.execute(document_links.delete().where(document_links.c.doc_id == doc_id))

    def links(self) -> dict[str, str]:
        """doc id -> the conversation it belongs to, for every conversation's document."""
        with self._db.connect() as c:
            return {r[0]: r[1] for r in c.execute(select(document_links.c.doc_id, document_links.c.conversation_id))}

    def documents_of(self, conversation_id: str) -> list[str]:
        """The doc ids that belong to `conversation_id`."""
        with self._db.connect() as c:
            rows = c.execute(select(document_links.c.doc_id).where(document_links.c.conversation_id == conversation_id))
            return sorted(r[0] for r in rows)

    def access(self, key_id: str, *, shared_library: bool = False) -> "DocumentAccess":
        """The document rule for caller `key_id` ("" = the local user), over a snapshot of both tables."""
        return DocumentAccess(key_id, shared_library, self.owners_of("document"), self.links())


@dataclass(frozen=True)
class DocumentAccess:
    """Which documents one caller may list, remove and search (the rule in the module docstring)."""

    key_id: str  # the caller's key id; "" = the key-less local user
    shared_library: bool  # server.shared_library: keys also see the operator's library, read-only
    owner: Mapping[str, str] = field(default_factory=dict)  # doc id -> the key that uploaded it
    conversation: Mapping[str, str] = field(default_factory=dict)  # doc id -> the conversation it belongs to

    def mine(self, doc_id: str) -> bool:
        """Uploaded by this caller (the local user: by no key); the caller may remove it."""
        owner = self.owner.get(doc_id)
        return owner == self.key_id if self.key_id else owner is None

    def shared(self, doc_id: str) -> bool:
        """The operator's library seen by a key through server.shared_library (read-only)."""
        return (bool(self.key_id) and self.shared_library and doc_id not in self.owner
                and doc_id not in self.conversation)

    def may_see(self, doc_id: str, conversation_id: str | None = None) -> bool:
        """Listed for the caller; with `conversation_id`, only that conversation's documents."""
        if conversation_id is not None and self.conversation.get(doc_id) != conversation_id:
            return False
        return self.mine(doc_id) or self.shared(doc_id)

    def may_search(self, doc_id: str, conversation_id: str | None) -> bool:
        """Searchable in a turn of `conversation_id`: visible, and in no other conversation."""
        return self.conversation.get(doc_id) in (None, conversation_id) and (self.mine(doc_id) or self.shared(doc_id))

    def scope(self, conversation_id: str | None, library: Callable[[], Iterable[str]]) -> frozenset[str]:
        """The doc ids a turn of `conversation_id` may search and read. `library()` lists every doc id
        in the index; it is not asked for a key that sees only its own uploads."""
        if self.key_id and not self.shared_library:
            candidates: Iterable[str] = [d for d, k in self.owner.items() if k == self.key_id]
        else:
            candidates = library()
        return frozenset(d for d in candidates if self.may_search(d, conversation_id))
