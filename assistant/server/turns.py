"""The assistant over HTTP: a turn streams its TurnEvents as server-sent events.

    POST /api/turns                      {"text": ..., "conversation_id"?: ..., "max_tokens"?: ...,
                                          "audio"?: {"name", "data": base64}, "images"?: [{"name", "data"}],
                                          "speak"?: bool}
                                         -> text/event-stream, one `event: <type>` + `data: <json>` per
                                            TurnEvent (`event.to_dict()`), ending with `done`; `audio`
                                            events carry the speech as base64 s16le (`pcm16_b64`)
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

import base64
import binascii
import json
import threading
from typing import Any, Iterator

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, field_validator, model_validator
from starlette.concurrency import run_in_threadpool

from assistant.errors import AssistantError, StoreError
from assistant.events import AudioChunk, TurnEvent, TurnStarted
from assistant.seams import Attachment, UserInput
from assistant.server.auth import key_checker
from assistant.server.streaming import ClosingStreamingResponse


class FilePart(BaseModel):
    name: str = Field(min_length=1, max_length=255, description="file name, e.g. question.webm")
    data: str = Field(description="the file's bytes, base64")

    @field_validator("data")
    @classmethod
    def _base64(cls, value: str) -> str:
        try:
            if not base64.b64decode(value, validate=True):
                raise ValueError("the file is empty")
        except binascii.Error as e:
            raise ValueError(f"data is not valid base64 ({e})") from None
        return value

    def attachment(self) -> Attachment:
        return Attachment(self.name, data=base64.b64decode(self.data))


class TurnRequest(BaseModel):
    text: str = Field(default="", max_length=100_000, description="the user's message ('' when audio carries it)")
    conversation_id: str | None = Field(default=None, description="continue this conversation (default: a new one)")
    max_tokens: int | None = Field(default=None, ge=1, le=32768, description="answer length limit")
    audio: FilePart | None = Field(default=None, description="the question spoken: its transcript becomes the message")
    images: list[FilePart] = Field(default_factory=list, max_length=8, description="pictures the question is about")
    speak: bool = Field(default=False, description="also answer in speech (`audio` events)")

    @model_validator(mode="after")
    def _something_to_answer(self) -> "TurnRequest":
        if not self.text.strip() and self.audio is None and not self.images:
            raise ValueError("send `text`, or `audio` with the spoken question, or `images`")
        return self

    def user_input(self) -> UserInput:
        return UserInput(self.text, self.audio.attachment() if self.audio else None,
                         tuple(i.attachment() for i in self.images), speak=self.speak)


def sse(event: TurnEvent) -> str:
    data = event.to_dict()
    if isinstance(event, AudioChunk):
        data["pcm16_b64"] = base64.b64encode(event.pcm16).decode()
    return f"event: {event.type}\ndata: {json.dumps(data, default=str)}\n\n"


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
            title = body.text[:60] or ("spoken question" if body.audio else "pictures")
            conversation_id = await run_in_threadpool(assistant.conversations.start, (), title=title)
            await run_in_threadpool(gateway.claim, principal, "conversation", conversation_id)
        cancel = threading.Event()
        events = assistant.turn(conversation_id, body.user_input(), params=params, cancel=cancel)
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
