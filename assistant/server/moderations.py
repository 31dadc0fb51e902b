"""POST /v1/moderations in OpenAI's shape, over the same safety layer that guards every turn.

    {"input": "text" | ["text", ...], "model"?: ...} -> {"id", "model", "results": [{"flagged",
    "categories", "category_scores"}, ...]}

Each result has OpenAI's category keys (harassment, hate, illicit, self-harm, ...; the SDK's typed
fields) mapped from ours (toxicity -> harassment and hate, weapons -> illicit and illicit/violent,
malware and drugs -> illicit, self_harm -> self-harm), plus our own keys as they are (prompt_injection
has no OpenAI counterpart). `flagged` is the default policy's verdict: exactly what the input guard
of a turn would block. Requests pass the gateway (key, rate limits, the ledger) like every /v1 route.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from assistant.server.auth import UNAUTHORIZED
from assistant.server.completions import error_response as _error
from assistant.server.gateway import Gateway, Refusal

MODEL = "assistant-safety"
MAX_INPUTS = 32
MAX_CHARS = 32_000
OPENAI_CATEGORIES = ("harassment", "harassment/threatening", "hate", "hate/threatening", "illicit", "illicit/violent",
                     "self-harm", "self-harm/intent", "self-harm/instructions", "sexual", "sexual/minors",
                     "violence", "violence/graphic")
OPENAI_NAMES = {"toxicity": ("harassment", "hate"), "weapons": ("illicit", "illicit/violent"),
                "malware": ("illicit",), "drugs": ("illicit",), "self_harm": ("self-harm",)}


def openai_result(moderation: Any) -> dict[str, Any]:
    """One of our Moderation results with OpenAI's category keys added (the max over what maps to each)."""
    categories = {name: False for name in OPENAI_CATEGORIES}
    scores = {name: 0.0 for name in OPENAI_CATEGORIES}
    for ours, score in moderation.category_scores.items():
        for name in OPENAI_NAMES.get(ours, ()):
            scores[name] = max(scores[name], score)
            categories[name] = categories[name] or bool(moderation.categories.get(ours))
    return {"flagged": moderation.flagged, "categories": {**categories, **moderation.categories},
            "category_scores": {**scores, **moderation.category_scores}}


def _inputs(body: Any) -> list[str] | str:
    """The texts to moderate, or the reason the body is refused."""
    if not isinstance(body, dict) or "input" not in body:
        return "The body must be a JSON object with `input`: a string or a list of strings."
    value = body["input"]
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        return "`input` must be a string or a non-empty list of strings (pictures are not moderated here)."
    if len(texts) > MAX_INPUTS:
        return f"`input` has {len(texts)} texts; at most {MAX_INPUTS} per request."
    if any(len(t) > MAX_CHARS for t in texts):
        return f"Each text may have at most {MAX_CHARS} characters."
    return texts


def create_moderation_api(assistant: Any, gateway: Gateway) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.post("/moderations")
    async def moderations(request: Request) -> Any:
        principal = gateway.principal(request)
        if principal is None:
            return _error(401, UNAUTHORIZED, code="invalid_api_key")
        try:
            texts = _inputs(json.loads(await request.body()))
        except ValueError as e:
            return _error(400, f"The body is not valid JSON: {e}.")
        if isinstance(texts, str):
            return _error(400, texts, "input")
        if assistant.safety is None:
            return _error(503, "Moderation is off on this server (safety.enabled = false): ask the administrator.",
                          type_="server_error", code="moderation_disabled")
        tokens = sum(len(t) for t in texts) // 4
        ticket = await gateway.admit(request, principal, MODEL, tokens)
        if isinstance(ticket, Refusal):
            return _error(ticket.status, ticket.message, None, ticket.type, ticket.headers, ticket.code)
        try:
            policy = gateway.safety_policy(principal)  # the key's tier's policy decides `flagged`
            results = await run_in_threadpool(lambda: [assistant.safety.moderate(t, policy=policy) for t in texts])
        except BaseException:
            await run_in_threadpool(ticket.finish, "error")
            raise
        await run_in_threadpool(ticket.finish, "ok", tokens, 0, 0)
        return JSONResponse({"id": f"modr-{uuid.uuid4().hex[:24]}", "model": MODEL, "created": int(time.time()),
                             "results": [openai_result(r) for r in results]}, headers=ticket.headers)

    return router
