"""`SessionPool`: one live session (a warm container, or a fake namespace) per conversation.

NOTE on the model: a session is expensive to create (~0.5 s for a container) and cheap to reuse
(~ms), and it holds state the user expects to keep (variables, files), so the pool keeps one per
conversation and bounds them in two ways:
  - count: at most `max_sessions`; creating one more evicts the least recently used idle session;
  - time: a session idle for `idle_s` is destroyed by `reap_idle()` (called on every acquire and by
    the executor's reaper thread).
A session in use is never evicted or reaped. Creation happens outside the pool lock (under a
per-conversation lock), so one slow container start does not stall the other conversations.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Generic, Iterator, TypeVar

from assistant.errors import ToolUnavailable

S = TypeVar("S")


@dataclass
class Slot(Generic[S]):
    """A conversation's place in the pool; `session` is None until created (or after a discard)."""

    key: str
    session: S | None = None
    last_used: float = 0.0
    num_users: int = 0  # acquirers holding or waiting for this slot; > 0 protects it from eviction
    lock: threading.Lock = field(default_factory=threading.Lock)  # one run at a time per conversation


class SessionPool(Generic[S]):
    def __init__(
        self,
        create: Callable[[str], S],
        destroy: Callable[[S], None],
        *,
        max_sessions: int,
        idle_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        assert max_sessions >= 1, max_sessions
        self._create, self._destroy = create, destroy
        self.max_sessions, self.idle_s, self._clock = max_sessions, idle_s, clock
        self._slots: OrderedDict[str, Slot[S]] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def keys(self) -> list[str]:
        """Conversations holding a slot, least recently used first."""
        with self._lock:
            return list(self._slots)

    def peek(self, key: str) -> S | None:
        """`key`'s session if it has one, without using or locking it."""
        with self._lock:
            slot = self._slots.get(key)
            return slot.session if slot is not None else None

    def __len__(self) -> int:
        return len(self._slots)

    @contextmanager
    def acquire(self, key: str) -> Iterator[Slot[S]]:
        """Hold `key`'s slot (its session created if needed) for one run; runs on a key are serialized."""
        self.reap_idle()
        victims: list[Slot[S]] = []
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                victims = self._evict_for_one_more()
                slot = self._slots[key] = Slot(key)
            self._slots.move_to_end(key)
            slot.num_users += 1
        self._destroy_all(victims)
        try:
            with slot.lock:
                if slot.session is None:
                    slot.session = self._create(key)
                yield slot
        finally:
            with self._lock:
                slot.num_users -= 1
                slot.last_used = self._clock()
                if slot.session is None and slot.num_users == 0 and self._slots.get(key) is slot:
                    del self._slots[key]  # creation failed or the session was discarded: free the place

    def discard(self, slot: Slot[S]) -> None:
        """Destroy the slot's session (called while holding it, e.g. after a timeout); the next run recreates it."""
        session, slot.session = slot.session, None
        if session is not None:
            self._destroy_all([_Detached(session)])

    def remove(self, key: str) -> bool:
        """Destroy `key`'s session now (waiting for a run in progress). False if it had none."""
        with self._lock:
            slot = self._slots.get(key)
        if slot is None:
            return False
        with slot.lock:
            with self._lock:
                if self._slots.get(key) is slot:
                    del self._slots[key]
            session, slot.session = slot.session, None
        if session is not None:
            self._destroy_all([_Detached(session)])
        return session is not None

    def reap_idle(self) -> list[str]:
        """Destroy sessions idle for longer than idle_s; returns their keys."""
        now = self._clock()
        with self._lock:
            idle = [s for s in self._slots.values() if s.num_users == 0 and now - s.last_used > self.idle_s]
            for slot in idle:
                del self._slots[slot.key]
        self._destroy_all(idle)
        return [s.key for s in idle]

    def close(self) -> None:
        with self._lock:
            slots, self._slots = list(self._slots.values()), OrderedDict()
        self._destroy_all(slots)

    def _evict_for_one_more(self) -> list[Slot[S]]:
        """Under the lock: pop least recently used idle slots until one more fits."""
        victims = []
        while len(self._slots) >= self.max_sessions:
            slot = next((s for s in self._slots.values() if s.num_users == 0), None)
            if slot is None:
                raise ToolUnavailable(
                    f"All {self.max_sessions} code sandboxes are busy; try again shortly or raise "
                    "sandbox.max_containers."
                )
            del self._slots[slot.key]
            victims.append(slot)
        return victims

    def _destroy_all(self, slots) -> None:
        for slot in slots:
            if slot.session is not None:
                try:
                    self._destroy(slot.session)
                finally:
                    slot.session = None


@dataclass
class _Detached:
    """A session already taken out of its slot, in the shape `_destroy_all` expects."""

    session: object
