"""The gateway's outermost layer (plain ASGI, so streams pass through untouched): request ids, W3C
trace context, the request body limit, per-request metrics and one structured log line per request.

  * Request id: a client's `x-request-id` (if short and printable) or a new `req_<hex>`; returned on
    every response as `x-request-id` and available to handlers as `request.state.request_id`.
  * Trace context: a valid incoming `traceparent` keeps its trace id (and sampled flag) and this
    request becomes a child span; otherwise a new trace starts. The response carries our
    `traceparent`, so a caller can join its trace with ours.
  * Body limit: a `content-length` above the route's limit (`max_body_bytes`; `max_upload_bytes` for the
    routes that take recordings, pictures and files) is refused with 413 before one byte of the
    body is read; a chunked body is counted as it arrives and refused the moment it passes the limit.
  * Log: one JSON line per request on the `assistant.access` logger (id, trace, method, path,
    status, ms, key id when authenticated).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from typing import Any, Awaitable, Callable

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# routes that take uploads (server.max_upload_bytes): OpenAI's audio, the turn endpoints, the document library,
# the web chat's files
UPLOAD_PREFIXES = ("/v1/audio/transcriptions", "/api/turns", "/api/conversations", "/api/documents",
                   "/gradio_api/upload", "/upload")
access_log = logging.getLogger("assistant.access")


def new_trace(traceparent: str | None) -> tuple[str, str, str]:
    """(trace id, our span id, flags) continuing `traceparent` when it is valid."""
    match = TRACEPARENT.match((traceparent or "").strip().lower())
    if match and match.group(1) != "0" * 32 and match.group(2) != "0" * 16:
        return match.group(1), secrets.token_hex(8), match.group(3)
    return secrets.token_hex(16), secrets.token_hex(8), "01"


def _route(path: str) -> str:
    """A low-cardinality label for metrics: the API routes by name, everything else as 'other'."""
    for prefix in ("/v1/chat/completions", "/v1/embeddings", "/v1/models", "/api/turns", "/api/conversations",
                   "/api/documents", "/metrics"):
        if path.startswith(prefix):
            return prefix
    return "other"


class GatewayMiddleware:
    def __init__(self, app: Any, *, max_body_bytes: int, max_upload_bytes: int | None = None,
                 metrics: Any = None) -> None:
        self.app, self.max_body_bytes, self.metrics = app, max_body_bytes, metrics
        self.max_upload_bytes = max(max_body_bytes, max_upload_bytes or max_body_bytes)

    def limit(self, path: str) -> int:
        """The body limit of a route: uploads (a recording, pictures, files) get the larger one."""
        return self.max_upload_bytes if path.startswith(UPLOAD_PREFIXES) else self.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get("x-request-id", "")
        request_id = given if REQUEST_ID.match(given) else f"req_{secrets.token_hex(12)}"
        trace_id, span_id, flags = new_trace(headers.get("traceparent"))
        traceparent = f"00-{trace_id}-{span_id}-{flags}"
        state = scope.setdefault("state", {})
        state.update(request_id=request_id, trace_id=trace_id, traceparent=traceparent, started=start)
        extra = [(b"x-request-id", request_id.encode()), (b"traceparent", traceparent.encode())]
        status = {"code": 0, "refused": False}

        async def send_with_ids(message: Message) -> None:
            if status["refused"]:
                return  # we answered 413 already; whatever the app says after that goes nowhere
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        async def refuse() -> None:
            await self._too_large(send_with_ids, limit)
            status["refused"] = True

        length = headers.get("content-length", "")
        limit = self.limit(scope.get("path", ""))
        if length.isdigit() and int(length) > limit:
            await refuse()
        else:
            received = {"n": 0}

            async def counted_receive() -> Message:
                if status["refused"]:
                    return {"type": "http.disconnect"}
                message = await receive()
                if message["type"] == "http.request":
                    received["n"] += len(message.get("body", b""))
                    if received["n"] > limit and not status["code"]:
                        await refuse()  # the app sees a client that went away; the client sees the 413
                        return {"type": "http.disconnect"}
                return message

            try:
                await self.app(scope, counted_receive, send_with_ids)
            except Exception:
                if not status["refused"]:
                    raise
        elapsed = time.perf_counter() - start
        route = _route(scope.get("path", ""))
        if self.metrics is not None and route != "other":
            self.metrics.requests.labels(route, str(status["code"])).inc()
            self.metrics.latency.labels(route).observe(elapsed)
        if access_log.isEnabledFor(logging.INFO):
            principal = state.get("principal")
            access_log.info(json.dumps({
                "request_id": request_id, "trace_id": trace_id, "span_id": span_id, "method": scope.get("method"),
                "path": scope.get("path"), "status": status["code"], "ms": round(elapsed * 1000, 2),
                "key_id": getattr(principal, "key_id", None)}))

    async def _too_large(self, send: Send, limit: int) -> None:
        setting = "server.max_upload_bytes" if limit == self.max_upload_bytes != self.max_body_bytes else \
            "server.max_body_bytes"
        body = json.dumps({"error": {
            "message": f"The request body is larger than the server's limit of {limit} bytes "
                       f"({setting}).", "type": "invalid_request_error", "param": None,
            "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
