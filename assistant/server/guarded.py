"""The safety layer on raw-model /v1 completions (a model id such as `qwen2.5-coder-0.5b`), so that an
API request passes the same guards as a turn of the `assistant` model, the web chat or the CLI.

Before the engine: the last user message goes through the input guard under the caller's tier's
policy (`Gateway.safety_policy`; the server's policy otherwise). A block is answered in OpenAI's
shape, 200 with the refusal as the message and `finish_reason: "content_filter"` (streamed or not),
recorded in the ledger as `blocked`, and the engine is never asked.

After the engine: `guard_deltas` passes the engine's deltas through an OutputGuard (one per request,
that policy, also protecting the request's own system messages like the system prompt), so secrets,
card numbers, private emails and phones and system-prompt copies are redacted in the stream, holding
back at most one sentence. A toxic answer is stopped: the notice replaces the rest, the engine is
closed (the generation stops), and the finish reason is `content_filter`. Token counts are the
engine's, so usage and the ledger stay exact. Token log-probabilities (`logprobs`) come at the end,
and only for an answer shown exactly as the model wrote it: each one names its token.
"""

from __future__ import annotations

from typing import Any, Iterator

from assistant.engine.base import TokenDelta
from assistant.events import SafetyVerdict, TextDelta
from assistant.seams import close_if_closable

CONTENT_FILTER = "content_filter"


def last_user_text(messages: list[dict[str, Any]]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts: the text parts
                return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            return str(content or "")
    return ""


def system_texts(messages: list[dict[str, Any]]) -> list[str]:
    return [str(m.get("content") or "") for m in messages if m.get("role") in ("system", "developer")
            and isinstance(m.get("content"), str) and m.get("content")]


def check_input(safety: Any, policy: str | None, key_id: str, messages: list[dict[str, Any]]) -> Any:
    """The input guard's Verdict on the request's last user message (audited under the caller's key)."""
    guard = safety.input_guard.for_policy(policy, key_id=key_id or None)
    return guard.check(last_user_text(messages), where="input")


def guard_deltas(deltas: Iterator[TokenDelta], out: Any) -> Iterator[TokenDelta]:
    """The engine's deltas with their text passed through the OutputGuard `out` (see the module notes).
    Token log-probabilities (each names its token's text) are held to the end and come with the last
    delta only when the whole answer was shown as written: none for a stopped or redacted answer."""
    last = TokenDelta("")
    written, shown_all, scored = [], [], []
    try:
        for last in deltas:
            shown, stopped = _shown(out.feed(TextDelta(last.text)) if last.text else ())
            written.append(last.text)
            shown_all.append(shown)
            scored.extend(last.logprobs)
            if stopped:
                yield TokenDelta(shown, last.token_ids, CONTENT_FILTER, last.num_prompt_tokens,
                                 last.num_generated_tokens, last.num_cached_tokens)
                return
            if last.finish_reason:
                tail, stopped = _shown(out.finish())
                whole = not stopped and "".join(shown_all) + tail == "".join(written)
                yield TokenDelta(shown + tail, last.token_ids, CONTENT_FILTER if stopped else last.finish_reason,
                                 last.num_prompt_tokens, last.num_generated_tokens, last.num_cached_tokens,
                                 tuple(scored) if whole else ())
                return
            if shown or last.token_ids:
                yield TokenDelta(shown, last.token_ids, None, last.num_prompt_tokens, last.num_generated_tokens,
                                 last.num_cached_tokens)
        tail, stopped = _shown(out.finish())  # an engine that ended without a finish reason
        if tail:
            yield TokenDelta(tail, (), CONTENT_FILTER if stopped else None, last.num_prompt_tokens,
                             last.num_generated_tokens, last.num_cached_tokens)
    finally:
        close_if_closable(deltas)  # a stopped answer, or a client gone: the engine stops generating


def _shown(events: Any) -> tuple[str, bool]:
    """(the text to show, whether the guard stopped the answer)."""
    text, stopped = [], False
    for e in events:
        if isinstance(e, TextDelta):
            text.append(e.text)
        elif isinstance(e, SafetyVerdict) and not e.allowed:
            stopped = True
    return "".join(text), stopped


def blocked_completion(verdict: Any, *, model: str, stream: bool, ticket: Any, text: bool = False) -> Any:
    """The answer to a request the input guard blocked: the refusal (it names the category and what to
    do instead) as the assistant's message, `finish_reason: "content_filter"`; `text`: as a /v1/completions
    reply."""
    import time
    import uuid

    from fastapi.responses import JSONResponse

    from assistant.server.completions import chunk
    from assistant.server.streaming import ClosingStreamingResponse

    from assistant.server.completions import Shape

    ticket.finish("blocked")
    cid = f"{'cmpl' if text else 'chatcmpl'}-{uuid.uuid4().hex[:24]}"
    safety = {"category": verdict.category, "score": verdict.score, "threshold": verdict.threshold,
              "detector": verdict.detector}
    if text:
        shape = Shape(cid, model, text=True)
        if stream:
            return ClosingStreamingResponse(iter([shape.chunk(verdict.reason, CONTENT_FILTER), "data: [DONE]\n\n"]),
                                            media_type="text/event-stream", headers=ticket.headers)
        return JSONResponse({"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
                             "choices": [{"index": 0, "text": verdict.reason, "logprobs": None,
                                          "finish_reason": CONTENT_FILTER}],
                             "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
                             "safety": safety}, headers=ticket.headers)
    if stream:
        def chunks() -> Iterator[str]:
            yield chunk(cid, model, {"role": "assistant", "content": verdict.reason}, None)
            yield chunk(cid, model, {}, CONTENT_FILTER)
            yield "data: [DONE]\n\n"
        return ClosingStreamingResponse(chunks(), media_type="text/event-stream", headers=ticket.headers)
    return JSONResponse({"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": verdict.reason},
                                      "finish_reason": CONTENT_FILTER}],
                         "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
                         "safety": safety}, headers=ticket.headers)
