"""Turning logits into the next token: greedy, temperature, top-k, top-p (gpt-fast style functions)."""

from __future__ import annotations

from typing import Any

from assistant.engine.base import SamplingParams


def logits_to_probs(logits: Any, params: SamplingParams) -> Any:
    """(B, V) float logits -> (B, V) probabilities after temperature, top-k and top-p."""
    import torch

    logits = logits.float() / max(params.temperature, 1e-5)
    if params.top_k:
        k = min(params.top_k, logits.size(-1))
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= params.top_p  # keep the token that crosses top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(-1)


def sample(logits: Any, params: SamplingParams, generator: Any = None) -> Any:
    """(B, V) logits -> (B,) token ids."""
    import torch

    if params.temperature == 0:
        return logits.argmax(-1)
    probs = logits_to_probs(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
