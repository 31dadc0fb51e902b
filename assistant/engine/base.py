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


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (deterministic); >0 samples from softmax(logits / temperature)
    top_k: int = 0  # keep only the k most likely tokens; 0 = off
    top_p: float = 1.0  # nucleus sampling: smallest set with cumulative probability >= top_p; 1 = off
    max_tokens: int = 512  # hard limit on generated tokens
    stop: tuple[str, ...] = ()  # generation ends before the first occurrence of any of these strings
    seed: int | None = None  # sampling seed for reproducible non-greedy output
    ignore_eos: bool = False  # keep generating past end-of-sequence (benchmarks: fixed-length answers)

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
