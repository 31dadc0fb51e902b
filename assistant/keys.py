"""API keys and what they own: created, listed, revoked and verified; only a hash is ever stored.

A key reads `sk-asst-<id>-<secret>`: `id` (12 hex digits) is public and names the key in listings and
in the usage ledger, `secret` is 32 random bytes. The store keeps sha256(key) and compares it in
constant time (`hmac.compare_digest`); the key itself is shown once, by `assistant keys create`.

Design note: the tables live in the store's database (SQLite file or PostgreSQL, through the same
SQLAlchemy engine as conversations), so every replica of the server sees a key the moment it is
created or revoked; there is no cache to go stale. A lookup is one primary-key read.

Ownership: `Owners` maps a resource (`conversation:<id>`) to the key that created it. A resource
created without a key (the web chat, the CLI, the open loopback server) has no owner row and is
visible only to key-less callers; the server answers 404 for anything another key owns.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

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
