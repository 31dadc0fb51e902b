"""Benchmark: LocalEngine vs a plain `model.generate()` on the same model, threads and prompt.

Absolute timings swing 2-3x on this shared machine, so both are measured in the same run, alternating,
and the ratio is the figure to quote. Greedy, fixed answer length (EOS ignored) so both decode the
same number of tokens.

  python bench/engine_baseline.py [--model NAME_OR_PATH] [--threads 2] [--new-tokens 64] [--repeats 3]

Last line: one JSON object with decode_tok_s, ttft_s, decode_vs_generate (>1 = LocalEngine faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write a detailed explanation of how a hash map works, with an example in Python."},
]


def time_local(engine, new_tokens: int) -> tuple[float, float]:
    from assistant.engine.base import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    first = None
    count = 0
    for delta in engine.generate(PROMPT, params):
        count += len(delta.token_ids)
        if first is None and delta.token_ids:
            first = time.perf_counter()
    end = time.perf_counter()
    assert count == new_tokens, count
    return first - start, (new_tokens - 1) / (end - first)


def time_generate(model, input_ids, new_tokens: int) -> tuple[float, float]:
    import torch

    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(input_ids, max_new_tokens=1, do_sample=False)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        total = time.perf_counter() - start
    assert out.shape[1] - input_ids.shape[1] == new_tokens
    # decode rate excludes the prefill, which generate() spends in its first step
    return ttft, (new_tokens - 1) / max(total - ttft, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()

    from assistant.config import AssistantConfig
    from assistant.engine.loading import load_model
    from assistant.engine.local import LocalEngine

    config = AssistantConfig.load(overrides={"engine.model": args.model, "engine.num_threads": args.threads,
                                             "data_dir": args.data_dir})
    # prefix cache off: the prompt repeats, and TTFT should compare prefill with prefill
    engine = LocalEngine(load_model(config), replace(config.engine, prefix_cache=False))
    hf_model = load_model(config).model  # the same checkpoint as plain transformers, fp32
    input_ids = __import__("torch").tensor([engine.encode(PROMPT)], device=engine.device)
    time_local(engine, 4)  # warm-up both paths
    time_generate(hf_model, input_ids, 4)

    local, hf = [], []
    for _ in range(args.repeats):
        local.append(time_local(engine, args.new_tokens))
        hf.append(time_generate(hf_model, input_ids, args.new_tokens))
    ttft = statistics.median(t for t, _ in local)
    tok_s = statistics.median(r for _, r in local)
    hf_ttft = statistics.median(t for t, _ in hf)
    hf_tok_s = statistics.median(r for _, r in hf)

    print(f"model {args.model}, {args.threads} threads, prompt {input_ids.shape[1]} tokens, "
          f"{args.new_tokens} new tokens, median of {args.repeats}")
    print(f"{'':<18}{'TTFT s':>10}{'decode tok/s':>15}")
    print(f"{'LocalEngine':<18}{ttft:>10.3f}{tok_s:>15.2f}")
    print(f"{'HF generate()':<18}{hf_ttft:>10.3f}{hf_tok_s:>15.2f}")
    print(f"decode ratio {tok_s / hf_tok_s:.2f}x, TTFT ratio {hf_ttft / ttft:.2f}x (>1 = LocalEngine faster)")
    engine.close()
    print(json.dumps({
        "model": args.model, "quantize": engine.quantize or "none", "threads": args.threads, "prompt_tokens": int(input_ids.shape[1]),
        "new_tokens": args.new_tokens, "decode_tok_s": round(tok_s, 3), "ttft_s": round(ttft, 4),
        "generate_decode_tok_s": round(hf_tok_s, 3), "generate_ttft_s": round(hf_ttft, 4),
        "decode_vs_generate": round(tok_s / hf_tok_s, 3), "ttft_vs_generate": round(hf_ttft / ttft, 3),
    }))


if __name__ == "__main__":
    main()
