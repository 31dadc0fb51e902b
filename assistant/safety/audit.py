"""The safety audit log, per-conversation policy choices and the score cache of screened passages,
as tables in the conversation store.

The score cache (`safety_scores`) keeps a costly detector's scores of a retrieved passage or tool
result by the sha256 of the text and the detector's key (which head file, which path), so a passage
is scored once: at ingest for every chunk (`SafetyLayer.screen`), otherwise on its first use, never
again by a later query or after a restart. Scores, not verdicts, are kept, so every policy applies its
own thresholds to them.

Every block, quarantine, warning and redaction writes one row: when, which conversation (and API
key id, once the gateway passes one), the policy, stage, category, action, score, threshold,
detector, and the sha256 of the excerpt — never the excerpt itself. The tables live in the same
database as the conversations (SQLite file or PostgreSQL), so they survive restarts; they are
created on first use beside the store's own tables, which this module does not touch.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Any

import json

from sqlalchemy import Column, Float, Integer, MetaData, String, Table, Text, select
from sqlalchemy.engine import Engine as SqlEngine

metadata = MetaData()

safety_audit = Table(
    "safety_audit",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("created_at", Float, nullable=False),
    Column("conversation_id", String(64), nullable=True),
    Column("key_id", String(64), nullable=True),  # API key id (never the key)
    Column("policy", String(64), nullable=False),
    Column("stage", String(16), nullable=False),  # input | retrieved | tool | output
    Column("category", String(32), nullable=False),
    Column("action", String(16), nullable=False),  # block | warn | log | redact
    Column("score", Float, nullable=False),
    Column("threshold", Float, nullable=False),
    Column("detector", String(32), nullable=False),
    Column("excerpt_sha256", String(64), nullable=False),
)

safety_policy_choice = Table(
    "safety_policy_choice",
    metadata,
    Column("conversation_id", String(64), primary_key=True),
    Column("policy", String(64), nullable=False),
    Column("updated_at", Float, nullable=False),
)

safety_scores = Table(
    "safety_scores",
    metadata,
    Column("text_sha256", String(64), primary_key=True),
    Column("detector_key", String(96), primary_key=True),  # e.g. "head:full:<sha256 of the head file>"
    Column("scores", Text, nullable=False),  # JSON [[category, score], ...]
    Column("created_at", Float, nullable=False),
)


@dataclass(frozen=True)
class AuditRecord:
    conversation_id: str | None
    key_id: str | None
    policy: str
    stage: str
    category: str
    action: str
    score: float
    threshold: float
    detector: str
    excerpt_sha256: str
    created_at: float = 0.0
    id: int = 0


def excerpt_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()


class SafetyAudit:
    """Audit rows and policy choices over a SQLAlchemy engine (the store's)."""

    def __init__(self, db: SqlEngine) -> None:
        self.db = db
        self._ready = False
        self._lock = threading.Lock()

    def _create(self) -> None:
        if not self._ready:
            with self._lock:
                if not self._ready:
                    metadata.create_all(self.db)
                    self._ready = True

    def record(self, *, conversation_id: str | None, policy: str, stage: str, category: str, action: str,
               score: float, threshold: float, detector: str, excerpt: str, key_id: str | None = None) -> None:
        self._create()
        row = {"created_at": time.time(), "conversation_id": conversation_id, "key_id": key_id, "policy": policy,
               "stage": stage, "category": category, "action": action, "score": float(score),
               "threshold": float(threshold), "detector": detector, "excerpt_sha256": excerpt_hash(excerpt)}
        with self.db.begin() as c:
            c.execute(safety_audit.insert().values(**row))

    def records(self, *, conversation_id: str | None = None, limit: int = 100) -> list[AuditRecord]:
        """Newest first."""
        self._create()
        query = select(safety_audit).order_by(safety_audit.c.id.desc()).limit(limit)
        if conversation_id is not None:
            query = query.where(safety_audit.c.conversation_id == conversation_id)
        with self.db.connect() as c:
            return [AuditRecord(**r) for r in c.execute(query).mappings().all()]

    def cached_scores(self, text: str, key: str) -> list[tuple[str, float]] | None:
        self._create()
        with self.db.connect() as c:
            row = c.execute(select(safety_scores.c.scores).where(
                (safety_scores.c.text_sha256 == excerpt_hash(text)) & (safety_scores.c.detector_key == key))).first()
        return [(str(c_), float(v)) for c_, v in json.loads(row[0])] if row else None

    def cache_scores(self, text: str, key: str, scores: list[tuple[str, float]]) -> None:
        self._create()
        sha = excerpt_hash(text)
        with self.db.begin() as c:  # a concurrent writer of the same text wrote the same scores
            c.execute(safety_scores.delete().where((safety_scores.c.text_sha256 == sha)
                                                   & (safety_scores.c.detector_key == key)))
            c.execute(safety_scores.insert().values(text_sha256=sha, detector_key=key, scores=json.dumps(scores),
                                                    created_at=time.time()))

    def set_policy(self, conversation_id: str, policy: str | None) -> None:
        """Choose the policy of one conversation (None: back to the configured default)."""
        self._create()
        with self.db.begin() as c:
            c.execute(safety_policy_choice.delete().where(safety_policy_choice.c.conversation_id == conversation_id))
            if policy:
                c.execute(safety_policy_choice.insert().values(conversation_id=conversation_id, policy=policy,
                                                               updated_at=time.time()))

    def policy_of(self, conversation_id: str | None) -> str | None:
        if not conversation_id:
            return None
        self._create()
        with self.db.connect() as c:
            row = c.execute(select(safety_policy_choice.c.policy)
                            .where(safety_policy_choice.c.conversation_id == conversation_id)).first()
        return row[0] if row else None


class MemoryAudit(SafetyAudit):
    """Audit kept in a list (for `assistant eval safety` and tests that have no store)."""

    def __init__(self) -> None:  # noqa: D107 - no database
        self.rows: list[dict[str, Any]] = []
        self.choices: dict[str, str] = {}
        self.scores: dict[tuple[str, str], list[tuple[str, float]]] = {}

    def cached_scores(self, text: str, key: str) -> list[tuple[str, float]] | None:
        return self.scores.get((excerpt_hash(text), key))

    def cache_scores(self, text: str, key: str, scores: list[tuple[str, float]]) -> None:
        self.scores[(excerpt_hash(text), key)] = list(scores)

    def record(self, **row: Any) -> None:  # type: ignore[override]
        row["excerpt_sha256"] = excerpt_hash(row.pop("excerpt"))
        self.rows.append(row)

    def set_policy(self, conversation_id: str, policy: str | None) -> None:
        if policy:
            self.choices[conversation_id] = policy
        else:
            self.choices.pop(conversation_id, None)

    def policy_of(self, conversation_id: str | None) -> str | None:
        return self.choices.get(conversation_id or "")
