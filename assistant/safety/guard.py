"""The input guard: detectors + a policy -> a Verdict for one text at one stage, audited.

`SafetyGuard.check(text, where=...)` implements the InputGuard seam with the configured default
policy; `for_conversation(id)` returns the same guard bound to that conversation's policy (the one
chosen for it, else the default) and to its audit rows. The orchestrator asks for the bound guard
at the start of every turn.

Decision (the policy's stage says which detectors run, in order, and which categories count):
every score at or above its category's threshold for that detector is a hit; the hit with the
strongest action (block > warn > log) wins, ties broken by the margin over the threshold. A block
stops the remaining (slower) detectors. The verdict carries category, score, threshold and detector;
a block at the input says what the user can do instead (assistant/safety/categories.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from assistant.errors import ConfigError
from assistant.safety.audit import SafetyAudit
from assistant.safety.categories import quarantine_notice, refusal, label
from assistant.safety.detectors import Detector, Score
from assistant.safety.policy import ACTION_RANK, Policy, load_policy
from assistant.seams import ALLOWED, Verdict


@dataclass(frozen=True)
class Hit:
    score: Score
    threshold: float
    action: str  # block | warn | log

    @property
    def key(self) -> tuple[int, float]:
        return ACTION_RANK[self.action], self.score.score - self.threshold


class PolicyBook:
    """Policies by name, loaded once; the default one, and each conversation's choice (in the audit db)."""

    def __init__(self, default: str, audit: SafetyAudit, extra_dir: str | None = None,
                 detectors: Mapping[str, Detector] | None = None) -> None:
        self.extra_dir, self.audit = extra_dir, audit
        self._known_detectors = set(detectors or ())
        self._cache: dict[str, Policy] = {}
        self.default = self.get(default)

    def get(self, name: str) -> Policy:
        if name not in self._cache:
            policy = load_policy(name, self.extra_dir)
            unknown = {d for s in policy.stages.values() for d in s.detectors} - self._known_detectors
            if self._known_detectors and unknown:
                raise ConfigError(f"Safety policy {name!r} names unknown detector(s) {', '.join(sorted(unknown))}: "
                                  f"use {', '.join(sorted(self._known_detectors))}.")
            self._cache[name] = policy
        return self._cache[name]

    def for_conversation(self, conversation_id: str | None) -> Policy:
        chosen = self.audit.policy_of(conversation_id)
        return self.get(chosen) if chosen else self.default


class SafetyGuard:
    """InputGuard over real (or, in tests, fake) detectors; see the module notes."""

    def __init__(self, detectors: Mapping[str, Detector], policies: PolicyBook, audit: SafetyAudit,
                 *, conversation_id: str | None = None, key_id: str | None = None,
                 policy: Policy | None = None) -> None:
        self.detectors, self.policies, self.audit = dict(detectors), policies, audit
        self.conversation_id, self.key_id = conversation_id, key_id
        self.policy = policy or policies.default

    def for_conversation(self, conversation_id: str | None, key_id: str | None = None) -> "SafetyGuard":
        return SafetyGuard(self.detectors, self.policies, self.audit, conversation_id=conversation_id,
                           key_id=key_id, policy=self.policies.for_conversation(conversation_id))

    def for_policy(self, policy: str | None, *, key_id: str | None = None) -> "SafetyGuard":
        """The guard under a named policy (an API key's tier) for text outside any conversation;
        None or "": the default policy."""
        return SafetyGuard(self.detectors, self.policies, self.audit, key_id=key_id,
                           policy=self.policies.get(policy) if policy else self.policies.default)

    def check(self, text: str, *, where: str) -> Verdict:
        hit = self.hit(text, where=where)
        if hit is None:
            return ALLOWED
        self.audit.record(conversation_id=self.conversation_id, key_id=self.key_id, policy=self.policy.name,
                          stage=where, category=hit.score.category, action=hit.action, score=hit.score.score,
                          threshold=hit.threshold, detector=hit.score.detector, excerpt=text)
        if hit.action == "log":
            return ALLOWED
        category = hit.score.category
        if hit.action == "warn":
            reason = (f"Note: this touches {label(category)}; the policy '{self.policy.name}' allows it with a "
                      "warning, and it was logged.")
        elif where == "input":
            reason = refusal(category, policy=self.policy.name)
        else:
            reason = quarantine_notice(where, category)
        return Verdict(hit.action != "block", category, round(hit.score.score, 4), hit.threshold,
                       hit.score.detector, reason)

    def hit(self, text: str, *, where: str, policy: Policy | None = None) -> Hit | None:
        """The deciding hit for `text` at stage `where` (None: nothing reached a threshold)."""
        policy = policy or self.policy
        stage = policy.stage(where)
        if not text.strip() or not stage.detectors:
            return None
        best: Hit | None = None
        for name in stage.detectors:
            detector = self.detectors[name]
            wanted = [c for c in stage.categories if c in detector.categories
                      and name in policy.rule(c).thresholds and policy.rule(c).action != "allow"]
            if not wanted:
                continue
            scored = self._scores(detector, text, where)
            for score in scored:
                if score.category not in wanted:
                    continue
                rule = policy.rule(score.category)
                threshold = stage.thresholds.get(name, rule.thresholds[name])
                if score.score >= threshold:
                    candidate = Hit(score, threshold, rule.action)
                    if best is None or candidate.key > best.key:
                        best = candidate
            if best is not None and best.action == "block":
                break  # the slower detectors cannot change a block
        return best

    def _scores(self, detector: Detector, text: str, where: str) -> list[Score]:
        """The detector's scores; a costly one's (`cache_key`) on passages and tool results come from the
        score cache when that text was scored before (at ingest, or by an earlier turn)."""
        key = getattr(detector, "cache_key", None)
        key = key(where) if callable(key) and where in ("retrieved", "tool") else None
        if key:
            cached = self.audit.cached_scores(text, key)
            if cached is not None:
                return [Score(c, v, detector.name) for c, v in cached]
        scored = detector.score(text)
        if key:
            self.audit.cache_scores(text, key, [(s.category, s.score) for s in scored])
        return scored

    def scores(self, text: str) -> list[Score]:
        """Every detector's scores for `text` (for moderation-style APIs and `assistant safety check`)."""
        return [s for d in self.detectors.values() for s in d.score(text)]
