"""Brevity: a document answer ends after its second sentence, while it streams.

Design note — what the model adds after two sentences drifts:
  * The answering prompt asks for "one or two full sentences" (assistant/context.py). The 1.5B model
    often writes three to five, and the later ones leave the question for whatever the other passages
    say ("It is called with the pointer to the structure as an argument [3].", "See Section DejaGnu
    Tests in The GNU Automake Manual [3]."), each with a citation to a page the answer is not on.
  * Replayed first on the stored answers of a whole dev run (6c1145c, 111 questions): keeping each
    answer's first two sentences cut 8 of its 124 page citations, 5 of them wrong (page precision
    0.863 -> 0.897); one sentence was too few, 8 answers lost a fact. Then two whole dev runs, before
    (f5571ba) and with the cap (7cc84f0): no answer changed from right to wrong or back (75 of 111
    both), page precision 0.884 -> 0.900, p95 latency 27.5 -> 22.8 s. The cap counts per part: each
    part of a compound question is its own answer (assistant/compound.py).
  * The cut is made while the answer streams, not afterwards: generation stops when a third sentence
    starts, so the user never sees text that is then taken back, and the answer ends sooner.
  * A sentence is what grounding splits on (assistant/grounding.py): ".", "!" or "?" then a space and
    a capital, or a line break. A citation marker written after the full stop ("... afterwards. [2]")
    is the earlier sentence's, so a piece counts as started only at its first word.
  * A request to summarise or compare whole files (the prefetch read whole pages) is not capped: it
    asks for more than one fact.
  * Lists, tables and code are not prose: once the answer has a bulleted or numbered line, a table row
    or a code fence, nothing is cut (a "which of ..." answer lists its items, one per line). Until the
    third piece has a few characters, it is held back: "- " may start a list item.
"""

from __future__ import annotations

import re

from assistant.grounding import OPENING_MARKERS, SENTENCES

NOT_PROSE = re.compile(r"^[ \t]*(?:[-*\u2022]|\d{1,3}[.)])[ \t]+\S|^[ \t]*\||```", re.M)
DECIDE_CHARS = 3  # of a third piece, past its markers, before it is judged a sentence


class SentenceCap:
    """Feed it answer text as it streams; it returns what may be shown and sets `done` once the
    answer has `limit` sentences and the next one begins (the caller then stops generating)."""

    def __init__(self, limit: int = 2) -> None:
        self.limit = limit
        self.text = ""  # everything fed
        self.shown = 0  # how much of it was returned
        self.done = False
        self.off = limit <= 0  # no cap: a list, a table or code, or none asked for

    def feed(self, chunk: str) -> str:
        if self.done or not chunk:
            return ""
        self.text += chunk
        if not self.off and NOT_PROSE.search(self.text):
            self.off = True
        if self.off:
            return self._release(len(self.text))
        start = self._next_sentence()
        if start is None:  # all may be shown but trailing space: an answer that ends here ends without it
            return self._release(len(self.text.rstrip()))
        markers = OPENING_MARKERS.match(self.text[start:])  # the earlier sentence's citation: it stays with it
        cut = start + (markers.end() if markers else 0)
        if len(self.text[cut:].strip()) < DECIDE_CHARS:
            # not yet known: a sentence, a list item, or the answer's end
            return self._release(len(self.text[:start].rstrip()))
        self.done = True
        return self._release(len(self.text[:cut].rstrip()))

    def finish(self) -> str:
        """What is still held back when the answer ends by itself."""
        return "" if self.done else self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.shown:
            return ""
        out, self.shown = self.text[self.shown:upto], upto
        return out

    def _next_sentence(self) -> int | None:
        """Where the (limit+1)-th sentence starts, counting only pieces with a word past their markers;
        None while the answer has at most `limit` of them."""
        starts = [0, *(m.end() for m in SENTENCES.finditer(self.text))]
        counted = 0
        for i, at in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else len(self.text)
            words = OPENING_MARKERS.sub("", self.text[at:end], count=1).strip()
            if not words and i + 1 < len(starts):
                continue  # markers only, between two sentences: the earlier sentence's citation
            counted += 1
            if counted == self.limit + 1:
                return at
        return None


# A loop: the small model, asked for long prose ("Write a long story about a lighthouse keeper."), can fall
# into one clause said over and over until max_tokens ("and it was covered in a thick layer of sandstone,
# gravel, and limestone, " ~70 characters, 15 times and on). `repeating` sees it once the answer ends in one
# unit of 10-200 characters said at least three times over 240 characters or more: short of that, code
# with a few identical lines or a table of equal rows is not taken for a loop.
REPEAT_UNIT = (10, 200)  # characters of the repeated unit
REPEAT_SPAN = 240  # characters the repeats must cover, at least three of them
REPEAT_TAIL = 3 * REPEAT_UNIT[1]  # the most of an answer's end that `repeating` reads


def repeating(text: str) -> bool:
    """Whether `text` ends in one unit said over and over (see above)."""
    n = len(text)
    if n < REPEAT_SPAN:
        return False
    for p in range(REPEAT_UNIT[0], min(REPEAT_UNIT[1], n // 3) + 1):
        times = max(3, -(-REPEAT_SPAN // p))
        if times * p > n:
            continue
        unit = text[n - p:]
        if all(text[n - (i + 1) * p:n - i * p] == unit for i in range(1, times)):
            return True
    return False
