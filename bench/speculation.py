"""Benchmark prompt-lookup speculation (assistant/engine/speculate.py): decode with it against without, in one run.

One engine per model; speculation is switched on and off between rounds on the same engine (same
weights, same warm KV and prefix cache), and the rounds alternate which goes first. Greedy, real
packaged models. Two kinds of prompts:
  rag   a question over retrieved passages, the system prompt asking for answers that quote them
        (the answers copy phrases from their prompt: what prompt lookup is for)
  free  open questions with nothing to copy from (what it costs where it cannot help)
each with 1 stream (the prompts one after another) and with 4 concurrent streams.

Figures per model, kind and streams (medians over the rounds; a ratio is taken within a round):
  off_tok_s / on_tok_s   decode tok/s without / with speculation: 1 stream: tokens after the first
                         delta over the time from it to the last; 4 streams: aggregate tokens from
                         the moment all four stream until the last answer ends, over that time
  speedup                on / off                                  (issue 18: RAG goal >= 1.6x)
  acceptance_rate        accepted drafts / drafted tokens
  tokens_per_verify      tokens a speculating sequence-step yields (accepted drafts + 1)
  identical              answers token-for-token equal with and without speculation
The step-time curve the engine measured (seconds of a step by its rows, over a one-row step) is
printed too: it is what decides whether a draft pays on this machine.

  python bench/speculation.py [--large] [--threads N] [--rounds 3] [--tokens 128] [--quick]

`--large` adds the packaged 1.5B model when it is prepared and at least 10 GB of memory is
available. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from assistant.config import AssistantConfig  # noqa: E402
from assistant.engine.base import SamplingParams  # noqa: E402
from assistant.engine.loading import load_model  # noqa: E402
from assistant.engine.local import LocalEngine  # noqa: E402
from assistant.engine.speculate import SpeculationStats  # noqa: E402

PASSAGES = """\
[1] Backups run every night at 02:00 local time. Each backup is an incremental snapshot of the data directory, compressed with zstd at level 3 and encrypted with AES-256-GCM before it leaves the machine. A full snapshot is taken every Sunday, and incremental snapshots are kept for 35 days.
[2] To restore a backup, stop the service with `systemctl stop assistant`, then run `assistant backup restore --snapshot <id> --target ./data`. The restore command verifies the sha256 checksum of every chunk before it writes anything, and it refuses to overwrite a non-empty target directory unless you pass --force.
[3] The retention policy is set in the [backup] section of assistant.toml: keep_daily = 35, keep_weekly = 12 and keep_monthly = 24. Snapshots older than the policy allows are pruned after each successful backup, never before it.
[4] If a backup fails three nights in a row, the service sends an alert to the address in backup.alert_email and writes the error to logs/backup.log. The most common cause is a full target disk: free at least twice the size of the data directory before the next run.
[5] Encryption keys are stored in the system keyring under the name assistant-backup. Losing the key means losing every snapshot made with it: export it with `assistant backup export-key` and keep the file somewhere other than the backed-up machine."""

RAG_QUESTIONS = [
    "How do I restore a backup, and what does the restore command check first?",
    "What happens if a backup fails three nights in a row, and what is the usual cause?",
    "How long are snapshots kept, and where is that configured?",
    "How are backups compressed and encrypted, and where is the key kept?",
]
FREE_QUESTIONS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "What are three good habits for writing maintainable software? Explain each.",
    "Describe a walk through a busy market in the morning.",
]


def rag_prompt(question: str) -> list[dict]:
    return [{"role": "system", "content": "Answer the question using only the passages below. Quote the passages "
                                          "word for word where you can, and cite them as [n].\n\n" + PASSAGES},
            {"role": "user", "content": question}]


def free_prompt(question: str) -> list[dict]:
    return [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": question}]


def stream(engine: LocalEngine, prompt: list[dict], params: SamplingParams) -> list[tuple[float, tuple[int, ...]]]:
    """(time, token ids) of every delta that carries tokens."""
    return [(time.perf_counter(), d.token_ids) for d in engine.generate(prompt, params) if d.token_ids]


def one_stream(engine: LocalEngine, prompts: list[list[dict]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Decode tok/s of the prompts one after another: tokens after each first delta / their time."""
    tokens = seconds = 0.0
    answers = []
    for prompt in prompts:
        deltas = stream(engine, prompt, params)
        answers.append([t for _, ids in deltas for t in ids])
        tokens += sum(len(ids) for _, ids in deltas[1:])
        seconds += deltas[-1][0] - deltas[0][0]
    return tokens / seconds, answers


def concurrent(engine: LocalEngine, prompts: list[list[dict]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Aggregate decode tok/s of the prompts submitted together: the tokens from the moment every stream
    has its first token until the last one finishes, over that time (answers end at their own length,
    so the window where all four still decode can be a dozen steps: too short to time)."""
    records: list[list[tuple[float, tuple[int, ...]]]] = [[] for _ in prompts]
    threads = [threading.Thread(target=lambda i=i: records[i].extend(stream(engine, prompts[i], params)))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start = max(r[0][0] for r in records)  # every stream has its first token
    end = max(r[-1][0] for r in records)
    tokens = sum(len(ids) for r in records for stamp, ids in r if start < stamp <= end)
    return tokens / max(end - start, 1e-9), [[t for _, ids in r for t in ids] for r in records]


def stats_delta(engine: LocalEngine, before: SpeculationStats) -> SpeculationStats:
    now = engine.speculator.stats
    return SpeculationStats(now.num_verify_steps - before.num_verify_steps, now.num_drafted - before.num_drafted,
                            now.num_accepted - before.num_accepted, now.num_emitted - before.num_emitted)


def speculation(engine: LocalEngine, on: bool) -> None:
    """Switch prompt lookup on or off between rounds (the engine is idle then)."""
    engine.scheduler.speculator = engine.speculator if on else None


def bench_model(name: str, args: argparse.Namespace) -> dict[str, object]:
    config = AssistantConfig.load(overrides={"engine.model": name, "engine.num_threads": args.threads,
                                             "data_dir": args.data_dir})
    loaded = load_model(config)
    engine = LocalEngine(loaded, config.engine)
    del loaded
    gc.collect()
    assert engine.speculator is not None, "engine.speculation is off in this configuration"
    params = SamplingParams(max_tokens=args.tokens)
    kinds = {"rag": [rag_prompt(q) for q in RAG_QUESTIONS], "free": [free_prompt(q) for q in FREE_QUESTIONS]}
    if args.quick:
        kinds = {kind: prompts[:2] for kind, prompts in kinds.items()}
    print(f"\nmodel {name}: quantization {engine.quantize or 'none'}, {args.rounds} rounds, up to {args.tokens} tokens")
    speculation(engine, False)
    for prompts in kinds.values():  # warm-up: every prompt prefilled once, so each round decodes from cached prompts
        for prompt in prompts:
            for _ in engine.generate(prompt, SamplingParams(max_tokens=2)):
                pass
    out: dict[str, object] = {}
    for kind, prompts in kinds.items():
        for streams, runner in ((1, one_stream), (len(prompts), concurrent)):
            rates: dict[bool, list[float]] = {False: [], True: []}
            answers: dict[bool, list[list[int]]] = {}
            totals = SpeculationStats()
            for round_ in range(args.rounds):
                for on in ((False, True) if round_ % 2 == 0 else (True, False)):
                    speculation(engine, on)
                    before = SpeculationStats(**vars(engine.speculator.stats))
                    rate, answers[on] = runner(engine, prompts, params)
                    rates[on].append(rate)
                    if on:
                        d = stats_delta(engine, before)
                        for field in vars(totals):
                            setattr(totals, field, getattr(totals, field) + getattr(d, field))
            ratios = [b / a for a, b in zip(rates[False], rates[True])]
            same = sum(a == b for a, b in zip(answers[False], answers[True]))
            tokens = sum(len(a) for a in answers[True])
            key = f"{kind}_{streams}"
            out[key] = {"off_tok_s": round(statistics.median(rates[False]), 2),
                        "on_tok_s": round(statistics.median(rates[True]), 2),
                        "speedup": round(statistics.median(ratios), 3),
                        "acceptance_rate": round(totals.acceptance_rate, 3),
                        "tokens_per_verify": round(totals.mean_tokens_per_step, 2),
                        "verified_share": round(totals.num_emitted / max(1, tokens * args.rounds), 3),
                        "identical": f"{same}/{len(prompts)}"}
            r = out[key]
            print(f"{kind:4s} {streams} stream{'s' if streams > 1 else ' '}: off {r['off_tok_s']:6.2f} tok/s, "
                  f"on {r['on_tok_s']:6.2f} tok/s -> {r['speedup']:.2f}x (rounds {[round(x, 2) for x in ratios]}); "
                  f"acceptance {r['acceptance_rate']:.2f}, {r['tokens_per_verify']:.2f} tokens per verify step, "
                  f"{r['verified_share'] * 100:.0f}% of tokens from verify steps; identical answers {r['identical']}")
    cost = engine.speculator.cost
    if 1 in cost.seconds:
        curve = {rows: round(s / cost.seconds[1], 2) for rows, s in sorted(cost.seconds.items()) if rows <= 16}
        out["step_time_vs_1_row"] = curve
        print(f"step time by rows, over a 1-row step (the engine's own measurements): {curve}")
    engine.close()
    del engine
    gc.collect()
    return out


def available_gb() -> float:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--large", action="store_true", help="also the packaged 1.5B (needs >= 10 GB available)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = the engine's default")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128, help="max_tokens of every answer")
    parser.add_argument("--quick", action="store_true", help="2 prompts per kind")
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    results: dict[str, object] = {"threads": args.threads, "rounds": args.rounds, "max_tokens": args.tokens}
    models = [args.model]
    if args.large:
        from assistant.models import prepared_path, resolve_model_name

        config = AssistantConfig.load(overrides={"data_dir": args.data_dir})
        if prepared_path(resolve_model_name("large"), config.resolved_models_dir) is None:
            print("the large model is not prepared: skipping it (assistant models prepare large)")
        else:
            models.append("large")
    for name in models:
        if name == "large" and available_gb() < 10:
            print(f"skipping the large model: {available_gb():.1f} GB available, 10 needed")
            continue
        results[name] = bench_model(name, args)
    small = results.get(args.model, {})
    if isinstance(small, dict) and "rag_1" in small:  # issue 18's keys, for the default model
        results["rag_lookup_speedup"] = small["rag_1"]["speedup"]
        results["acceptance_rate"] = small["rag_1"]["acceptance_rate"]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
