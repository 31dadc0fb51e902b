"""The orchestrator: one user turn from input to stored answer, as a stream of TurnEvents.

Design note — the turn loop:
  1. the user message is committed to the store before anything else (never lost);
  2. the prompt is built from the system prompt and the conversation's active branch, fitted to the
     context window (assistant/context.py);
  3. an assistant message is inserted as `partial` and the engine's deltas are streamed out as
     TextDelta events; the partial text is flushed to the store every FLUSH_INTERVAL_S, so a crash
     mid-answer loses at most that much of the answer;
  4. the message is finalised (`complete`, with usage in its meta), then Usage and Done are emitted.
  Failures inside the engine become an Error event plus a Done with finish_reason "error"; the
  stored message is marked `error` with whatever text was produced. Front ends only render events.
"""

from __future__ import annotations

import threading
import time
from typing import Iterator

from assistant.config import AssistantConfig
from assistant.context import fit_history
from assistant.engine.base import Engine, SamplingParams
from assistant.errors import AssistantError
from assistant.events import Done, Error, TextDelta, TurnEvent, Usage
from assistant.store import Store

FLUSH_INTERVAL_S = 1.0  # how often a streaming answer is written to the store


class Orchestrator:
    def __init__(self, engine: Engine, store: Store, config: AssistantConfig) -> None:
        self.engine = engine
        self.store = store
        self.config = config

    @classmethod
    def from_config(cls, config: AssistantConfig, engine: Engine | None = None) -> "Orchestrator":
        from assistant.engine import create_engine

        store = Store(config.store_url)
        return cls(engine or create_engine(config), store, config)

    def default_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.config.engine.max_new_tokens)

    def run_turn(
        self,
        conversation_id: str | None,
        user_input: str,
        *,
        params: SamplingParams | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[TurnEvent]:
        params = params or self.default_params()
        text = user_input.strip()
        conversation = self.store.get_or_create(conversation_id, title=text[:60])
        cid = conversation.id
        history = [m.as_chat() for m in self.store.history(cid) if m.status != "error" and m.content]
        user = self.store.add_message(cid, "user", text)
        answer = self.store.add_message(cid, "assistant", "", parent_id=user.id, status="partial")
        parts: list[str] = []
        finish, prompt_tokens, completion_tokens, dropped = "error", 0, 0, 0
        try:
            plan = fit_history(
                {"role": "system", "content": self.config.system_prompt},
                history,
                user.as_chat(),
                count_tokens=self.engine.count_tokens,
                context_window=self.engine.context_window,
                reserve=params.max_tokens,
            )
            prompt_tokens, dropped = plan.prompt_tokens, plan.num_dropped
            last_flush = time.monotonic()
            for delta in self.engine.generate(plan.messages, params, cancel=cancel):
                completion_tokens = delta.num_generated_tokens
                if delta.text:
                    parts.append(delta.text)
                    yield TextDelta(delta.text)
                if delta.finish_reason:
                    finish = delta.finish_reason
                if time.monotonic() - last_flush >= FLUSH_INTERVAL_S:
                    self.store.update_message(answer.id, content="".join(parts))
                    last_flush = time.monotonic()
        except AssistantError as e:
            self.store.update_message(answer.id, content="".join(parts), status="error", meta={"error": str(e)})
            yield Error(str(e))
            yield Done(cid, answer.id, "".join(parts), "error")
            return
        except BaseException:
            # Client gone or a bug: keep what was produced, marked partial, and let it propagate.
            self.store.update_message(answer.id, content="".join(parts), status="partial")
            raise
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "dropped_messages": dropped}
        final = "".join(parts)
        self.store.update_message(answer.id, content=final, status="complete",
                                  meta={"usage": usage, "finish_reason": finish, "model": self.engine.name})
        yield Usage(prompt_tokens, completion_tokens, self.engine.context_window, dropped)
        yield Done(cid, answer.id, final, finish)
