"""OpenAI-compatible HTTP API over any Engine: /v1/models and /v1/chat/completions (SSE streaming).

Stateless like OpenAI's: the client sends the whole conversation. Streaming and non-streaming share
one code path (non-streaming drains the same delta iterator). If `server.api_keys` is set, every
request needs `Authorization: Bearer <key>`. A client that disconnects mid-stream cancels its request
in the engine (the streaming generator is closed, which frees its KV slot within one step).

Robustness rules (the web chat shares this event loop, and one engine step serves many requests):
  * Requests are validated completely at the boundary (server/schemas.py): a client mistake is an
    HTTP 400 in OpenAI's error shape, never a 500 and never something the engine thread sees.
  * Nothing that can block runs on the event loop: `engine.generate` (chat template, tokenising,
    submitting) and the non-streaming drain run in the threadpool; streams are iterated there too.
  * Chat-template errors (jinja raising for a message order the model does not support) surface from
    `engine.generate` before the request reaches the engine thread and become a 400 as well.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from typing import Any, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from assistant.engine.base import Engine, TokenDelta
from assistant.errors import AssistantError, EngineBusy
from assistant.server.auth import key_ok
from assistant.server.schemas import MAX_TOKENS_DEFAULT, RequestError, parse_chat_request  # noqa: F401

log = logging.getLogger(__name__)
ASSISTANT_MODEL = "assistant"  # the model id that runs the full assistant turn

try:  # transformers renders chat templates with jinja2; engines without it never raise this
    from jinja2 import TemplateError
except ImportError:  # pragma: no cover
    class TemplateError(Exception):  # type: ignore[no-redef]
        pass


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status)


def _chunk(cid: str, model: str, delta: dict[str, Any], finish: str | None) -> str:
    body = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n"


def _finish(reason: str | None) -> str | None:
    return {"cancelled": "stop"}.get(reason or "", reason)


def create_api(engine: Engine, *, model_name: str, api_keys: tuple[str, ...] = (), assistant: Any = None) -> APIRouter:
    """/v1 over `engine` (the raw model `model_name`); with `assistant`, the model id `assistant`
    runs the full turn (retrieval, tools, citations, the store) over the sent messages."""
    router = APIRouter(prefix="/v1")

    def denied(request: Request) -> JSONResponse | None:
        if key_ok(request, api_keys):
            return None
        return _error(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key")

    @router.get("/models")
    def models(request: Request) -> Any:
        if (refusal := denied(request)) is not None:
            return refusal
        ids = [model_name] + ([ASSISTANT_MODEL] if assistant is not None else [])
        return {"object": "list", "data": [{"id": i, "object": "model", "owned_by": "local"} for i in ids]}

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Any:
        if (refusal := denied(request)) is not None:
            return refusal
        try:
            req = parse_chat_request(await request.body())
            params = req.sampling_params()
        except RequestError as e:
            return _error(400, e.message, param=e.param)
        except ValueError as e:  # SamplingParams.verify: unreachable after the schema, kept as a guard
            return _error(400, str(e))
        if assistant is not None and req.model == ASSISTANT_MODEL:
            return await run_in_threadpool(assistant_completion, assistant, req.engine_messages(), params, req.stream)
        try:  # the chat template and tokenising run here: off the event loop
            deltas = await run_in_threadpool(engine.generate, req.engine_messages(), params, tools=req.engine_tools())
        except EngineBusy as e:
            return _error(503, str(e), "overloaded")
        except TemplateError as e:
            return _error(400, f"The model's chat template cannot render these messages: {e}", param="messages")
        except (AssistantError, ValueError) as e:  # prompt too long, empty, ...: the request's fault
            return _error(400, str(e))
        except Exception as e:  # ours: say so in the API's shape, keep the details in the log
            log.exception("engine.generate failed")
            return _error(500, f"The server failed to start generating: {type(e).__name__}: {e}", "server_error")
        cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        if req.stream:
            return StreamingResponse(_sse(deltas, cid, model_name, req.include_usage), media_type="text/event-stream")
        try:  # the drain waits for every token: in the threadpool, never on the event loop
            text, last = await run_in_threadpool(_drain, deltas)
        except EngineBusy as e:
            return _error(503, str(e), "overloaded")
        except ValueError as e:  # an engine that validates lazily (on first iteration)
            return _error(400, str(e))
        except AssistantError as e:
            return _error(500, str(e), "server_error")
        except Exception as e:
            log.exception("generation failed")
            return _error(500, f"Generation failed: {type(e).__name__}: {e}", "server_error")
        return {
            "id": cid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": _finish(last.finish_reason)}],
            "usage": _usage(last),
        }

    return router


def assistant_completion(assistant: Any, messages: list[dict], params: Any, stream: bool) -> Any:
    """A stateless assistant turn: the sent messages before the last user message become a new stored
    conversation's history, the last one is the turn. The answer comes in OpenAI's shape with two
    extra fields OpenAI clients ignore: `sources` (verified citations) and `conversation_id`."""
    from assistant.events import Done, Error, Sources, TextDelta

    *history, last = messages
    if last.get("role") != "user" or not str(last.get("content") or "").strip():
        return _error(400, "The model `assistant` answers a conversation that ends with a user message.",
                      param="messages")
    conversation_id = assistant.conversations.start(history, title=str(last["content"])[:60])
    events = assistant.turn(conversation_id, str(last["content"]), params=params)
    cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    if stream:
        def chunks() -> Iterator[str]:
            yield _chunk(cid, ASSISTANT_MODEL, {"role": "assistant", "content": ""}, None)
            for event in events:
                if isinstance(event, TextDelta):
                    yield _chunk(cid, ASSISTANT_MODEL, {"content": event.text}, None)
                elif isinstance(event, Error):
                    yield f"data: {json.dumps(error_body(event.message, 'server_error'))}\n\n"
                elif not isinstance(event, Done):  # sources, tool steps, ...: extra events clients ignore
                    yield f"event: assistant.{event.type}\ndata: {json.dumps(event.to_dict(), default=str)}\n\n"
                else:
                    yield _chunk(cid, ASSISTANT_MODEL, {}, _finish(event.finish_reason))
            yield "data: [DONE]\n\n"
        return StreamingResponse(chunks(), media_type="text/event-stream")
    sources: list[dict] = []
    done = None
    for event in events:
        if isinstance(event, Sources):
            sources = [dataclasses.asdict(s) for s in event.sources]
        elif isinstance(event, Done):
            done = event
    if done is None or done.finish_reason == "error":
        return _error(500, "The assistant turn failed; see the server log.", "server_error")
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": ASSISTANT_MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": done.text},
                         "finish_reason": _finish(done.finish_reason)}],
            "sources": sources, "conversation_id": done.conversation_id}


def _drain(deltas: Iterator[TokenDelta]) -> tuple[str, TokenDelta]:
    text, last = [], TokenDelta("")
    try:
        for last in deltas:
            text.append(last.text)
    finally:
        close = getattr(deltas, "close", None)
        if close:
            close()
    return "".join(text), last


def _usage(last: TokenDelta) -> dict[str, Any]:
    return {"prompt_tokens": last.num_prompt_tokens, "completion_tokens": last.num_generated_tokens,
            "total_tokens": last.num_prompt_tokens + last.num_generated_tokens,
            "prompt_tokens_details": {"cached_tokens": last.num_cached_tokens}}


def _sse(deltas: Iterator[TokenDelta], cid: str, model: str, include_usage: bool) -> Iterator[str]:
    """Runs in Starlette's threadpool; when the client goes away the generator is closed, which
    closes `deltas` and cancels the request in the engine. A failure after the 200 was sent can only
    be reported in-band: one `data: {"error": ...}` event (OpenAI's shape), then [DONE]."""
    yield _chunk(cid, model, {"role": "assistant", "content": ""}, None)
    last = TokenDelta("")
    try:
        for last in deltas:
            if last.text or last.finish_reason:
                yield _chunk(cid, model, {"content": last.text} if last.text else {}, _finish(last.finish_reason))
    except (AssistantError, ValueError) as e:
        kind = ("overloaded" if isinstance(e, EngineBusy) else
                "invalid_request_error" if isinstance(e, ValueError) else "server_error")
        yield f"data: {json.dumps(error_body(str(e), kind))}\n\n"
    except Exception as e:
        log.exception("generation failed mid-stream")
        yield f"data: {json.dumps(error_body(f'Generation failed: {type(e).__name__}: {e}', 'server_error'))}\n\n"
    finally:
        close = getattr(deltas, "close", None)
        if close:
            close()
    if include_usage:
        usage = {"id": cid, "object": "chat.completion.chunk", "model": model, "choices": [], "usage": _usage(last)}
        yield f"data: {json.dumps(usage)}\n\n"
    yield "data: [DONE]\n\n"
