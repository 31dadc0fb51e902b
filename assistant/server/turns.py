"""The assistant over HTTP: a turn streams its TurnEvents as server-sent events.

    POST /api/turns                      {"text": ..., "conversation_id"?: ..., "max_tokens"?: ...}
                                         -> text/event-stream, one `event: <type>` + `data: <json>` per
                                            TurnEvent (`event.to_dict()`), ending with `done`
    POST /api/turns/{message_id}/cancel  stop a running turn (its id is TurnStarted.message_id)
    GET  /api/conversations/{id}         the stored active branch (messages with their meta)

The turn runs in Starlette's thread pool (the generator is synchronous), never on the event loop. A
client that goes away closes the generator: the engine request is cancelled and the answer so far is
kept, marked partial. Errors in the request are 4xx before anything runs; failures inside the turn
arrive as `error` events followed by `done`, like every other front end sees them.

The gateway applies here as on /v1 (gateway.py): a key (401), its rate limits (429), a running slot
(503), the usage ledger; a conversation belongs to the key that created it, and any other key gets 404.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Iterator

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from assistant.errors import AssistantError, StoreError
from assistant.events import TurnEvent, TurnStarted
from assistant.server.auth import key_checker
from assistant.server.streaming import ClosingStreamingResponse


class TurnRequest(BaseModel):
    text: str = Field(min_length=1, max_length=100_000, description="the user's message")
    conversation_id: str | None = Field(default=None, description="continue this conversation (default: a new one)")
    max_tokens: int | None = Field(default=None, ge=1, le=32768, description="answer length limit")


def sse(event: TurnEvent) -> str:
    return f"event: {event.type}\ndata: {json.dumps(event.to_dict(), default=str)}\n\n"


class RunningTurns:
    """Cancel switches of the turns in flight, by the id their TurnStarted carried."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancels: dict[str, threading.Event] = {}

    def add(self, message_id: str, cancel: threading.Event) -> None:
        with self._lock:
            self._cancels[message_id] = cancel

    def remove(self, message_id: str) -> None:
        with self._lock:
            self._cancels.pop(message_id, None)

    def cancel(self, message_id: str) -> bool:
        with self._lock:
            cancel = self._cancels.get(message_id)
        if cancel is not None:
            cancel.set()
        return cancel is not None


def create_turn_routes(assistant: Any, api_keys: tuple[str, ...] = (), gateway: Any = None) -> APIRouter:
    from assistant.server.gateway import Gateway, Refusal

    gateway = gateway or Gateway.from_keys(api_keys)
    router = APIRouter(prefix="/api", dependencies=[Depends(key_checker(gateway.auth))])
    running = RunningTurns()

    def visible(request: Request, conversation_id: str) -> None:
        """404 for a conversation that does not exist or that another key owns (never 403)."""
        try:
            assistant.conversations.get(conversation_id)
        except StoreError as e:
            raise HTTPException(404, str(e)) from e
        if not gateway.may_see(request.state.principal, "conversation", conversation_id):
            raise HTTPException(404, f"No conversation with id {conversation_id!r}.")

    @router.post("/turns")
    async def start_turn(body: TurnRequest, request: Request) -> Any:
        principal = request.state.principal
        if body.conversation_id:
            await run_in_threadpool(visible, request, body.conversation_id)
        max_tokens = body.max_tokens or assistant.default_params().max_tokens
        ticket = await gateway.admit(request, principal, "assistant", len(body.text) // 4 + max_tokens)
        if isinstance(ticket, Refusal):
            return JSONResponse({"detail": ticket.message}, ticket.status, headers=ticket.headers)
        params = assistant.default_params(**({"max_tokens": body.max_tokens} if body.max_tokens else {}))
        conversation_id = body.conversation_id
        if not conversation_id:  # created here, so that it belongs to the caller's key from the start
            conversation_id = await run_in_threadpool(assistant.conversations.start, (), title=body.text[:60])
            await run_in_threadpool(gateway.claim, principal, "conversation", conversation_id)
        cancel = threading.Event()
        events = assistant.turn(conversation_id, body.text, params=params, cancel=cancel)
        return ClosingStreamingResponse(_stream(events, running, cancel, ticket, gateway.metrics),
                                 media_type="text/event-stream", headers=ticket.headers)

    @router.post("/turns/{message_id}/cancel")
    def cancel_turn(message_id: str, request: Request) -> dict[str, Any]:
        try:
            conversation_id = assistant.conversations.message(message_id).conversation_id
        except StoreError:
            conversation_id = None
        if conversation_id is None or not gateway.may_see(request.state.principal, "conversation", conversation_id) \
                or not running.cancel(message_id):
            raise HTTPException(404, f"No running turn {message_id!r} (it may have finished).")
        return {"cancelled": message_id}

    @router.get("/conversations/{conversation_id}")
    def get_conversation(conversation_id: str, request: Request) -> dict[str, Any]:
        visible(request, conversation_id)
        try:
            return json.loads(assistant.conversations.export(conversation_id))
        except StoreError as e:
            raise HTTPException(404, str(e)) from e

    return router


def _stream(events: Iterator[TurnEvent], running: RunningTurns, cancel: threading.Event, ticket: Any = None,
            metrics: Any = None) -> Iterator[str]:
    from assistant.server.assistant_model import TurnTally

    turn_id = ""
    tally = TurnTally(metrics)
    failed = False
    try:
        for event in events:
            tally.see(event)
            if isinstance(event, TurnStarted):
                turn_id = event.message_id
                running.add(turn_id, cancel)
            yield sse(event)
    except AssistantError as e:  # raised before the turn started (e.g. speech input not available)
        failed = True
        yield f"event: error\ndata: {json.dumps({'type': 'error', 'message': str(e)})}\n\n"
    finally:
        if turn_id:
            running.remove(turn_id)
        close = getattr(events, "close", None)
        if close is not None:
            close()
        tally.finish(ticket, failed)
