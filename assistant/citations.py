"""Citations: numbering what was retrieved in a turn, and checking what the answer cites.

Design note — a citation is only as good as the retrieval behind it:
  * Every passage the model is shown in a turn (auto-retrieved context, `search_documents` hits,
    `read_document` pages) is registered in the turn's `SourceLedger` and gets a marker `[n]`,
    numbered from 1 in the order first seen; the same chunk seen twice keeps its first number.
  * When the answer is final, `verify_citations` looks at every `[n]` (also `[1, 2]` and `[1][2]`):
    a marker that names a passage of *this turn* becomes a `Source`; any other number (a marker the
    model made up, or one from an earlier turn) is removed from the answer and reported in
    `Sources.dropped_markers`.
  * A small model often states the fact without any marker. When an answer cites nothing but clearly
    reuses a passage (enough shared content words, see MIN_SHARED_WORDS), that passage is attributed
    and its marker appended to the sentence that reuses it; such sources carry `inferred=True` in the
    stored meta. Answers that share nothing with the passages get no sources at all.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from assistant.events import Source

MARKER = re.compile(r"\[(\d{1,3}(?:\s*,\s*\d{1,3})*)\]")
MARKER_RUN = re.compile(r"(?<![\w)\]])(?:\[\d{1,3}(?:\s*,\s*\d{1,3})*\])+")  # not `a[1]`: that is code
CODE = re.compile(r"```.*?(?:```|$)|`[^`\n]*`", re.S)  # fenced and inline code is never touched
WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9'.-]*[A-Za-z0-9]|[A-Za-z0-9]")
MIN_SHARED_WORDS = 3  # content words an uncited sentence must share with a passage to be attributed to it
SNIPPET_CHARS = 240  # evidence text kept per source
STOPWORDS = frozenset(
    "a an the of to in on at for from by with and or but is are was were be been being it its this that these "
    "those as into than then there their they them he she his her we you your our i me my not no yes do does did "
    "has have had can could will would should may might about which what who whom when where why how all any "
    "each also more most other some such only own same so too very just".split()
)


@dataclass(frozen=True)
class Passage:
    marker: int  # [n] as shown to the model
    doc: str  # document name (file name)
    page: int | None  # 1-based page, None when the format has none
    text: str  # the text the model was shown
    chunk_id: str  # retriever chunk id, or "<doc_id>:p<page>" for a whole page read

    def render(self, max_chars: int | None = None) -> str:
        text = self.text if max_chars is None or len(self.text) <= max_chars else self.text[:max_chars] + " …"
        where = f"{self.doc} p. {self.page}" if self.page is not None else self.doc
        return f"[{self.marker}] {where}: {' '.join(text.split())}"


class SourceLedger:
    """The passages retrieved in one turn, by marker."""

    def __init__(self) -> None:
        self._by_marker: dict[int, Passage] = {}
        self._by_chunk: dict[str, int] = {}

    def add(self, doc: str, page: int | None, text: str, chunk_id: str) -> Passage:
        if chunk_id in self._by_chunk:
            return self._by_marker[self._by_chunk[chunk_id]]
        passage = Passage(len(self._by_marker) + 1, doc, page, text, chunk_id)
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
    text: str  # the answer with unverifiable markers removed (and inferred ones appended)
    sources: tuple[Source, ...]  # one per verified marker, in marker order
    dropped_markers: tuple[int, ...]  # markers that matched no passage of this turn
    inferred_markers: tuple[int, ...] = ()  # markers added by attribution (the model cited nothing)

    def to_meta(self) -> dict[str, Any]:
        return {"sources": [asdict(s) for s in self.sources], "dropped_markers": list(self.dropped_markers),
                "inferred_markers": list(self.inferred_markers)}


def verify_citations(answer: str, ledger: SourceLedger, *, attribute: bool = True) -> CitationCheck:
    """Keep the markers that name a passage of this turn; drop the others (see the design note)."""
    cited: list[int] = []
    dropped: list[int] = []

    def keep_valid(match: re.Match) -> str:
        numbers = [int(n) for n in match.group(1).split(",")]
        good = [n for n in numbers if ledger.get(n) is not None]
        for n in numbers:
            (cited if n in good else dropped).append(n)
        return f"[{', '.join(map(str, good))}]" if good else ""

    text = _outside_code(answer, lambda prose: MARKER_RUN.sub(lambda run: MARKER.sub(keep_valid, run.group(0)), prose))
    if dropped:
        text = re.sub(r"[ \t]+([.,;:!?])", r"\1", text)  # "fact [9]." -> "fact."
        text = re.sub(r"[ \t]{2,}", " ", text)
    inferred: list[int] = []
    if attribute and not cited and len(ledger):
        text, inferred = attribute_sentences(text, ledger.passages)
        cited = inferred
    markers = sorted(set(cited))
    sources = tuple(_source(ledger.get(n)) for n in markers)  # type: ignore[arg-type]
    return CitationCheck(text, sources, tuple(sorted(set(dropped))), tuple(sorted(set(inferred))))


def attribute_sentences(answer: str, passages: Iterable[Passage]) -> tuple[str, list[int]]:
    """Append `[n]` to each sentence that shares at least MIN_SHARED_WORDS content words with
    passage n (the best such passage). Returns the new text and the markers used."""
    passages = list(passages)
    words = [(p, content_words(p.text)) for p in passages]
    used: list[int] = []
    out: list[str] = []
    for sentence in re.split(r"(?<=[.!?])(\s+)", answer):
        if not sentence.strip():
            out.append(sentence)
            continue
        mine = content_words(sentence)
        best, best_shared = None, 0
        for passage, theirs in words:
            shared = len(mine & theirs)
            if shared > best_shared:
                best, best_shared = passage, shared
        if best is not None and best_shared >= MIN_SHARED_WORDS:
            stripped = sentence.rstrip()
            end = len(stripped) - 1 if stripped and stripped[-1] in ".!?" else len(stripped)
            sentence = f"{stripped[:end]} [{best.marker}]{stripped[end:]}{sentence[len(stripped):]}"
            used.append(best.marker)
        out.append(sentence)
    return "".join(out), used


def _outside_code(text: str, edit) -> str:
    out, last = [], 0
    for m in CODE.finditer(text):
        out += [edit(text[last:m.start()]), m.group(0)]
        last = m.end()
    out.append(edit(text[last:]))
    return "".join(out)


def content_words(text: str) -> set[str]:
    return {w.lower().strip(".") for w in WORD.findall(text)} - STOPWORDS


def _source(passage: Passage) -> Source:
    snippet = " ".join(passage.text.split())
    if len(snippet) > SNIPPET_CHARS:
        snippet = snippet[: SNIPPET_CHARS - 1] + "…"
    return Source(passage.marker, passage.doc, passage.page, snippet, passage.chunk_id)
