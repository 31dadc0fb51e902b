"""Fixtures of the gateway tests: the real app (create_app, web chat off) over the real composition root
with a scripted engine, an in-memory SQLite store and the deterministic hash embedder."""

from __future__ import annotations

import threading
from typing import Any

from assistant.agent_loop import AgentOptions
from assistant.app import build_assistant
from assistant.config import AssistantConfig
from assistant.engine.base import Engine, TokenDelta
from assistant.engine.fake import ScriptedEngine
from assistant.store import Store

ERROR_KEYS = {"message", "type", "param", "code"}
USER = {"role": "user", "content": "hi"}


def make_app(tmp_path, *script: Any, engine: Engine | None = None, media: Any = None, settings: dict | None = None,
             **server: Any) -> tuple[Any, Any, Any]:
    """(assistant, engine, app); `server` overrides server.* settings (tiers as dicts), `settings` any
    other ("engine.response_cache": True); `media` replaces voice and vision (assistant/modalities.py:
    pass Modalities(config, stt=..., tts=..., describer=...)). The safety layer is off unless `settings`
    turns it on (its own tests use fake detectors: tests/test_guarded_api.py)."""
    from assistant.server.app import create_app

    engine = engine or ScriptedEngine(script)
    overrides = {"data_dir": str(tmp_path), "retrieval.embedder": "hash-64", "safety.enabled": False,
                 **{f"server.{k}": v for k, v in server.items()}, **(settings or {})}
    config = AssistantConfig.load(env={}, overrides=overrides)
    if callable(media):
        media = media(config)
    assistant = build_assistant(config, engine=engine, store=Store("sqlite://"), tools=[], options=AgentOptions(),
                                media=media)
    return assistant, engine, create_app(assistant, web_chat=False)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_openai_error(response: Any, status: int, *, code: str | None = "any") -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and isinstance(error["message"], str) and error["message"]
    if code != "any":
        assert error["code"] == code, error
    return error


class GatedEngine(Engine):
    """Streams `num_tokens` one-character deltas, each only after `step` is released (or all at once
    when `free`); counts what it was asked and whether its stream was closed."""

    name = "gated"

    def __init__(self, num_tokens: int = 50) -> None:
        self.num_tokens = num_tokens
        self.step = threading.Semaphore(0)
        self.free = threading.Event()
        self.closed = threading.Event()
        self.calls = 0

    def count_tokens(self, messages, *, tools=None) -> int:
        return 3

    def open_all(self) -> None:
        """Every stream, running or to come, runs to its end without waiting."""
        self.free.set()
        self.step.release(10 * self.num_tokens)

    def generate(self, prompt, params, *, tools=None, cancel=None):
        self.calls += 1
        return self._deltas(params)

    def _deltas(self, params):
        try:
            for i in range(1, self.num_tokens + 1):
                if not self.free.is_set():
                    self.step.acquire(timeout=30)
                yield TokenDelta("x", (i,), "length" if i == self.num_tokens else None, 3, i, 1)
        finally:
            self.closed.set()
