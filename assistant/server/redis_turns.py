"""Cancelling a turn that another replica runs: the running turns' registry shared through Redis.

Behind a load balancer, POST /api/turns/{id}/cancel may reach a replica other than the one streaming
that turn. With `server.redis_url` set, every replica:
  * records each turn it starts under `assistant:turn:<message id>` (its replica id, with a TTL so a
    replica that died leaves nothing behind for long), and removes it when the turn ends;
  * listens on the `assistant:cancel` channel in one daemon thread and cancels its own turn when a
    message names it.
A cancel that finds no local turn asks Redis whether a replica runs it, and publishes the id if one
does; the answer is then 200 like a local cancel (the owning replica stops it within a moment), and
404 as before when no replica runs it. Pub/sub delivers to the replicas listening now, which is what
a cancel needs: a turn that starts later is not the one being stopped.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

from assistant.errors import ConfigError
from assistant.server.redis_limits import redis_client
from assistant.server.turns import RunningTurns

log = logging.getLogger(__name__)

CHANNEL = "assistant:cancel"
TURN_TTL_S = 3600  # longer than any turn runs; a crashed replica's record expires after it
RETRY_MIN_S, RETRY_MAX_S = 0.5, 30.0  # the listener's pause after a failed read, doubling up to the max


class RedisRunningTurns(RunningTurns):
    def __init__(self, client: Any, *, prefix: str = "assistant:turn") -> None:
        super().__init__()
        self.client, self.prefix = client, prefix
        self.replica = uuid.uuid4().hex[:12]
        self._retry_s, self._last_warning = RETRY_MIN_S, -1e9
        self._pubsub = client.pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(**{CHANNEL: self._on_cancel})
        self._thread = self._pubsub.run_in_thread(sleep_time=0.5, daemon=True, exception_handler=self._on_error)

    @classmethod
    def from_url(cls, url: str) -> "RedisRunningTurns":
        client = redis_client(url, socket_timeout=5)  # a ConfigError when the library is missing
        import redis

        try:
            return cls(client)
        except redis.RedisError as e:
            raise ConfigError(f"server.redis_url is set, but Redis at {url} cannot be reached ({e}): start it, "
                              "or unset server.redis_url for a single server.") from e

    def add(self, message_id: str, cancel: threading.Event) -> None:
        super().add(message_id, cancel)
        self._try(self.client.set, f"{self.prefix}:{message_id}", self.replica, ex=TURN_TTL_S)

    def remove(self, message_id: str) -> None:
        super().remove(message_id)
        self._try(self.client.delete, f"{self.prefix}:{message_id}")

    def cancel(self, message_id: str) -> bool:
        if super().cancel(message_id):
            return True
        if not self._try(self.client.exists, f"{self.prefix}:{message_id}"):
            return False
        return bool(self._try(self.client.publish, CHANNEL, message_id))

    def close(self) -> None:
        """Stop listening (again: a no-op)."""
        if self._thread.is_alive():
            self._thread.stop()
        self._pubsub.close()

    def _on_cancel(self, message: dict) -> None:
        self._retry_s = RETRY_MIN_S  # connected again
        data = message.get("data")
        super().cancel(data.decode() if isinstance(data, bytes) else str(data))

    @staticmethod
    def _try(call, *args, **kwargs) -> Any:
        """Redis being away must not break the turns of this replica: a cross-replica cancel then
        fails (404) and says so in the log; local ones keep working."""
        try:
            return call(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - redis.RedisError and connection failures
            log.warning("turn registry (Redis) unavailable: %s", e)
            return None

    def _on_error(self, exc: BaseException, pubsub: Any, thread: Any) -> None:
        """Redis away: retry with a growing pause (at most RETRY_MAX_S), saying so once per outage
        and then once a minute, not at every retry."""
        now = time.monotonic()
        if now - self._last_warning >= 60:
            log.warning("turn cancel listener (Redis) failed: %s; retrying (cancels from other replicas "
                        "do not reach this one meanwhile)", exc)
            self._last_warning = now
        self._retry_s = min(RETRY_MAX_S, self._retry_s * 2)
        time.sleep(self._retry_s)
