"""OpenAI-compatible HTTP API over any Engine: /v1/models and /v1/chat/completions (SSE streaming).

Stateless like OpenAI's: the client sends the whole conversation. Streaming and non-streaming share
one code path (non-streaming drains the same delta iterator). If `server.api_keys` is set, every
request needs `Authorization: Bearer <key>`. A client that disconnects mid-stream cancels its request
in the engine (the streaming generator is closed, which frees its KV slot within one step).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Iterator

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse

from assistant.engine.base import Engine, SamplingParams, TokenDelta
from assistant.errors import AssistantError, EngineBusy

MAX_TOKENS_DEFAULT = 512


def _params(body: dict[str, Any]) -> SamplingParams:
    stop = body.get("stop") or ()
    params = SamplingParams(
        temperature=float(body.get("temperature", 0.0) or 0.0),
        top_p=float(body.get("top_p", 1.0) or 1.0),
        top_k=int(body.get("top_k", 0) or 0),
        max_tokens=int(body.get("max_tokens") or body.get("max_completion_tokens") or MAX_TOKENS_DEFAULT),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        seed=body.get("seed"),
    )
    params.verify()
    return params


def _chunk(cid: str, model: str, delta: dict[str, Any], finish: str | None) -> str:
    body = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n"


def _finish(reason: str | None) -> str | None:
    return {"cancelled": "stop"}.get(reason or "", reason)


def create_api(engine: Engine, *, model_name: str, api_keys: tuple[str, ...] = ()) -> APIRouter:
    router = APIRouter(prefix="/v1")

    def check_key(request: Request) -> None:
        if not api_keys:
            return
        header = request.headers.get("authorization", "")
        if not header.startswith("Bearer ") or header[7:] not in api_keys:
            raise HTTPException(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.")

    @router.get("/models", dependencies=[Depends(check_key)])
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "local"}]}

    @router.post("/chat/completions", dependencies=[Depends(check_key)])
    async def chat_completions(request: Request) -> Any:
        try:
            body = await request.json()
            messages = body["messages"]
            if not isinstance(messages, list) or not messages:
                raise ValueError("messages must be a non-empty list")
            params = _params(body)
        except (ValueError, KeyError, TypeError) as e:
            return JSONResponse({"error": {"message": f"Bad request: {e}", "type": "invalid_request_error"}}, 400)
        try:
            deltas = engine.generate(messages, params, tools=body.get("tools"))
        except EngineBusy as e:
            return JSONResponse({"error": {"message": str(e), "type": "overloaded"}}, 503)
        except AssistantError as e:
            return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error"}}, 400)
        cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_sse(deltas, cid, model_name, include_usage), media_type="text/event-stream")
        text, last = [], TokenDelta("")
        for last in deltas:
            text.append(last.text)
        return {
            "id": cid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                         "finish_reason": _finish(last.finish_reason)}],
            "usage": _usage(last),
        }

    return router


def _usage(last: TokenDelta) -> dict[str, int]:
    return {"prompt_tokens": last.num_prompt_tokens, "completion_tokens": last.num_generated_tokens,
            "total_tokens": last.num_prompt_tokens + last.num_generated_tokens,
            "prompt_tokens_details": {"cached_tokens": last.num_cached_tokens}}


def _sse(deltas: Iterator[TokenDelta], cid: str, model: str, include_usage: bool) -> Iterator[str]:
    """Runs in Starlette's threadpool; when the client goes away the generator is closed, which
    closes `deltas` and cancels the request in the engine."""
    yield _chunk(cid, model, {"role": "assistant", "content": ""}, None)
    last = TokenDelta("")
    try:
        for last in deltas:
            if last.text or last.finish_reason:
                yield _chunk(cid, model, {"content": last.text} if last.text else {}, _finish(last.finish_reason))
    except AssistantError as e:
        yield f"data: {json.dumps({'error': {'message': str(e)}})}\n\n"
    finally:
        close = getattr(deltas, "close", None)
        if close:
            close()
    if include_usage:
        usage = {"id": cid, "object": "chat.completion.chunk", "model": model, "choices": [], "usage": _usage(last)}
        yield f"data: {json.dumps(usage)}\n\n"
    yield "data: [DONE]\n\n"
