"""The safety layer as build_assistant wires it: one input guard, one output guard, one audit.

`SafetyLayer.from_config(config, store)` reads the `[safety]` section (policy, policies_dir,
enabled), builds the real detectors (each loads its model on first use, so building costs
nothing), the policy book and the audit tables in the store's database. The facade exposes it as
`assistant.safety`: choose a conversation's policy, read the audit log, moderate a text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from assistant.safety.audit import AuditRecord, MemoryAudit, SafetyAudit
from assistant.safety.detectors import Detector, real_detectors
from assistant.safety.guard import PolicyBook, SafetyGuard
from assistant.safety.output import OutputGuard
from assistant.safety.policy import available_policies
from assistant.safety.redact import LeakMatcher


@dataclass(frozen=True)
class Moderation:
    """One text's scores in OpenAI's moderation shape."""

    flagged: bool
    categories: dict[str, bool]
    category_scores: dict[str, float]
    verdict_category: str  # "" when not flagged
    detector: str

    def to_dict(self) -> dict[str, Any]:
        return {"flagged": self.flagged, "categories": self.categories, "category_scores": self.category_scores}


class SafetyLayer:
    def __init__(self, detectors: Mapping[str, Detector], audit: SafetyAudit, *, policy: str = "default",
                 policies_dir: str | None = None, protected: Sequence[str] = (), second_opinion: bool = True) -> None:
        self.audit = audit
        self.policies = PolicyBook(policy, audit, policies_dir, detectors)
        self.guard = SafetyGuard(detectors, self.policies, audit, second_opinion=second_opinion)
        self.leaks = LeakMatcher(protected)
        self.policies_dir = policies_dir

    @classmethod
    def from_config(cls, config: Any, store: Any = None, *, detectors: Mapping[str, Detector] | None = None) -> "SafetyLayer":
        audit = SafetyAudit(store.db) if store is not None else MemoryAudit()
        s = config.safety
        if detectors is None:
            detectors = real_detectors(s.head_dir or None, config.resolved_models_dir)
        return cls(detectors, audit, policy=s.policy, policies_dir=s.policies_dir or None,
                   protected=[config.system_prompt], second_opinion=s.second_opinion)

    def lend_engine(self, engine: Any, system_prompt: str | None = None) -> bool:
        """Let the second opinion read the assistant's own engine (assistant/safety/probe.py): its taps
        on the turn's prefill, and its own one-token requests, with no second copy of the model. False
        when the engine does not run the probe's model as the probe reads it; `None` takes it back."""
        use = getattr(self.guard.detectors.get("probe"), "use_engine", None)
        return bool(use(engine, system_prompt)) if callable(use) else False

    def screen(self, texts: Sequence[str], where: str = "retrieved") -> int:
        """Score passages ahead of use (a document's chunks at ingest): their scores go to the score
        cache, so no query pays for them; returns how many the default policy would quarantine."""
        hits = [self.guard.hit(text, where=where) for text in texts if text.strip()]
        return sum(hit is not None and hit.action == "block" for hit in hits)

    def protect(self, texts: Sequence[str]) -> None:
        """Treat these fixed texts like the system prompt: an answer repeating them is redacted."""
        self.leaks.add(texts)

    # -- seams ----------------------------------------------------------------------------------
    @property
    def input_guard(self) -> SafetyGuard:
        return self.guard

    def output_guard(self) -> OutputGuard:
        """A template: the orchestrator calls `for_turn(conversation_id)` for each answer."""
        return OutputGuard(policy=self.policies.default, audit=self.audit, guard=self.guard, leaks=self.leaks,
                           policy_for=self.policies.for_conversation)

    # -- the facade -----------------------------------------------------------------------------
    def policy_names(self) -> list[str]:
        return sorted(available_policies(self.policies_dir))

    def set_policy(self, conversation_id: str, policy: str | None) -> None:
        """Pick the policy of one conversation (None: the configured default). Checked before it is stored."""
        if policy:
            self.policies.get(policy)
        self.audit.set_policy(conversation_id, policy)

    def policy_of(self, conversation_id: str | None) -> str:
        return self.policies.for_conversation(conversation_id).name

    def audit_log(self, conversation_id: str | None = None, limit: int = 100) -> list[AuditRecord]:
        return self.audit.records(conversation_id=conversation_id, limit=limit)

    def output_guard_for(self, policy: str | None = None, *, protect: Sequence[str] = ()) -> OutputGuard:
        """An output guard for one answer outside any conversation (a raw /v1 completion) under a named
        policy (the key's tier; None: the default), also protecting `protect` (the request's own
        system messages) like the system prompt."""
        chosen = self.policies.get(policy) if policy else self.policies.default
        return OutputGuard(policy=chosen, audit=self.audit, guard=self.guard,
                           leaks=self.leaks.plus(protect) if protect else self.leaks)

    def moderate(self, text: str, *, conversation_id: str | None = None, policy: str | None = None) -> Moderation:
        """Scores of every input category plus the verdict of the conversation's policy, or of the named
        `policy` (an API key's tier) (POST /v1/moderations)."""
        guard = self.guard.for_policy(policy) if policy else self.guard.for_conversation(conversation_id)
        scores: dict[str, float] = {}
        for s in guard.scores(text):
            scores[s.category] = max(scores.get(s.category, 0.0), round(s.score, 4))
        hit = guard.hit(text, where="input")
        flagged = hit is not None and hit.action == "block"
        category = hit.score.category if hit is not None else ""
        return Moderation(flagged, {c: flagged and c == category for c in scores}, scores, category,
                          hit.score.detector if hit is not None else "")


