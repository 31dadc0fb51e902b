"""What bench/load.py counts and computes, apart from any model or server (tests/test_bench_load.py
tests it with made-up outcomes): percentiles, how a request ended and what that makes it (a
rejection, a 5xx, an acknowledged row or turn), what the kill lost, the JSON line's keys, and the
engine's share of a request's time-to-first-token.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

REQUIRED_KEYS = ("requests", "five_xx", "rejected_429_503", "ttft_p50_ms", "ttft_p95_ms", "lost_turns",
                 "lost_usage_rows", "gateway_overhead_ms_p50", "requests_per_s", "tokens_per_s")


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between closest ranks (numpy's default); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def p50_difference_ci(a: list[float], b: list[float], num_resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of p50(b) - p50(a): how far the noise of two small samples reaches."""
    import random

    rng = random.Random(seed)
    diffs = [percentile(rng.choices(b, k=len(b)), 50) - percentile(rng.choices(a, k=len(a)), 50)
             for _ in range(num_resamples)]
    return percentile(diffs, 2.5), percentile(diffs, 97.5)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


@dataclass
class Outcome:
    """One generating request as the client saw it."""

    kind: str  # v1 | turn | assistant
    tier: str
    ended: str  # complete | rejected | http_error | stream_error | interrupted (server killed) | broken
    status: int = 0  # HTTP status (0: no response)
    ttft_s: float | None = None  # to the first non-empty text
    latency_s: float = 0.0  # to the last byte (or the refusal)
    tokens: int = 0  # completion tokens, from the response's usage
    request_id: str = ""  # x-request-id: the usage ledger row's request_id
    message_id: str = ""  # the stored answer of a turn (kinds turn, assistant)
    retry_after: str | None = None

    @property
    def five_xx(self) -> bool:
        """A server error: any 5xx but a 503 that says when to come back (admission, engine busy)."""
        return self.status >= 500 and not (self.status == 503 and self.retry_after)

    @property
    def rejected(self) -> bool:
        return self.status == 429 or (self.status == 503 and bool(self.retry_after))

    @property
    def row_expected(self) -> bool:
        """The server answered in full, so its ledger row was committed before the last byte."""
        return bool(self.request_id) and (self.ended == "complete" or self.rejected)

    @property
    def turn_committed(self) -> bool:
        return self.ended == "complete" and bool(self.message_id)


def classify(status: int, retry_after: str | None) -> str:
    """The `ended` of a request answered with `status` before any stream."""
    if status == 429 or (status == 503 and retry_after):
        return "rejected"
    return "http_error"


class SseLines:
    """Server-sent events from lines: `feed(line)` returns (event name, data text) at each data line."""

    def __init__(self) -> None:
        self.event = ""

    def feed(self, line: str) -> tuple[str, str] | None:
        if not line:
            self.event = ""
        elif line.startswith("event:"):
            self.event = line[6:].strip()
        elif line.startswith("data:"):
            return self.event, line[5:].strip()
        return None


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)
    broken: int = 0  # connections lost while the server was up

    def add(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)

    def acked_rows(self) -> set[str]:
        return {o.request_id for o in self.outcomes if o.row_expected}

    def acked_turns(self) -> set[str]:
        return {o.message_id for o in self.outcomes if o.turn_committed}

    def counts(self) -> dict[str, int]:
        out = {"requests": len(self.outcomes)}
        for name in ("complete", "interrupted", "stream_error", "broken"):
            out[name] = sum(o.ended == name for o in self.outcomes)
        out["rejected_429"] = sum(o.status == 429 for o in self.outcomes)
        out["rejected_503"] = sum(o.rejected and o.status == 503 for o in self.outcomes)
        out["five_xx"] = sum(o.five_xx for o in self.outcomes)
        out["other_4xx"] = sum(400 <= o.status < 500 and o.status != 429 for o in self.outcomes)
        return out

    def summary(self, serving_s: float) -> dict[str, Any]:
        c = self.counts()
        done = [o for o in self.outcomes if o.ended == "complete"]
        ttfts = [o.ttft_s for o in done if o.ttft_s is not None]
        refusals = [o for o in self.outcomes if o.rejected]
        return {
            **c,
            "rejected_429_503": c["rejected_429"] + c["rejected_503"],
            "rejections_without_retry_after": sum(o.status in (429, 503) and not o.retry_after for o in self.outcomes),
            "rejection_p95_ms": ms(percentile([o.latency_s for o in refusals], 95)),
            "requests_per_s": round(len(done) / serving_s, 3) if serving_s else 0.0,
            "tokens_per_s": round(sum(o.tokens for o in done) / serving_s, 2) if serving_s else 0.0,
            "ttft_p50_ms": ms(percentile(ttfts, 50)),
            "ttft_p95_ms": ms(percentile(ttfts, 95)),
            "ttft_p50_ms_by_kind": {k: ms(percentile([o.ttft_s for o in done if o.kind == k and o.ttft_s], 50))
                                    for k in sorted({o.kind for o in done})},
            "ttft_p50_ms_by_tier": {t: ms(percentile([o.ttft_s for o in done if o.tier == t and o.ttft_s], 50))
                                    for t in sorted({o.tier for o in done})},
        }


def losses(acked_rows: set[str], found_rows: set[str], acked_turns: set[str], committed_turns: set[str],
           before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """What the kill lost: acknowledged rows and turns missing after the restart, or a store total that
    shrank (the totals read just before the kill against those right after the restart)."""
    return {"lost_usage_rows": max(len(acked_rows - found_rows), before["usage_rows"] - after["usage_rows"], 0),
            "lost_turns": max(len(acked_turns - committed_turns), before["turns"] - after["turns"], 0),
            "usage_rows_checked": len(acked_rows), "turns_checked": len(acked_turns)}


def result_line(summary: dict[str, Any], loss: dict[str, int], overhead: dict[str, Any],
                extra: dict[str, Any]) -> dict[str, Any]:
    out = {**summary, **loss, **overhead, **extra}
    missing = [k for k in REQUIRED_KEYS if k not in out]
    assert not missing, f"result line lacks {missing}"
    return out


class EngineClock:
    """Times an engine's requests from `generate` to their first delta with text (the engine's share of
    a TTFT: chat template, tokenising, queueing, prefill, the first decode step), by wrapping that one
    engine object's `generate` in this process. HTTP TTFT minus it, request by request, is what the
    gateway added to that very request, free of the engine's own noise."""

    def __init__(self, engine: Any) -> None:
        self.ttfts: list[float] = []
        generate = engine.generate

        def timed(*args: Any, **kwargs: Any) -> Iterable[Any]:
            called = time.perf_counter()
            return self._watch(generate(*args, **kwargs), called)

        engine.generate = timed

    def _watch(self, deltas: Iterable[Any], called: float) -> Iterable[Any]:
        first = True
        try:
            for delta in deltas:
                if first and delta.text:
                    self.ttfts.append(time.perf_counter() - called)
                    first = False
                yield delta
        finally:
            close = getattr(deltas, "close", None)
            if close is not None:
                close()


def overhead_figures(direct: list[float], via_http: list[float], engine_share: list[float]) -> dict[str, Any]:
    """`engine_share[i]`: the engine's part of the TTFT of HTTP request i (EngineClock)."""
    added = [h - e for h, e in zip(via_http, engine_share)]
    p50_direct, p50_http = percentile(direct, 50), percentile(via_http, 50)
    return {"gateway_overhead_ms_p50": ms(percentile(added, 50)), "gateway_overhead_ms_p95": ms(percentile(added, 95)),
            "ttft_direct_p50_ms": ms(p50_direct), "ttft_http_p50_ms": ms(p50_http),
            "ttft_p50_difference_ms": round((p50_http - p50_direct) * 1000, 1),
            "ttft_p50_difference_ci95_ms": [ms(x) for x in p50_difference_ci(direct, via_http)],
            "overhead_samples": len(added)}


def busy_gauges(metrics_text: str) -> float:
    """Streams the gateway runs or queues, plus requests the engine holds, in a /metrics scrape."""
    names = ("assistant_running_streams", "assistant_queue_depth", "assistant_engine_running_requests",
             "assistant_engine_waiting_requests")
    return sum(float(line.split()[1]) for line in metrics_text.splitlines() if line.split(" ")[0] in names)
