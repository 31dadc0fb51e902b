"""OpenAI-compatible HTTP API: /v1/models, /v1/chat/completions (SSE streaming), /v1/completions (text and
fill-in-the-middle, text_completions.py), /v1/embeddings.

Pictures (`image_url` parts with data: URLs) are described by the vision backend (labels, text read)
and the description goes into the message's text, as for a picture uploaded in the web chat; with the
model `assistant`, the last message's pictures go into the turn itself (ImageDescribed events, and the
pictures are kept with the stored message).

Stateless like OpenAI's: the client sends the whole conversation. Streaming and non-streaming share
one code path (non-streaming drains the same delta iterator; completions.py shapes both, tool calls
included). The model id `assistant` runs the full turn instead (assistant_model.py).

Every request goes through the gateway (gateway.py): key -> Principal (401), model known and allowed
for the key's tier (404), rate limits (429 + Retry-After + x-ratelimit-*), a running slot (503 +
Retry-After when the queue is full), and, when it ends, the usage ledger. A client that disconnects
mid-stream cancels its request in the engine (the streaming generator is closed, which frees its KV
slot within one step) and its partial usage is recorded.

Robustness rules (the web chat shares this event loop, and one engine step serves many requests):
  * Requests are validated completely at the boundary (server/schemas.py): a client mistake is an
    HTTP 4xx in OpenAI's error shape, never a 500 and never something the engine thread sees. The
    body size limit is enforced before the body is read (middleware.py).
  * Nothing that can block runs on the event loop: `engine.generate` (chat template, tokenising,
    submitting), the non-streaming drain, embedding and database writes run in the threadpool.
  * Chat-template errors (jinja raising for a message order the model does not support) surface from
    `engine.generate` before the request reaches the engine thread and become a 400 as well.
"""

from __future__ import annotations

import base64
import logging
import time
import uuid
from dataclasses import replace
from typing import Any, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from assistant.engine.base import Engine
from assistant.errors import AssistantError, ConfigError, EngineBusy, ModelError
from assistant.server.assistant_model import ASSISTANT_MODEL, assistant_completion
from assistant.server.auth import UNAUTHORIZED
from assistant.server.completions import (Shape, drain, error_body, finish_reason, legacy_logprobs, logprobs_of,
                                          message_of, sse, status_of, usage_of)
from assistant.server.gateway import Gateway, Refusal, Ticket
from assistant.server.guarded import blocked_completion, check_input, guard_deltas, system_texts
from assistant.server.response_cache import ResponseCache, recording, replay
from assistant.server.schemas import (MAX_TOKENS_DEFAULT, RequestError, parse_chat_request, parse_embeddings_request,
                                      parse_text_request)
from assistant.server.streaming import ClosingStreamingResponse
from assistant.server.text_completions import NEEDS_LOCAL, TextPrompt, guarded_text, prompt_ids, suffix_stop

log = logging.getLogger(__name__)
__all__ = ["ASSISTANT_MODEL", "MAX_TOKENS_DEFAULT", "create_api", "error_body"]

try:  # transformers renders chat templates with jinja2; engines without it never raise this
    from jinja2 import TemplateError
except ImportError:  # pragma: no cover
    class TemplateError(Exception):  # type: ignore[no-redef]
        pass


NO_ASSISTANT_LOGPROBS = ("logprobs describe a raw model's tokens ({models}); the `assistant` model's answer is "
                         "rewritten after the model writes it (citations, grounding), so they would not describe it.")
NO_ASSISTANT_TEXT = ("The `assistant` model answers messages: send them to /v1/chat/completions, or ask one of "
                     "the raw models ({models}) for a text completion.")
NO_TOOL_LOGPROBS = "logprobs are not given with `tools`: ask without tools, or leave logprobs out."


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status, headers=headers)


def _refused(refusal: Refusal) -> JSONResponse:
    return _error(refusal.status, refusal.message, refusal.type, None, refusal.code, refusal.headers)


def _unknown_model(model: str) -> JSONResponse:
    return _error(404, f"The model `{model}` does not exist or you do not have access to it: see GET /v1/models.",
                  param="model", code="model_not_found")


def create_api(engine: Engine, *, model_name: str, api_keys: tuple[str, ...] = (), assistant: Any = None,
               gateway: Gateway | None = None) -> APIRouter:
    """/v1 over `engine` (the raw model `model_name`); with `assistant`, every chat model it has, the
    model id `assistant` (the full turn) and the embedder. `gateway` carries keys, limits, admission,
    the ledger and metrics; without one, only the static `api_keys` are checked."""
    router = APIRouter(prefix="/v1")
    gateway = gateway or Gateway.from_keys(api_keys)
    chat_models = list(dict.fromkeys([model_name, *(assistant.models.ids() if assistant is not None else [])]))
    embedding_model = assistant.models.embedding_model if assistant is not None else None

    def model_ids() -> list[str]:
        return chat_models + ([ASSISTANT_MODEL] if assistant is not None else []) + (
            [embedding_model] if embedding_model else [])

    def engine_for(model: str) -> Engine:
        return engine if assistant is None or model == model_name else assistant.models.engine(model)

    cache = response_cache_of(assistant, embedding_model)

    def cache_lookup(principal: Any, model: str, messages: list[dict], params: Any, req: Any) -> Any:
        """(cached deltas or None, how to record a miss or None): runs in the threadpool (it embeds)."""
        if (cache is None or (principal.tier is not None and not principal.tier.response_cache)
                or not cache.eligible(params, req.engine_tools(), False)):
            return None, None
        target = engine_for(model)  # its identity: a reloaded or changed model starts an empty cache
        prefix = Shape.of(req, "", model).prefix  # a JSON-mode or forced-tool reply starts differently
        identity = f"{model}|{getattr(target, 'name', '')}|{id(target)}|{prefix!r}"
        exact, text = cache.key(principal.key_id, identity, messages, params)
        try:
            answer, vector = cache.get(exact, text)
        except Exception:  # noqa: BLE001 - the embedder failed: answer from the engine, as without a cache
            log.warning("response cache lookup failed; asking the engine", exc_info=True)
            return None, None
        gateway.metrics.response_cache.labels("hit" if answer is not None else "miss").inc()
        if answer is not None:
            return replay(answer), None
        return None, lambda deltas: recording(deltas, lambda a: cache.put(exact, text, vector, a))

    def who(request: Request) -> Any:
        principal = gateway.principal(request)
        return principal if principal is not None else _error(401, UNAUTHORIZED, code="invalid_api_key")

    def listing(model: str) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": 0, "owned_by": "local"}

    @router.get("/models")
    def models(request: Request) -> Any:
        principal = who(request)
        if isinstance(principal, JSONResponse):
            return principal
        return {"object": "list", "data": [listing(m) for m in model_ids() if principal.may_use(m)]}

    @router.get("/models/{model:path}")
    def model(model: str, request: Request) -> Any:
        principal = who(request)
        if isinstance(principal, JSONResponse):
            return principal
        return listing(model) if model in model_ids() and principal.may_use(model) else _unknown_model(model)

    async def read(request: Request, parse: Callable[[bytes], Any]) -> Any:
        """(caller, raw body, request, its SamplingParams), or the error response to send instead."""
        principal = who(request)
        if isinstance(principal, JSONResponse):
            return principal
        raw = await request.body()
        try:
            req = parse(raw)
            return principal, raw, req, req.sampling_params()
        except RequestError as e:
            return _error(400, e.message, param=e.param)
        except ValueError as e:  # SamplingParams.verify: unreachable after the schema, kept as a guard
            return _error(400, str(e))

    async def guards(principal: Any, model: str, req: Any, ticket: Ticket, messages: list[dict], protect: list[str],
                     text: bool = False) -> tuple[Any, Any]:
        """(the request's OutputGuard or None, the blocked reply to send instead or None): the same guards
        as a turn (assistant/server/guarded.py) when the server has its safety layer."""
        safety = getattr(assistant, "safety", None)
        if safety is None:
            return None, None
        policy = gateway.safety_policy(principal)
        verdict = await run_in_threadpool(check_input, safety, policy, principal.key_id, messages)
        if not verdict.allowed:
            return None, await run_in_threadpool(lambda: blocked_completion(verdict, model=model, stream=req.stream,
                                                                            ticket=ticket, text=text))
        return safety.output_guard_for(policy, protect=protect), None

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Any:
        got = await read(request, parse_chat_request)
        if isinstance(got, JSONResponse):
            return got
        principal, raw, req, params = got
        model = req.model or model_name
        if model not in chat_models + ([ASSISTANT_MODEL] if assistant is not None else []) or not principal.may_use(model):
            return _unknown_model(model)
        if req.logprobs and (model == ASSISTANT_MODEL or req.engine_tools()):
            return _error(400, (NO_ASSISTANT_LOGPROBS if model == ASSISTANT_MODEL else NO_TOOL_LOGPROBS).format(
                models=", ".join(chat_models)), param="logprobs")
        pictures = [m.images for m in req.messages]
        if any(pictures) and getattr(assistant, "media", None) is None:
            return _error(400, "Pictures need the assistant's vision backend, which this server does not have.",
                          param="messages")
        ticket = await gateway.admit(request, principal, model, len(raw) // 4 + params.max_tokens)
        if isinstance(ticket, Refusal):
            return _refused(ticket)
        try:
            messages, last_pictures = req.engine_messages(), []
            if any(pictures):
                try:
                    messages, last_pictures = await run_in_threadpool(
                        with_descriptions, assistant.media, messages, pictures, model == ASSISTANT_MODEL)
                except (ModelError, ConfigError) as e:
                    await run_in_threadpool(ticket.finish, "error")
                    return _error(500, str(e), "server_error", headers=ticket.headers)
                except AssistantError as e:  # the picture's fault: not an image, truncated, too large
                    await run_in_threadpool(ticket.finish, "invalid")
                    return _error(400, str(e), param="messages", headers=ticket.headers)
            if model == ASSISTANT_MODEL:
                return await run_in_threadpool(assistant_completion, assistant, messages, params, req.stream,
                                               ticket=ticket, gateway=gateway, metrics=gateway.metrics,
                                               images=last_pictures)
            out, blocked = await guards(principal, model, req, ticket, messages, system_texts(messages))
            if blocked is not None:
                return blocked
            cached, record = ((None, None) if any(pictures) else
                              await run_in_threadpool(cache_lookup, principal, model, messages, params, req))
            return await _raw_completion(engine_for(model), req, messages, params, model, ticket, gateway, request,
                                         cached=cached, record=record, out=out)
        except BaseException:
            await run_in_threadpool(ticket.finish, "error")  # no-op when the response already finished it
            raise

    @router.post("/completions")
    async def completions(request: Request) -> Any:
        """OpenAI's text completion (assistant/server/text_completions.py)."""
        got = await read(request, parse_text_request)
        if isinstance(got, JSONResponse):
            return got
        principal, _, req, params = got
        model = req.model or model_name
        if model == ASSISTANT_MODEL and assistant is not None:
            return _error(400, NO_ASSISTANT_TEXT.format(models=", ".join(chat_models)), param="model")
        if model not in chat_models or not principal.may_use(model):
            return _unknown_model(model)
        target = engine_for(model)
        tokenizer = getattr(target, "tokenizer", None)
        if tokenizer is None:
            return _error(400, NEEDS_LOCAL.format(model=model), param="model")
        try:
            ids = await run_in_threadpool(prompt_ids, tokenizer, req, model)
        except ValueError as e:
            return _error(400, str(e), param="suffix" if req.suffix is not None else "prompt")
        if (stop := suffix_stop(req.suffix)) is not None:
            params = replace(params, stop=(*params.stop, stop))
        prompt = TextPrompt(ids, (req.prompt_text if req.prompt_text is not None else tokenizer.decode(ids))
                            if req.echo else "", tokenizer.decode(ids[:1]) if req.scores_prompt else None,
                            answer=req.max_tokens != 0)
        ticket = await gateway.admit(request, principal, model, len(ids) + params.max_tokens)
        if isinstance(ticket, Refusal):
            return _refused(ticket)
        try:
            out, blocked = await guards(principal, model, req, ticket, guarded_text(req), [], text=True)
            if blocked is not None:
                return blocked
            return await _raw_completion(target, req, [], params, model, ticket, gateway, request, out=out,
                                         text=prompt)
        except BaseException:
            await run_in_threadpool(ticket.finish, "error")  # no-op when the response already finished it
            raise

    @router.post("/embeddings")
    async def embeddings(request: Request) -> Any:
        principal = who(request)
        if isinstance(principal, JSONResponse):
            return principal
        raw = await request.body()
        try:
            req = parse_embeddings_request(raw)
        except RequestError as e:
            return _error(400, e.message, param=e.param)
        if not embedding_model or req.model != embedding_model or not principal.may_use(req.model):
            return _unknown_model(req.model)
        ticket = await gateway.admit(request, principal, req.model, len(raw) // 4)
        if isinstance(ticket, Refusal):
            return _refused(ticket)
        try:
            vectors, num_tokens = await run_in_threadpool(assistant.models.embed, req.texts)
        except AssistantError as e:
            await run_in_threadpool(ticket.finish, "error")
            return _error(500, str(e), "server_error")
        await run_in_threadpool(ticket.finish, "ok", num_tokens, 0, 0)
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if req.encoding_format == "base64"
                 else [float(x) for x in v]} for i, v in enumerate(vectors)]
        return JSONResponse({"object": "list", "data": data, "model": req.model,
                             "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}},
                            headers=ticket.headers)

    return router


def with_descriptions(media: Any, messages: list[dict], pictures: list[list[bytes]],
                      keep_last: bool) -> tuple[list[dict], list[bytes]]:
    """Each picture's description put before its message's text, as "[image k: ...]" lines (the way a
    stored message shows its pictures to the model); with `keep_last`, the last message's pictures are
    returned as they are, for the turn to describe."""
    out, kept, number = [], [], 0
    for i, (message, images) in enumerate(zip(messages, pictures)):
        if keep_last and i == len(messages) - 1:
            out.append(message)
            kept = list(images)
            continue
        lines = []
        for data in images:
            number += 1
            lines.append(f"[image {number}: {media.describe_image(data, name=f'image-{number}').compact()}]")
        out.append({**message, "content": "\n".join([*lines, message["content"]])} if lines else message)
    return out, kept


def response_cache_of(assistant: Any, embedding_model: str | None) -> ResponseCache | None:
    """The semantic response cache when engine.response_cache is on and the packaged embedder is here."""
    config = getattr(getattr(assistant, "config", None), "engine", None)
    if config is None or not config.response_cache or not embedding_model:
        return None
    return ResponseCache(embed=lambda texts: assistant.models.embed(texts)[0], threshold=config.response_cache_threshold,
                         ttl_s=config.response_cache_ttl_s)


async def _raw_completion(engine: Engine, req: Any, messages: list[dict], params: Any, model: str, ticket: Ticket,
                          gateway: Gateway, request: Request, cached: Any = None, record: Any = None,
                          out: Any = None, text: TextPrompt | None = None) -> Any:
    """`cached`: the deltas of an answer from the response cache (the engine is not asked); `record`: wraps
    the engine's deltas to store the answer when it completes; `out`: the request's OutputGuard (None:
    safety is off), applied before the cache records, so the cache only holds guarded answers. `text`:
    a /v1/completions request instead (text_completions.py)."""
    if text is not None:
        shape = Shape(f"cmpl-{uuid.uuid4().hex[:24]}", model, prefix=text.echo, text=True)
    else:
        shape = Shape.of(req, f"chatcmpl-{uuid.uuid4().hex[:24]}", model)
    cid = shape.cid

    async def refuse(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                     ledger: str = "invalid", headers: dict[str, str] | None = None) -> JSONResponse:
        await run_in_threadpool(ticket.finish, ledger)
        return _error(status, message, type_, param, headers={**ticket.headers, **(headers or {})})

    try:  # the chat template and tokenising run here: off the event loop
        deltas = cached if cached is not None else await run_in_threadpool(
            engine.generate, text.ids if text is not None else shape.messages(messages), params,
            tools=None if text is not None else req.engine_tools())
        if text is not None:
            deltas = text.deltas(deltas)
        if out is not None and cached is None:
            deltas = guard_deltas(deltas, out)
        if record is not None:
            deltas = record(deltas)
    except EngineBusy as e:
        return await refuse(503, str(e), "overloaded", ledger="busy", headers={"retry-after": "1"})
    except TemplateError as e:
        return await refuse(400, f"The model's chat template cannot render these messages: {e}", param="messages")
    except (AssistantError, ValueError) as e:  # prompt too long, empty, ...: the request's fault
        return await refuse(400, str(e))
    except Exception as e:  # ours: say so in the API's shape, keep the details in the log
        log.exception("engine.generate failed")
        return await refuse(500, f"The server failed to start generating: {type(e).__name__}: {e}", "server_error",
                            ledger="error")
    if req.stream:
        started = getattr(request.state, "started", None)
        return ClosingStreamingResponse(sse(deltas, shape, req.include_usage, ticket, gateway.metrics, started),
                                 media_type="text/event-stream", headers=ticket.headers)
    try:  # the drain waits for every token: in the threadpool, never on the event loop
        reply, last, scored = await run_in_threadpool(drain, deltas)
    except EngineBusy as e:
        return await refuse(503, str(e), "overloaded", ledger="busy", headers={"retry-after": "1"})
    except ValueError as e:  # an engine that validates lazily (on first iteration)
        return await refuse(400, str(e))
    except AssistantError as e:
        return await refuse(500, str(e), "server_error", ledger="error")
    except Exception as e:
        log.exception("generation failed")
        return await refuse(500, f"Generation failed: {type(e).__name__}: {e}", "server_error", ledger="error")
    scored = scored if params.logprobs is not None else []  # none when the output guard held them back
    if shape.text:
        finish = finish_reason(last.finish_reason)
        whole = shape.prefix + reply  # the tokens scored end where it ends
        choice = {"index": 0, "text": whole, "finish_reason": finish,
                  "logprobs": legacy_logprobs(scored, len(whole) - sum(len(s.token) for s in scored)) if scored
                  else None}
    else:
        message, finish = message_of(shape, reply, last.finish_reason)
        choice = {"index": 0, "message": message, "finish_reason": finish,
                  "logprobs": logprobs_of(scored) if scored else None}
    await run_in_threadpool(ticket.finish, status_of(finish), last.num_prompt_tokens, last.num_cached_tokens,
                            last.num_generated_tokens)
    return JSONResponse({
        "id": cid, "object": "text_completion" if shape.text else "chat.completion", "created": int(time.time()),
        "model": model, "choices": [choice], "usage": usage_of(last),
    }, headers=ticket.headers)
