"""The Engine seam: what the orchestrator needs from any LLM backend.

`Engine.generate(prompt, params) -> Iterator[TokenDelta]` streams text as it is decoded. `prompt` is
either chat messages (`[{"role": ..., "content": ...}]`, rendered with the model's own chat template)
or token ids. Cancel by setting the `cancel` event or closing the iterator; the engine frees the
request's resources within one step. Backends: `LocalEngine` (in-process transformers model),
`RemoteEngine` (any OpenAI-compatible server), `ScriptedEngine` (fake for tests).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

Message = dict[str, Any]  # {"role": "system"|"user"|"assistant"|"tool", "content": str, ...}
# A final assistant message with PREFIX set to True is continued, not answered: the model writes on
# from its content (how the API forces a tool call or a JSON object). Engines drop the flag.
PREFIX = "prefix"
Prompt = Sequence[Message] | Sequence[int]


MAX_TOP_LOGPROBS = 20  # as OpenAI's API
MAX_LOGIT_BIAS = 300  # tokens a request may bias, as OpenAI's API


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (deterministic); >0 samples from softmax(logits / temperature)
    top_k: int = 0  # keep only the k most likely tokens; 0 = off
    top_p: float = 1.0  # nucleus sampling: smallest set with cumulative probability >= top_p; 1 = off
    max_tokens: int = 512  # hard limit on generated tokens
    stop: tuple[str, ...] = ()  # generation ends before the first occurrence of any of these strings
    seed: int | None = None  # sampling seed for reproducible non-greedy output
    ignore_eos: bool = False  # keep generating past end-of-sequence (benchmarks: fixed-length answers)
    # None: no log-probabilities; n >= 0: each token's log-probability under the model (its raw logits,
    # before temperature, top-k and top-p) and its n most likely alternatives (OpenAI's top_logprobs)
    logprobs: int | None = None
    # None, or n >= 0: the log-probability of every prompt token after the first, with its n most likely
    # alternatives (on the first delta; the whole prompt is computed, none of it from the prefix cache)
    prompt_logprobs: int | None = None
    # OpenAI's penalties on the answer so far: a token's logit loses presence_penalty once it is in the answer
    # and frequency_penalty for each time it is; logit_bias adds (token id, bias) to a token's logit
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    def verify(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy).")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = off).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 = off).")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be at least 1.")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty.")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name}={getattr(self, name)} must be between 0 and {MAX_TOP_LOGPROBS} (None = off).")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name}={getattr(self, name)} must be between -2 and 2 (0 = off).")
        if len(self.logit_bias) > MAX_LOGIT_BIAS or any(not -100 <= b <= 100 for _, b in self.logit_bias):
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, each biased by -100 to 100.")


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and, when asked for, the most likely tokens at its place
    (the token itself among them when it is one of them), most likely first."""
    token: str  # the token's own text (may be part of a character: a byte-level token decodes to "\ufffd")
    logprob: float | None  # None only for a prompt's first token, which nothing before it predicts
    top: tuple[tuple[str, float], ...] = ()


def check_biased_tokens(params: SamplingParams, vocab: int) -> None:
    """Refuse a logit_bias that names a token outside a vocabulary of `vocab` ids."""
    bad = next((t for t, _ in params.logit_bias if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab),
               None)
    if bad is not None:
        raise ValueError(f"logit_bias names token {bad!r}, which is not in the model's vocabulary "
                         f"(integers 0..{vocab - 1}).")


FINISH_STOP = "stop"  # end-of-sequence token or a stop string
FINISH_LENGTH = "length"  # max_tokens or the context window reached
FINISH_CANCELLED = "cancelled"  # the caller cancelled


@dataclass(frozen=True)
class TokenDelta:
    text: str  # newly decoded text since the previous delta; always whole UTF-8 characters, may be ""
    token_ids: tuple[int, ...] = ()  # tokens sampled since the previous delta
    finish_reason: str | None = None  # None while running; FINISH_* on the last delta
    num_prompt_tokens: int = 0  # tokens in the prompt (after the chat template)
    num_generated_tokens: int = 0  # tokens generated so far
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token of token_ids but an end-of-sequence token, when
    # SamplingParams.logprobs asks
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # on the first delta: the prompt's tokens after its first


class Engine(ABC):
    """An LLM backend. Implementations must be safe to call from several threads."""

    name: str = "engine"
    context_window: int = 4096  # tokens: prompt + answer

    @abstractmethod
    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        *,
        tools: Sequence[dict] | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[TokenDelta]:
        """Stream the answer to `prompt`. The last delta has `finish_reason` set."""

    @abstractmethod
    def count_tokens(self, messages: Sequence[Message], *, tools: Sequence[dict] | None = None) -> int:
        """Tokens the rendered prompt for `messages` takes (used for the context budget)."""

    def close(self) -> None:
        """Release the model / connections."""
