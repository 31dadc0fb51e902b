"""ScriptedEngine: a fake LLM for unit tests that replays canned answers as token deltas.

Each call to `generate` takes the next script entry (a string, or a list of chunks to stream as
separate deltas) and records the prompt it was given, so tests can assert on what the orchestrator
sent. It honours max_tokens (counted in chunks), stop strings and cancellation like a real engine, and scores
each chunk as one token when logprobs are asked for (fixed numbers).
"""

from __future__ import annotations

import math
import threading
from typing import Iterator, Sequence

from assistant.engine.base import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    Engine,
    Message,
    Prompt,
    SamplingParams,
    TokenDelta,
    TokenLogprob,
)
from assistant.engine.detokenize import StopMatcher
from assistant.errors import EngineError


class ScriptedEngine(Engine):
    name = "scripted"

    def __init__(self, script: Sequence[str | Sequence[str]] = (), *, context_window: int = 4096) -> None:
        self.script = list(script)
        self.context_window = context_window
        self.prompts: list[Prompt] = []  # every prompt received, in order
        self.params: list[SamplingParams] = []  # and its sampling settings
        self.tools_seen: list[Sequence[dict] | None] = []

    def add(self, *answers: str | Sequence[str]) -> None:
        self.script.extend(answers)

    def count_tokens(self, messages: Sequence[Message], *, tools: Sequence[dict] | None = None) -> int:
        """About one token per 4 characters, plus 4 per message for the template."""
        return sum(4 + len(str(m.get("content", ""))) // 4 for m in messages)

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        *,
        tools: Sequence[dict] | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[TokenDelta]:
        params.verify()
        self.prompts.append(list(prompt))
        self.params.append(params)
        self.tools_seen.append(tools)
        if not self.script:
            raise EngineError("ScriptedEngine has no scripted answer left for this prompt.")
        entry = self.script.pop(0)
        chunks = [entry[i:i + 4] for i in range(0, len(entry), 4)] if isinstance(entry, str) else list(entry)
        num_prompt = self.count_tokens(prompt) if prompt and isinstance(prompt[0], dict) else len(prompt)
        stops = StopMatcher(params.stop)
        for step, chunk in enumerate(chunks, start=1):
            if cancel is not None and cancel.is_set():
                yield TokenDelta("", (), FINISH_CANCELLED, num_prompt, step - 1)
                return
            text = stops.push(chunk)
            scored = () if params.logprobs is None else (_scored(chunk, params.logprobs),)
            if stops.stopped:
                yield TokenDelta(text, (step,), FINISH_STOP, num_prompt, step, logprobs=scored)
                return
            if step == params.max_tokens:
                yield TokenDelta(text + stops.flush(), (step,), FINISH_LENGTH, num_prompt, step, logprobs=scored)
                return
            yield TokenDelta(text, (step,), None, num_prompt, step, logprobs=scored)
        yield TokenDelta(stops.flush(), (), FINISH_STOP, num_prompt, len(chunks))


def _scored(chunk: str, top: int) -> TokenLogprob:
    """A scripted chunk as one token of probability 1/2, the runner-up "?" at 1/4 (fixed fake numbers)."""
    return TokenLogprob(chunk, math.log(0.5), ((chunk, math.log(0.5)), ("?", math.log(0.25)))[:top])
