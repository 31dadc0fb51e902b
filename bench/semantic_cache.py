"""Choose and measure the semantic response cache's threshold (assistant/server/response_cache.py).

The set: tests/data/semantic_cache_pairs.jsonl, pairs (a, b) labelled `paraphrase` (b asks exactly what a
asks: a hit is right) or `near_miss` (b is worded like a but asks something else: a hit would serve a
wrong answer), split into dev (the threshold is chosen there) and test (only reported). For each pair
the cache stores a's answer and looks b up, with the packaged embedder (retrieval.embedder).

Printed, per threshold on the dev half: the paraphrase hit rate and the near-miss false-hit rate, with
the word guard and with similarity alone. Chosen: among the thresholds with no false hit on dev, the
one with the best dev hit rate, the highest of those on a tie (similarity then is a second check behind
the word guard, not the only one). Then, on test, at that threshold: hit rate, false-hit rate, and the latency of a hit
(embedding + lookup, median and p95) against the time to embed alone (its baseline).

  python bench/semantic_cache.py [--embedder all-minilm-l6-v2]

Last line: one JSON object (semantic_cache_hit_ms, semantic_cache_false_hit_rate, semantic_cache_hit_rate,
threshold).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from assistant.engine.base import SamplingParams  # noqa: E402
from assistant.server.response_cache import ResponseCache, same_terms  # noqa: E402

PAIRS = ROOT / "tests" / "data" / "semantic_cache_pairs.jsonl"
GRID = [round(0.70 + 0.01 * i, 2) for i in range(30)]


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def rates(pairs, sims, threshold: float, guard: bool) -> tuple[float, float]:
    hit = lambda p, s: s >= threshold and (not guard or same_terms(p["a"], p["b"]))  # noqa: E731
    para = [hit(p, s) for p, s in zip(pairs, sims) if p["label"] == "paraphrase"]
    near = [hit(p, s) for p, s in zip(pairs, sims) if p["label"] == "near_miss"]
    return sum(para) / len(para), sum(near) / len(near)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--embedder", default="all-minilm-l6-v2")
    args = parser.parse_args()
    from ingest.embed import load_embedder

    embedder = load_embedder(args.embedder, lazy=False)
    pairs = [json.loads(line) for line in PAIRS.read_text().splitlines() if line.strip()]
    texts = lambda p: ([f"user: {p['a']}"], [f"user: {p['b']}"])  # noqa: E731  (the cache's normalised form)
    sims = []
    for p in pairs:
        a, b = texts(p)
        sims.append(float(embedder.embed(a)[0] @ embedder.embed(b)[0]))
    dev = [(p, s) for p, s in zip(pairs, sims) if p["split"] == "dev"]
    test = [(p, s) for p, s in zip(pairs, sims) if p["split"] == "test"]
    print(f"{len(pairs)} pairs ({len(dev)} dev, {len(test)} test), embedder {args.embedder}")
    print("threshold  dev hit (guard)  dev false hit (guard)  dev hit (similarity only)  dev false hit (similarity only)")
    chosen, best = 1.0, -1.0
    for t in GRID:
        hg, fg = rates([p for p, _ in dev], [s for _, s in dev], t, True)
        hs, fs = rates([p for p, _ in dev], [s for _, s in dev], t, False)
        print(f"  {t:.2f}     {hg:6.3f}          {fg:6.3f}                 {hs:6.3f}                     {fs:6.3f}")
        if fg == 0 and hg >= best:
            chosen, best = t, hg
    hit_rate, false_rate = rates([p for p, _ in test], [s for _, s in test], chosen, True)
    _, false_sim_only = rates([p for p, _ in test], [s for _, s in test], chosen, False)
    wrong = [(p["a"], p["b"], round(s, 3)) for p, s in test if p["label"] == "near_miss" and s >= chosen
             and same_terms(f"user: {p['a']}", f"user: {p['b']}")]
    print(f"chosen threshold {chosen} (best dev hit rate with no dev false hit, highest on a tie); test: hit rate {hit_rate:.3f}, "
          f"false-hit rate {false_rate:.3f} (similarity alone: {false_sim_only:.3f})")
    for a, b, s in wrong:
        print(f"  false hit on test: {a!r} -> {b!r} ({s})")

    # hit latency through the cache itself, against embedding alone (the part a hit cannot skip)
    cache = ResponseCache(embed=embedder.embed, threshold=chosen)
    params = SamplingParams(max_tokens=64)
    for p, _ in test:
        exact, text = cache.key("bench", "m", ask(p["a"]), params)
        _, vector = cache.get(exact, text)
        cache.put(exact, text, vector, {"text": "x"})
    hit_ms, embed_ms = [], []
    for _ in range(3):
        for p, _ in test:
            exact, text = cache.key("bench", "m", ask(p["a"]), params)
            start = time.perf_counter()
            answer, _ = cache.get(exact, text)
            hit_ms.append((time.perf_counter() - start) * 1e3)
            assert answer is not None
            start = time.perf_counter()
            embedder.embed([text])
            embed_ms.append((time.perf_counter() - start) * 1e3)
    p50, p95 = statistics.median(hit_ms), statistics.quantiles(hit_ms, n=20)[18]
    base = statistics.median(embed_ms)
    print(f"hit latency with {len(cache)} entries: p50 {p50:.2f} ms, p95 {p95:.2f} ms; embedding alone {base:.2f} ms "
          f"-> {p50 / base:.2f}x (goal: hit <= 20 ms)")
    print(json.dumps({"threshold": chosen, "semantic_cache_hit_rate": round(hit_rate, 3),
                      "semantic_cache_false_hit_rate": round(false_rate, 3),
                      "semantic_cache_false_hit_rate_similarity_only": round(false_sim_only, 3),
                      "semantic_cache_hit_ms": round(p50, 2), "semantic_cache_hit_p95_ms": round(p95, 2),
                      "embed_ms": round(base, 2), "hit_vs_embed": round(p50 / base, 3),
                      "num_pairs": len(pairs), "num_test": len(test)}))


if __name__ == "__main__":
    main()
