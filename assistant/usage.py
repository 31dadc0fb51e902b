"""The usage ledger: one row per API request (key, model, prompt / cached / completion tokens,
latency, status), in the store's database, and the totals and cost `assistant usage` reports.

Design note: a row is written once, when the request ends, whatever way it ends: finished, cut at
max_tokens, refused, failed, or cancelled by a client that went away (then the counts are those of
the tokens generated so far). One committed insert per request; with PostgreSQL every replica
writes the same table, so totals are global. Prices are configuration (`server.prices`), applied at
report time, so a price change never rewrites history.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from sqlalchemy import Column, Float, Index, Integer, MetaData, String, Table, func, select
from sqlalchemy.engine import Engine as SqlEngine

metadata = MetaData()

usage = Table(
    "usage",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("request_id", String(64), nullable=False, default=""),
    Column("key_id", String(16), nullable=False, default=""),  # "" = no key (open loopback server)
    Column("model", String(200), nullable=False),
    Column("prompt_tokens", Integer, nullable=False, default=0),
    Column("cached_tokens", Integer, nullable=False, default=0),  # part of prompt_tokens
    Column("completion_tokens", Integer, nullable=False, default=0),
    Column("latency_ms", Float, nullable=False, default=0.0),
    Column("status", String(32), nullable=False),  # ok | length | tool_calls | cancelled | error | rejected
    Column("created_at", Float, nullable=False),
    Index("ix_usage_key_time", "key_id", "created_at"),
)


@dataclass(frozen=True)
class UsageRecord:
    key_id: str
    model: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    latency_ms: float = 0.0
    status: str = "ok"
    request_id: str = ""
    created_at: float = field(default_factory=time.time)


@dataclass
class UsageTotal:
    key_id: str
    model: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class UsageLedger:
    """Rows of `usage` over the store's database (see the module docstring)."""

    def __init__(self, db: SqlEngine) -> None:
        self._db = db
        metadata.create_all(db)

    def record(self, row: UsageRecord) -> None:
        with self._db.begin() as c:
            c.execute(usage.insert().values(**row.__dict__))

    def rows(self, *, key_id: str | None = None, since: float | None = None) -> list[UsageRecord]:
        query = select(usage).order_by(usage.c.created_at)
        if key_id is not None:
            query = query.where(usage.c.key_id == key_id)
        if since is not None:
            query = query.where(usage.c.created_at >= since)
        with self._db.connect() as c:
            found = c.execute(query).mappings().all()
        return [UsageRecord(**{k: v for k, v in r.items() if k != "id"}) for r in found]

    def count(self) -> int:
        with self._db.connect() as c:
            return int(c.execute(select(func.count()).select_from(usage)).scalar_one())

    def totals(self, *, key_id: str | None = None, since: float | None = None,
               prices: Mapping[str, object] | None = None) -> list[UsageTotal]:
        """One total per (key, model), with its cost at `prices` (model id -> PriceConfig)."""
        return summarise(self.rows(key_id=key_id, since=since), prices or {})


def summarise(rows: Iterable[UsageRecord], prices: Mapping[str, object]) -> list[UsageTotal]:
    out: dict[tuple[str, str], UsageTotal] = {}
    for r in rows:
        t = out.setdefault((r.key_id, r.model), UsageTotal(r.key_id, r.model))
        t.requests += 1
        t.prompt_tokens += r.prompt_tokens
        t.cached_tokens += r.cached_tokens
        t.completion_tokens += r.completion_tokens
        t.statuses[r.status] = t.statuses.get(r.status, 0) + 1
    for t in out.values():
        t.cost = cost(t, prices.get(t.model))
    return sorted(out.values(), key=lambda t: (t.key_id, t.model))


def cost(total: UsageTotal, price: object | None) -> float:
    """Cost of a total at a PriceConfig (per million tokens); cached prompt tokens at their own price."""
    if price is None:
        return 0.0
    uncached = total.prompt_tokens - total.cached_tokens
    return (uncached * getattr(price, "prompt") + total.cached_tokens * getattr(price, "cached")
            + total.completion_tokens * getattr(price, "completion")) / 1e6
