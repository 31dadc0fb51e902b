"""The model id `assistant` on /v1/chat/completions: the full orchestrator turn (retrieval, tools,
safety, citations, the store) over the messages a stateless OpenAI client sends.

The sent messages before the last user message become a new stored conversation's history (owned by
the caller's key), the last one is the turn. The answer comes in OpenAI's shape with two extra fields
OpenAI clients ignore: `sources` (verified citations) and `conversation_id`; when streaming, tool
steps, sources and safety verdicts come as extra `event: assistant.<type>` SSE events. The turn's
Usage event feeds the ledger; a client that goes away cancels the turn and its partial usage is kept.
The turn searches only the caller's documents (gateway.document_scope, as every HTTP turn does).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from typing import Any, Iterator

from fastapi.responses import JSONResponse

from assistant.seams import close_if_closable
from assistant.server.completions import chunk, error_body, finish_reason
from assistant.server.streaming import ClosingStreamingResponse

ASSISTANT_MODEL = "assistant"  # the model id that runs the full assistant turn


class TurnTally:
    """What the ledger and metrics need from a turn's events."""

    def __init__(self, metrics: Any) -> None:
        self.metrics = metrics
        self.prompt = self.cached = self.completion = 0
        self.reason: str | None = None
        self.filtered = False  # the output guard stopped the answer

    def finish_reason(self, reason: str | None) -> str | None:
        """The turn's finish reason in OpenAI's words: a stopped answer is `content_filter` too."""
        return "content_filter" if self.filtered and reason in ("stop", "length") else finish_reason(reason)

    def see(self, event: Any) -> None:
        from assistant.events import Done, SafetyVerdict, Usage

        if isinstance(event, Usage):
            # billed as consumed: every call's prompt (a tool step's too), as cached and completion tokens are
            self.prompt = event.total_prompt_tokens or event.prompt_tokens
            self.cached, self.completion = event.cached_tokens, event.completion_tokens
            if self.metrics is not None and event.context_window:
                self.metrics.context_use.observe(min(1.0, event.prompt_tokens / event.context_window))
        elif isinstance(event, SafetyVerdict):
            self.filtered = self.filtered or (event.stage == "output" and not event.allowed)
            if self.metrics is not None:
                self.metrics.safety.labels(event.stage, str(event.allowed).lower()).inc()
        elif isinstance(event, Done):
            self.reason = event.finish_reason

    def finish(self, ticket: Any, failed: bool = False) -> None:
        if ticket is None:
            return
        status = "error" if failed or self.reason == "error" else (
            "cancelled" if self.reason in (None, "cancelled") else "ok" if self.reason == "stop" else self.reason)
        ticket.finish(status, self.prompt, self.cached, self.completion)


def assistant_completion(assistant: Any, messages: list[dict], params: Any, stream: bool, *, ticket: Any = None,
                         gateway: Any = None, metrics: Any = None, images: list[bytes] = ()) -> Any:
    """`images`: the last message's pictures, which the turn describes and keeps with the question."""
    from assistant.events import Done, Error, Notice, Sources, TextDelta
    from assistant.seams import Attachment, UserInput

    *history, last = messages
    if last.get("role") != "user" or not (str(last.get("content") or "").strip() or images):
        if ticket is not None:
            ticket.finish("invalid")
        return JSONResponse(error_body("The model `assistant` answers a conversation that ends with a user message.",
                                       param="messages"), 400)
    conversation_id = assistant.conversations.start(history, title=str(last["content"])[:60])
    scope = None
    if gateway is not None and ticket is not None:
        gateway.claim(ticket.principal, "conversation", conversation_id)
        scope = gateway.document_scope(ticket.principal, conversation_id, assistant.documents.list)
    cancel = threading.Event()
    turn_input = UserInput(str(last["content"]), images=tuple(Attachment(f"image-{i}", data=data)
                                                            for i, data in enumerate(images, start=1)))
    events = assistant.turn(conversation_id, turn_input, params=params, cancel=cancel, scope=scope)
    cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    tally = TurnTally(metrics)
    headers = ticket.headers if ticket is not None else {}
    if stream:
        def chunks() -> Iterator[str]:
            started, previous = time.perf_counter(), None
            failed = False
            try:
                yield chunk(cid, ASSISTANT_MODEL, {"role": "assistant", "content": ""}, None)
                for event in events:
                    tally.see(event)
                    if isinstance(event, TextDelta):
                        now = time.perf_counter()
                        if metrics is not None:
                            (metrics.ttft.labels(ASSISTANT_MODEL).observe(now - started) if previous is None
                             else metrics.itl.labels(ASSISTANT_MODEL).observe(now - previous))
                        previous = now
                        yield chunk(cid, ASSISTANT_MODEL, {"content": event.text}, None)
                    elif isinstance(event, Error):
                        yield f"data: {json.dumps(error_body(event.message, 'server_error'))}\n\n"
                    elif isinstance(event, Notice) and event.replaces_answer:  # a client that reads only
                        # the content deltas has the withdrawn answer: it is told, and given what stands now
                        text = f"\n\n{event.message}\n{event.replaces_answer}"
                        yield chunk(cid, ASSISTANT_MODEL, {"content": text}, None)
                    elif not isinstance(event, Done):  # sources, tool steps, ...: extra events clients ignore
                        yield f"event: assistant.{event.type}\ndata: {json.dumps(event.to_dict(), default=str)}\n\n"
                    else:
                        yield chunk(cid, ASSISTANT_MODEL, {}, tally.finish_reason(event.finish_reason))
                yield "data: [DONE]\n\n"
            except Exception:
                failed = True
                raise
            finally:
                cancel.set()  # a client that went away: the turn stops, its partial answer is kept
                close_if_closable(events)
                tally.finish(ticket, failed)
        return ClosingStreamingResponse(chunks(), media_type="text/event-stream", headers=headers)
    sources: list[dict] = []
    done = None
    try:
        for event in events:
            tally.see(event)
            if isinstance(event, Sources):
                sources = [dataclasses.asdict(s) for s in event.sources]
            elif isinstance(event, Done):
                done = event
    finally:
        tally.finish(ticket, done is None)
    if done is None or done.finish_reason == "error":
        return JSONResponse(error_body("The assistant turn failed; see the server log.", "server_error"), 500)
    usage = {"prompt_tokens": tally.prompt, "completion_tokens": tally.completion,
             "total_tokens": tally.prompt + tally.completion, "prompt_tokens_details": {"cached_tokens": tally.cached}}
    return JSONResponse({"id": cid, "object": "chat.completion", "created": int(time.time()), "model": ASSISTANT_MODEL,
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": done.text},
                                      "finish_reason": tally.finish_reason(done.finish_reason)}],
                         "usage": usage, "sources": sources, "conversation_id": done.conversation_id}, headers=headers)
