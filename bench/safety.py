"""Benchmark: the safety input check's latency, and what a guarded turn adds to time-to-first-token.

Runs the default policy's input check on every user message of tests/data/safety_*.jsonl (after a
warm-up that loads every model), one torch thread as in `serve` on this box, and reports p50/p95 of
the wait before a turn may start (`check_early`), for all and apart for English-looking messages (the
fast head) and the rest (the full head, with e5); then how many messages the second opinion (the
probe on the chat model, assistant/safety/probe.py) reads, its own time, which the turn's start
overlaps, and the whole check's time with it.
The TTFT part runs turns through build_assistant with a scripted engine that sleeps `--engine-ms`
before its first token (a stand-in for the model's prefill; pass the prefill time you measured with
bench/engine.py), guarded vs unguarded in the same run, and reports the added fraction; there the
second opinion runs its own request (a scripted engine lends no hidden states). Then, on the packaged
model, turns guarded vs unguarded (and guarded without the second opinion): the worst case, benign
messages that all fall in the doubt band, where the second opinion reads the turn's own prefill
(assistant/engine/taps.py); typical ones, benign messages the heads are sure of; and benign messages as
they come (a seeded sample of all of them, whatever the heads say, ~23% not English). Under the default
policy the second opinion reads every guarded turn's prefill first and clears most benign messages
(`clears_below`, assistant/safety/guard.py), so the head runs beside no prefill for them; guarded
without the second opinion, the heads read beside every prefill, as every turn did before. Each is
timed twice: at the engine's first token (what the input check costs the prefill) and at the first
visible text (the output guard's hold-back too).
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def input_latency(rows: list[dict], repeats: int) -> dict:
    import torch

    from assistant.config import AssistantConfig
    from assistant.safety.layer import SafetyLayer

    torch.set_num_threads(1)
    layer = SafetyLayer.from_config(AssistantConfig.load(env={}))
    guard = layer.input_guard.for_conversation(None)
    started = time.perf_counter()
    guard.warm()  # every model, the second opinion's too (it is asked only for doubtful messages)
    guard.check("warm-up: load every model", where="input")
    load_s = time.perf_counter() - started
    from assistant.safety.head import looks_english

    times, full, second, english = [], [], [], []
    for _ in range(repeats):
        for row in rows:
            t = time.perf_counter()
            verdict = guard.check_early(row["text"], where="input")  # what the turn waits for before it starts
            times.append((time.perf_counter() - t) * 1000)
            if verdict.pending is not None:  # the second opinion, which the turn's start overlaps
                s = time.perf_counter()
                verdict.final()
                second.append((time.perf_counter() - s) * 1000)
            full.append((time.perf_counter() - t) * 1000)
            english.append(looks_english(row["text"]))
    times_a, english_a, full_a = np.array(times), np.array(english), np.array(full)
    out = {"num_checks": len(times), "load_s": round(load_s, 2), "p50_ms": _pct(times_a, 50),
           "p95_ms": _pct(times_a, 95), "max_ms": round(max(times), 2),
           "second_opinion_share": round(len(second) / len(times), 4),
           "second_opinion_p50_ms": _pct(np.array(second), 50), "second_opinion_p95_ms": _pct(np.array(second), 95),
           "with_second_opinion_p50_ms": _pct(full_a, 50), "with_second_opinion_p95_ms": _pct(full_a, 95)}
    for name, mask in (("english", english_a), ("other", ~english_a)):  # the fast head, or the full head with e5
        out[name] = {"share": round(float(mask.mean()), 4), "p50_ms": _pct(times_a[mask], 50),
                     "p95_ms": _pct(times_a[mask], 95)}
    return out


VARIANTS = {"unguarded": {"safety.enabled": False},  # the three assistants ttft_real compares
            "no_second_opinion": {"safety.enabled": True, "safety.second_opinion": False},
            "guarded": {"safety.enabled": True}}


def ttft_real(sets: dict[str, list[str]], tmp: Path) -> dict[str, tuple[dict[str, list[float]], dict[str, list[float]], dict]]:
    """Per set of messages: first visible text and engine first-token times on the packaged small model,
    per VARIANTS entry, turns interleaved (one assistant each, with its own engine, built once and warmed
    on each set's first message); and how the guarded one's second opinions were read in that set."""
    from assistant.app import build_assistant
    from assistant.config import AssistantConfig
    from assistant.store import Store

    models = AssistantConfig.load(env={}).resolved_models_dir
    built = {}
    for name, overrides in VARIANTS.items():
        config = AssistantConfig.load(env={}, overrides={"data_dir": str(tmp / name), "models_dir": str(models),
                                                         "engine.large_model": "", "engine.max_new_tokens": 8,
                                                         **overrides})
        built[name] = build_assistant(config, store=Store("sqlite://"), tools=[])
    probe = built["guarded"].safety.guard.detectors["probe"]
    first_token: dict[str, list[float]] = {name: [] for name in built}  # the engine's first delta, per turn
    for name, assistant in built.items():
        engine = assistant.orchestrator.engine
        engine.generate = _stamped(engine.generate, first_token[name])
    out = {}
    try:
        for key, messages in sets.items():
            times: dict[str, list[float]] = {name: [] for name in built}
            engine_times: dict[str, list[float]] = {name: [] for name in built}
            before = dict(probe.reads)
            for i, text in enumerate([messages[0], *messages]):
                for name, assistant in built.items():
                    first_token[name].clear()
                    t = time.perf_counter()
                    for event in assistant.turn(None, text):
                        if event.type in ("text_delta", "done"):
                            if i:  # the first message only warms them up
                                times[name].append((time.perf_counter() - t) * 1000)
                                stamp = first_token[name][0] if first_token[name] else float("nan")  # no model
                                engine_times[name].append((stamp - t) * 1000)  # call (a blocked message): NaN
                            break
                    for _ in assistant.turn(None, "ok"):  # nothing left running between measurements
                        pass
            # tapped from the turn's prefill, or read by a request of its own
            out[key] = times, engine_times, {k: v - before.get(k, 0) for k, v in probe.reads.items()}
    finally:
        for assistant in built.values():
            assistant.close()
    return out


def _stamped(generate: Any, stamps: list[float]) -> Any:
    """`generate`, noting when each call's first delta arrives."""
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        first = True
        for delta in generate(*args, **kwargs):
            if first:
                stamps.append(time.perf_counter())
                first = False
            yield delta

    return wrapped


def _guard():
    from assistant.config import AssistantConfig
    from assistant.safety.layer import SafetyLayer

    return SafetyLayer.from_config(AssistantConfig.load(env={})).input_guard.for_conversation(None)


def _pct(values: np.ndarray, q: float) -> float:
    return round(float(np.percentile(values, q)), 2) if len(values) else 0.0


def ttft(messages: list[str], engine_ms: float, guarded: bool, tmp: Path) -> list[float]:
    """First-token times of `messages` as turns, with a stand-in engine that sleeps `engine_ms` before its
    first token."""
    from assistant.app import build_assistant
    from assistant.config import AssistantConfig
    from assistant.engine.fake import ScriptedEngine
    from assistant.store import Store

    class SlowFirstToken(ScriptedEngine):
        def generate(self, *args, **kwargs):
            time.sleep(engine_ms / 1000)
            yield from super().generate(*args, **kwargs)

    models = AssistantConfig.load(env={}).resolved_models_dir  # the prepared chat model (the second opinion reads it)
    config = AssistantConfig.load(env={}, overrides={"data_dir": str(tmp), "models_dir": str(models),
                                                     "safety.enabled": guarded})
    engine = SlowFirstToken(["Fine. It works."] * len(messages))
    out = []
    with build_assistant(config, engine=engine, store=Store("sqlite://"), tools=[]) as assistant:
        for text in messages:
            t = time.perf_counter()
            for event in assistant.turn(None, text):
                if event.type in ("text_delta", "done"):
                    out.append((time.perf_counter() - t) * 1000)
                    break
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--engine-ms", type=float, default=400.0, help="stand-in prefill time of the model")
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--real-turns", type=int, default=30, help="turns on the packaged model, of messages that get "
                        "the second opinion and of messages that do not, each (0: skip)")
    args = parser.parse_args()
    rows = [json.loads(line) for name in ("safety_train.jsonl", "safety_heldout.jsonl", "safety_heldout_v2.jsonl",
                                          "safety_heldout_v3.jsonl", "safety_heldout_v4.jsonl", "safety_heldout_v5.jsonl",
                                          "safety_heldout_short.jsonl")
            for line in (ROOT / "tests" / "data" / name).open() if line.strip()]
    rows = [r for r in rows if r.get("where", "input") == "input"]
    result = {"input_check": input_latency(rows, args.repeats)}
    check = result["input_check"]
    print(f"input check over {check['num_checks']} messages, the wait before the turn starts: p50 {check['p50_ms']} ms, "
          f"p95 {check['p95_ms']} ms (goal <= 30 ms)")
    print(f"  second opinion (here by a request of its own, as outside a turn) on {check['second_opinion_share']:.1%} of messages: "
          f"p50 {check['second_opinion_p50_ms']} ms, p95 {check['second_opinion_p95_ms']} ms; the whole check including "
          f"it: p50 {check['with_second_opinion_p50_ms']} ms, p95 {check['with_second_opinion_p95_ms']} ms")
    for name, what in (("english", "English-looking (fast head)"), ("other", "other languages and very short (+ e5)")):
        part = result["input_check"][name]
        print(f"  {what}: {part['share']:.0%} of messages, p50 {part['p50_ms']} ms, p95 {part['p95_ms']} ms")
    import tempfile

    benign = [r["text"] for r in rows if r["label"] == "allow"][: args.turns]
    with tempfile.TemporaryDirectory() as tmp:
        plain = ttft(benign, args.engine_ms, False, Path(tmp))
        guarded = ttft(benign, args.engine_ms, True, Path(tmp))
    p50_plain, p50_guarded = float(np.median(plain)), float(np.median(guarded))
    result["ttft"] = {"engine_ms": args.engine_ms, "unguarded_p50_ms": round(p50_plain, 1),
                      "guarded_p50_ms": round(p50_guarded, 1), "added_fraction": round(p50_guarded / p50_plain - 1, 4)}
    print(f"TTFT p50 unguarded {p50_plain:.1f} ms, guarded {p50_guarded:.1f} ms: "
          f"+{result['ttft']['added_fraction']:.1%} (goal <= 5%)")
    if args.real_turns:  # the worst case (every message in the doubt band), the typical one, and as they come
        import random

        layer_guard, doubtful, sure = _guard(), [], []
        benign = [r["text"] for r in rows if r["label"] == "allow"]
        mixed = random.Random(0).sample(benign, min(args.real_turns, len(benign)))
        for text in benign:
            verdict = layer_guard.check_early(text, where="input")
            if verdict.pending is not None:
                verdict.final()  # no second opinion left queued behind the measured turns
                if len(doubtful) < args.real_turns:
                    doubtful.append(text)
            elif verdict.allowed and len(sure) < args.real_turns:
                sure.append(text)
            if len(doubtful) == len(sure) == args.real_turns:
                break
        with tempfile.TemporaryDirectory() as tmp:
            measured = ttft_real({"doubtful": doubtful, "typical": sure, "mixed": mixed}, Path(tmp))
        for key, what in (("doubtful", "benign messages that all get the second opinion"),
                          ("typical", "benign messages the heads are sure of (~80% of messages; outside a turn they need no second "
                                      "opinion, in one the probe clears most of them)"),
                          ("mixed", "benign messages as they come (a seeded sample of all of them)")):
            times, engine_times, reads = measured[key]

            def added(over: str, base: str, of: dict[str, list[float]] = times) -> float:  # median of per-message ratios
                return round(float(np.nanmedian([g / p for p, g in zip(of[base], of[over])])) - 1, 4)

            r = result[f"ttft_real_{key}"] = {
                "turns": len(times["guarded"]), "second_opinion_reads": reads,
                **{f"{name}_p50_ms": round(float(np.median(t)), 1) for name, t in times.items()},
                "added_fraction": added("guarded", "unguarded"),
                "second_opinion_added_fraction": added("guarded", "no_second_opinion"),
                "without_second_opinion_added_fraction": added("no_second_opinion", "unguarded"),
                "engine_first_token_added_fraction": added("guarded", "unguarded", engine_times),
                "engine_first_token_without_second_opinion_added_fraction": added("no_second_opinion", "unguarded",
                                                                                  engine_times)}
            print(f"TTFT with the packaged model, {r['turns']} {what} (first visible text, so the output guard's "
                  f"hold-back counts): p50 unguarded {r['unguarded_p50_ms']} ms, guarded without the second opinion "
                  f"{r['no_second_opinion_p50_ms']} ms, guarded {r['guarded_p50_ms']} ms: +{r['added_fraction']:.1%} "
                  f"in all (median of per-message ratios), of which the second opinion "
                  f"+{r['second_opinion_added_fraction']:.1%} (read from the turn's prefill: {reads.get('tapped', 0)}, "
                  f"by a request of its own: {reads.get('own', 0)}) and the rest of the guards "
                  f"+{r['without_second_opinion_added_fraction']:.1%}; at the engine's first token (the prefill alone): "
                  f"guarded +{r['engine_first_token_added_fraction']:.1%}, without the second opinion "
                  f"+{r['engine_first_token_without_second_opinion_added_fraction']:.1%}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
