"""Server-sent events: one event's text (`server_sent`), and a StreamingResponse that closes its source
the moment the response ends, however it ends.

Starlette iterates a synchronous generator in the threadpool and, when the client goes away, cancels
that iteration but leaves the generator suspended; it is closed only when the garbage collector
breaks the reference cycle of the cancellation's traceback, seconds or minutes later. Until then the
engine request keeps decoding for nobody (holding its KV blocks) and nothing is recorded. Closing
the generator runs its `finally`: the engine request is cancelled and the partial usage recorded.
A generator that never started (its client left before the first chunk was asked for, e.g. while the
request waited for a slot) would skip its `finally` on close, and with it the admission slot's return
and the usage row: it is run to its first yield first, then closed.
The close runs in the threadpool (it may write to the store), shielded from the cancellation.
"""

from __future__ import annotations

import inspect
import json
from typing import Any, Iterator

import anyio
from fastapi.responses import StreamingResponse


def server_sent(kind: str, data: dict[str, Any]) -> str:
    """One event of a text/event-stream: `event: <kind>` and its JSON `data`."""
    return f"event: {kind}\ndata: {json.dumps(data, default=str)}\n\n"


class ClosingStreamingResponse(StreamingResponse):
    def __init__(self, content: Iterator[Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(content, *args, **kwargs)
        self._source = content

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._close_source)

    def _close_source(self) -> None:
        close = getattr(self._source, "close", None)
        if close is None:
            return
        try:
            if inspect.isgenerator(self._source) and inspect.getgeneratorstate(self._source) == inspect.GEN_CREATED:
                next(self._source, None)  # never started (see the module docstring): run it to its first yield
            close()
        except ValueError:  # "generator already executing": its own thread is finishing it
            pass
