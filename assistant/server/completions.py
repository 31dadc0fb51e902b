"""A raw-model chat completion in OpenAI's shape: tool calls, forced tool calls, JSON mode, usage,
streamed or not, and the gateway's accounting when it ends (however it ends).

Tool calls: the model writes them in its own chat-template format (Qwen: `<tool_call>{...}</tool_call>`,
or a JSON fence); assistant/toolcalls.py finds and parses them. With `tool_choice: "auto"` a stream
shows answer text as it comes and holds back anything that may be a call (ToolCallSplitter); a reply
with calls ends with one `tool_calls` delta and `finish_reason: "tool_calls"`.
Forcing: `"required"` and a named function prefill the model's reply with the opening of a call
(`<tool_call>\\n{"name": "NAME", "arguments": `; engine/base.py PREFIX), so the model can only
continue it; JSON mode (`response_format: json_object | json_schema`) prefills `{`. Neither is
grammar-constrained decoding: a model can still write a broken call or broken JSON (then the text
comes back as content); a json_schema's schema is not enforced.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from assistant.engine.base import PREFIX, TokenDelta, TokenLogprob
from assistant.errors import AssistantError, EngineBusy
from assistant.seams import close_if_closable
from assistant.toolcalls import ParsedReply, ToolCallSplitter, parse_reply

log = logging.getLogger(__name__)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                   headers: dict[str, str] | None = None, code: str | None = None) -> Any:
    """An OpenAI-shaped error as a JSONResponse."""
    from fastapi.responses import JSONResponse

    return JSONResponse(error_body(message, type_, param, code), status, headers=headers)


def finish_reason(reason: str | None) -> str | None:
    """An engine's or a turn's finish reason in OpenAI's words (a safety block is `content_filter`)."""
    return {"cancelled": "stop", "blocked": "content_filter"}.get(reason or "", reason)


def chunk(cid: str, model: str, delta: dict[str, Any], finish: str | None,
          logprobs: dict[str, Any] | None = None) -> str:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
    if logprobs is not None:
        choice["logprobs"] = logprobs
    body = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [choice]}
    return f"data: {json.dumps(body)}\n\n"


def logprobs_of(scored: Sequence[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's `choices[].logprobs` for tokens the engine scored (SamplingParams.logprobs)."""
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(s.token, s.logprob), "top_logprobs": [entry(t, v) for t, v in s.top]}
                        for s in scored], "refusal": None}


def legacy_logprobs(scored: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """/v1/completions' `choices[].logprobs`: parallel lists, each token's alternatives as a dict, and where
    each token's text starts in the reply (`offset`: the first one's)."""
    starts, at = [], offset
    for s in scored:
        starts.append(at)
        at += len(s.token)
    return {"tokens": [s.token for s in scored], "token_logprobs": [s.logprob for s in scored],
            "top_logprobs": [None if s.logprob is None else dict(s.top) for s in scored], "text_offset": starts}


def usage_of(last: TokenDelta) -> dict[str, Any]:
    return {"prompt_tokens": last.num_prompt_tokens, "completion_tokens": last.num_generated_tokens,
            "total_tokens": last.num_prompt_tokens + last.num_generated_tokens,
            "prompt_tokens_details": {"cached_tokens": last.num_cached_tokens}}


@dataclass(frozen=True)
class Shape:
    """How one request's reply is read: which tools can be called, and what was prefilled."""

    cid: str
    model: str
    tool_names: tuple[str, ...] = ()
    prefix: str = ""  # prefilled start of the reply (a forced call's opening, or "{")
    forced: bool = False  # the prefix opens a tool call
    text: bool = False  # a /v1/completions reply (text_completion chunks, OpenAI's legacy logprobs)

    def chunk(self, content: str | None, finish: str | None, scored: Sequence[TokenLogprob] = (),
              offset: int = 0) -> str:
        """One stream event: `content` (None: a chunk with no content, as the end of a chat reply), its
        tokens' logprobs (`offset`: where its text starts in the reply, for the legacy shape)."""
        if not self.text:
            return chunk(self.cid, self.model, {} if content is None else {"content": content}, finish,
                         logprobs_of(scored) if scored else None)
        choice = {"index": 0, "text": content or "", "finish_reason": finish,
                  "logprobs": legacy_logprobs(scored, offset) if scored else None}
        body = {"id": self.cid, "object": "text_completion", "created": int(time.time()), "model": self.model,
                "choices": [choice]}
        return f"data: {json.dumps(body)}\n\n"

    @classmethod
    def of(cls, req: Any, cid: str, model: str) -> "Shape":
        names = tuple(req.tool_names)
        forced = req.forced_tool
        if names and forced is not None:
            opening = '<tool_call>\n{"name": "' + (f'{forced}", "arguments": ' if forced else "")
            return cls(cid, model, names, opening, True)
        return cls(cid, model, names, "{" if req.wants_json else "")

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not self.prefix:
            return messages
        return [*messages, {"role": "assistant", "content": self.prefix, PREFIX: True}]

    def parse(self, text: str) -> ParsedReply:
        if not self.tool_names:
            return ParsedReply(self.prefix + text)
        return parse_reply(self.prefix + text, self.tool_names)


def tool_calls(reply: ParsedReply) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in reply.calls]


def message_of(shape: Shape, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """The non-streamed reply: (message, finish_reason)."""
    reply = shape.parse(text)
    if reply.calls:
        return {"role": "assistant", "content": reply.text or None, "tool_calls": tool_calls(reply)}, "tool_calls"
    return {"role": "assistant", "content": shape.prefix + text}, finish_reason(reason)


def status_of(reason: str | None) -> str:
    """A ledger status for an engine finish_reason."""
    return {"stop": "ok", "length": "length", "cancelled": "cancelled", "tool_calls": "tool_calls",
            "content_filter": "content_filter"}.get(reason or "", "ok")


def drain(deltas: Iterator[TokenDelta]) -> tuple[str, TokenDelta, list[TokenLogprob]]:
    """(the whole text, the last delta, every token's log-probabilities when they were asked for)."""
    text, last, scored = [], TokenDelta(""), []
    try:
        for last in deltas:
            text.append(last.text)
            scored.extend(last.logprobs)
    finally:
        close_if_closable(deltas)
    return "".join(text), last, scored


def sse(deltas: Iterator[TokenDelta], shape: Shape, include_usage: bool, ticket: Any = None, metrics: Any = None,
        started: float | None = None) -> Iterator[str]:
    """The streamed reply. Runs in Starlette's threadpool; when the client goes away the generator is
    closed, which closes `deltas` (cancelling the request in the engine) and records the partial
    usage. A failure after the 200 was sent can only be reported in-band: one `data: {"error": ...}`
    event (OpenAI's shape), then [DONE]."""
    cid, model = shape.cid, shape.model
    splitter = ToolCallSplitter(shape.tool_names) if shape.tool_names and not shape.forced else None
    held: list[str] = []  # a forced call's text, parsed at the end
    last, ended, failed = TokenDelta(""), None, False
    started = time.perf_counter() if started is None else started
    previous = None
    shown = len(shape.prefix)  # characters of the reply streamed so far (the legacy logprobs' offsets)
    try:  # from the first yield on: a client gone after the first chunk still gets the `finally`
        if not shape.text:
            yield chunk(cid, model, {"role": "assistant", "content": ""}, None)
        if shape.prefix and not shape.forced:
            yield shape.chunk(shape.prefix, None)
        for last in deltas:
            if last.text and metrics is not None:
                now = time.perf_counter()
                if previous is None:
                    metrics.ttft.labels(model).observe(now - started)
                else:
                    metrics.itl.labels(model).observe(now - previous)
                previous = now
            if shape.forced:
                held.append(last.text)
            elif splitter is not None:
                shown = splitter.feed(last.text)
                if shown:
                    yield chunk(cid, model, {"content": shown}, None)
            elif last.text or last.finish_reason or last.logprobs:
                yield shape.chunk(last.text or None, finish_reason(last.finish_reason), last.logprobs,
                                  shown - sum(len(s.token) for s in last.logprobs) + len(last.text)
                                  if last.logprobs else shown)
                shown += len(last.text)
            if last.finish_reason:
                ended = last.finish_reason
        if shape.forced or splitter is not None:
            if splitter is not None:
                reply, rest = splitter.finish()
            else:
                reply, rest = shape.parse("".join(held)), shape.prefix + "".join(held)
            if reply.calls:
                ended = "tool_calls"
                calls = [{"index": i, **call} for i, call in enumerate(tool_calls(reply))]
                yield chunk(cid, model, {"tool_calls": calls}, None)
            elif rest:
                yield chunk(cid, model, {"content": rest}, None)
            yield chunk(cid, model, {}, finish_reason(ended))
    except (AssistantError, ValueError) as e:
        failed = True
        kind = ("overloaded" if isinstance(e, EngineBusy) else
                "invalid_request_error" if isinstance(e, ValueError) else "server_error")
        yield f"data: {json.dumps(error_body(str(e), kind))}\n\n"
    except Exception as e:
        failed = True
        log.exception("generation failed mid-stream")
        yield f"data: {json.dumps(error_body(f'Generation failed: {type(e).__name__}: {e}', 'server_error'))}\n\n"
    finally:
        close_if_closable(deltas)
        if ticket is not None:  # also when the client went away (GeneratorExit): the partial counts
            status = "error" if failed else status_of(ended) if ended else "cancelled"
            ticket.finish(status, last.num_prompt_tokens, last.num_cached_tokens, last.num_generated_tokens)
    if include_usage:
        usage = {"id": cid, "object": "text_completion" if shape.text else "chat.completion.chunk", "model": model,
                 "choices": [], "usage": usage_of(last)}
        yield f"data: {json.dumps(usage)}\n\n"
    yield "data: [DONE]\n\n"
