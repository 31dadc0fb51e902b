"""The assistant over HTTP: a turn streams its TurnEvents as server-sent events.

    POST /api/turns                      {"text": ..., "conversation_id"?: ..., "max_tokens"?: ...,
                                          "audio"?: {"name", "data": base64}, "images"?: [{"name", "data"}],
                                          "speak"?: bool}
                                         -> text/event-stream, one `event: <type>` + `data: <json>` per
                                            TurnEvent (`event.to_dict()`), ending with `done`; `audio`
                                            events carry the speech as base64 s16le (`pcm16_b64`)
    POST /api/turns/{message_id}/cancel  stop a running turn (its id is TurnStarted.message_id), on
                                         whichever replica runs it (redis_turns.py)

The conversations themselves (list, get, rename, delete, a turn, regenerate, edit) are rest.py's routes;
they run their turns through the same `TurnRunner`, so a turn started there is cancelled here too.

The turn runs in Starlette's thread pool (the generator is synchronous), never on the event loop. A
client that goes away closes the generator: the engine request is cancelled and the answer so far is
kept, marked partial. Errors in the request are 4xx before anything runs; failures inside the turn
arrive as `error` events followed by `done`, like every other front end sees them.

The gateway applies here as on /v1 (gateway.py): a key (401), its rate limits (429), a running slot
(503), the usage ledger; a conversation belongs to the key that created it, and any other key gets 404.
Every turn run here searches only the caller's documents (`TurnRunner.scope`: gateway.document_scope,
the rule of GET /api/documents, plus the files of the turn's own conversation).
"""

from __future__ import annotations

import base64
import threading
from typing import Any, Callable, Iterator

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from assistant.engine.base import SamplingParams
from assistant.errors import AssistantError, StoreError
from assistant.events import AudioChunk, TurnEvent, TurnStarted
from assistant.seams import close_if_closable
from assistant.server.auth import Principal, key_checker
from assistant.server.gateway import Gateway, Refusal
from assistant.server.schemas import TurnRequest
from assistant.server.streaming import ClosingStreamingResponse, server_sent


def sse(event: TurnEvent) -> str:
    data = event.to_dict()
    if isinstance(event, AudioChunk):
        data["pcm16_b64"] = base64.b64encode(event.pcm16).decode()
    return server_sent(event.type, data)


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

    def close(self) -> None:
        """Nothing to release here (the Redis-shared registry stops its listener)."""


def running_turns(redis_url: str) -> RunningTurns:
    """This process's turns; shared with the other replicas through Redis when `server.redis_url` is set
    (redis_turns.py), so a cancel reaching any replica stops the turn."""
    if not redis_url:
        return RunningTurns()
    from assistant.server.redis_turns import RedisRunningTurns

    return RedisRunningTurns.from_url(redis_url)


class TurnRunner:
    """What every route that runs a turn shares (here and in rest.py): the ownership check, admission,
    the turn's events as SSE, and the cancel switches of the turns in flight."""

    def __init__(self, assistant: Any, gateway: Gateway) -> None:
        self.assistant, self.gateway = assistant, gateway
        self.running = running_turns(getattr(assistant.config.server, "redis_url", ""))

    def scope(self, principal: Principal, conversation_id: str | None) -> frozenset[str] | None:
        """The doc ids a turn of `conversation_id` by `principal` may search and read (blocking: the store
        and the index are asked, so call it in the threadpool, as `start` callbacks are)."""
        return self.gateway.document_scope(principal, conversation_id, self.assistant.documents.list)

    def check_visible(self, principal: Principal, conversation_id: str) -> None:
        """404 for a conversation that does not exist or that another key owns (never 403)."""
        try:
            self.assistant.conversations.get(conversation_id)
        except StoreError as e:
            raise HTTPException(404, str(e)) from e
        if not self.gateway.may_see(principal, "conversation", conversation_id):
            raise HTTPException(404, f"No conversation with id {conversation_id!r}.")

    async def run(self, request: Request, text: str, max_tokens: int | None,
                  start: Callable[[SamplingParams, threading.Event], Iterator[TurnEvent]]) -> Any:
        """Admit the caller (rate limits, a running slot), then stream the turn `start(params, cancel)`
        begins (called in the threadpool) as SSE; a Refusal when the gateway says no."""
        params = self.assistant.default_params(**({"max_tokens": max_tokens} if max_tokens else {}))
        ticket = await self.gateway.admit(request, request.state.principal, "assistant",
                                          len(text) // 4 + params.max_tokens)
        if isinstance(ticket, Refusal):
            return ticket
        cancel = threading.Event()
        try:
            events = await run_in_threadpool(start, params, cancel)
        except BaseException:
            await run_in_threadpool(ticket.finish, "error")
            raise
        return ClosingStreamingResponse(_stream(events, self.running, cancel, ticket, self.gateway.metrics),
                                        media_type="text/event-stream", headers=ticket.headers)


def create_turn_routes(assistant: Any, api_keys: tuple[str, ...] = (), gateway: Any = None,
                       runner: TurnRunner | None = None) -> APIRouter:
    runner = runner or TurnRunner(assistant, gateway or Gateway.from_keys(api_keys))
    gateway = runner.gateway
    router = APIRouter(prefix="/api", dependencies=[Depends(key_checker(gateway.auth))])

    @router.post("/turns")
    async def start_turn(body: TurnRequest, request: Request) -> Any:
        principal = request.state.principal
        if body.conversation_id:
            await run_in_threadpool(runner.check_visible, principal, body.conversation_id)

        def start(params: SamplingParams, cancel: threading.Event) -> Iterator[TurnEvent]:
            conversation_id = body.conversation_id
            if not conversation_id:  # created here, so that it belongs to the caller's key from the start
                title = body.text[:60] or ("spoken question" if body.audio else "pictures")
                conversation_id = assistant.conversations.start((), title=title)
                gateway.claim(principal, "conversation", conversation_id)
            return assistant.turn(conversation_id, body.user_input(), params=params, cancel=cancel,
                                  scope=runner.scope(principal, conversation_id))

        response = await runner.run(request, body.text, body.max_tokens, start)
        if isinstance(response, Refusal):
            return JSONResponse({"detail": response.message}, response.status, headers=response.headers)
        return response

    @router.post("/turns/{message_id}/cancel")
    def cancel_turn(message_id: str, request: Request) -> dict[str, Any]:
        try:
            conversation_id = assistant.conversations.message(message_id).conversation_id
        except StoreError:
            conversation_id = None
        if conversation_id is None or not gateway.may_see(request.state.principal, "conversation", conversation_id) \
                or not runner.running.cancel(message_id):
            raise HTTPException(404, f"No running turn {message_id!r} (it may have finished).")
        return {"cancelled": message_id}

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
        yield server_sent("error", {"type": "error", "message": str(e)})
    finally:
        if turn_id:
            running.remove(turn_id)
        close_if_closable(events)
        tally.finish(ticket, failed)
