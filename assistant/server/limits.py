"""Rate limits and quotas per key: token buckets on requests and on tokens, and a daily token quota.

NOTE the model (the same in process and in Redis, see redis_limits.py):
  * Each key has two buckets that hold up to `rpm` requests / `tpm` tokens and refill evenly over a
    minute (so a full bucket allows a burst of a minute's worth, then the steady rate).
  * Admission reserves: one request, and the request's token *estimate* (prompt estimate +
    max_tokens, like OpenAI counts it). It needs the token bucket to hold min(estimate, tpm), so a
    request larger than a minute's budget still runs once the bucket is full (and drives it
    negative). A refused request takes nothing.
  * When the request ends, `settle` gives back (or takes) the difference between the estimate and the
    tokens really used, and adds them to the key's counter of the UTC day.
  * The daily quota refuses a request once the day's counter has reached it; tokens of requests in
    flight are counted when they end (a quota can be overrun by at most the requests in flight).
A refusal carries `retry_after` (seconds until the missing capacity has refilled, or until the UTC
day ends for the quota) and the OpenAI `x-ratelimit-*` headers; so does every admitted response.
"""

from __future__ import annotations

import math
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

from assistant.config import TierConfig

DAY_S = 86400


@dataclass(frozen=True)
class Decision:
    allowed: bool
    rpm: int  # the tier's limits (0 = none)
    tpm: int
    requests_left: float  # bucket levels after this decision
    tokens_left: float
    retry_after: float = 0.0  # seconds; only when refused
    reason: str = ""  # "requests" | "tokens" | "daily_quota" when refused

    def headers(self) -> dict[str, str]:
        """OpenAI's rate-limit headers (only for the limits the tier has), plus Retry-After on a refusal."""
        out: dict[str, str] = {}
        if self.rpm:
            out["x-ratelimit-limit-requests"] = str(self.rpm)
            out["x-ratelimit-remaining-requests"] = str(max(0, math.floor(self.requests_left)))
            out["x-ratelimit-reset-requests"] = _duration((self.rpm - self.requests_left) * 60 / self.rpm)
        if self.tpm:
            out["x-ratelimit-limit-tokens"] = str(self.tpm)
            out["x-ratelimit-remaining-tokens"] = str(max(0, math.floor(self.tokens_left)))
            out["x-ratelimit-reset-tokens"] = _duration((self.tpm - self.tokens_left) * 60 / self.tpm)
        if not self.allowed:
            out["retry-after"] = str(max(1, math.ceil(self.retry_after)))
        return out

    def message(self) -> str:
        wait = max(1, math.ceil(self.retry_after))
        what = {"requests": f"{self.rpm} requests per minute", "tokens": f"{self.tpm} tokens per minute",
                "daily_quota": "the daily token quota"}.get(self.reason, "the rate limit")
        return f"Rate limit reached for {what} of this key's tier: retry in {wait} s, or ask for a higher tier."


UNLIMITED = Decision(True, 0, 0, 0.0, 0.0)


def _duration(seconds: float) -> str:
    """OpenAI's reset format: 1s, 6m0s, 1h2m3s, 250ms."""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    s = round(seconds)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return (f"{h}h" if h else "") + (f"{m}m" if h or m else "") + f"{s}s"


def seconds_to_utc_midnight(now: float) -> float:
    return DAY_S - (now % DAY_S)


def utc_day(now: float) -> int:
    return int(now // DAY_S)


class Limiter(ABC):
    """Per-key limits; `admit` before the work, `settle` after it (see the module docstring)."""

    @abstractmethod
    def admit(self, key_id: str, tier: TierConfig, estimate: int) -> Decision: ...

    @abstractmethod
    def settle(self, key_id: str, tier: TierConfig, reserved: int, used: int) -> None: ...

    def close(self) -> None:
        pass


class _Bucket:
    __slots__ = ("level", "ts")

    def __init__(self, level: float, ts: float) -> None:
        self.level, self.ts = level, ts

    def refill(self, capacity: int, now: float) -> float:
        self.level = min(capacity, self.level + (now - self.ts) * capacity / 60)
        self.ts = now
        return self.level


class MemoryLimiter(Limiter):
    """The limits in this process (one server, the default). `clock` is wall-clock seconds (tests pass
    their own), the same clock that decides the UTC day."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}
        self._daily: dict[tuple[str, int], int] = {}

    def _bucket(self, table: dict[str, _Bucket], key_id: str, capacity: int, now: float) -> _Bucket:
        bucket = table.get(key_id)
        if bucket is None:
            bucket = table[key_id] = _Bucket(float(capacity), now)
        bucket.refill(capacity, now)
        return bucket

    def admit(self, key_id: str, tier: TierConfig, estimate: int) -> Decision:
        if not (tier.rpm or tier.tpm or tier.daily_tokens):
            return UNLIMITED
        with self._lock:
            now = self._clock()
            requests = self._bucket(self._requests, key_id, tier.rpm, now) if tier.rpm else None
            tokens = self._bucket(self._tokens, key_id, tier.tpm, now) if tier.tpm else None
            used = self._daily.get((key_id, utc_day(now)), 0)
            req_level = requests.level if requests else 0.0
            tok_level = tokens.level if tokens else 0.0
            reason, wait = "", 0.0
            if tier.daily_tokens and used >= tier.daily_tokens:
                reason, wait = "daily_quota", seconds_to_utc_midnight(now)
            elif requests is not None and req_level < 1:
                reason, wait = "requests", (1 - req_level) * 60 / tier.rpm
            elif tokens is not None and tok_level < min(estimate, tier.tpm):
                reason, wait = "tokens", (min(estimate, tier.tpm) - tok_level) * 60 / tier.tpm
            if reason:
                return Decision(False, tier.rpm, tier.tpm, req_level, tok_level, wait, reason)
            if requests is not None:
                requests.level -= 1
            if tokens is not None:
                tokens.level -= estimate
            return Decision(True, tier.rpm, tier.tpm, req_level - (1 if requests else 0),
                            tok_level - (estimate if tokens else 0))

    def settle(self, key_id: str, tier: TierConfig, reserved: int, used: int) -> None:
        with self._lock:
            now = self._clock()
            if tier.tpm:
                bucket = self._bucket(self._tokens, key_id, tier.tpm, now)
                bucket.level = min(tier.tpm, bucket.level + reserved - used)
            day = utc_day(now)
            self._daily[(key_id, day)] = self._daily.get((key_id, day), 0) + used
            for stale in [k for k in self._daily if k[1] < day]:
                del self._daily[stale]


def create_limiter(redis_url: str) -> Limiter:
    """In process by default; shared through Redis when `server.redis_url` is set."""
    if not redis_url:
        return MemoryLimiter()
    from assistant.server.redis_limits import RedisLimiter

    return RedisLimiter.from_url(redis_url)
