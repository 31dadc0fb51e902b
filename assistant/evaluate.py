"""`assistant eval answers FILE.jsonl`: answer accuracy and citation precision over a QA file.

Each line is a JSON object: `question` (required), `must_contain` (a string or a list of strings that
must all appear in the answer, case-insensitively), `pages` (1-based pages where the answer is; a
citation to any other page counts against precision). Other fields are ignored. Every question is
asked in a new conversation of the data dir's assistant (ingest the documents first with
`assistant ingest`, or pass them with `--docs`). Prints one row per question, then one JSON line:
{"accuracy", "citation_page_precision", "num_questions", "num_cited", "num_failed"}.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from assistant.commands import EVAL_HELP, command_group
from assistant.events import Done, Sources


@dataclass(frozen=True)
class QAItem:
    line: int  # 1-based line in the file
    question: str
    must_contain: tuple[str, ...]
    pages: tuple[int, ...]  # empty: citations are not scored for this question


@dataclass
class QAResult:
    item: QAItem
    answer: str = ""
    cited_pages: list[int] = field(default_factory=list)
    correct: bool = False
    error: str = ""

    @property
    def num_cited_right(self) -> int:
        return sum(p in self.item.pages for p in self.cited_pages) if self.item.pages else 0


@dataclass
class EvalReport:
    results: list[QAResult]

    @property
    def scored(self) -> list[QAResult]:
        return [r for r in self.results if not r.error]

    def metrics(self) -> dict[str, Any]:
        scored = self.scored
        cited = [r for r in scored if r.item.pages]
        num_cited = sum(len(r.cited_pages) for r in cited)
        return {
            "accuracy": round(sum(r.correct for r in scored) / len(scored), 4) if scored else 0.0,
            "citation_page_precision": round(sum(r.num_cited_right for r in cited) / num_cited, 4) if num_cited else 0.0,
            "num_questions": len(scored),
            "num_cited": num_cited,
            "num_failed": len(self.results) - len(scored),
        }


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


def parse_item(number: int, obj: Any) -> QAItem:
    if not isinstance(obj, dict) or not isinstance(obj.get("question"), str) or not obj["question"].strip():
        raise ValueError('each line needs a "question" string')
    must = obj.get("must_contain", [])
    must = [must] if isinstance(must, str) else list(must)
    pages = obj.get("pages", [])
    pages = [pages] if isinstance(pages, int) else list(pages)
    return QAItem(number, obj["question"].strip(), tuple(str(m) for m in must), tuple(int(p) for p in pages))


def evaluate_answers(assistant: Any, items: Iterable[QAItem]) -> EvalReport:
    """Ask every question in a fresh conversation and score the answer and its sources."""
    results = []
    for item in items:
        result = QAResult(item)
        for event in assistant.turn(None, item.question):
            if isinstance(event, Sources):
                result.cited_pages = [s.page for s in event.sources if s.page is not None]
            elif isinstance(event, Done):
                result.answer = event.text
                if event.finish_reason == "error":
                    result.error = "the turn failed"
        text = result.answer.lower()
        result.correct = not result.error and all(m.lower() in text for m in item.must_contain)
        results.append(result)
    return EvalReport(results)


def format_table(report: EvalReport) -> str:
    rows = [f"{'#':>3}  {'ok':<4} {'cited':<10} {'expected':<10} question -> answer"]
    for r in report.results:
        ok = "ERR" if r.error else ("yes" if r.correct else "no")
        cited = ",".join(map(str, r.cited_pages)) or "-"
        expected = ",".join(map(str, r.item.pages)) or "-"
        answer = " ".join(r.answer.split())[:70]
        rows.append(f"{r.item.line:>3}  {ok:<4} {cited:<10} {expected:<10} {r.item.question[:50]} -> {answer}")
    return "\n".join(rows)


# -- CLI ------------------------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction, add_common) -> None:
    """Add `eval answers` to the `eval` group (created here unless another module already did)."""
    answers = command_group(subparsers, "eval", EVAL_HELP).add_parser(
        "answers", help="answer accuracy and citation precision over a JSONL file of questions",
        description=__doc__.split("\n\n", 1)[1])
    answers.add_argument("file", metavar="FILE.jsonl")
    answers.add_argument("--docs", nargs="*", default=[], metavar="PATH", help="ingest these files first")
    answers.add_argument("--max-new-tokens", type=int, default=None, help="answer length limit per question")
    add_common(answers)
    answers.set_defaults(func=cmd_eval_answers)


def cmd_eval_answers(args: argparse.Namespace, config) -> int:
    from dataclasses import replace

    from assistant.errors import ConfigError

    path = Path(args.file)
    if not path.is_file():
        raise ConfigError(f"QA file {path} does not exist: give a JSONL file with one question per line.")
    items = read_qa_file(path)
    if not items:
        raise ConfigError(f"{path} has no questions: each line needs a JSON object with a \"question\".")
    if args.max_new_tokens:
        config = replace(config, engine=replace(config.engine, max_new_tokens=args.max_new_tokens))
    from assistant.app import build_assistant

    print(f"Loading model {config.engine.model}...", file=sys.stderr, flush=True)
    with build_assistant(config) as assistant:
        if args.docs:
            for result in assistant.documents.ingest(args.docs):
                if result.status == "failed":
                    print(f"Skipping {result.path}: {result.error}", file=sys.stderr)
        report = evaluate_answers(assistant, items)
    print(format_table(report))
    print(json.dumps(report.metrics()))
    for r in report.results:
        if r.error:
            print(f"Question on line {r.item.line} failed: {r.error}", file=sys.stderr)
    return 1 if any(r.error for r in report.results) else 0
