"""`assistant eval answers FILE.jsonl`: answer accuracy, citations, refusals and leaks over a QA file.

Each line is a JSON object (lines that are empty or start with # are skipped):

  question      the user's question (required)
  must_contain  a string, or a list whose entries must all occur in the answer, case-insensitively;
                an entry that is itself a list is a set of alternatives, one of which is enough
  pages         1-based pages where the answer is; a citation to any other page counts against precision
  id, kind      a name for the item and its kind (eval/rag/README.md lists the kinds); optional
  docs          file names of the documents the item is about, relative to the QA file's docs/ folder
                when there is one, else to the QA file's folder; a citation of another document is wrong
  history       earlier user questions of the same conversation: they are asked first, in one new
                conversation (their answers are not scored), then `question` in that same conversation

Any other field is ignored. Every item is asked in a new conversation. An item of kind "unanswerable"
is correct when the answer says the documents do not hold the answer (see `refusal_phrase`); any
other item when every must_contain entry occurs in it (a number as a whole number: "5" not in "rfc5890").

Documents: `--docs PATH...` ingests those files first. The documents named in the file's `docs` are
ingested too (each once, before the first question; unchanged files are skipped) with `--ingest`, and
without it whenever the QA file's folder has a docs/ folder holding them (`--no-ingest` turns that
off). They go into the data dir's library (--data-dir), which retrieval then searches as a whole.

Output: one row per item, a summary per kind, then one JSON line with accuracy, accuracy_by_kind,
citation_page_precision, citation_page_recall, refusal_correctness, false_refusals, leak_rate,
latency_p50_s, latency_p95_s, num_questions, num_cited, num_failed (and run_to_run_agreement with
--repeat 2 or more). --output FILE.jsonl writes one line per item and run, to read failures one by one.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from assistant.commands import EVAL_HELP, command_group
from assistant.events import Done, Sources

UNANSWERABLE = "unanswerable"
NUMBER = re.compile(r"\d+(?:\.\d+)*")  # a must_contain entry that is a number or version
NO_KIND = "-"  # the kind of items that do not name one (the old format)


@dataclass(frozen=True)
class QAItem:
    line: int  # 1-based line in the file
    question: str
    must_contain: tuple[tuple[str, ...], ...]  # every entry must occur; an entry = its alternatives
    pages: tuple[int, ...]  # empty: citations are not scored for this question
    id: str = ""
    kind: str = ""
    docs: tuple[str, ...] = ()  # file names; empty: any document may be cited
    history: tuple[str, ...] = ()  # earlier user questions of the conversation

    @property
    def name(self) -> str:
        return self.id or f"line {self.line}"

    @property
    def kind_key(self) -> str:
        return self.kind or NO_KIND

    @property
    def answerable(self) -> bool:
        return self.kind != UNANSWERABLE

    def missing(self, answer: str) -> list[str]:
        """The must_contain entries the answer lacks (alternatives joined with |)."""
        text = answer.lower()
        return ["|".join(alts) for alts in self.must_contain if not any(occurs(a.lower(), text) for a in alts)]


def occurs(entry: str, text: str) -> bool:
    """Whether `entry` occurs in `text`; a number only as a whole number: "5" is not in "rfc5890" or "25",
    "1.6" is not in "1.6.3" (a count of 6 RFCs listing rfc5890 was scored right for "5"); letters
    before it are a name's prefix, not digits: "8878" is in "RFC8878"."""
    if NUMBER.fullmatch(entry):
        return re.search(rf"(?<![\d.]){re.escape(entry)}(?!\w|\.\d)", text) is not None
    return entry in text


@dataclass
class QAResult:
    item: QAItem
    answer: str = ""
    cited_pages: list[int] = field(default_factory=list)
    cited_docs: list[str] = field(default_factory=list)  # file name of each cited page, in the same order
    correct: bool = False
    refusal: str = ""  # the refusal phrase found in the answer, "" when it does not refuse
    missing: list[str] = field(default_factory=list)
    leak: str = ""  # the prompt text the answer repeats, "" when none
    latency_s: float = 0.0  # wall time of the scored turn
    conversation_id: str = ""
    error: str = ""
    run: int = 1

    @property
    def refused(self) -> bool:
        return bool(self.refusal)

    def cite_is_right(self, doc: str, page: int) -> bool:
        item = self.item
        return page in item.pages and (not item.docs or Path(doc).name in item.docs)

    @property
    def num_cited_right(self) -> int:
        if not self.item.pages:
            return 0
        return sum(self.cite_is_right(d, p) for d, p in zip(self.cited_docs, self.cited_pages))

    def to_dict(self) -> dict[str, Any]:
        item = self.item
        return {"run": self.run, "id": item.name, "line": item.line, "kind": item.kind_key, "question": item.question,
                "history": list(item.history), "answer": self.answer, "correct": self.correct,
                "refused": self.refused, "refusal": self.refusal, "missing": self.missing,
                "must_contain": [list(a) if len(a) > 1 else a[0] for a in item.must_contain],
                "cited_pages": self.cited_pages,
                "cited": [{"doc": d, "page": p, "right": self.cite_is_right(d, p) if item.pages else None}
                          for d, p in zip(self.cited_docs, self.cited_pages)],
                "expected_pages": list(item.pages), "docs": list(item.docs), "latency_s": round(self.latency_s, 3),
                "leaked": bool(self.leak), "leak": self.leak, "error": self.error,
                "conversation_id": self.conversation_id}


def _ratio(num: float, den: float) -> float | None:
    return round(num / den, 4) if den else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between closest ranks; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass
class EvalReport:
    runs: list[list[QAResult]]  # one list per --repeat run, items in the same order

    @property
    def results(self) -> list[QAResult]:
        """The first run: the one the headline metrics, the table and the summary describe."""
        return self.runs[0] if self.runs else []

    @property
    def scored(self) -> list[QAResult]:
        return [r for r in self.results if not r.error]

    def metrics(self) -> dict[str, Any]:
        """Over the first run's items that did not fail. citation_page_precision and num_cited keep
        their old meaning (0.0 when nothing was cited); the newer ratios are null when undefined."""
        scored = self.scored
        cited = [r for r in scored if r.item.pages and r.item.answerable]
        num_cited = sum(len(r.cited_pages) for r in cited)
        answerable = [r for r in scored if r.item.answerable]
        unanswerable = [r for r in scored if not r.item.answerable]
        latencies = [r.latency_s for r in scored]
        by_kind: dict[str, list[QAResult]] = {}
        for r in scored:
            by_kind.setdefault(r.item.kind_key, []).append(r)
        p50, p95 = percentile(latencies, 50), percentile(latencies, 95)
        out = {
            "accuracy": round(sum(r.correct for r in scored) / len(scored), 4) if scored else 0.0,
            "accuracy_by_kind": {k: _ratio(sum(r.correct for r in rs), len(rs)) for k, rs in by_kind.items()},
            "citation_page_precision": round(sum(r.num_cited_right for r in cited) / num_cited, 4) if num_cited else 0.0,
            "citation_page_recall": _ratio(sum(r.num_cited_right > 0 for r in cited), len(cited)),
            "refusal_correctness": _ratio(sum(r.refused for r in unanswerable), len(unanswerable)),
            "false_refusals": _ratio(sum(r.refused for r in answerable), len(answerable)),
            "leak_rate": _ratio(sum(bool(r.leak) for r in scored), len(scored)),
            "latency_p50_s": round(p50, 3) if p50 is not None else None,
            "latency_p95_s": round(p95, 3) if p95 is not None else None,
            "num_questions": len(scored),
            "num_cited": num_cited,
            "num_failed": len(self.results) - len(scored),
        }
        if len(self.runs) > 1:
            out["run_to_run_agreement"] = self.agreement()
            out["accuracy_per_run"] = [
                _ratio(sum(r.correct for r in run if not r.error), sum(not r.error for r in run)) for run in self.runs]
        return out

    def agreement(self) -> float | None:
        """Share of items whose scored answer is the same text in every run (a failed run disagrees)."""
        if len(self.runs) < 2 or not self.results:
            return None
        same = sum(all(not r.error for r in group) and len({r.answer for r in group}) == 1
                   for group in zip(*self.runs))
        return round(same / len(self.results), 4)


# -- reading the QA file --------------------------------------------------------------------------


def read_qa_file(path: Path, *, warn=lambda message: print(message, file=sys.stderr)) -> list[QAItem]:
    items = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            items.append(parse_item(number, json.loads(line)))
        except (ValueError, TypeError) as e:
            warn(f"Skipping line {number} of {path}: {e}")
    return items


def _strings(obj: Any, name: str) -> tuple[str, ...]:
    values = [obj] if isinstance(obj, str) else obj
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ValueError(f'"{name}" must be a string or a list of strings')
    return tuple(v.strip() for v in values if v.strip())


def _must_contain(obj: Any) -> tuple[tuple[str, ...], ...]:
    entries = [obj] if isinstance(obj, (str, int, float)) else obj
    if not isinstance(entries, list):
        raise ValueError('"must_contain" must be a string or a list')
    out = []
    for entry in entries:
        alts = entry if isinstance(entry, list) else [entry]
        if not alts or not all(isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in alts):
            raise ValueError('each "must_contain" entry must be a string or a non-empty list of alternatives')
        out.append(tuple(str(a) for a in alts))
    return tuple(out)


def parse_item(number: int, obj: Any) -> QAItem:
    if not isinstance(obj, dict) or not isinstance(obj.get("question"), str) or not obj["question"].strip():
        raise ValueError('each line needs a "question" string')
    pages = obj.get("pages", [])
    pages = [pages] if isinstance(pages, int) else list(pages)
    for key in ("id", "kind"):
        if not isinstance(obj.get(key, ""), str):
            raise ValueError(f'"{key}" must be a string')
    return QAItem(number, obj["question"].strip(), _must_contain(obj.get("must_contain", [])),
                  tuple(int(p) for p in pages), id=obj.get("id", "").strip(), kind=obj.get("kind", "").strip(),
                  docs=_strings(obj.get("docs", []), "docs"), history=_strings(obj.get("history", []), "history"))


def docs_folder(qa_path: Path) -> Path:
    """Where the file's `docs` names are: the QA file's docs/ subfolder when it exists, else its folder."""
    folder = qa_path.parent / "docs"
    return folder if folder.is_dir() else qa_path.parent


def named_documents(items: Iterable[QAItem], qa_path: Path) -> list[Path]:
    """Every document the items name, once each, in order of first mention."""
    folder, seen = docs_folder(qa_path), {}
    for item in items:
        for name in item.docs:
            seen.setdefault(name, folder / name)
    return list(seen.values())


def select(items: Sequence[QAItem], *, kinds: Iterable[str] = (), limit: int | None = None) -> list[QAItem]:
    """The items of the given kinds (all when none given), the first `limit` of them."""
    wanted = {k.strip() for k in kinds if k.strip()}
    chosen = [i for i in items if not wanted or i.kind_key in wanted]
    return chosen[:limit] if limit is not None and limit >= 0 else chosen


# -- refusals -------------------------------------------------------------------------------------

# A refusal says the documents (or the assistant) do not have the answer. The detector is a list of
# phrases, matched case-insensitively on the answer with contractions expanded ("doesn't" -> "does
# not", "can't" -> "cannot") and curly quotes straightened:
#   * the text does not state it: "not mentioned", "not specified", "not stated", "not provided", ...
#   * a negated verb of saying: "does not mention / say / state / specify / cover / discuss ...";
#   * "no information / mention / details / data ..." and "there is nothing about";
#   * the assistant cannot: "cannot find / locate / determine / answer", "unable to find", "I do not know";
#   * "not in the documents / passages / context" and "outside the scope".
# Verbs that also describe things rather than texts (contain, include, provide, list, offer) count only
# when the same sentence names the text ("document", "passage", "manual", "information", ...), so that
# "SQLite does not provide a boolean type" is not a refusal. A phrase in a conditional clause ("if not
# specified, the default is 999": if / when / unless / whether earlier in the sentence) is not one either.
_PARTICIPLES = ("mentioned|specified|stated|provided|documented|covered|described|discussed|addressed|"
                "explained|indicated|answered")
_SAYING_VERBS = "mention|say|state|specify|cover|discuss|describe|explain|indicate|document|tell|address|give"
_TEXT_VERBS = "contain|include|provide|list|offer|have"
_ADVERB = r"(?:explicitly |directly |specifically |clearly |actually )?"
_TEXT_WORDS = re.compile(r"\b(?:documents?|passages?|manuals?|texts?|context|sources?|pages?|spec|specification|"
                         r"readme|documentation|information|details|sections?|excerpts?|provided|given)\b")
_REFUSALS = [
    re.compile(rf"\bnot (?:been )?{_ADVERB}(?:{_PARTICIPLES})\b"),
    re.compile(rf"\b(?:does|do|did) not {_ADVERB}(?:{_SAYING_VERBS})\b"),
    re.compile(r"\bno (?:specific |explicit |such |relevant |further |additional |clear |direct )?"
               r"(?:information|mention|details?|data|reference|indication|documentation|answer)\b"),
    re.compile(r"\bthere is nothing (?:about|on|in|regarding)\b"),
    re.compile(r"\b(?:cannot|could not|unable to|not able to) (?:find|locate|determine|answer|tell|confirm|say)\b"),
    re.compile(r"\bi (?:do not|did not) (?:know|find|see)\b"),
    re.compile(r"\bnot (?:in|part of|within|found in|included in|available in) the (?:provided |given |available )?"
               r"(?:documents?|passages?|context|texts?|sources?|manuals?|documentation)\b"),
    re.compile(r"\b(?:outside|beyond) the scope\b"),
]
_TEXT_REFUSAL = re.compile(rf"\b(?:does|do|did) not {_ADVERB}(?:{_TEXT_VERBS})\b")
_CONDITIONAL = re.compile(r"\b(?:if|when|unless|whether)\b")
_SENTENCE = re.compile(r"[^.!?\n]+(?:[.!?]+|$)")


def _normalise(text: str) -> str:
    text = text.lower().replace("\u2019", "'").replace("\u2018", "'")
    text = re.sub(r"\bcan't\b", "cannot", text)
    text = re.sub(r"\bwon't\b", "will not", text)
    text = re.sub(r"\b(\w+)n't\b", r"\1 not", text)
    return re.sub(r"\s+", " ", text)


def refusal_phrase(answer: str) -> str:
    """The phrase by which `answer` says the documents do not hold the answer, or "" (see above)."""
    for sentence in _SENTENCE.findall(_normalise(answer)):
        for pattern in _REFUSALS + [_TEXT_REFUSAL]:
            for match in pattern.finditer(sentence):
                if _CONDITIONAL.search(sentence[: match.start()]):
                    continue
                if pattern is _TEXT_REFUSAL and not _TEXT_WORDS.search(sentence):
                    continue
                return match.group(0)
    return ""


def is_refusal(answer: str) -> bool:
    return bool(refusal_phrase(answer))


# -- prompt leaks ---------------------------------------------------------------------------------

LEAK_WORDS = 8  # a run of this many consecutive words of a prompt text in an answer is a leak
_WORD = re.compile(r"[a-z0-9]+(?:'[a-z0-9]+)*")
_PLACEHOLDER = re.compile(r"\{[A-Za-z_][A-Za-z0-9_]*\}")
_MARKERS = re.compile(r"\[\d{1,3}(?:\s*,\s*\d{1,3})*\]")
_EXAMPLE = re.compile(r"(?:for example|for instance|e\.g\.)[:,]?\s*([^\n]+?\[\d{1,3}\])", re.I)


def _words(text: str) -> list[str]:
    return _WORD.findall(_MARKERS.sub(" ", text.lower().replace("\u2019", "'")))


class LeakDetector:
    """Finds prompt text in answers: any run of LEAK_WORDS consecutive words of one of the prompt
    texts (case-insensitive, on word tokens; citation markers in the answer are skipped; a placeholder
    such as {passages} splits a text, so no run spans it), or a verbatim copy of a citation example
    the prompts give ("for example: The device weighs 2 kg [2]", compared without its marker)."""

    def __init__(self, prompt_texts: Iterable[str], n: int = LEAK_WORDS) -> None:
        self.n = n
        self.runs: set[tuple[str, ...]] = set()
        self.examples: list[tuple[str, ...]] = []
        for text in prompt_texts:
            for segment in _PLACEHOLDER.split(text):
                words = _words(segment)
                self.runs.update(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
            for match in _EXAMPLE.finditer(_PLACEHOLDER.sub(" ", text)):
                words = tuple(_words(match.group(1)))
                if len(words) >= 3 and words not in self.examples:
                    self.examples.append(words)

    def check(self, answer: str) -> str:
        """The leaked words, or "" when the answer repeats no prompt text."""
        words = _words(answer)
        for i in range(len(words) - self.n + 1):
            if tuple(words[i:i + self.n]) in self.runs:
                return " ".join(words[i:i + self.n])
        for example in self.examples:
            k = len(example)
            if any(tuple(words[i:i + k]) == example for i in range(len(words) - k + 1)):
                return " ".join(example)
        return ""


# -- asking ---------------------------------------------------------------------------------------


@dataclass
class _Turn:
    answer: str = ""
    sources: list[tuple[str, int]] = field(default_factory=list)
    conversation_id: str | None = None
    error: str = ""
    seconds: float = 0.0


def _ask(assistant: Any, conversation_id: str | None, question: str) -> _Turn:
    turn, start = _Turn(conversation_id=conversation_id), time.perf_counter()
    try:
        for event in assistant.turn(conversation_id, question):
            if isinstance(event, Sources):
                turn.sources = [(s.doc, s.page) for s in event.sources if s.page is not None]
            elif isinstance(event, Done):
                turn.answer, turn.conversation_id = event.text, event.conversation_id or conversation_id
                if event.finish_reason == "error":
                    turn.error = "the turn failed"
    except Exception as e:  # one failing question must not end a long run: it is reported and counted
        turn.error = f"{type(e).__name__}: {e}"
    turn.seconds = time.perf_counter() - start
    return turn


def ask_item(assistant: Any, item: QAItem, *, leaks: LeakDetector | None = None, run: int = 1) -> QAResult:
    """Ask the item's history (unscored), then its question, in one new conversation; score the last answer."""
    result, conversation_id = QAResult(item, run=run), None
    for number, question in enumerate(item.history, start=1):
        earlier = _ask(assistant, conversation_id, question)
        if earlier.error:
            result.error = f"history turn {number} failed: {earlier.error}"
            return result
        conversation_id = earlier.conversation_id
    turn = _ask(assistant, conversation_id, item.question)
    result.answer, result.error, result.latency_s = turn.answer, turn.error, turn.seconds
    result.conversation_id = turn.conversation_id or ""
    result.cited_docs = [Path(str(d)).name for d, _ in turn.sources]
    result.cited_pages = [p for _, p in turn.sources]
    result.refusal = refusal_phrase(turn.answer)
    result.missing = item.missing(turn.answer)
    result.leak = leaks.check(turn.answer) if leaks is not None else ""
    if result.error:
        result.correct = False
    elif item.answerable:
        result.correct = not result.missing
    else:
        result.correct = result.refused
    return result


def evaluate_answers(assistant: Any, items: Iterable[QAItem], *, repeat: int = 1,
                     on_result: Callable[[QAResult, int, int], None] | None = None) -> EvalReport:
    """Ask every item (`repeat` times, each run in fresh conversations) and score the answers and
    their sources. `on_result(result, done, total)` is called after each item."""
    items = list(items)
    prompt_texts = getattr(assistant, "prompt_texts", None)
    leaks = LeakDetector(prompt_texts()) if callable(prompt_texts) else None
    runs, total, done = [], len(items) * max(repeat, 1), 0
    for run in range(1, max(repeat, 1) + 1):
        results = []
        for item in items:
            results.append(ask_item(assistant, item, leaks=leaks, run=run))
            done += 1
            if on_result is not None:
                on_result(results[-1], done, total)
        runs.append(results)
    return EvalReport(runs)


def ingest_documents(assistant: Any, paths: Sequence[Path | str],
                     warn: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> dict[str, int]:
    """Ingest the files (unchanged ones are skipped by the ingester); returns the count per status."""
    counts: dict[str, int] = {}
    if not paths:
        return counts
    for result in assistant.documents.ingest([str(p) for p in paths]):
        counts[result.status] = counts.get(result.status, 0) + 1
        if result.status == "failed":
            warn(f"Skipping {result.path}: {result.error}")
    return counts


# -- tables ---------------------------------------------------------------------------------------


def _ok(r: QAResult) -> str:
    return "ERR" if r.error else ("yes" if r.correct else "no")


def format_table(report: EvalReport) -> str:
    results = report.results
    width = max([len("id")] + [len(r.item.id or str(r.item.line)) for r in results])
    rows = [f"{'id':<{width}}  {'kind':<12} {'ok':<4} {'cited':<10} {'expected':<10} question -> answer"]
    other_doc = False
    for r in results:
        marks = ["" if not r.item.docs or Path(d).name in r.item.docs else "*" for d in r.cited_docs]
        other_doc = other_doc or "*" in marks
        cited = ",".join(f"{p}{m}" for p, m in zip(r.cited_pages, marks)) or "-"
        expected = ",".join(map(str, r.item.pages)) or "-"
        answer = " ".join(r.answer.split())[:70]
        flag = " [LEAK]" if r.leak else ""
        rows.append(f"{r.item.id or r.item.line:<{width}}  {r.item.kind_key:<12} {_ok(r):<4} {cited:<10} "
                    f"{expected:<10} {' '.join(r.item.question.split())[:50]} -> {answer}{flag}")
    if other_doc:
        rows.append("(* a page of a document the item does not name)")
    return "\n".join(rows)


def format_summary(report: EvalReport) -> str:
    """One row per kind (and one for all): items, correct, refusals, citations, leaks, median latency."""
    groups: dict[str, list[QAResult]] = {}
    for r in report.results:
        groups.setdefault(r.item.kind_key, []).append(r)
    groups["all"] = list(report.results)
    rows = [f"{'kind':<13} {'n':>3} {'failed':>6} {'correct':>7} {'acc':>6} {'refused':>7} {'cites right':>11} "
            f"{'leaks':>5} {'p50 s':>6}"]
    for kind, rs in groups.items():
        scored = [r for r in rs if not r.error]
        with_pages = [r for r in scored if r.item.pages and r.item.answerable]
        right = sum(r.num_cited_right for r in with_pages)
        cited = sum(len(r.cited_pages) for r in with_pages)
        acc = f"{sum(r.correct for r in scored) / len(scored):.3f}" if scored else "-"
        p50 = percentile([r.latency_s for r in scored], 50)
        rows.append(f"{kind:<13} {len(rs):>3} {len(rs) - len(scored):>6} {sum(r.correct for r in scored):>7} {acc:>6} "
                    f"{sum(r.refused for r in scored):>7} {f'{right}/{cited}':>11} "
                    f"{sum(bool(r.leak) for r in scored):>5} {(f'{p50:.1f}' if p50 is not None else '-'):>6}")
    return "\n".join(rows)


# -- CLI ------------------------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction, add_common) -> None:
    """Add `eval answers` to the `eval` group (created here unless another module already did)."""
    answers = command_group(subparsers, "eval", EVAL_HELP).add_parser(
        "answers", help="answer accuracy, citations, refusals and prompt leaks over a JSONL file of questions",
        description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    answers.add_argument("file", metavar="FILE.jsonl")
    answers.add_argument("--docs", nargs="*", default=[], metavar="PATH", help="ingest these files first")
    ingest = answers.add_mutually_exclusive_group()
    ingest.add_argument("--ingest", action="store_true", default=None,
                        help="ingest the documents the file names (default: when they are in its docs/ folder)")
    ingest.add_argument("--no-ingest", dest="ingest", action="store_false", help="ingest nothing the file names")
    answers.add_argument("--max-new-tokens", type=int, default=None, help="answer length limit per question")
    answers.add_argument("--kinds", default="", metavar="A,B", help="only items of these kinds (e.g. lookup,count)")
    answers.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N items (after --kinds)")
    answers.add_argument("--repeat", type=int, default=1, metavar="N",
                         help="ask everything N times, each run in fresh conversations (reports run_to_run_agreement)")
    answers.add_argument("--output", default=None, metavar="FILE.jsonl", help="write one JSON line per item and run")
    add_common(answers)
    answers.set_defaults(func=cmd_eval_answers)


def _documents_to_ingest(args: argparse.Namespace, path: Path, items: Sequence[QAItem]) -> list[Path]:
    from assistant.errors import ConfigError

    named = named_documents(items, path)
    present = [p for p in named if p.is_file()]
    missing = [p for p in named if not p.is_file()]
    if args.ingest is False or not named:
        return []
    if args.ingest:
        if missing:
            raise ConfigError(f"{path} names documents that are not in {docs_folder(path)}: "
                              + ", ".join(p.name for p in missing))
        return named
    if not (path.parent / "docs").is_dir() or not present:  # automatic: only from a docs/ folder
        return []
    if missing:
        print(f"Not in {docs_folder(path)}, so not ingested: {', '.join(p.name for p in missing)}", file=sys.stderr)
    return present


def cmd_eval_answers(args: argparse.Namespace, config) -> int:
    from dataclasses import replace

    from assistant.errors import ConfigError

    path = Path(args.file)
    if not path.is_file():
        raise ConfigError(f"QA file {path} does not exist: give a JSONL file with one question per line.")
    all_items = read_qa_file(path)
    if not all_items:
        raise ConfigError(f"{path} has no questions: each line needs a JSON object with a \"question\".")
    items = select(all_items, kinds=args.kinds.split(","), limit=args.limit)
    if not items:
        kinds = sorted({i.kind_key for i in all_items})
        raise ConfigError(f"No item of {path} is left after --kinds/--limit (its kinds: {', '.join(kinds)}).")
    if args.repeat < 1:
        raise ConfigError("--repeat must be 1 or more.")
    documents = _documents_to_ingest(args, path, all_items)  # the whole file's: retrieval sees the same library
    if args.max_new_tokens:
        config = replace(config, engine=replace(config.engine, max_new_tokens=args.max_new_tokens))
    from assistant.app import build_assistant

    output = open(args.output, "w", encoding="utf-8") if args.output else None

    def progress(result: QAResult, done: int, total: int) -> None:
        state = "ERR" if result.error else ("ok" if result.correct else "wrong")
        print(f"[{done}/{total}] {result.item.name} ({result.item.kind_key}): {state}, {result.latency_s:.1f}s",
              file=sys.stderr, flush=True)
        if output is not None:
            output.write(json.dumps(result.to_dict(), ensure_ascii=False) + "\n")
            output.flush()

    # build_assistant opens the SQLite store in the data dir before anything else would create it
    Path(config.data_dir).mkdir(parents=True, exist_ok=True)
    print(f"Loading model {config.engine.model}...", file=sys.stderr, flush=True)
    try:
        with build_assistant(config) as assistant:
            to_ingest = [*args.docs, *documents]
            if to_ingest:
                print(f"Ingesting {len(to_ingest)} document(s) into {config.data_dir}...", file=sys.stderr, flush=True)
                counts = ingest_documents(assistant, to_ingest)
                print("Ingested: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())), file=sys.stderr)
            report = evaluate_answers(assistant, items, repeat=args.repeat, on_result=progress)
    finally:
        if output is not None:
            output.close()
    print(format_table(report))
    print()
    print(format_summary(report))
    print(json.dumps(report.metrics()))
    for run in report.runs:
        for r in run:
            if r.error:
                print(f"{r.item.name} (line {r.item.line}, run {r.run}) failed: {r.error}", file=sys.stderr)
    return 1 if any(r.error for run in report.runs for r in run) else 0
