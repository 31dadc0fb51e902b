"""The gateway's request lifecycle, shared by every generating route: who (auth), may they (model
access, rate limits), is there room (admission), and afterwards what it cost (usage ledger, limits
settled, metrics). One `Gateway` per app; one `Ticket` per admitted request.

    principal = gateway.principal(request)           -> None: 401
    refusal = gateway.check_model(principal, model)  -> a 404 when the tier may not use it
    ticket = await gateway.admit(request, principal, model, estimate)
             -> Refusal(429, rate limit | 503, queue full) or a Ticket holding a running slot
    ... generate ...
    ticket.finish(status, prompt, cached, completion)   exactly once (later calls do nothing), from
                                                       any thread; also on a cancelled stream

Refusals and admitted responses carry the rate-limit headers (`ticket.headers`).

Ownership: `may_see` / `claim` / `forget` for conversations; for documents `documents(principal)`
is the caller's `DocumentAccess` (assistant/keys.py) and `document_scope(principal, conversation_id,
library)` the doc ids a turn may search, by the same rule, so what a key can list is what it can
search (plus, in a conversation, that conversation's own files).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from starlette.concurrency import run_in_threadpool

from assistant.config import AssistantConfig, TierConfig
from assistant.errors import ConfigError
from assistant.server.admission import Admission
from assistant.server.auth import Authenticator, Principal
from assistant.server.limits import UNLIMITED, Decision, Limiter, MemoryLimiter, create_limiter
from assistant.server.metrics import Metrics

log = logging.getLogger(__name__)
BUSY_RETRY_AFTER_S = 2  # what a refused client is told when the queue is full


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str
    type: str
    code: str | None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Ticket:
    gateway: "Gateway"
    principal: Principal
    model: str
    estimate: int
    decision: Decision
    request_id: str
    started: float = field(default_factory=time.perf_counter)
    _done: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def headers(self) -> dict[str, str]:
        return self.decision.headers()

    def finish(self, status: str, prompt_tokens: int = 0, cached_tokens: int = 0, completion_tokens: int = 0) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        g = self.gateway
        try:  # the row is written before the slot is given back: a free slot means the request is on record
            used = prompt_tokens + completion_tokens
            tier = self.principal.tier
            try:
                if tier is not None and self.decision is not UNLIMITED:
                    g.limiter.settle(self.principal.key_id, tier, self.estimate, used)
            except Exception:  # the ledger row below still matters more than the bucket
                log.exception("settling rate limits failed")
            g.metrics.tokens.labels(self.model).inc(completion_tokens)
            if g.ledger is not None:
                from assistant.usage import UsageRecord

                try:
                    g.ledger.record(UsageRecord(self.principal.key_id, self.model, prompt_tokens, cached_tokens,
                                                completion_tokens,
                                                round((time.perf_counter() - self.started) * 1000, 2),
                                                status, self.request_id))
                except Exception:
                    log.exception("recording usage failed")
        finally:
            g.admission.release()


class Gateway:
    def __init__(self, auth: Authenticator, *, limiter: Limiter | None = None, ledger: Any = None, owners: Any = None,
                 admission: Admission | None = None, metrics: Metrics | None = None, max_body_bytes: int = 4 << 20,
                 max_upload_bytes: int = 64 << 20, shared_library: bool = False, safety: Any = None) -> None:
        self.auth = auth
        self.safety = safety  # the SafetyLayer whose policy a tier names (None: safety is off)
        self.shared_library = shared_library  # keys also see the documents no key owns (server.shared_library)
        self.limiter = limiter or MemoryLimiter()
        self.ledger, self.owners = ledger, owners
        self.admission = admission or Admission(16, 64)
        self.metrics = metrics or Metrics(admission=self.admission)
        self.max_body_bytes = max_body_bytes
        self.max_upload_bytes = max_upload_bytes

    @classmethod
    def from_assistant(cls, assistant: Any) -> "Gateway":
        config: AssistantConfig = assistant.config
        s = config.server
        admission = Admission(s.max_running, s.max_queued)
        engine = assistant.models.engine()
        stats = getattr(engine, "stats", None)
        safety = getattr(assistant, "safety", None)
        if safety is not None:  # a tier naming a policy that does not exist stops the server here, not a turn
            for name, tier in s.tiers.items():
                if tier.safety_policy:
                    try:
                        safety.policies.get(tier.safety_policy)
                    except Exception as e:
                        raise ConfigError(f"[server.tiers.{name}] safety_policy: {e}") from e
        return cls(Authenticator.from_config(config, assistant.keys), limiter=create_limiter(s.redis_url),
                   ledger=assistant.usage, owners=assistant.owners, admission=admission,
                   metrics=Metrics(stats if callable(stats) else None, admission), max_body_bytes=s.max_body_bytes,
                   max_upload_bytes=s.max_upload_bytes, shared_library=s.shared_library, safety=safety)

    @classmethod
    def from_keys(cls, api_keys: tuple[str, ...] = ()) -> "Gateway":
        """Static keys only, no limits, no ledger: the /v1 router on its own (tests, embedding)."""
        return cls(Authenticator(None, api_keys, {"free": TierConfig()}, "free"))

    def principal(self, request: Any) -> Principal | None:
        principal = self.auth.of(request)
        if principal is not None:
            request.state.principal = principal
        return principal

    async def admit(self, request: Any, principal: Principal, model: str, estimate: int) -> Ticket | Refusal:
        decision = UNLIMITED
        if principal.tier is not None:
            try:
                decision = await run_in_threadpool(self.limiter.admit, principal.key_id, principal.tier, estimate)
            except Exception as e:  # Redis down: refuse rather than serve without limits
                log.error("rate limiter failed: %s", e)
                return Refusal(503, f"{e}. Retry shortly.", "overloaded", "rate_limiter_unavailable",
                               {"retry-after": str(BUSY_RETRY_AFTER_S)})
        if not decision.allowed:
            self.metrics.rate_limited.labels(decision.reason).inc()
            await run_in_threadpool(self._ledger_refusal, principal, model, request, "rate_limited")
            return Refusal(429, decision.message(), "requests" if decision.reason == "requests" else "tokens",
                           "rate_limit_exceeded" if decision.reason != "daily_quota" else "insufficient_quota",
                           decision.headers())
        if not await self.admission.acquire(principal.priority):
            self.metrics.admission_rejected.inc()
            if principal.tier is not None and decision is not UNLIMITED:
                await run_in_threadpool(self.limiter.settle, principal.key_id, principal.tier, estimate, 0)
            await run_in_threadpool(self._ledger_refusal, principal, model, request, "busy")  # refused: a row too
            return Refusal(503, "The server is at capacity (the generation queue is full): retry shortly.",
                           "overloaded", "server_busy", {**decision.headers(), "retry-after": str(BUSY_RETRY_AFTER_S)})
        return Ticket(self, principal, model, estimate, decision, getattr(request.state, "request_id", ""))

    def _ledger_refusal(self, principal: Principal, model: str, request: Any, status: str) -> None:
        if self.ledger is None:
            return
        from assistant.usage import UsageRecord

        try:
            self.ledger.record(UsageRecord(principal.key_id, model, status=status,
                                           request_id=getattr(request.state, "request_id", "")))
        except Exception:
            log.exception("recording usage failed")

    # -- ownership --------------------------------------------------------------------------------
    def may_see(self, principal: Principal, kind: str, resource_id: str) -> bool:
        """A key sees only what it created; the key-less local user of an open server sees what no key owns."""
        if self.owners is None:
            return True
        owner = self.owners.owner(kind, resource_id)
        return owner == principal.key_id if principal.key_id else owner is None

    def claim(self, principal: Principal, kind: str, resource_id: str) -> None:
        """Record the caller's key as the owner, unless the resource has one already (a re-upload). A
        conversation the key starts takes its tier's safety policy."""
        if self.owners is not None and principal.key_id and self.owners.owner(kind, resource_id) is None:
            self.owners.claim(kind, resource_id, principal.key_id)
            policy = self.safety_policy(principal)
            if kind == "conversation" and policy:
                self.safety.set_policy(resource_id, policy)

    def safety_policy(self, principal: Principal) -> str | None:
        """The safety policy the caller's tier names (None: the server's own, or safety is off)."""
        if self.safety is None or principal.tier is None:
            return None
        return principal.tier.safety_policy or None

    def forget(self, kind: str, resource_id: str) -> None:
        """Drop the owner row of a deleted resource (and a document's conversation link)."""
        if self.owners is not None:
            self.owners.forget(kind, resource_id)
            if kind == "document":
                self.owners.unlink(resource_id)

    def documents(self, principal: Principal) -> Any:
        """The caller's DocumentAccess (assistant/keys.py): which documents it may list, remove and
        search; None when this gateway keeps no owners (every document is everyone's)."""
        if self.owners is None:
            return None
        return self.owners.access(principal.key_id, shared_library=self.shared_library)

    def document_scope(self, principal: Principal, conversation_id: str | None,
                       library: Callable[[], Iterable[dict]]) -> frozenset[str] | None:
        """The doc ids a turn of `conversation_id` may search and read (None: no owners kept, no limit).
        `library()` returns the library's records (Documents.list); asked only when the rule needs it."""
        access = self.documents(principal)
        if access is None:
            return None
        return access.scope(conversation_id, lambda: [d["doc_id"] for d in library()])

    def close(self) -> None:
        self.limiter.close()
