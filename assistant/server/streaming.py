"""Server-sent events: one event's text (`server_sent`), and a StreamingResponse that closes its source
the moment the response ends, however it ends.

Starlette iterates a synchronous generator in the threadpool and, when the client goes away, cancels
that iteration but leaves the generator suspended; it is closed only when the garbage collector
breaks the reference cycle of the cancellation's traceback, seconds or minutes later. Until then the
engine request keeps decoding for nobody (holding its KV blocks) and nothing is recorded. Closing
the generator runs its `finally`: the engine request is cancelled and the partial usage recorded.
The close runs in the threadpool (it may write to the store), shielded from the cancellation.
"""

from __future__ import annotations

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
            close()
        except ValueError:  # "generator already executing": its own thread is finishing it
            pass
