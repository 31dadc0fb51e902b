"""Citations: numbering what was retrieved in a turn, and assigning the answer's citations from evidence.

Design note — a citation is only as good as the evidence behind it:
  * Every passage the model is shown in a turn (prefetched context, `search_documents` hits,
    `read_document` pages) is registered in the turn's `SourceLedger` and gets a marker `[n]`,
    numbered from 1 in the order first seen; the same chunk seen twice keeps its first number.
  * When the answer is final, `verify_citations` checks every claim against the passages instead of
    trusting the model's numbers. A claim is the text a marker run (`[1]`, `[1, 2]`, `[1][2]`) closes:
    from the previous run or sentence end up to the run (the whole sentence when that is shorter
    than MIN_CLAIM_WORDS content words, as in "…, see [2]"). A passage *supports* a claim when they share at least
    min(MIN_SHARED_WORDS, the claim's content words) content words. Then, per marker:
      - a number that names no passage of *this turn* (made up, or from an earlier turn) is removed
        and reported in `dropped_markers`;
      - when the claim states specific facts (names, numbers, options: `FactSupport`, given by the
        orchestrator from assistant/grounding.py), the passages that hold the most of them are the
        supporting ones, whatever the shared words say: "returns IDN2_TOO_BIG_LABEL" is supported by
        the page that has IDN2_TOO_BIG_LABEL, not by a page that shares more common words;
      - a passage that supports the claim, nearly as well as the best one does, keeps its marker;
      - otherwise the marker moves to the passage that supports the claim best (`reassigned`);
      - and when no passage supports the claim, its marker is removed: no evidence, no citation.
  * A marker run that follows another with no words between them ("… is 2 [1]. [2]") is dropped: it
    closes no claim (the 1.5B model ends one answer in five with such a stray number). A run after the
    full stop of a sentence without one ("… is 50. [4]") is moved before the full stop first: it cites
    that sentence.
  * Code is not prose: a `[1]` inside a code block or inline code is no marker, nor is `x[2]` written
    against a word; inline code stays part of its sentence (its brackets hidden while markers are
    assigned), so "… is `-V`. [2]" is that sentence's late marker, and `-V` is one of the claim's facts.
  * A sentence without any marker that clearly reuses a passage (MIN_SHARED_WORDS content words)
    gets that passage's marker appended; such sources carry `inferred=True` in the stored meta.
  * The snippet shown with a source is the passage's sentence that best matches the claim it
    supports, so the user can check the citation at a glance.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Mapping

from assistant.events import Source

MARKER = re.compile(r"\[(\d{1,3}(?:\s*,\s*\d{1,3})*)\]")
MARKER_RUN = re.compile(r"(?<![\w)\]])(?:\[\d{1,3}(?:\s*,\s*\d{1,3})*\])+")  # not `a[1]`: that is code
CODE = re.compile(r"```.*?(?:```|$)|`[^`\n]*`", re.S)  # fenced and inline code: markers in it are not markers
FENCED = re.compile(r"```.*?(?:```|$)", re.S)  # a code block gets no inferred marker; a sentence with `code` may
INLINE_CODE = re.compile(r"`[^`\n]*`")
HIDE_BRACKETS = {ord("["): "\ue05b", ord("]"): "\ue05d"}  # inline code's brackets while markers are assigned
SHOW_BRACKETS = {ord(v): chr(k) for k, v in HIDE_BRACKETS.items()}
WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9'.-]*[A-Za-z0-9]|[A-Za-z0-9]")
MIN_SHARED_WORDS = 3  # content words a claim must share with a passage to be supported by it (fewer for short claims)
MIN_CLAIM_WORDS = 1  # a marker's claim with fewer content words ("…, see [2]") is widened to its sentence
KEEP_RATIO = 0.5  # the model's passage keeps the marker if it shares at least this share of the best one's words
NUMBER_WORDS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())}
SENTENCE = re.compile(r"(?<=[.!?])\s+|\n+")
SNIPPET_CHARS = 240  # evidence text kept per source
STOPWORDS = frozenset(
    "a an the of to in on at for from by with and or but is are was were be been being it its this that these "
    "those as into than then there their they them he she his her we you your our i me my not no yes do does did "
    "has have had can could will would should may might about which what who whom when where why how all any "
    "each also more most other some such only own same so too very just".split()
)


FactSupport = Callable[["Iterable[Passage]"], Callable[[str], Mapping[int, int]]]  # passages -> claim -> facts held


@dataclass(frozen=True)
class Passage:
    marker: int  # [n] as shown to the model
    doc: str  # document name (file name)
    page: int | None  # 1-based page, None when the format has none
    text: str  # the text the model was shown
    chunk_id: str  # retriever chunk id, or "<doc_id>:p<page>" for a whole page read
    heading: str = ""  # the section heading above the passage ("" when unknown)

    def render(self, max_chars: int | None = None) -> str:
        text = self.text if max_chars is None or len(self.text) <= max_chars else self.text[:max_chars] + " …"
        where = f"{self.doc} p. {self.page}" if self.page is not None else self.doc
        section = f" (section {self.heading})" if self.heading else ""
        return f"[{self.marker}] {where}{section}: {flatten(text)}"


def flatten(text: str) -> str:
    """`text` on one line, except that table rows ("| a | b |") keep a line each: run together, the
    model lost which cell belongs to which row."""
    out: list[str] = []
    for line in text.split("\n"):
        words = " ".join(line.split())
        if not words:
            continue
        if words.startswith("|") or (out and out[-1].startswith("|")):
            out.append(words)
        elif out:
            out[-1] += " " + words
        else:
            out.append(words)
    return "\n".join(out)


class SourceLedger:
    """The passages retrieved in one turn, by marker."""

    def __init__(self) -> None:
        self._by_marker: dict[int, Passage] = {}
        self._by_chunk: dict[str, int] = {}

    def add(self, doc: str, page: int | None, text: str, chunk_id: str, heading: str = "") -> Passage:
        if chunk_id in self._by_chunk:
            return self._by_marker[self._by_chunk[chunk_id]]
        passage = Passage(len(self._by_marker) + 1, doc, page, text, chunk_id, heading)
        self._by_marker[passage.marker] = passage
        self._by_chunk[chunk_id] = passage.marker
        return passage

    def get(self, marker: int) -> Passage | None:
        return self._by_marker.get(marker)

    @property
    def passages(self) -> list[Passage]:
        return list(self._by_marker.values())

    def __len__(self) -> int:
        return len(self._by_marker)


@dataclass(frozen=True)
class CitationCheck:
    text: str  # the answer with its markers assigned from evidence (see the design note)
    sources: tuple[Source, ...]  # one per marker left in the text, in marker order
    dropped_markers: tuple[int, ...]  # markers removed: no passage of this turn, or no passage supports the claim
    inferred_markers: tuple[int, ...] = ()  # markers added to sentences the model did not cite
    reassigned: tuple[tuple[int, int], ...] = ()  # (the model's marker, the supporting one) pairs

    def to_meta(self) -> dict[str, Any]:
        return {"sources": [asdict(s) for s in self.sources], "dropped_markers": list(self.dropped_markers),
                "inferred_markers": list(self.inferred_markers), "reassigned_markers": [list(p) for p in self.reassigned]}


def marker_numbers(run: str) -> list[int]:
    """The passage numbers of a marker run: "[1][2, 3]" -> [1, 2, 3]."""
    return [int(n) for m in MARKER.finditer(run) for n in m.group(1).split(",")]


def verify_citations(answer: str, ledger: SourceLedger, *, attribute: bool = True,
                     facts: FactSupport | None = None) -> CitationCheck:
    """Assign the answer's markers from evidence (see the design note)."""
    words = {p.marker: content_words(p.text) for p in ledger.passages}
    held = facts(ledger.passages) if facts is not None else (lambda claim: {})
    claims: dict[int, str] = {}  # marker -> the first claim it supports (for the snippet)
    dropped: list[int] = []
    reassigned: list[tuple[int, int]] = []

    def assign(prose: str) -> str:
        out, last = [], 0
        for run in MARKER_RUN.finditer(prose):
            if not words and len(marker_numbers(run.group(0))) > 1:
                continue  # no passages this turn: "[1, 2, 5, 9]" is data (a sorted list), not made-up citations
            if last and not content_words(MARKER_RUN.sub(" ", prose[last:run.start()])):
                # a second run right after a cited sentence ("... is 2 [1]. [2]") closes no claim of its
                # own: the model repeats or guesses a number; it is dropped, not re-attributed
                dropped.extend(marker_numbers(run.group(0)))
                out += [prose[last:run.start()].rstrip(" \t")]
                last = run.end()
                continue
            claim = _claim(prose, last, run.start()).translate(SHOW_BRACKETS)  # code's facts as written: `a[1]`
            numbers = marker_numbers(run.group(0))
            kept: list[int] = []
            for n in numbers:
                chosen = _supporting(n, claim, words, held(claim)) if n in words else None
                if n not in words or chosen is None:
                    dropped.append(n)
                    continue
                if chosen != n:
                    reassigned.append((n, chosen))
                if chosen not in kept:
                    kept.append(chosen)
                    claims.setdefault(chosen, claim)
            out += [prose[last:run.start()], f"[{', '.join(map(str, kept))}]" if kept else ""]
            last = run.end()
        out.append(prose[last:])
        return "".join(out)

    text = _outside_code(_outside_code(answer, _masking_code(_inside_sentence)), _masking_code(assign))
    if dropped:
        text = re.sub(r"[ \t]+([.,;:!?])", r"\1", text)  # "fact [9]." -> "fact."
        text = re.sub(r"[ \t]{2,}", " ", text)
    inferred: list[int] = []
    if attribute and words:
        def attribute(prose: str) -> str:
            attributed, used = attribute_sentences(prose, ledger.passages, claims, held)
            inferred.extend(used)
            return attributed
        text = _outside_code(text, attribute)
    runs = MARKER_RUN.findall(_without_code(text))  # what assign took for markers: not `x[2]` in prose either
    markers = sorted({n for run in runs for n in marker_numbers(run)} & set(words))
    sources = tuple(_source(ledger.get(n), claims.get(n, "")) for n in markers)  # type: ignore[arg-type]
    really_dropped = sorted(set(dropped) - set(markers))
    return CitationCheck(text, sources, tuple(really_dropped), tuple(sorted(set(inferred))), tuple(reassigned))


def cited_as_written(answer: str, ledger: SourceLedger) -> CitationCheck:
    """The sources of an answer whose markers code assigned from verbatim evidence (a count's items,
    assistant/counting.py `supported_items`): kept as written. Read as the model's would be, a lone
    symbol such as "- * [1]" holds no claim of its own, and its marker was dropped."""
    claims: dict[int, list[str]] = {}  # marker -> the lines (items) it cites: the snippet's words
    known = {p.marker for p in ledger.passages}
    for line in _without_code(answer).splitlines():
        for run in MARKER_RUN.findall(line):
            for n in marker_numbers(run):
                if n in known:
                    claims.setdefault(n, []).append(MARKER_RUN.sub(" ", line))
    return CitationCheck(answer, tuple(_source(ledger.get(n), " ".join(claims[n])) for n in sorted(claims)),  # type: ignore[arg-type]
                         ())


LATE_RUN = re.compile(r"(?<=[\w)\"'`])([.!?])[ \t]*((?:\[\d{1,3}(?:\s*,\s*\d{1,3})*\])+)(?=\s|$)")


def _inside_sentence(prose: str) -> str:
    """A marker run written after the full stop of a sentence without one ("… is 50. [4]") moved
    before it ("… is 50 [4]."): it cites that sentence, not the next one."""
    return LATE_RUN.sub(r" \2\1", prose)


def _claim(prose: str, start: int, end: int) -> str:
    """The text a marker run at `end` closes: since the previous run or sentence end (markers removed)."""
    prose = MARKER_RUN.sub(lambda m: " " * len(m.group(0)), prose)
    segment = prose[start:end]
    sentences = SENTENCE.split(segment)
    claim = sentences[-1] if sentences else segment
    if len(content_words(claim)) < MIN_CLAIM_WORDS:  # "…, see [2]": widen to the sentence
        before = SENTENCE.split(prose[:end])
        claim = before[-1] if before else claim
        if len(content_words(claim)) < MIN_CLAIM_WORDS and len(before) > 1:
            claim = before[-2] + " " + claim
    return claim


def _supporting(marker: int, claim: str, words: dict[int, set[str]], held: Mapping[int, int] = {}) -> int | None:
    """The marker the claim should carry: the model's, the best-supporting passage's, or None."""
    mine = content_words(claim)
    most = max(held.values(), default=0)
    if most:  # the claim's facts decide: only passages that hold the most of them support it
        holders = [n for n in words if held.get(n, 0) == most]
        return marker if marker in holders else max(holders, key=lambda n: len(mine & words[n]))
    if not mine:
        return marker  # nothing to check against (a bare "[1]"): trust the number
    need = min(MIN_SHARED_WORDS, len(mine))
    shared = {n: len(mine & theirs) for n, theirs in words.items()}
    best = max(shared, key=lambda n: (shared[n], n == marker))
    if shared[marker] >= need and shared[marker] >= KEEP_RATIO * shared[best]:
        return marker
    return best if shared[best] >= need else None


def attribute_sentences(answer: str, passages: Iterable[Passage], claims: dict[int, str] | None = None,
                        held: Callable[[str], Mapping[int, int]] = lambda claim: {}) -> tuple[str, list[int]]:
    """Append `[n]` to each uncited sentence that shares at least MIN_SHARED_WORDS content words with
    passage n (the best such passage; among passages that hold the sentence's specific facts when it
    states any that a passage holds). Returns the new text and the markers added."""
    passages = list(passages)
    words = [(p, content_words(p.text)) for p in passages]
    used: list[int] = []
    out: list[str] = []
    for sentence in re.split(r"(?<=[.!?])(\s+)", answer):
        if not sentence.strip() or MARKER_RUN.search(_without_code(sentence)) or "```" in sentence:
            out.append(sentence)
            continue
        mine = content_words(sentence)
        facts_held = held(sentence)
        most = max(facts_held.values(), default=0)
        best, best_shared = None, 0
        for passage, theirs in words:
            shared = len(mine & theirs)
            if shared > best_shared and facts_held.get(passage.marker, 0) == most:
                best, best_shared = passage, shared
        if best is not None and best_shared >= MIN_SHARED_WORDS:
            stripped = sentence.rstrip()
            end = len(stripped) - 1 if stripped and stripped[-1] in ".!?" else len(stripped)
            sentence = f"{stripped[:end]} [{best.marker}]{stripped[end:]}{sentence[len(stripped):]}"
            used.append(best.marker)
            if claims is not None:
                claims.setdefault(best.marker, sentence)
        out.append(sentence)
    return "".join(out), used


def _without_code(text: str) -> str:
    return CODE.sub(" ", text)


def _masking_code(edit: Callable[[str], str]) -> Callable[[str], str]:
    """`edit` over prose whose inline code spans keep their text but not their brackets (stand-ins from
    Unicode's private-use area, put back afterwards): a marker in code is no marker, while the sentence
    around `code` stays one sentence and its claim keeps the code's facts ("... is `-V`. [2]" is a late
    marker of that sentence, and `-V` says which passage supports it)."""
    def run(prose: str) -> str:
        masked = INLINE_CODE.sub(lambda m: m.group(0).translate(HIDE_BRACKETS), prose)
        return edit(masked).translate(SHOW_BRACKETS)
    return run


def _outside_code(text: str, edit: Callable[[str], str]) -> str:
    """`edit` over the text between code blocks; the blocks stay as they are (inline code: _masking_code)."""
    out, last = [], 0
    for m in FENCED.finditer(text):
        out += [edit(text[last:m.start()]), m.group(0)]
        last = m.end()
    out.append(edit(text[last:]))
    return "".join(out)


def content_words(text: str) -> set[str]:
    """Lower-cased words without stopwords, plural "s" and spelled-out small numbers folded
    ("Seven years" and "7 year" share both words)."""
    words = (w.lower().strip(".") for w in WORD.findall(text))
    return {_fold(w) for w in words if w not in STOPWORDS}


def _fold(word: str) -> str:
    word = NUMBER_WORDS.get(word, word)
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word


def _source(passage: Passage, claim: str = "") -> Source:
    """The source of a marker, its snippet the passage sentence that best matches the claim."""
    text = " ".join(passage.text.split())
    snippet = text
    wanted = content_words(claim)
    if wanted:
        sentences = [s for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]
        snippet = max(sentences, key=lambda s: len(wanted & content_words(s)), default=text)
    if len(snippet) > SNIPPET_CHARS:
        snippet = snippet[: SNIPPET_CHARS - 1] + "…"
    return Source(passage.marker, passage.doc, passage.page, snippet, passage.chunk_id)


# -- what a counting question counts (assistant/counting.py, tools/retrieval.py) ---------------------
HOW_MANY = re.compile(r"\bhow many\s+(?P<noun>.+?)\s+(?:does|do|did|are|is|were|was|can|could|will|would|has|have|"
                      r"exist|appear|get)\b", re.I)


def counted_noun(question: str) -> str:
    """What a "how many X ..." question counts ("options"), or "items"."""
    match = HOW_MANY.search(question) or re.search(r"\bhow many\s+(?P<noun>.+)$", question, re.I)
    if not match:
        return "items"
    words = match.group("noun").rstrip("?.!").split()[:4]
    plural = next((i for i, w in enumerate(words)
                   if w.lower().endswith("s") and not w.lower().endswith(("ss", "us", "is")) and len(w) > 3), None)
    return " ".join(words[: plural + 1] if plural is not None else words[:1])  # "rules decide…" -> "rules"


def stem(word: str) -> str:
    """A crude singular: "utilities" -> "utility", "classes" -> "class", "rules" -> "rule"."""
    word = word.lower().strip("'\u2019")
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith(("sses", "xes", "ches", "shes")):
        return word[:-2]
    return word[:-1] if word.endswith("s") and not word.endswith("ss") else word


NOT_NAMING = {"and", "or", "of", "the", "a", "an", "different", "distinct", "separate", "total", "main"}


def names(text: str, noun: str) -> bool:
    """Whether `text` names the counted noun: every word of it ("major user-visible changes" in "The
    following major, user-visible changes"), each as itself or as the start of a word there
    ("Subclassing" names "subclass"). One word of it is not enough: "top-level variables" are not
    the "variable" of "The full lookup order for a variable is:"."""
    have = {stem(w) for w in re.findall(r"[A-Za-z][\w-]*", text)}
    wanted = [stem(w) for w in re.findall(r"[A-Za-z][\w-]*", noun) if w.lower() not in NOT_NAMING]
    return bool(wanted) and all(any(h.startswith(w) for h in have) for w in wanted)


def plural_head(noun: str) -> str:
    """The head word of a counted noun of two words or more when the question writes it in the plural
    ("substitutions" of "format substitutions", "operators" of "mathematical operators"), else ""."""
    words = re.findall(r"[A-Za-z][\w-]*", noun)
    head = words[-1].lower() if len(words) >= 2 else ""
    return head if head and stem(head) != head else ""


def holds_plural_head(text: str, noun: str, last: int | None = None) -> bool:
    """Whether `text` (its `last` words only, when given) holds the counted noun's plural head word."""
    head = plural_head(noun)
    words = re.findall(r"[A-Za-z][\w-]*", text)
    return bool(head) and head in (w.lower() for w in (words[-last:] if last else words))


# -- whether a text mentions a name (assistant/grounding.py, tools/retrieval.py) ------------------------

def fold_text(text: str) -> str:
    """`text` lower-cased, its whitespace and curly quotes folded and line-break hyphenation joined
    ("ELE-\\nMENT", or "ELE- MENT" once whitespace was folded, is "element")."""
    text = text.replace("\u2019", "'").replace("\u2018", "'").replace("\u201c", '"').replace("\u201d", '"')
    text = re.sub(r"(\w)-\s*\n\s*(\w)", r"\1\2", text)  # line-break hyphenation
    text = re.sub(r"(\w)- (\w)", r"\1\2", text)  # the same, after whitespace was folded
    return " ".join(text.lower().split())


def _term_fold(text: str) -> str:
    return " ".join(re.sub(r"[_-]+", " ", fold_text(text)).split())  # "AUTOMAKE_OPTIONS" is "AUTOMAKE OPTIONS" in a PDF


def mentions(text: str, term: str) -> bool:
    """Whether `text` mentions `term`, case, "_", "-" and spacing aside, as a whole word or its plural."""
    folded = _term_fold(term)
    if folded.endswith("s") and not folded.endswith("ss") and len(folded) > 3:  # "RFCs" is mentioned by "RFC 5890"
        folded = folded[:-1]
    return bool(folded) and re.search(rf"(?<![\w%]){re.escape(folded)}(?:e?s)?(?!\w)", _term_fold(text)) is not None


# a quoted phrase: 'New in this release' (tools/retrieval.py `named_section` too)
QUOTED = re.compile(r"[\'\"\u2018\u201c]([^\'\"\u2019\u201d]{3,80})[\'\"\u2019\u201d]")
TERM = re.compile(r"(?<![\w-])-{0,2}[A-Za-z0-9][\w./+-]*[\w+]|[A-Za-z0-9]")


def specific_terms(text: str) -> list[str]:
    """The words of `text` that name one thing rather than a common idea: quoted phrases, identifiers
    (asn1_create_element, v1.2, mime.cache, ext4), ALL-CAPS names (PRAGMA, HTTP) and capitalised
    words after the first (Ninja, OpenSSL). "times", "year" or "17" are not: every manual has them."""
    terms = [m.group(1) for m in QUOTED.finditer(text)]
    unquoted = QUOTED.sub(" ", text)
    for match in TERM.finditer(unquoted):
        word = match.group(0).rstrip(".")
        has_digit, has_letter = any(c.isdigit() for c in word), any(c.isalpha() for c in word)
        opens = unquoted[: match.start()].rstrip()[-1:] in ("", ".", "?", "!", ":")  # a sentence's first word
        if ((has_digit and has_letter) or any(c in word for c in "_./+")
                or (word.startswith("-") and word.lstrip("-")[:1].isalpha())
                or (len(word) >= 2 and word.isalpha() and (word.isupper() or (not opens and word[0].isupper())
                                                           or any(c.isupper() for c in word[1:])))):
            terms.append(word)
    return list(dict.fromkeys(terms))
