"""The assistant over HTTP: a turn streams its TurnEvents as server-sent events.

    POST /api/turns                      {"text": ..., "conversation_id"?: ..., "max_tokens"?: ...}
                                         -> text/event-stream, one `event: <type>` + `data: <json>` per
                                            TurnEvent (`event.to_dict()`), ending with `done`
    POST /api/turns/{message_id}/cancel  stop a running turn (its id is TurnStarted.message_id)
    GET  /api/conversations/{id}         the stored active branch (messages with their meta)

The turn runs in Starlette's thread pool (the generator is synchronous), never on the event loop. A
client that goes away closes the generator: the engine request is cancelled and the answer so far is
kept, marked partial. Errors in the request are 400s before anything runs; failures inside the turn
arrive as `error` events followed by `done`, like every other front end sees them.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Iterator

from fastapi import APIRouter, Depends, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from assistant.errors import AssistantError, StoreError
from assistant.events import TurnEvent, TurnStarted
from assistant.server.auth import key_checker


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


def create_turn_routes(assistant: Any, api_keys: tuple[str, ...] = ()) -> APIRouter:
    router = APIRouter(prefix="/api", dependencies=[Depends(key_checker(api_keys))])
    running = RunningTurns()

    @router.post("/turns")
    def start_turn(request: TurnRequest) -> StreamingResponse:
        if request.conversation_id:
            try:
                assistant.conversations.get(request.conversation_id)
            except StoreError as e:
                raise HTTPException(404, str(e)) from e
        params = assistant.default_params(**({"max_tokens": request.max_tokens} if request.max_tokens else {}))
        cancel = threading.Event()
        events = assistant.turn(request.conversation_id, request.text, params=params, cancel=cancel)
        return StreamingResponse(_stream(events, running, cancel), media_type="text/event-stream")

    @router.post("/turns/{message_id}/cancel")
    def cancel_turn(message_id: str) -> dict[str, Any]:
        if not running.cancel(message_id):
            raise HTTPException(404, f"No running turn {message_id!r} (it may have finished).")
        return {"cancelled": message_id}

    @router.get("/conversations/{conversation_id}")
    def get_conversation(conversation_id: str) -> dict[str, Any]:
        try:
            return json.loads(assistant.conversations.export(conversation_id))
        except StoreError as e:
            raise HTTPException(404, str(e)) from e

    return router


def _stream(events: Iterator[TurnEvent], running: RunningTurns, cancel: threading.Event) -> Iterator[str]:
    turn_id = ""
    try:
        for event in events:
            if isinstance(event, TurnStarted):
                turn_id = event.message_id
                running.add(turn_id, cancel)
            yield sse(event)
    except AssistantError as e:  # raised before the turn started (e.g. speech input not available)
        yield f"event: error\ndata: {json.dumps({'type': 'error', 'message': str(e)})}\n\n"
    finally:
        if turn_id:
            running.remove(turn_id)
        close = getattr(events, "close", None)
        if close is not None:
            close()
