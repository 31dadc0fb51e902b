"""`assistant eval safety FILE.jsonl`: catch rate per category, false positives, latency.

Each line: {"text": ..., "label": "allow" | "block", "category": ..., "where": "input" | "retrieved" |
"tool" | "output", optional "system": the turn's system prompt, for output rows}. Input, retrieved and tool rows go through the input guard at their stage (a
quarantine counts as a block); output rows stream through the output guard in small deltas of
random size (fixed seed), and count as caught when anything was redacted or the answer was stopped.
Latency is the input guard's, per row, wall clock. Prints a table, then one JSON line.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from assistant.errors import ConfigError
from assistant.events import SafetyVerdict, TextDelta

STAGES = ("input", "retrieved", "tool", "output")


@dataclass
class RowResult:
    row: dict[str, Any]
    flagged: bool
    ms: float
    category: str = ""
    detector: str = ""


@dataclass
class SafetyReport:
    results: list[RowResult] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        harmful = [r for r in self.results if r.row["label"] == "block"]
        benign = [r for r in self.results if r.row["label"] == "allow"]
        per_category: dict[str, dict[str, Any]] = {}
        for r in harmful:
            c = per_category.setdefault(r.row.get("category") or "unlabelled", {"n": 0, "caught": 0})
            c["n"] += 1
            c["caught"] += r.flagged
        for c in per_category.values():
            c["catch_rate"] = round(c["caught"] / c["n"], 4)
        checks = [r.ms for r in self.results if r.row.get("where", "input") != "output"]
        inputs = [r.ms for r in self.results if r.row.get("where", "input") == "input"]
        output_harm = [r for r in harmful if r.row.get("where") == "output"
                       and r.row.get("category") in ("secret", "pii", "system_prompt_leak")]
        fp_by_where = {}
        for where in STAGES:
            rows = [r for r in benign if r.row.get("where", "input") == where]
            if rows:
                fp_by_where[where] = round(sum(r.flagged for r in rows) / len(rows), 4)
        return {
            "num_rows": len(self.results),
            "catch_rate": _rate(harmful), "false_positive_rate": _rate(benign),
            "num_harmful": len(harmful), "num_benign": len(benign),
            "p50_ms": _pct(checks, 50), "p95_ms": _pct(checks, 95),
            "input_p50_ms": _pct(inputs, 50), "input_p95_ms": _pct(inputs, 95),
            "output_redaction_recall": _rate(output_harm) if output_harm else None,
            "false_positive_rate_by_where": fp_by_where,
            "per_category": dict(sorted(per_category.items())),
        }


def _rate(results: list[RowResult]) -> float:
    return round(sum(r.flagged for r in results) / len(results), 4) if results else 0.0


def _pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 2) if values else 0.0


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{i} is not JSON: {e}") from e
            if not isinstance(row.get("text"), str) or row.get("label") not in ("allow", "block"):
                raise ConfigError(f"{path}:{i} needs \"text\" and \"label\": \"allow\" | \"block\".")
            if row.get("where", "input") not in STAGES:
                raise ConfigError(f"{path}:{i}: where={row['where']!r}; use {', '.join(STAGES)}.")
            rows.append(row)
    return rows


def evaluate_rows(rows: Iterable[dict[str, Any]], layer: Any, *, seed: int = 0) -> SafetyReport:
    """Run every row through `layer` (a SafetyLayer) under its default policy."""
    rng = random.Random(seed)
    report = SafetyReport()
    guard = layer.input_guard.for_conversation(None)
    template = layer.output_guard()
    for row in rows:
        where = row.get("where", "input")
        if where == "output":
            out = template.for_turn(None, protect=[row["system"]] if row.get("system") else ())
            text, events, i = row["text"], [], 0
            start = time.perf_counter()
            while i < len(text):
                step = rng.randint(1, 6)
                events += out.feed(TextDelta(text[i:i + step]))
                i += step
            events += out.finish()
            ms = (time.perf_counter() - start) * 1000
            verdicts = [e for e in events if isinstance(e, SafetyVerdict)]
            shown = "".join(e.text for e in events if isinstance(e, TextDelta))
            flagged = bool(verdicts) and shown != text
            v = verdicts[0] if verdicts else None
            report.results.append(RowResult(row, flagged, ms, v.category if v else "", v.detector if v else ""))
        else:
            start = time.perf_counter()
            verdict = guard.check(row["text"], where=where)
            ms = (time.perf_counter() - start) * 1000
            report.results.append(RowResult(row, not verdict.allowed, ms, verdict.category, verdict.detector))
    return report


def format_table(summary: dict[str, Any], report: SafetyReport, *, show_errors: int = 15) -> str:
    lines = [f"{'category':<20} {'n':>4} {'caught':>7} {'rate':>7}"]
    for name, c in summary["per_category"].items():
        lines.append(f"{name:<20} {c['n']:>4} {c['caught']:>7} {c['catch_rate']:>7.1%}")
    lines.append(f"{'harmful (all)':<20} {summary['num_harmful']:>4} {'':>7} {summary['catch_rate']:>7.1%}")
    lines.append(f"{'benign blocked':<20} {summary['num_benign']:>4} {'':>7} {summary['false_positive_rate']:>7.1%}"
                 f"   by stage: {summary['false_positive_rate_by_where']}")
    if summary["output_redaction_recall"] is not None:
        lines.append(f"{'output redaction':<20} {'':>4} {'':>7} {summary['output_redaction_recall']:>7.1%}")
    lines.append(f"latency: p50 {summary['p50_ms']} ms, p95 {summary['p95_ms']} ms (guard checks); "
                 f"user messages p50 {summary['input_p50_ms']} ms, p95 {summary['input_p95_ms']} ms")
    wrong = [r for r in report.results if r.flagged != (r.row["label"] == "block")]
    if wrong and show_errors:
        lines.append(f"mistakes ({len(wrong)}):")
        for r in wrong[:show_errors]:
            kind = "missed" if r.row["label"] == "block" else f"false positive ({r.category}, {r.detector})"
            lines.append(f"  {kind:<40} [{r.row.get('category', '')}] {r.row['text'][:70]!r}")
    return "\n".join(lines)
