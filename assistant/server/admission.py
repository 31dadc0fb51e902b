"""Admission control: a bounded number of generations run at once, a bounded number wait, by priority.

NOTE the model: `max_running` slots (keep it at least the engine's batch size, so the engine stays
full) and a waiting line of at most `max_queued` requests. A request that finds a free slot and
nobody waiting runs at once; otherwise it waits in line, higher tier priority first, then first
come; when the line is full it is refused at once (the server answers 503 with Retry-After) instead
of queueing without limit. A finished request hands its slot straight to the head of the line.

`acquire` is awaited on the event loop; `release` may be called from any thread (a stream ends in
Starlette's thread pool), so a slot is handed over with `call_soon_threadsafe`. A waiter whose client
went away (its task cancelled) leaves the line, or passes on a slot it was handed meanwhile.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
from typing import Any


class Admission:
    def __init__(self, max_running: int, max_queued: int) -> None:
        self.max_running, self.max_queued = max_running, max_queued
        self._lock = threading.Lock()
        self._running = 0
        self._line: list[tuple[int, int, Any, asyncio.Future]] = []  # (-priority, seq, loop, future)
        self._seq = itertools.count()

    @property
    def num_running(self) -> int:
        return self._running

    @property
    def num_waiting(self) -> int:
        return len(self._line)

    async def acquire(self, priority: int = 0) -> bool:
        """Wait for a slot; False at once when the line is full."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._running < self.max_running and not self._line:
                self._running += 1
                return True
            if len(self._line) >= self.max_queued:
                return False
            future: asyncio.Future = loop.create_future()
            entry = (-priority, next(self._seq), loop, future)
            heapq.heappush(self._line, entry)
        try:
            await future
            return True
        except asyncio.CancelledError:
            with self._lock:
                if entry in self._line:  # still waiting: just leave the line
                    self._line.remove(entry)
                    heapq.heapify(self._line)
            # else: a slot was handed to us meanwhile; _grant sees the cancelled future and passes it on
            raise

    def release(self) -> None:
        """Give a slot back: to the head of the line, or to the pool."""
        with self._lock:
            if self._line:
                _, _, loop, future = heapq.heappop(self._line)
            else:
                self._running -= 1
                return
        loop.call_soon_threadsafe(self._grant, future)  # the slot moves with the call: _running unchanged

    def _grant(self, future: asyncio.Future) -> None:
        if future.done():  # its waiter was cancelled: the slot goes to the next one
            self.release()
        else:
            future.set_result(True)
