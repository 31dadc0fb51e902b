"""HFLoopEngine: any transformers causal LM behind the Engine seam, one request at a time.

The fallback for checkpoints the batched LocalEngine's lean model does not implement (see
model.unsupported_reason), and the reference the batched engine is tested against.

A plain prefill/decode loop (nanoGPT / gpt-fast shape) over transformers' model forward with its
`DynamicCache` as the KV cache: `prefill` runs the whole prompt once and fills the cache, then
`decode_one_token` feeds back one sampled token per step. Doing the loop ourselves instead of calling
`model.generate()` gives us per-token streaming without a helper thread, cancellation within one step,
stop strings across token boundaries, and no logits-processor overhead per token (measured against
`generate()` by bench/engine_baseline.py).

Requests are served one at a time (a lock); iteration-level batching, prefix caching and int8 weights
live in LocalEngine (local.py).
"""

from __future__ import annotations

import threading
from typing import Any, Iterator, Sequence

from assistant.config import AssistantConfig
from assistant.engine.base import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    Engine,
    Prompt,
    SamplingParams,
    TokenDelta,
    check_biased_tokens,
)
from assistant.engine.detokenize import IncrementalDetokenizer, StopMatcher
from assistant.engine.loading import ChatTemplateEncoding, LoadedModel, eos_token_ids, load_model
from assistant.engine.sampling import adjusted, sample, token_logprobs


def prefill(model: Any, input_ids: Any, cache: Any, every: bool = False) -> Any:
    """Run the prompt (1, T) through the model, filling `cache`; return last-position logits (1, V), or
    with `every`, every position's (T, V)."""
    out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=0 if every else 1)
    return out.logits[0] if every else out.logits[:, -1, :]


def decode_one_token(model: Any, token: Any, cache: Any) -> Any:
    """Feed one token (1, 1) with the cache; return next-token logits (1, V)."""
    out = model(input_ids=token, past_key_values=cache, use_cache=True)
    return out.logits[:, -1, :]


class HFLoopEngine(ChatTemplateEncoding, Engine):
    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.name = loaded.name
        self.context_window = loaded.context_window
        self._lock = threading.Lock()
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)

    @classmethod
    def from_config(cls, config: AssistantConfig) -> "HFLoopEngine":
        return cls(load_model(config))

    # -- generation ---------------------------------------------------------------------------------
    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        *,
        tools: Sequence[dict] | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[TokenDelta]:
        prompt_ids = self.checked_prompt_ids(prompt, params, tools)
        check_biased_tokens(params, self.model.config.vocab_size)
        with self._lock:
            yield from self._generate_locked(prompt_ids, params, cancel)

    def _generate_locked(self, prompt_ids: list[int], params: SamplingParams, cancel: threading.Event | None):
        import torch
        from transformers import DynamicCache

        max_new = min(params.max_tokens, self.context_window - len(prompt_ids))
        generator = None
        if params.seed is not None and params.temperature > 0:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        stops = StopMatcher(params.stop)
        num_prompt = len(prompt_ids)
        cache = DynamicCache()
        answer: list[int] = []  # the tokens so far, for the penalties
        with torch.inference_mode():
            every = params.prompt_logprobs is not None
            logits = prefill(self.model, torch.tensor([prompt_ids], device=self.device), cache, every)
            prompt_scored: tuple = ()
            if every:  # row i predicts prompt token i + 1
                prompt_scored = tuple(token_logprobs(logits, prompt_ids[1:], params.prompt_logprobs, self.token_text))
                logits = logits[-1:]
            for step in range(1, max_new + 1):
                if cancel is not None and cancel.is_set():
                    yield TokenDelta("", (), FINISH_CANCELLED, num_prompt, step - 1)
                    return
                chosen = adjusted(logits, params, answer) if params.adjusts_logits else logits
                token = sample(chosen, params, generator)  # (1,)
                token_id = int(token.item())
                answer.append(token_id)
                scored = () if params.logprobs is None else tuple(
                    token_logprobs(logits, [token_id], params.logprobs, self.token_text))
                if token_id in self.eos_ids and not params.ignore_eos:
                    yield TokenDelta(stops.flush(), (token_id,), FINISH_STOP, num_prompt, step,  # EOS: no logprob
                                     prompt_logprobs=prompt_scored if step == 1 else ())
                    return
                text = stops.push(detok.push(token_id))
                if stops.stopped:
                    yield TokenDelta(text, (token_id,), FINISH_STOP, num_prompt, step, logprobs=scored,
                                     prompt_logprobs=prompt_scored if step == 1 else ())
                    return
                if step == max_new:
                    yield TokenDelta(text + stops.flush(), (token_id,), FINISH_LENGTH, num_prompt, step,
                                     logprobs=scored, prompt_logprobs=prompt_scored if step == 1 else ())
                    return
                yield TokenDelta(text, (token_id,), None, num_prompt, step, logprobs=scored,
                                     prompt_logprobs=prompt_scored if step == 1 else ())
                logits = decode_one_token(self.model, token.view(1, 1), cache)
