"""The engine on a CUDA GPU against HF generate() and the memory-bandwidth limit, in one run.

Runs on a lent GPU machine in one command (the packaged weights cannot travel there, so every model
is a random-weight stand-in of a packaged shape, engine/stand_in.py: speed does not depend on the
weight values). Every ratio is taken within this run. Figures, per shape:

  decode_tok_s         batch-1 decode through LocalEngine (bf16, CUDA graphs), 256 tokens after a
                       128-token prompt, best of 3
  hbm_fraction         decode_tok_s x bytes one token must read (weights + its KV) / hbm_gb_s, the
                       device-to-device copy bandwidth measured in this run (goal >= 0.6 on the 1.5B)
  eager_tok_s          the same with engine.cuda_graphs = false; graphs_vs_eager = their ratio
  hf_tok_s             HF generate() on the same model and weights (bf16, greedy, its default cache)
  decode_vs_hf         decode_tok_s / hf_tok_s                                      (goal >= 5)
  agg_tok_s_N          aggregate decode tok/s of N concurrent requests (N = 8, 32, 128), counted in
                       the window where all N are past their prefill and none has finished
  agg128_vs_batch1     agg_tok_s_128 / decode_tok_s                                  (goal >= 20)
  ttft_2k_s            time to the first token of a 2,048-token prompt, cold
  prefix_ttft_ratio    the same prompt again (its blocks in the prefix cache) / cold
  greedy_match_vs_hf   tokens of 64 greedy ones where the engine and HF generate() agree before the
                       first difference (bf16 on random weights: near-ties make this a rough figure;
                       exact equality is tests/test_engine_cuda.py's, in fp32)

  python bench/gpu.py [--shapes qwen2.5-0.5b,qwen2.5-1.5b] [--out DIR]

Prints a table per shape; the last line is one JSON object (also written to DIR/gpu.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from assistant.config import EngineConfig  # noqa: E402
from assistant.engine.base import SamplingParams  # noqa: E402
from assistant.engine.local import LocalEngine  # noqa: E402
from assistant.engine.stand_in import random_model  # noqa: E402
from engine import decode_only_rate  # noqa: E402  (bench/engine.py: the CPU figures' same measure)


DEVICE = "cuda"  # --device cpu: a smoke run of this script's logic where there is no GPU (figures meaningless)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy (best of 10)."""
    src = torch.empty(2**29 if DEVICE == "cuda" else 2**24, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    best = float("inf")
    for _ in range(10):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def prompt_ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(1, vocab - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def stream(engine, prompt, n) -> list[float]:
    """Timestamps of each token of one greedy request."""
    stamps = []
    for delta in engine.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True)):
        stamps.extend([time.perf_counter()] * len(delta.token_ids))
    return stamps


def decode_rate(engine, prompt, n) -> float:
    stamps = stream(engine, prompt, n)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def concurrent_rate(engine, prompts, n) -> float:
    """Aggregate tok/s of len(prompts) greedy requests of n tokens, in the window where all decode."""
    return decode_only_rate(engine, prompts, SamplingParams(max_tokens=n, ignore_eos=True))


def ttft(engine, prompt) -> float:
    start = time.perf_counter()
    for delta in engine.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True)):
        if delta.token_ids:
            return time.perf_counter() - start
    raise RuntimeError("no token")


def hf_rate(model, prompt, n) -> tuple[float, list[int]]:
    ids = torch.tensor([prompt], device=DEVICE)

    def gen(k):
        sync()
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0)
        sync()
        return time.perf_counter() - start, out[0, len(prompt):].tolist()

    gen(4)  # warm-up
    one = min(gen(1)[0] for _ in range(2))
    runs = [gen(n) for _ in range(2)]
    return (n - 1) / (min(t for t, _ in runs) - one), runs[0][1]


def replay_ms(graphs, rows: int, length: int, n: int = 50) -> float:
    """GPU time of one replay of a captured decode graph (padding rows only: it writes the scratch block)."""
    graph = graphs._graphs.get((rows, length)) or graphs._build(rows, length)
    graph = graph.graph
    graphs._load([], [], [], [], rows, length)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def engine_config(**overrides) -> EngineConfig:
    base = dict(max_num_seqs=128, max_batched_tokens=4096, max_prefill_chunk=512,
                kv_cache_mb=8192 if DEVICE == "cuda" else 256, max_waiting=256, speculation="off")
    return EngineConfig(**{**base, **overrides})


def measure(shape: str, bandwidth: float, dtype: torch.dtype) -> dict[str, object]:
    row: dict[str, object] = {}
    loaded = random_model(shape, dtype=dtype, device=DEVICE, seed=0)
    vocab = loaded.model.config.vocab_size
    prompt = prompt_ids(128, 0, vocab)
    with torch.inference_mode():
        hf_tok_s, hf_tokens = hf_rate(loaded.model, prompt, 128)
    engine = LocalEngine(loaded, engine_config())
    try:
        start = time.perf_counter()
        for n in (1, 8, 32, 128):  # capture the buckets the runs below use (lengths 256, 512) before timing
            for length in (128, 300):
                concurrent_rate(engine, [prompt_ids(length, 100 + i, vocab) for i in range(n)], 8)
        row["warmup_s"] = round(time.perf_counter() - start, 2)
        rate = max(decode_rate(engine, prompt, 256) for _ in range(3))
        a = engine.model.args
        kv_bytes = 2 * a.num_layers * a.num_kv_heads * a.head_dim * engine.kv.k[0].element_size() * (128 + 128)
        per_token = engine.model.decode_bytes() + kv_bytes
        row.update(decode_tok_s=round(rate, 1), bytes_per_token_mb=round(per_token / 1e6, 1),
                   hbm_limit_tok_s=round(bandwidth / per_token, 1), hbm_fraction=round(rate * per_token / bandwidth, 3),
                   hf_tok_s=round(hf_tok_s, 1), decode_vs_hf=round(rate / hf_tok_s, 2))
        for n in (8, 32, 128):
            row[f"agg_tok_s_{n}"] = round(concurrent_rate(engine, [prompt_ids(128, 1000 * n + i, vocab)
                                                                    for i in range(n)], 128), 1)
        row["agg128_vs_batch1"] = round(row["agg_tok_s_128"] / rate, 2)
        long_prompt = prompt_ids(2048, 7, vocab)
        ttft(engine, prompt_ids(2048, 8, vocab))  # warm-up of the long prefill
        cold = ttft(engine, long_prompt)
        hit = statistics.median(ttft(engine, long_prompt) for _ in range(3))
        row.update(ttft_2k_s=round(cold, 4), prefix_ttft_ratio=round(hit / cold, 3))
        ours = []
        for delta in engine.generate(prompt, SamplingParams(max_tokens=64, ignore_eos=True)):
            ours.extend(delta.token_ids)
        row["greedy_match_vs_hf"] = next((i for i, (x, y) in enumerate(zip(ours, hf_tokens)) if x != y), 64)
        row.update({k: v for k, v in engine.stats().items() if k in ("cuda_graphs", "graph_replays")})
        if engine.graphs is not None:  # the GPU's share of a step: replays alone, against the engine's step
            row["replay_ms_batch1"] = round(replay_ms(engine.graphs, 1, 512), 3)
            row["step_ms_batch1"] = round(1e3 / rate, 3)
            row["replay_ms_batch128"] = round(replay_ms(engine.graphs, 128, 512), 3)
    finally:
        engine.close()
    eager = LocalEngine(loaded, engine_config(cuda_graphs=False, max_num_seqs=8))
    try:
        decode_rate(eager, prompt, 16)
        row["eager_tok_s"] = round(max(decode_rate(eager, prompt, 64) for _ in range(2)), 1)
        row["graphs_vs_eager"] = round(row["decode_tok_s"] / row["eager_tok_s"], 2)
    finally:
        eager.close()
    del loaded, engine, eager
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="qwen2.5-1.5b,qwen2.5-0.5b")
    parser.add_argument("--out", default=os.environ.get("OUT", ""))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA GPU (run it on a lent device machine, or --device cpu for a smoke run).")
    bandwidth = copy_bandwidth()
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke run)"
    result: dict[str, object] = {"device": name, "torch": torch.__version__, "hbm_gb_s": round(bandwidth / 1e9, 1)}
    print(f"{result['device']}: copy bandwidth {result['hbm_gb_s']} GB/s (read + written)", flush=True)
    for shape in args.shapes.split(","):
        row = measure(shape, bandwidth, torch.bfloat16 if DEVICE == "cuda" else torch.float32)
        result[shape] = row
        print(f"\n{shape}")
        for key, value in row.items():
            print(f"  {key:22} {value}", flush=True)
    big = result.get("qwen2.5-1.5b") or result[args.shapes.split(",")[-1]]
    result.update(decode_vs_hf=big["decode_vs_hf"], hbm_fraction_1_5b=big["hbm_fraction"],
                  agg128_vs_batch1=big["agg128_vs_batch1"], prefix_ttft_ratio=big["prefix_ttft_ratio"])
    line = json.dumps(result)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "gpu.json").write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
