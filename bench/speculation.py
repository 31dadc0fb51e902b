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
  speedup                mode / off                                (issue 18: RAG goal >= 1.6x)
  acceptance_rate        accepted drafts / drafted tokens
  tokens_per_verify      tokens a speculating sequence-step yields (accepted drafts + 1)
  identical              answers token-for-token equal with and without speculation
The step-time curve the engine measured (seconds of a step by its rows, over a one-row step) is
printed too: it is what decides whether a draft pays on this machine.

  python bench/speculation.py [--large] [--threads N] [--rounds 3] [--tokens 128] [--quick]

For the default model, the RAG prompts also run on llama.cpp (llama-cpp-python, when installed; never a
product dependency) right after: rag_vs_llamacpp = this engine's RAG decode with prompt lookup over plain
llama.cpp on the same prompts (issue 18 goal >= 1.3), rag_vs_llamacpp_lookup the same over llama.cpp
with its own prompt-lookup drafting, rag_off_vs_llamacpp this engine without speculation over llama.cpp.

`--large` adds the packaged 1.5B model when it is prepared and at least 12 GB of memory is available,
with a third mode beside off and prompt lookup: the --model (the 0.5B) drafting for it (engine/draft.py;
draft_speedup: RAG answers, 1 stream, issue 18 goal >= 1.8x; draft_speedup_free: free-form answers).
Last line: one JSON object.
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
from assistant.engine.loading import load_draft_model, load_model  # noqa: E402
from assistant.engine.local import LocalEngine  # noqa: E402
from assistant.engine.speculate import SpeculationStats, Speculator  # noqa: E402
from engine import llamacpp_rates  # noqa: E402  (bench/engine.py: llama-cpp-python in its own process)

LLAMACPP_LOOKUP_TOKENS = 10  # llama-cpp-python's prompt-lookup drafting (its documented default for CPU)

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
    """What the engine's current speculator counted since `before`."""
    now = engine.speculator.stats
    return SpeculationStats(now.num_verify_steps - before.num_verify_steps, now.num_drafted - before.num_drafted,
                            now.num_accepted - before.num_accepted, now.num_emitted - before.num_emitted)


def use(engine: LocalEngine, speculator: object) -> None:
    """Switch the engine's speculation between rounds (the engine is idle then): None = plain decoding."""
    engine.scheduler.speculator = speculator
    if speculator is not None:
        engine.speculator = speculator


def bench_model(name: str, args: argparse.Namespace, draft: str = "") -> dict[str, object]:
    """Modes, each timed in every round against plain decoding ("off"): prompt lookup ("lookup"), and
    with a draft model also the draft model's speculation ("draft")."""
    config = AssistantConfig.load(overrides={"engine.model": name, "engine.num_threads": args.threads,
                                             "engine.draft_model": draft, "data_dir": args.data_dir})
    loaded = load_model(config)
    engine = LocalEngine(loaded, config.engine, load_draft_model(config))
    del loaded
    gc.collect()
    assert engine.speculator is not None, "engine.speculation is off in this configuration"
    modes: dict[str, object] = {"off": None, "lookup": Speculator()}
    if draft:
        modes["draft"] = engine.speculator
    params = SamplingParams(max_tokens=args.tokens)
    kinds = {"rag": [rag_prompt(q) for q in RAG_QUESTIONS], "free": [free_prompt(q) for q in FREE_QUESTIONS]}
    if args.quick:
        kinds = {kind: prompts[:2] for kind, prompts in kinds.items()}
    print(f"\nmodel {name}{f' drafted for by {draft}' if draft else ''}: quantization {engine.quantize or 'none'}, "
          f"{args.rounds} rounds, up to {args.tokens} tokens")
    use(engine, None)
    for prompts in kinds.values():  # warm-up: every prompt prefilled once, so each round decodes from cached prompts
        for prompt in prompts:
            for _ in engine.generate(prompt, SamplingParams(max_tokens=2)):
                pass
    out: dict[str, object] = {}
    names = list(modes)
    for kind, prompts in kinds.items():
        for streams, runner in ((1, one_stream), (len(prompts), concurrent)):
            rates: dict[str, list[float]] = {m: [] for m in names}
            answers: dict[str, list[list[int]]] = {}
            totals = {m: SpeculationStats() for m in names if m != "off"}
            for round_ in range(args.rounds):
                for mode in names[round_ % len(names):] + names[:round_ % len(names)]:  # rotate who goes first
                    use(engine, modes[mode])
                    before = SpeculationStats(**vars(modes[mode].stats)) if mode != "off" else None
                    rate, answers[mode] = runner(engine, prompts, params)
                    rates[mode].append(rate)
                    if before is not None:
                        d = stats_delta(engine, before)
                        for field in vars(d):
                            setattr(totals[mode], field, getattr(totals[mode], field) + getattr(d, field))
            key = f"{kind}_{streams}"
            out[key] = {"off_tok_s": round(statistics.median(rates["off"]), 2)}
            line = f"{kind:4s} {streams} stream{'s' if streams > 1 else ' '}: off {out[key]['off_tok_s']:6.2f} tok/s"
            for mode in names[1:]:
                ratios = [b / a for a, b in zip(rates["off"], rates[mode])]
                same = sum(a == b for a, b in zip(answers["off"], answers[mode]))
                tokens = sum(len(a) for a in answers[mode])
                t = totals[mode]
                r = {"tok_s": round(statistics.median(rates[mode]), 2), "speedup": round(statistics.median(ratios), 3),
                     "acceptance_rate": round(t.acceptance_rate, 3), "tokens_per_verify": round(t.mean_tokens_per_step, 2),
                     "verified_share": round(t.num_emitted / max(1, tokens * args.rounds), 3),
                     "identical": f"{same}/{len(prompts)}"}
                out[key][mode] = r
                line += (f"; {mode} {r['tok_s']:6.2f} tok/s -> {r['speedup']:.2f}x (rounds {[round(x, 2) for x in ratios]}), "
                         f"acceptance {r['acceptance_rate']:.2f}, {r['tokens_per_verify']:.2f} tokens per verify step, "
                         f"{r['verified_share'] * 100:.0f}% of tokens from verify steps, identical {r['identical']}")
            print(line)
    if not draft and "rag_1" in out:
        out.update(llamacpp_peer(engine, config, kinds["rag"], args, out["rag_1"]))
    for mode in names[1:]:
        cost = modes[mode].cost
        if 1 in cost.seconds:
            curve = {rows: round(s / cost.seconds[1], 2) for rows, s in sorted(cost.seconds.items()) if rows <= 16}
            out[f"step_time_vs_1_row_{mode}"] = curve
            print(f"{mode}: step time by rows, over a 1-row step (the engine's own measurements): {curve}")
    if draft:  # the hybrid's split: prompt lookup where the text repeats, the draft model elsewhere
        out["draft_sources"] = {source: {"verify_steps": st.num_verify_steps, "acceptance_rate": round(st.acceptance_rate, 3),
                                         "tokens_per_verify": round(st.mean_tokens_per_step, 2)}
                                for source, st in engine.speculator.stats_by_source.items()}
        print(f"draft mode, by source of the drafts: {out['draft_sources']}")
    if draft and 1 in engine.speculator.cost.seconds and 1 in engine.speculator.draft_cost.seconds:
        ratio = engine.speculator.draft_cost.seconds[1] / engine.speculator.cost.seconds[1]
        out["draft_round_vs_target_step"] = round(ratio, 3)
        print(f"a 1-row draft round costs {ratio:.2f} of a 1-row target step")
    engine.close()
    del engine
    gc.collect()
    return out


def llamacpp_peer(engine: LocalEngine, config: AssistantConfig, prompts: list[list[dict]], args: argparse.Namespace,
                  ours: dict) -> dict[str, object]:
    """The RAG prompts on llama.cpp (llama-cpp-python, the packaged GGUF, the same threads and answer
    length), plain and with its own prompt lookup, right after this engine's rounds: issue 18's
    rag_vs_llamacpp is this engine with prompt lookup over plain llama.cpp (goal >= 1.3)."""
    from assistant.engine.loading import resolve_model_path

    gguf = next(resolve_model_path(config).glob("*.gguf"), None)
    texts = [engine.tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    plain = llamacpp_rates(gguf, texts, args.threads, args.tokens, rounds=args.rounds) if gguf else None
    if plain is None:
        print("llama.cpp peer: not installed (pip install llama-cpp-python; see bench/engine.py --build-llamacpp)")
        return {"rag_vs_llamacpp": None}
    looked = llamacpp_rates(gguf, texts, args.threads, args.tokens, rounds=args.rounds, lookup=LLAMACPP_LOOKUP_TOKENS)
    plain_s = statistics.median(plain)
    out: dict[str, object] = {"llamacpp_rag_1_tok_s": round(plain_s, 2),
                              "rag_vs_llamacpp": round(ours["lookup"]["tok_s"] / plain_s, 3),
                              "rag_off_vs_llamacpp": round(ours["off_tok_s"] / plain_s, 3)}
    line = (f"llama.cpp, rag 1 stream: {plain_s:.2f} tok/s (rounds {[round(r, 2) for r in plain]}); this engine with "
            f"prompt lookup {out['rag_vs_llamacpp']:.2f}x it, without {out['rag_off_vs_llamacpp']:.2f}x")
    if looked:
        looked_s = statistics.median(looked)
        out.update(llamacpp_lookup_rag_1_tok_s=round(looked_s, 2),
                   rag_vs_llamacpp_lookup=round(ours["lookup"]["tok_s"] / looked_s, 3))
        line += (f"; llama.cpp with its own prompt lookup ({LLAMACPP_LOOKUP_TOKENS} tokens) {looked_s:.2f} tok/s, "
                 f"this engine's lookup {out['rag_vs_llamacpp_lookup']:.2f}x it")
    print(line)
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
        if name == "large" and available_gb() < 12:
            print(f"skipping the large model: {available_gb():.1f} GB available, 12 needed")
            continue
        results[name] = bench_model(name, args, draft=args.model if name == "large" else "")
    small, large = results.get(args.model, {}), results.get("large", {})
    if isinstance(small, dict) and "rag_1" in small:  # issue 18's keys, for the default model
        results["rag_lookup_speedup"] = small["rag_1"]["lookup"]["speedup"]
        results["acceptance_rate"] = small["rag_1"]["lookup"]["acceptance_rate"]
        results["rag_vs_llamacpp"] = small.get("rag_vs_llamacpp")
        results["rag_vs_llamacpp_lookup"] = small.get("rag_vs_llamacpp_lookup")
    if isinstance(large, dict) and "rag_1" in large:  # the 1.5B drafted for by the 0.5B, against the 1.5B alone
        results["draft_speedup"] = large["rag_1"]["draft"]["speedup"]
        results["draft_speedup_free"] = large["free_1"]["draft"]["speedup"]
        results["draft_acceptance_rate"] = large["rag_1"]["draft"]["acceptance_rate"]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
