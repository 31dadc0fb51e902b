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

Second opinion (a stage's `second_opinion`, assistant/safety/probe.py): when the `after` detector's
top score lies in the policy's doubt band, its hits do not decide alone. A slower detector reads the
text, and the mean of the two top scores, held against the slower detector's threshold for the
stronger category, takes the place of `after`'s hits (detector "head+probe" in the verdict). Outside
the band `after` decides as before; a block by an earlier detector needs no second opinion.
`check` waits for it. `check_early` returns at once with the opinion `pending` on an allowed verdict,
so the orchestrator can start the turn (retrieval, the model's prefill) while it reads and show
nothing until it resolves: the user-facing wait stays that of the fast detectors. `check_beside` moves
those beside the turn too: the turn's model call starts with them (`Verdict.begin`), so a guarded
turn's first token waits for neither (bench/safety.py).

Clearing (a stage's second opinion's `clears_below`): a text the second opinion scores under it is
allowed whatever `after` says (another detector's block stands). While clears_below <= 2 x the second
opinion's threshold - the band's top (0.05 for the default policy's 0.5 and 0.95), a doubtful text
cannot reach a block with so low a second score anyway, so clearing only turns `after`'s sure blocks
(above the band) into allows. What it buys is order: where the turn lends its prefill (a tap), a text
the second opinion clears needs no `after`, so `check_beside` runs `after` (the MiniLM head, whose CPU
the prefill would otherwise share) only for the texts it does not clear, once the prefill has read the
message. `check_early` (safety.check_beside_turn = false) keeps `after`'s sure blocks uncleared.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from assistant.errors import AssistantError, ConfigError
from assistant.safety.audit import SafetyAudit
from assistant.safety.categories import quarantine_notice, refusal, label
from assistant.safety.detectors import Detector, Score
from assistant.safety.policy import ACTION_RANK, Policy, load_policy
from assistant.seams import ALLOWED, Verdict

# second opinions run here, beside the turn they may stop (one at a time: each is a model forward pass)
_SECOND_OPINIONS = ThreadPoolExecutor(1, thread_name_prefix="safety-second-opinion")
# `check_beside`'s fast detectors, one turn each (turns run concurrently in `serve`)
_FIRST_CHECKS = ThreadPoolExecutor(4, thread_name_prefix="safety-check")
log = logging.getLogger(__name__)
TAP_TIMEOUT_S = 30.0  # the longest a verdict waits for a turn's prefill to reach the message (a busy engine)
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


class _SecondOpinion:
    """One text's second opinion. With a tap (assistant/engine/taps.py), from the hidden states the
    turn's own prefill lends, decided on a first-check thread the moment the prefill has read the
    message (so what it still runs, the head for a text it does not clear, starts then, not at the
    first token); once the tap is declined (the turn's engine is another model, a remote one, or no
    engine took the prompt), the detector reads the text itself on the second-opinion thread, started
    at once so it still overlaps the turn. Without a tap, that thread from the start."""

    def __init__(self, ask: Callable[..., Hit | None], tap: Any) -> None:
        self.ask, self.tap = ask, tap
        self.future: Future | None = None
        self._ready = threading.Event()
        if tap is None:
            self.future = _SECOND_OPINIONS.submit(ask)
            self._ready.set()
        else:
            tap.on_settle(self._settled)

    def _settled(self, tap: Any) -> None:  # on the settling thread (maybe the engine's): hand off at once
        if tap.features is None:  # declined: read it ourselves
            self.future = _SECOND_OPINIONS.submit(self.ask)
        else:
            self.future = _FIRST_CHECKS.submit(self.ask, tap.features)
        self._ready.set()

    def result(self) -> Hit | None:
        tap = self.tap
        if tap is not None:
            if tap.span is None:  # no engine took it (the turn ended before its model was asked)
                tap.decline("no engine read the turn's prompt")
            elif tap.wait(TAP_TIMEOUT_S) is None:
                tap.decline("the turn's prefill did not reach the message in time")
            self._ready.wait()
        return self.future.result()


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
            named = {d for s in policy.stages.values()
                     for d in (*s.detectors, *((s.second_opinion.detector,) if s.second_opinion else ()))}
            unknown = named - self._known_detectors
            if self._known_detectors and unknown:
                raise ConfigError(f"Safety policy {name!r} names unknown detector(s) {', '.join(sorted(unknown))}: "
                                  f"use {', '.join(sorted(self._known_detectors))}.")
            self._cache[name] = policy
        return self._cache[name]

    def for_conversation(self, conversation_id: str | None) -> Policy:
        chosen = self.audit.policy_of(conversation_id)
        return self.get(chosen) if chosen else self.default


RECENT_SCORES = 8  # answer texts whose scores a guard remembers (`_scores`)


class SafetyGuard:
    """InputGuard over real (or, in tests, fake) detectors; see the module notes."""

    def __init__(self, detectors: Mapping[str, Detector], policies: PolicyBook, audit: SafetyAudit,
                 *, conversation_id: str | None = None, key_id: str | None = None,
                 policy: Policy | None = None, second_opinion: bool = True) -> None:
        self.detectors, self.policies, self.audit = dict(detectors), policies, audit
        self.conversation_id, self.key_id = conversation_id, key_id
        self.policy = policy or policies.default
        self.second_opinion = second_opinion  # false: policies' second opinions are not asked (safety.second_opinion)
        # the last few answer texts' scores per detector: the output guard asks how close a sentence comes to a
        # block before it releases a word early, then scans the same text as it releases it (output.py)
        self._recent: dict[tuple[str, str], list[Score]] = {}
        self._recent_lock = threading.Lock()

    def for_conversation(self, conversation_id: str | None, key_id: str | None = None) -> "SafetyGuard":
        return SafetyGuard(self.detectors, self.policies, self.audit, conversation_id=conversation_id,
                           key_id=key_id, policy=self.policies.for_conversation(conversation_id),
                           second_opinion=self.second_opinion)

    def for_policy(self, policy: str | None, *, key_id: str | None = None) -> "SafetyGuard":
        """The guard under a named policy (an API key's tier) for text outside any conversation;
        None or "": the default policy."""
        return SafetyGuard(self.detectors, self.policies, self.audit, key_id=key_id,
                           policy=self.policies.get(policy) if policy else self.policies.default,
                           second_opinion=self.second_opinion)

    def check(self, text: str, *, where: str) -> Verdict:
        return self._verdict(text, where, self.hit(text, where=where))

    def warm(self) -> None:
        """Load every detector this guard's policy names (a second opinion only runs for doubtful texts,
        so a warm-up text would not load it)."""
        for stage in self.policy.stages.values():
            second = stage.second_opinion if self.second_opinion else None
            names = (*stage.detectors, *((second.detector,) if second else ()))
            for name in names:
                load = getattr(self.detectors.get(name), "model", None)
                if callable(load):
                    load()

    def check_early(self, text: str, *, where: str) -> Verdict:
        """`check`, except that a second opinion the text needs (see the module notes) is started on
        its own thread and left `pending` on an allowed verdict: the caller resolves it (`final()`)
        before it shows anything that depends on the text being allowed. One difference: a block by the
        fast detectors outside the doubt band is final here, not cleared by the second opinion
        (`clears_below`): the orchestrator uses this mode (safety.check_beside_turn = false) to keep such
        a message from reaching the model at all, and a clearing read of its own would cost ~100 ms."""
        policy = self.policy
        first, later = self._first_hit(text, where, policy)
        if later is None:  # a sure block stands, uncleared: this mode keeps it from reaching the model at all
            return self._verdict(text, where, first)
        opinion = _SecondOpinion(self._asker(text, where, policy, first, later), self._tap(text, where))
        return self._pending(text, where, opinion.result, opinion.tap)

    def check_beside(self, text: str, *, where: str, cancel: threading.Event | None = None) -> Verdict:
        """`check_early` with its fast detectors moved beside the turn too: returns at once, the whole
        verdict `pending` (the caller resolves it before it shows anything that depends on the text
        being allowed). The detectors start on `_FIRST_CHECKS` when the caller calls `begin` (the
        orchestrator: just before the turn's first model call, when its own thread only waits for
        tokens; started earlier, they and the turn's Python work queue for the GIL and the turn gains
        nothing), or when the verdict is resolved. The second opinion's tap is made at once and
        declined as soon as the fast detectors need no second opinion, so the engine stops filling
        it. `cancel` (the turn's) is set the moment they block, so a refused turn stops during its
        prefill, not at its first token.

        When the stage's second opinion clears texts (`clears_below`) and the turn lends its prefill (a
        tap), only the detectors other than `after` run here: the second opinion reads the prefill, and
        `after` (the MiniLM head, the costliest first check, which would share the cores with the
        prefill) runs only for a text it does not clear, once the prefill has read the message
        (`_tapped`). Most benign messages are cleared, and their first token waits for no head."""
        policy = self.policy
        tap = self._tap(text, where)
        second = policy.stage(where).second_opinion

        def stopping(ask: Callable[..., Hit | None]) -> Callable[..., Hit | None]:  # a block stops the turn
            def run(*args: Any) -> Hit | None:
                hit = ask(*args)
                if cancel is not None and hit is not None and hit.action == "block":
                    cancel.set()
                return hit

            return run

        def first_stage() -> tuple[Hit | None, _SecondOpinion | None]:
            if tap is not None and second.clears_below > 0:
                others, _ = self._first_hit(text, where, policy, without=second.after)
                if others is not None and others.action == "block":
                    if cancel is not None:
                        cancel.set()
                    tap.decline("an earlier detector blocked the message")
                    return others, None
                return others, _SecondOpinion(
                    stopping(lambda features=None: self._tapped(text, where, policy, others, features)), tap)
            first, later = self._first_hit(text, where, policy)
            if later is None and not self._clearable(where, policy, first):
                if cancel is not None and first is not None and first.action == "block":
                    cancel.set()
                if tap is not None:
                    tap.decline("the fast detectors needed no second opinion")
                return first, None
            # started here: a declined tap's own read begins at once
            return first, _SecondOpinion(stopping(self._asker(text, where, policy, first, later)), tap)

        futures: list[Future] = []
        lock = threading.Lock()

        def begin() -> Future:
            with lock:
                if not futures:
                    futures.append(_FIRST_CHECKS.submit(first_stage))
                return futures[0]

        def decide() -> Hit | None:
            first, opinion = begin().result()
            return opinion.result() if opinion is not None else first

        return self._pending(text, where, decide, tap, begin)

    def _tapped(self, text: str, where: str, policy: Policy, others: Hit | None, features: Any = None) -> Hit | None:
        """`hit`, second opinion first: from the prefill's `features` (None: declined, so it reads the
        text itself), a text it clears takes `others` (the other detectors' verdict, already read)
        without `after` running."""
        second = policy.stage(where).second_opinion
        scored = None
        if features is not None:
            try:
                scored = self._second_scores(text, where, policy, features)  # a linear map: read once, used twice
            except AssistantError:  # its head is missing, say: decided as without the prefill (which warns)
                features = None
        if scored is not None:
            if max((s.score for s in scored), default=1.0) < second.clears_below:
                return others
        first, later = self._first_hit(text, where, policy)
        return self._asker(text, where, policy, first, later)(features, scored)

    def _asker(self, text: str, where: str, policy: Policy, first: Hit | None,
               later: Callable[..., Hit | None] | None) -> Callable[..., Hit | None]:
        """What a second opinion asks, given the first detectors' (`_first_hit`): the doubt resolved
        (`later`, from tapped features or the text), then `_clear`."""
        def ask(features: Any = None, scored: list[Score] | None = None) -> Hit | None:
            decided, top = later(features, scored) if later is not None else (first, None)
            if scored is not None:
                top = max((s.score for s in scored), default=1.0)
            return self._clear(text, where, policy, decided, features, top)

        return ask

    def _clearable(self, where: str, policy: Policy, decided: Hit | None) -> bool:
        """Whether the second opinion may still clear `decided`: the stage has `clears_below` and `after`
        took part in the decision (a hit of another detector stands)."""
        second = policy.stage(where).second_opinion if self.second_opinion else None
        if decided is None or second is None or second.clears_below <= 0:
            return False
        after = getattr(self.detectors.get(second.after), "name", second.after)
        return decided.score.detector in (after, f"{second.after}+{second.detector}")

    def _clear(self, text: str, where: str, policy: Policy, decided: Hit | None, features: Any = None,
               top: float | None = None) -> Hit | None:
        """`decided`, unless `after` took part in it and the second opinion's top score (`top`, else read from
        `features` or the text) lies under the stage's `clears_below`: then the other detectors' best hit.
        On the held-out sets v12-v14 (900 user messages) this changed no caught harmful message and
        cleared 77% of the benign ones at 0.02 (the default policy's notes)."""
        if not self._clearable(where, policy, decided):
            return decided
        second = policy.stage(where).second_opinion
        if top is None:
            top = self._second_top(text, where, policy, features)
        if top >= second.clears_below:
            return decided
        return self._first_hit(text, where, policy, without=second.after)[0]

    def _second_top(self, text: str, where: str, policy: Policy, features: Any = None) -> float:
        """The second opinion's top score over the stage's categories (1.0 when it is unavailable: it
        then clears nothing)."""
        try:
            scored = self._second_scores(text, where, policy, features)
        except AssistantError as e:
            _warn_once(f"The safety second opinion ({policy.stage(where).second_opinion.detector}) is unavailable, "
                       f"so it clears nothing: {e}")
            return 1.0
        return max((s.score for s in scored), default=1.0)

    def _tap(self, text: str, where: str) -> Any:
        """A tap for the stage's second opinion on `text`, when it has one and its detector reads taps."""
        second = self.policy.stage(where).second_opinion if self.second_opinion else None
        make_tap = getattr(self.detectors.get(second.detector), "tap", None) if second else None
        return make_tap(text) if callable(make_tap) else None

    def _pending(self, text: str, where: str, decide: Callable[[], Hit | None], tap: Any,
                 begin: Callable[[], Any] | None = None) -> Verdict:
        """An allowed-looking verdict whose `pending` resolves (once, audited once) to `decide()`'s."""
        done: list[Verdict] = []
        lock = threading.Lock()

        def resolve() -> Verdict:
            with lock:  # audited once, however often it is asked
                if not done:
                    done.append(self._verdict(text, where, decide()))
                return done[0]

        return Verdict(pending=resolve, tap=tap, begin=begin)

    def _verdict(self, text: str, where: str, hit: Hit | None) -> Verdict:
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

    def closeness(self, text: str, *, where: str, policy: Policy | None = None) -> float:
        """How near `text` comes to a hit at stage `where`: the largest score / threshold over the stage's
        detectors and categories (>= 1 is a hit; second opinions not asked)."""
        policy = policy or self.policy
        stage = policy.stage(where)
        best = 0.0
        for name in stage.detectors:
            detector = self.detectors[name]
            wanted = self._wanted(policy, stage.categories, name, detector)
            if not wanted:
                continue
            for score in self._scores(detector, text, where):
                if score.category in wanted:
                    threshold = self._threshold(policy, stage, name, score.category)
                    best = max(best, score.score / threshold if threshold > 0 else float("inf"))
        return best

    def hit(self, text: str, *, where: str, policy: Policy | None = None) -> Hit | None:
        """The deciding hit for `text` at stage `where` (None: nothing reached a threshold), the second
        opinion included when the text needs one."""
        policy = policy or self.policy
        first, later = self._first_hit(text, where, policy)
        return self._asker(text, where, policy, first, later)()

    def _first_hit(self, text: str, where: str, policy: Policy, *, without: str | None = None
                   ) -> tuple[Hit | None, Callable[[], Hit | None] | None]:
        """(the best hit of the stage's detectors, but `without`, the second opinion to ask or None). A
        text whose `after` detector's top score lies in the doubt band leaves that detector's hits to the
        second opinion; a block by another detector needs none."""
        stage = policy.stage(where)
        if not text.strip() or not stage.detectors:
            return None, None
        second = stage.second_opinion if self.second_opinion else None
        best: Hit | None = None
        doubt: Score | None = None
        alone: Hit | None = None  # the doubtful detector's own hit, should the second opinion fail
        for name in stage.detectors:
            if name == without:
                continue
            detector = self.detectors[name]
            wanted = self._wanted(policy, stage.categories, name, detector)
            if not wanted:
                continue
            scored = [s for s in self._scores(detector, text, where) if s.category in wanted]
            hit = self._best(policy, stage, name, scored)
            if second is not None and name == second.after and scored:
                top = max(scored, key=lambda s: s.score)
                if second.band[0] <= top.score < second.band[1]:
                    doubt, alone = top, hit
                    continue
            if hit is not None and (best is None or hit.key > best.key):
                best = hit
            if best is not None and best.action == "block":
                return best, None  # the slower detectors cannot change a block
        if doubt is None:
            return best, None

        def later(features: Any = None, scored: list[Score] | None = None) -> tuple[Hit | None, float | None]:
            """(the hit, the second opinion's top score: None when it could not read the text); `scored`:
            its scores, when the caller has them already."""
            try:
                if scored is None:
                    scored = self._second_scores(text, where, policy, features)
            except AssistantError as e:  # e.g. the chat model is not prepared: decide as before it existed
                _warn_once(f"The safety second opinion ({second.detector}) is unavailable, so the {second.after} "
                           f"decides alone: {e}")
                scored = []
            if scored:
                return self._second_opinion(where, policy, doubt, best, scored), max(s.score for s in scored)
            return (alone if alone is not None and (best is None or alone.key > best.key) else best), None

        return best, later

    @staticmethod
    def _threshold(policy: Policy, stage: Any, name: str, category: str) -> float:
        """Detector `name`'s threshold for `category` at this stage (the stage's own, else the category's)."""
        return stage.thresholds.get(name, policy.rule(category).thresholds[name])

    @staticmethod
    def _best(policy: Policy, stage: Any, name: str, scored: list[Score]) -> Hit | None:
        """The strongest hit among one detector's scores."""
        best: Hit | None = None
        for score in scored:
            rule = policy.rule(score.category)
            threshold = SafetyGuard._threshold(policy, stage, name, score.category)
            if score.score >= threshold:
                candidate = Hit(score, threshold, rule.action)
                if best is None or candidate.key > best.key:
                    best = candidate
        return best

    def _second_scores(self, text: str, where: str, policy: Policy, features: Any = None) -> list[Score]:
        """The second opinion's scores of the stage's categories. `features`: what the turn's prefill
        tapped for its detector (else it reads the text itself)."""
        stage = policy.stage(where)
        name = stage.second_opinion.detector
        detector = self.detectors[name]
        wanted = self._wanted(policy, stage.categories, name, detector)
        scores = detector.score_features(features) if features is not None else self._scores(detector, text, where)
        return [s for s in scores if s.category in wanted]

    def _second_opinion(self, where: str, policy: Policy, doubt: Score, best: Hit | None,
                        scored: list[Score]) -> Hit | None:
        """The mean of the doubtful detector's top score and the second opinion's (`scored`, not empty),
        under the second opinion's threshold for the stronger category; the better of that and `best`."""
        stage = policy.stage(where)
        second = stage.second_opinion
        top = max(scored, key=lambda s: s.score)
        category = doubt.category if doubt.category in {s.category for s in scored} and doubt.score >= top.score \
            else top.category
        rule = policy.rule(category)
        threshold = self._threshold(policy, stage, second.detector, category)
        combined = (doubt.score + top.score) / 2
        if combined < threshold:
            return best
        candidate = Hit(Score(category, combined, f"{second.after}+{second.detector}"), threshold, rule.action)
        return candidate if best is None or candidate.key > best.key else best

    @staticmethod
    def _wanted(policy: Policy, categories: tuple[str, ...], name: str, detector: Detector) -> list[str]:
        """The stage's categories this detector scores and acts on."""
        return [c for c in categories if c in detector.categories and name in policy.rule(c).thresholds
                and policy.rule(c).action != "allow"]

    def _scores(self, detector: Detector, text: str, where: str) -> list[Score]:
        """The detector's scores; a costly one's (`cache_key`) on passages and tool results come from the
        score cache when that text was scored before (at ingest, or by an earlier turn)."""
        key = getattr(detector, "cache_key", None)
        key = key(where) if callable(key) and where in ("retrieved", "tool") else None
        if key:
            cached = self.audit.cached_scores(text, key)
            if cached is not None:
                return [Score(c, v, detector.name) for c, v in cached]
        memo = (detector.name, text) if where == "output" else None
        if memo is not None:
            with self._recent_lock:
                recent = self._recent.get(memo)
            if recent is not None:
                return recent
        scored = detector.score(text)
        if key:
            self.audit.cache_scores(text, key, [(s.category, s.score) for s in scored])
        if memo is not None:
            with self._recent_lock:
                self._recent[memo] = scored
                if len(self._recent) > RECENT_SCORES:
                    del self._recent[next(iter(self._recent))]  # the oldest
        return scored

    def scores(self, text: str) -> list[Score]:
        """Every detector's scores for `text` (for moderation-style APIs and `assistant safety check`)."""
        return [s for d in self.detectors.values() for s in d.score(text)]
