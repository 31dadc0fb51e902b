"""Turning logits into the next token: OpenAI's penalties and logit bias, greedy, temperature, top-k, top-p
(gpt-fast style functions), and the tokens' log-probabilities when a request asks for them."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from assistant.engine.base import SamplingParams, TokenLogprob


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


def adjusted(logits: Any, params: SamplingParams, answer: Sequence[int], drafts: Sequence[int] = ()) -> Any:
    """One request's rows of logits ((1 + len(drafts), V): a step that verifies drafts) with OpenAI's
    presence and frequency penalties and logit bias applied, as a new tensor. Row j follows the answer so
    far and the first j drafts, so its penalties count those tokens, as plain decoding would."""
    import torch

    out = logits.float().clone()
    vocab = out.size(-1)
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], device=out.device)
        out[:, ids] += torch.tensor([b for _, b in params.logit_bias], device=out.device)
    if params.presence_penalty or params.frequency_penalty:
        seen = list(answer)
        for j in range(out.size(0)):
            if j:
                seen.append(drafts[j - 1])
            if not seen:
                continue
            counts = torch.bincount(torch.tensor(seen, device=out.device), minlength=vocab).float()
            out[j] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return out


def sample(logits: Any, params: SamplingParams, generator: Any = None) -> Any:
    """(B, V) logits -> (B,) token ids."""
    import torch

    if params.temperature == 0:
        return logits.argmax(-1)
    probs = logits_to_probs(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def accept_greedy(drafts: Sequence[int], argmax: Sequence[int]) -> list[int]:
    """What a greedy verify step yields: the drafts that equal the argmax of the row before them, then
    that row's argmax (the model's own next token). argmax: (1 + k,) over the step's rows."""
    m = 0
    while m < len(drafts) and drafts[m] == argmax[m]:
        m += 1
    return [*drafts[:m], int(argmax[m])]


def accept_sampled(probs: Any, drafts: Sequence[int], generator: Any = None) -> list[int]:
    """What a sampled verify step yields (speculative sampling, Leviathan et al. 2023; Chen et al. 2023).

    probs: (1 + k, V), the target's distribution (after temperature, top-k, top-p) at the row before
    each draft and after the last. The drafters propose one token with certainty (q = a point mass),
    so the rule is: accept draft d at row i with probability p_i(d); at the first rejection draw the
    token from max(p_i - q, 0) normalised, i.e. p_i without d; when all k are accepted draw one more
    from p_k. Every token yielded is then distributed exactly as sampling one token at a time."""
    import torch

    device = probs.device
    for i, d in enumerate(drafts):
        u = torch.rand(1, generator=generator, device=device).item()
        if u < probs[i, d].item():
            continue
        residual = probs[i].clone()
        residual[d] = 0.0
        return [*drafts[:i], int(torch.multinomial(residual / residual.sum(), 1, generator=generator).item())]
    return [*drafts, int(torch.multinomial(probs[len(drafts)], 1, generator=generator).item())]


def token_logprobs(logits: Any, tokens: Sequence[int], top: int, decode: Callable[[int], str]) -> list[TokenLogprob]:
    """The log-probabilities of `tokens` under the rows of `logits` that chose them ((>= len(tokens), V),
    row i for token i), with each row's `top` most likely tokens: the model's raw distribution, before
    temperature, top-k and top-p (as OpenAI's and vLLM's logprobs). Rows must be full logits (not a greedy
    row's screened head, whose non-candidates are -inf)."""
    import torch

    rows = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)
    best = torch.topk(rows, top, dim=-1) if top else None
    out = []
    for i, token in enumerate(tokens):
        alternatives: tuple[tuple[str, float], ...] = ()
        if best is not None:
            alternatives = tuple((decode(int(t)), float(v)) for v, t in zip(best.values[i], best.indices[i]))
        out.append(TokenLogprob(decode(int(token)), float(rows[i, token]), alternatives))
    return out
