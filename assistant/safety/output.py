"""The output guard: a StreamTransformer that checks the answer as it streams, in windows.

Design note — hold back at most one sentence, release plain words early:
  Deltas are appended to a pending buffer. Whenever the buffer holds a sentence end (., ! or ?
  followed by white space, or a line break) everything up to the last one is a window: it is
  scanned (redaction patterns from assistant/safety/redact.py, then the policy's output detectors
  for toxicity) and released; the unfinished sentence stays pending. A secret never contains such a
  boundary, so a key split over any number of deltas is still whole when its window is scanned.
  Within the unfinished sentence, whole words are released early (`_early_cut`): the user sees the
  answer start after a word or two instead of after its first sentence (bench/safety.py: the guards
  had added +133% to a short turn's first visible text). A word is only ever released whole, so
  one-word secrets (keys, tokens, emails, URLs with a password) are scanned whole. The cut never
  falls where a pattern of several words could straddle it: the last word released must be plain
  (letters, inner ' or -, closing punctuation: no digit, so no card, phone or IBAN group) and not one
  of a pair of consecutive words of the protected texts, nor the first of such a pair whose second is
  still being written (so a verbatim run of them is never cut, and none of it is shown before the run
  is long enough to be found: redact.LeakMatcher.may_continue); the word being written stays held; a
  sentence with a PEM marker (-----) releases nothing early, and neither
  does one whose text so far scores EARLY_CLOSENESS of an output detector's threshold or more
  (toxicity builds up over a sentence; the words before the one that raises the score, such as
  "What a", may be shown before the notice that stops the answer). Windows are scanned with the
  released part of their sentence in front of them (`self.sentence`), so a `password: value`, a PEM
  header or an announcement already shown ("my instructions say: \"") still has its value, its block
  or its quote held and redacted after it, and the toxicity detectors read the sentence so far. A
  PEM private key block is held until its END line, and a quote the answer announces as its own
  instructions ("my instructions say: \"...") until its closing mark (at most 4 x max_hold_chars), so
  redact.SELF_QUOTE sees it whole. A sentence longer than `max_hold_chars` is cut at
  its last space (the last word stays pending). `finish()` scans what is left.
  Redactions replace the span (`[redacted: api key]`) and emit one SafetyVerdict(stage="output",
  allowed=True) per kind; toxic text with action `block` is replaced by a notice and everything after
  it is dropped. A category the policy's [output] table names acts as it says there: a hit of the
  `disclosure` classifier (system_prompt_leak: an answer revealing the assistant's own instructions in
  words no pattern knows, assistant/safety/disclosure.py) has no span to cut out, so with `redact` the
  window and the rest of the answer give way to one `[redacted: system prompt]` marker; the classifier
  also takes part in the early-release closeness, so the words of a sentence heading for a disclosure
  are held until it is scored whole. Because the emitter stores what the last transformer emits, the
  stored message holds the redacted text. Every redaction and stop is audited (hash of the excerpt only).
  The answer's very first token is the one exception to "whole words only" (`_opener`): when it is,
  exactly, one of OPENERS (common words an answer starts with: "To", "The", "Yes", "In", ...), a token
  of letters alone (any script, at most FIRST_LETTERS: "Practice", "Para", "日本") or a single digit (a
  numbered list's "1"), and nothing has been shown yet, it goes out at once, before the next token
  says whether its word goes on ("To" -> "Today"). What it shows is one token of letters or one digit,
  so even if it turns out to begin something redacted ("Tomas.smith@corp.example" ->
  "Tomas[redacted: email]", a random 32+ character token, a verbatim run of the system prompt, which is
  redacted from there on, since windows are scanned with the released part of their sentence in
  front) it discloses next to nothing; a token with a digit and a letter, punctuation, or a leading
  space is held as before. Holding it for the next token cost a whole decode step or more (~25-140
  ms, +28% of a short turn's first visible text on the packaged model, bench/safety.py). The rule grew
  with what was still held: common words first; then up to three ASCII letters (2026-11-28: 4 of the 7
  first tokens held in 40 typical turns: "Ant", "Bre", "Ar", "N"); then any letters and one digit
  (2026-11-29: 21 of 60 benign messages as they come, many of them not English, had their first token
  held: "Play", "Para", "Bien", "日本", "Д", "1", ...). Over the 2,490 answer rows of tests/data cut into
  the chat model's tokens, the last step changed the shown text of 4, each a disclosure block that now
  shows less ("System[redacted: system prompt]" instead of "System: [redacted: ...]"), and showed the
  first text sooner in 387. Every later word keeps the rules above.
  One instance serves one turn: `for_turn(conversation_id)` makes a fresh one bound to that
  conversation's policy.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

from assistant.events import SafetyVerdict, TextDelta, TurnEvent
from assistant.safety.audit import SafetyAudit
from assistant.safety.categories import label
from assistant.safety.policy import Policy
from assistant.safety.redact import (QUOTES_CLOSE, SELF_DUMP_OPEN, SELF_QUOTE_OPEN, Finding, LeakMatcher, find, redact,
                                     words)

QUOTE_CLOSE = re.compile(f"[{QUOTES_CLOSE}]")
from assistant.seams import StreamTransformer

BOUNDARY = re.compile(r"[.!?](?=\s)|\n")
TRAILING = ",.;:!?)]\"'”’»"
# early release stops while the sentence so far scores at least this fraction of an output threshold
EARLY_CLOSENESS = 0.3
# a word that may end an early release: letters (any script), inner ' or -, closing punctuation; no digit
PLAIN_WORD = re.compile(rf"[(\"“«]?[^\W\d_]+(?:['’-][^\W\d_]+)*[{re.escape(TRAILING)}]*")
# words an answer's first token may be shown as at once (see `_opener`): common, so showing one discloses nothing
FIRST_LETTERS = 12  # ... and so may a first token of letters alone (any script) up to this many, or one digit
OPENERS = frozenset("""a about absolutely according actually after again all also although an and another any
are as at based because before being below both but by can certainly could dear did do does each even every
first for from generally glad good great had has have he hello here hey hi how however i if in indeed instead
is it its just let many may maybe most much my no not now of oh ok okay on one only or our please since so some
sometimes sorry sure thank thanks that the their then there these they this those though thus to today under
unfortunately unlike unless usually very we well what when where whether which while who why with would yes yeah
you your""".split())
PEM_OPEN = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----")
PEM_CLOSE = re.compile(r"-----END [A-Z0-9 ]*PRIVATE KEY-----")
LEAD_CHARS = 300  # the most of the sentence before a window that the detectors read with it (`_lead`)
SHOWN_TAIL = 800  # characters of the answer shown so far kept for redact.find's context rules
MARKER_KINDS = {"system_prompt_leak": "system prompt"}  # the marker a classifier's redaction leaves
STOP_NOTICE = ("[The rest of this answer was withheld by the safety policy ({category}). Ask again in other "
               "words, or ask for a neutral summary.]")


class OutputGuard(StreamTransformer):
    def __init__(self, *, policy: Policy, audit: SafetyAudit, guard: "Callable | None" = None,
                 leaks: LeakMatcher | None = None, conversation_id: str | None = None,
                 max_hold_chars: int = 400, policy_for: Callable[[str | None], Policy] | None = None) -> None:
        self.policy, self.audit, self.leaks = policy, audit, leaks
        self.guard = guard  # SafetyGuard (its `hit` scores windows for toxicity), or None: patterns only
        self.conversation_id, self.max_hold_chars = conversation_id, max_hold_chars
        self.max_quote_chars = 4 * max_hold_chars  # a quote of the instructions is held whole up to this
        self.policy_for = policy_for
        self.pending = ""
        self.sentence = ""  # what was released of the unfinished sentence (words released early)
        self.stopped = False
        # the end of what went out (SHOWN_TAIL): the words around a number (redact.find's `before`), the
        # sentence before a window (`_lead`), and whether anything went out yet (`_opener`)
        self.shown_text = ""
        self._reported: set[str] = set()

    def for_turn(self, conversation_id: str | None, *, protect: Sequence[str] = ()) -> "OutputGuard":
        """A fresh guard for one answer; `protect`: that turn's own instructions (a client's system
        message), protected like the system prompt for this answer only."""
        policy = self.policy_for(conversation_id) if self.policy_for else self.policy
        leaks = self.leaks.plus(protect) if protect and self.leaks is not None else self.leaks
        if protect and leaks is None:
            leaks = LeakMatcher(protect)
        return OutputGuard(policy=policy, audit=self.audit, guard=self.guard, leaks=leaks,
                           conversation_id=conversation_id, max_hold_chars=self.max_hold_chars,
                           policy_for=self.policy_for)

    # -- the transformer ------------------------------------------------------------------------
    def feed(self, event: TurnEvent) -> Sequence[TurnEvent]:
        if not isinstance(event, TextDelta):
            return (event,)
        if self.stopped:
            return ()
        self.pending += event.text
        cut = self._cut()
        return self._release(cut) if cut else ()

    def finish(self) -> Sequence[TurnEvent]:
        if self.stopped or not self.pending:
            return ()
        return self._release(len(self.pending))

    # -- windows --------------------------------------------------------------------------------
    def _cut(self) -> int:
        """How much of the pending text is complete enough to scan and release (0: hold it all). The
        holds read the released part of the sentence too: an announcement may have been shown."""
        off = len(self.sentence)
        text = self.sentence + self.pending
        opened = None
        for m in PEM_OPEN.finditer(text):
            opened = m
        if opened is not None and not PEM_CLOSE.search(text, opened.end()):
            return max(0, self._last_boundary(text[:opened.start()]) - off)  # hold the key block until its END line
        cut = max(0, self._last_boundary(text) - off)
        dumping = None
        for m in SELF_DUMP_OPEN.finditer(text):
            dumping = m
        if dumping is not None and len(text) - dumping.end() <= self.max_quote_chars:
            return max(0, self._last_boundary(text[:dumping.start()]) - off)  # "here is my system prompt:": hold what follows
        quoting = None
        for m in SELF_QUOTE_OPEN.finditer(text):
            quoting = m
        if quoting is not None and len(text) - quoting.end() <= self.max_quote_chars:
            closed = QUOTE_CLOSE.search(text, quoting.end())  # "my instructions say: \"...": never cut inside
            if closed is None or quoting.start() < cut + off < closed.end():
                return max(0, self._last_boundary(text[:quoting.start()]) - off)
        if cut == 0 and len(self.pending) > self.max_hold_chars:
            space = self.pending.rfind(" ", 0, len(self.pending) - 1)
            cut = space + 1 if space > 0 else 0
        return max(cut, self._early_cut(cut), self._opener())

    def _opener(self) -> int:
        """All of the pending text when it is the answer's first token and one of OPENERS, a token of
        letters alone or a single digit (module notes)."""
        first = self.pending
        plain = (len(first) <= FIRST_LETTERS and first.isalpha()) or (len(first) == 1 and first.isdigit())
        if self.shown_text or not (plain or first.lower() in OPENERS):
            return 0
        if self.guard is not None and self.guard.closeness(self.pending, where="output",
                                                           policy=self.policy) >= EARLY_CLOSENESS:
            return 0
        return len(self.pending)

    def _early_cut(self, cut: int) -> int:
        """The furthest word boundary after `cut` up to which the unfinished sentence may be released
        now (0: none); the rules are in the module's design note."""
        context = self.sentence if cut == 0 else ""  # what precedes pending[cut:] in its sentence
        text = context + self.pending[cut:]
        if "-----" in text:
            return 0  # a PEM block's header is held with it
        base = len(context) - cut  # pending position = text position - base
        spans = [m.span() for m in re.finditer(r"\S+", text)]
        ends = [start for start, _ in spans[1:]] + [len(text)]  # where the whitespace after each word ends
        for (start, end), next_start in zip(reversed(spans), reversed(ends)):
            if end == len(text):
                continue  # the last word may still grow
            cut_at = next_start - base  # release through the whitespace after the word
            if start < len(context):
                break  # only this window's words
            word = text[start:end]
            if not PLAIN_WORD.fullmatch(word):
                continue
            last, after = words(word), words(text[next_start:])
            if last and self.leaks is not None and self.leaks.may_continue(last[-1][0], after[0][0] if after else ""):
                continue
            # scored through the whitespace after the word: the very text the release scans (the guard
            # remembers the score), unless an earlier sentence ends in this window or a finding is redacted
            lead = self._lead(cut)
            if self.guard is not None and self.guard.closeness(lead + text[:next_start], where="output",
                                                               policy=self.policy) >= EARLY_CLOSENESS:
                return 0  # the sentence is heading for a block: show none of it before it is whole
            return cut_at
        return 0

    def _lead(self, cut: int) -> str:
        """The sentence before the text being scored (which starts at pending[cut:], or with the released
        part of its sentence when cut is 0), up to LEAD_CHARS: the output detectors read a window with the
        sentence before it, as the disclosure classifier was cross-validated ("Dumping runtime config:"
        and the first line of the dump say more together than apart), and toxicity that builds up over
        two sentences counts."""
        before = self.shown_text + self.pending[:cut] if cut else self._shown_before_sentence()
        body = before.rstrip()
        start = 0
        for m in BOUNDARY.finditer(body):
            start = m.end()
        return before[start:][-LEAD_CHARS:]

    def _shown_before_sentence(self) -> str:
        """What went out before the released part of the unfinished sentence (its end, SHOWN_TAIL at most)."""
        return self.shown_text[:max(0, len(self.shown_text) - len(self.sentence))]

    @staticmethod
    def _last_boundary(text: str) -> int:
        last = 0
        for m in BOUNDARY.finditer(text):
            last = m.end()
        return last

    def _release(self, cut: int) -> list[TurnEvent]:
        window, self.pending = self.pending[:cut], self.pending[cut:]
        events: list[TurnEvent] = []
        context = self.sentence  # already shown: scanned again only as context for what follows it
        findings = [Finding(max(f.start - len(context), 0), f.end - len(context), f.category, f.kind)
                    for f in find(context + window, self.leaks, before=self._shown_before_sentence())
                    if f.end > len(context) and self.policy.output_action(f.category) != "allow"]
        redacted = [f for f in findings if self.policy.output_action(f.category) == "redact"]
        for f in findings:
            action = self.policy.output_action(f.category)
            self._audit(f.category, "redact" if action == "redact" else action, 1.0, 1.0, f"pattern:{f.kind}",
                        window[f.start:f.end])
            if action in ("redact", "warn") and f.kind not in self._reported:
                self._reported.add(f.kind)
                verb = "was redacted" if action == "redact" else "appears"
                events.append(SafetyVerdict("output", True, f.category, f"A {f.kind} in the answer {verb} "
                                            f"(policy '{self.policy.name}').", 1.0, 1.0, f"pattern:{f.kind}"))
        text = redact(window, redacted)
        scored = self._lead(0) + context + text  # with the sentence before it (see `_lead`)
        hit = self.guard.hit(scored, where="output", policy=self.policy) if self.guard is not None else None
        if hit is not None:
            # a category the policy's [output] table names acts as it says there (system_prompt_leak: redact)
            action = self.policy.output.get(hit.score.category, hit.action)
            self._audit(hit.score.category, action, hit.score.score, hit.threshold, hit.score.detector, text)
            if action == "redact":  # a classifier's leak: no span to cut out, so the rest of the answer goes
                self.stopped, self.pending = True, ""
                kind = MARKER_KINDS.get(hit.score.category, label(hit.score.category))
                events.append(SafetyVerdict("output", True, hit.score.category,
                                            f"The answer began to reveal {label(hit.score.category)}; the rest of it "
                                            f"was redacted (policy '{self.policy.name}').", round(hit.score.score, 4),
                                            hit.threshold, hit.score.detector))
                return [*events, TextDelta(f"[redacted: {kind}]")]
            if action == "block":
                self.stopped, self.pending = True, ""
                notice = STOP_NOTICE.format(category=label(hit.score.category))
                events.append(SafetyVerdict("output", False, hit.score.category, notice, round(hit.score.score, 4),
                                            hit.threshold, hit.score.detector))
                return [*events, TextDelta(notice)]
            if action == "warn":
                events.append(SafetyVerdict("output", True, hit.score.category,
                                            f"This part of the answer may contain {label(hit.score.category)}.",
                                            round(hit.score.score, 4), hit.threshold, hit.score.detector))
        sentence = context + text  # the next character tells whether a final "." ends the sentence
        self.sentence = sentence[self._last_boundary(sentence + self.pending[:1]):]
        self.shown_text = (self.shown_text + text)[-SHOWN_TAIL:]
        return [*events, TextDelta(text)] if text else events

    def _audit(self, category: str, action: str, score: float, threshold: float, detector: str, excerpt: str) -> None:
        self.audit.record(conversation_id=self.conversation_id, policy=self.policy.name, stage="output",
                          category=category, action=action, score=score, threshold=threshold, detector=detector,
                          excerpt=excerpt)


def findings_summary(findings: Sequence[Finding]) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in findings:
        out[f.category] = out.get(f.category, 0) + 1
    return out
