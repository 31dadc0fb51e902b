"""Fitting a conversation into the model's context window.

Design note — the context budget:
  budget = context_window - reserve, where reserve is the answer's max_tokens.
  The prompt is laid out stable-part-first: system prompt, then history oldest to newest, then the
  new user message. Stable parts first means consecutive turns of one conversation share a long
  token prefix, which an engine with a prefix cache reuses instead of recomputing.
  When the prompt is over budget, whole *turns* are dropped oldest first (a turn is a user message
  and everything after it up to the next user message), so the model never sees an answer without
  its question. The system prompt and the newest user message are never dropped; if those alone do
  not fit, the turn fails with a message that says how long the input may be.
  The number of dropped messages is reported in the turn's Usage event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from assistant.engine.base import Message
from assistant.errors import EngineError


@dataclass(frozen=True)
class ContextPlan:
    messages: list[Message]  # what goes to the engine
    prompt_tokens: int  # tokens of the rendered prompt
    num_dropped: int  # history messages left out


def split_turns(history: Sequence[Message]) -> list[list[Message]]:
    turns: list[list[Message]] = []
    for message in history:
        if message["role"] == "user" or not turns:
            turns.append([])
        turns[-1].append(message)
    return turns


def fit_history(
    system: Message,
    history: Sequence[Message],
    user: Message,
    *,
    count_tokens: Callable[[Sequence[Message]], int],
    context_window: int,
    reserve: int,
) -> ContextPlan:
    budget = context_window - reserve
    turns = split_turns(history)
    dropped = 0
    while True:
        messages = [system, *(m for turn in turns for m in turn), user]
        tokens = count_tokens(messages)
        if tokens <= budget:
            return ContextPlan(messages, tokens, dropped)
        if not turns:
            raise EngineError(
                f"The message is too long for the model: the prompt needs {tokens} tokens but only {budget} fit "
                f"(context window {context_window}, {reserve} kept for the answer). Shorten it or split it up."
            )
        dropped += len(turns.pop(0))
