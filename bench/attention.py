"""Decode attention over the paged KV cache (the native `attend`, csrc/layer_ops.cpp), in one run.

Every layer of the 0.5B model's attention shapes (24 layers, 14 query heads, 2 kv heads, head dim 64, fp32
KV) over random keys and values, the cache's 16-slot blocks in order or shuffled (a cache after many
requests). Cases at each context length: 1 query row; n query rows of one sequence (a speculation verify
step); n sequences of one row each (a batched decode step). Medians of the rounds, in ms for all layers.

Figures, each a ratio within this run:
  rows_of_one_seq_vs_1row   n rows of one sequence over 1 row: what a verify step pays for its n - 1
                            extra rows (1.0 would be free; the cache is read once per segment of keys)
  seqs_vs_1row_per_row      n sequences over n x 1 row: a batched step's attention per row against a
                            lone row's (it reads n caches, so ~1.0 is the best it can do)
  shuffled_vs_in_order      1 row with shuffled blocks over in order

  python bench/attention.py [--threads 2] [--rounds 7] [--rows 8]

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from assistant.engine import native  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 24, 14, 2, 64, 16


def case(ops, contexts: list[int], queries: list[int], shuffled: bool, rounds: int) -> float:
    """Median ms of one `attend` call per layer, summed over the layers."""
    slots_total = (sum(contexts) // BLOCK + len(contexts) + 8) * BLOCK
    kc = [torch.randn(slots_total, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    vc = [torch.randn(slots_total, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    blocks = torch.randperm(slots_total // BLOCK) if shuffled else torch.arange(slots_total // BLOCK)
    slots, used = [], 0
    for ctx in contexts:
        n = (ctx + BLOCK - 1) // BLOCK
        mine = blocks[used:used + n].repeat_interleave(BLOCK) * BLOCK + torch.arange(BLOCK).repeat(n)
        slots.append(mine[:ctx])
        used += n
    kv_off = torch.tensor([0, *contexts]).cumsum(0)
    q_off = torch.tensor([0, *queries]).cumsum(0)
    q = torch.randn(sum(queries), HEADS, HEAD_DIM)
    slots_all = torch.cat(slots)
    for i in range(LAYERS):  # warm-up
        ops.attend(q, kc[i], vc[i], slots_all, kv_off, q_off)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for i in range(LAYERS):
            ops.attend(q, kc[i], vc[i], slots_all, kv_off, q_off)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rows", type=int, default=8)
    args = parser.parse_args()
    ops = native.int8_kernels()
    if ops is None:
        sys.exit(f"the native kernels are not available: {native.unavailable_reason() or 'build failed'}")
    ops.set_threads(args.threads)
    n = args.rows
    results: dict[str, object] = {"threads": args.threads, "rows": n}
    for ctx in (300, 2000):
        for shuffled in (False, True):
            tag = f"{ctx}_{'shuffled' if shuffled else 'in_order'}"
            one = case(ops, [ctx], [1], shuffled, args.rounds)
            rows = case(ops, [ctx], [n], shuffled, args.rounds)
            seqs = case(ops, [ctx] * n, [1] * n, shuffled, args.rounds)
            results.update({f"ms_1row_{tag}": round(one, 3), f"ms_{n}rows_one_seq_{tag}": round(rows, 3),
                            f"ms_{n}seqs_{tag}": round(seqs, 3),
                            f"rows_of_one_seq_vs_1row_{tag}": round(rows / one, 3),
                            f"seqs_vs_1row_per_row_{tag}": round(seqs / (n * one), 3)})
            print(f"{ctx} keys, blocks {'shuffled' if shuffled else 'in order'}: 1 row {one:.2f} ms, {n} rows of one "
                  f"sequence {rows:.2f} ms ({rows / one:.2f}x), {n} sequences {seqs:.2f} ms "
                  f"({seqs / (n * one):.2f}x {n} lone rows)")
        ratio = results[f"ms_1row_{ctx}_shuffled"] / results[f"ms_1row_{ctx}_in_order"]
        results[f"shuffled_vs_in_order_{ctx}"] = round(ratio, 3)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
