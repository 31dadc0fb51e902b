"""Fitting a turn's prompt into the model's context window, and accounting for its tokens.

Design note — the context budget:
  budget = context_window - reserve, where reserve is the answer's max_tokens (never given away).
  The prompt is laid out stable-part-first, so consecutive turns (and consecutive tool steps of one
  turn) share a long token prefix that an engine with a prefix cache reuses:
      system prompt + tool specs          (the chat template renders the specs into the system turn)
      memory                              (summary of turns that no longer fit; changes rarely)
      history                             (earlier turns, oldest first)
      retrieved context                   (this turn's passages "[n] doc p. N: text", best first)
      user message
      tool steps of this turn             (assistant tool calls and tool results, in order)
  When it is over budget, parts give way in this order, each step re-measured with the real
  tokenizer (`count_tokens` renders the chat template, tool specs included):
    1. oldest whole *turns* of history (a user message and everything up to the next one; the model
       never sees an answer without its question). With a `summarize` callback (the orchestrator
       passes one that asks the model, see Orchestrator.summarize) the dropped turns are folded into
       the memory, at most memory_tokens(budget) long (MAX_MEMORY_TOKENS, or a quarter of a small
       budget); without one they are simply dropped;
    2. retrieved passages, lowest ranked first (the model can still fetch them with a tool);
    3. outputs of this turn's earlier tool steps, oldest first, cut to a marker line;
  The system prompt, the tool specs and the new user message are never cut: if they alone do not
  fit, the turn fails with a message that says how long the input may be.
  The plan reports the tokens of each part (`breakdown`) and what gave way; the orchestrator emits
  them as the turn's Usage event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from assistant.engine.base import Message
from assistant.errors import EngineError

MAX_MEMORY_TOKENS = 160  # answer budget of one summary of dropped turns
CUT_TOOL_OUTPUT = "(output removed to fit the context window)"

CountTokens = Callable[..., int]  # count_tokens(messages, tools=...) -> int
Summarize = Callable[[str, Sequence[Message], int], str]  # (previous memory, dropped messages, max tokens) -> memory


@dataclass(frozen=True)
class PromptParts:
    system: Message  # {"role": "system", "content": system prompt}
    user: Message  # the new user message
    history: Sequence[Message] = ()  # earlier turns on the active branch, oldest first
    memory: str = ""  # summary of older turns already left out ("" = none)
    context: Sequence[str] = ()  # rendered retrieved passages, best first
    steps: Sequence[Message] = ()  # this turn's tool calls and results
    tools: Sequence[dict] = ()  # tool specs offered this step


@dataclass(frozen=True)
class ContextPlan:
    messages: list[Message]  # what goes to the engine
    prompt_tokens: int  # tokens of the rendered prompt (tool specs included)
    num_dropped: int  # history messages left out (summarised or not)
    memory: str = ""  # the memory the prompt carries (new when `num_summarised` > 0)
    num_summarised: int = 0  # history messages newly folded into `memory` by this plan
    num_context_dropped: int = 0  # retrieved passages left out
    num_steps_cut: int = 0  # tool outputs of this turn cut to a marker
    breakdown: dict[str, int] = field(default_factory=dict)  # tokens per part, see layout()


def split_turns(history: Sequence[Message]) -> list[list[Message]]:
    turns: list[list[Message]] = []
    for message in history:
        if message["role"] == "user" or not turns:
            turns.append([])
        turns[-1].append(message)
    return turns


def user_questions(chat: Sequence[Message]) -> list[str]:
    """The user's text questions in `chat`, oldest first (what a follow-up leans on)."""
    return [m["content"] for m in chat if m.get("role") == "user" and isinstance(m.get("content"), str)]


def memory_message(memory: str) -> Message:
    return {"role": "system", "content": f"Summary of the earlier conversation:\n{memory}"}


def passages_block(passages: Sequence[str]) -> str:
    """The retrieved passages as the model reads them, under one heading."""
    return "Passages from the user's documents:\n" + "\n".join(passages)


def context_message(passages: Sequence[str]) -> Message:
    # No example answer here: the 0.5B model copied "The device weighs 2 kg [2]." into 5 of 30 answers
    # when it was unsure. Asking for full sentences matters as much: told only to "write the number of
    # its passage after the fact", it answered with the marker alone ("[1]") on 21 of 60 dev questions.
    return {"role": "system", "content": (
        passages_block(passages) + "\n\nAnswer the user's question in one or "
        "two full sentences, using only these passages, with names and values written exactly as in the passages. "
        "End each sentence with the number of the passage it comes from, in square brackets. If the passages do "
        "not contain the answer, say that the documents do not say.")}


def layout(parts: PromptParts) -> list[Message]:
    """The messages in prompt order (see the design note)."""
    messages: list[Message] = [parts.system]
    if parts.memory:
        messages.append(memory_message(parts.memory))
    messages.extend(parts.history)
    if parts.context:
        messages.append(context_message(parts.context))
    messages.append(parts.user)
    messages.extend(parts.steps)
    return messages


def fit_prompt(
    parts: PromptParts,
    *,
    count_tokens: CountTokens,
    context_window: int,
    reserve: int,
    summarize: Summarize | None = None,
) -> ContextPlan:
    """Lay out `parts` within context_window - reserve tokens, giving way as the design note says."""
    budget = context_window - reserve
    tools = list(parts.tools) or None
    turns = split_turns(parts.history)
    context, steps = list(parts.context), [dict(m) for m in parts.steps]
    memory, summarised, context_dropped, steps_cut = parts.memory, 0, 0, 0
    dropped: list[Message] = []

    def measure() -> tuple[list[Message], int]:
        current = PromptParts(parts.system, parts.user, [m for t in turns for m in t], memory, context, steps, parts.tools)
        messages = layout(current)
        return messages, count_tokens(messages, tools=tools)

    messages, tokens = measure()
    if tokens > budget and turns:
        # 1. history, oldest whole turns first; leave room for the new memory when summarising
        current_memory = tokens_of(memory_message(memory), count_tokens) if memory else 0
        room = max(0, memory_tokens(budget) + 8 - current_memory) if summarize else 0
        while tokens > budget - room and turns:
            dropped.extend(turns.pop(0))
            messages, tokens = measure()
        if summarize and dropped:
            memory = summarize(memory, dropped, memory_tokens(budget))
            summarised = len(dropped)
            messages, tokens = measure()
    while tokens > budget:
        if turns:  # the new memory came out longer than planned
            dropped.extend(turns.pop(0))
        elif context:  # 2. retrieved passages, lowest ranked first
            context.pop()
            context_dropped += 1
        elif (i := _first_uncut_output(steps)) is not None:  # 3. earlier tool outputs of this turn
            steps[i]["content"] = CUT_TOOL_OUTPUT
            steps_cut += 1
        else:
            raise EngineError(
                f"The message is too long for the model: the prompt needs {tokens} tokens but only {budget} fit "
                f"(context window {context_window}, {reserve} kept for the answer). Shorten it or split it up."
            )
        messages, tokens = measure()
    breakdown = _breakdown(parts, memory, turns, context, steps, tokens, count_tokens, budget, reserve)
    return ContextPlan(messages, tokens, len(dropped), memory, summarised, context_dropped, steps_cut, breakdown)


def memory_tokens(budget: int) -> int:
    """The longest summary worth keeping within `budget` prompt tokens."""
    return max(16, min(MAX_MEMORY_TOKENS, budget // 4))


def tokens_of(message: Message, count_tokens: CountTokens) -> int:
    return count_tokens([message])


def _first_uncut_output(steps: list[Message]) -> int | None:
    for i, m in enumerate(steps[:-1] if len(steps) > 1 else steps):  # the newest result is cut last
        if m["role"] == "tool" and m["content"] != CUT_TOOL_OUTPUT:
            return i
    return None


def _breakdown(parts: PromptParts, memory: str, turns: list[list[Message]], context: list[str],
               steps: list[Message], total: int, count_tokens: CountTokens, budget: int, reserve: int) -> dict[str, int]:
    """Tokens per part, each measured after the system prompt (chat templates add a default system
    prompt to a message list without one, which would inflate a part counted alone)."""
    system = count_tokens([parts.system])

    def after_system(messages: list[Message]) -> int:
        return count_tokens([parts.system, *messages]) - system if messages else 0

    out = {
        "system": system,
        "tools": max(0, count_tokens([parts.system], tools=list(parts.tools)) - system) if parts.tools else 0,
        "memory": after_system([memory_message(memory)]) if memory else 0,
        "history": after_system([m for t in turns for m in t]),
        "retrieved": after_system([context_message(context)]) if context else 0,
        "user": after_system([parts.user]),
        "tool_steps": after_system(steps),
    }
    out["total"] = total
    out["reserved_answer"] = reserve
    out["free"] = max(0, budget - total)
    return out

