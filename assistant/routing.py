"""Model routing: a small and a large engine, chosen per engine call, with fallback to the small one.

Design note — the policy (`RoutingPolicy`):
  * simple turns go to the small model: a plain question with a short prompt;
  * a call goes to the large model when the prompt is long (>= long_prompt_tokens), when it carries
    retrieved document passages, or when it follows a tool step of this turn (reading tool output
    and deciding what to do next is where the small model fails most) — the "tool-heavy" case;
  * any other turn goes to the large model too unless it is a writing request (`WRITING`: "Write a poem
    about…", "Tell me a joke…"), which stays on the small one (`large_for_questions`). Measured through the
    assistant on general-knowledge questions with checkable answers (eval/general/facts.py, 2026-12-01): on
    the 70 it was read on the 0.5B answered 29 right ("How many legs does a spider have?" "1"; "the largest
    mammal is the elephant"), the 1.5B 55, at ~0.9 s a question against ~0.25 s; on the 50 held out, 38
    against 45. On 16 writing requests the 1.5B refused 4 ("I'm sorry, but I can't
    assist with that.") and the 0.5B none (2026-11-30);
  * the large engine is created on first use (loading it takes a while: ~8 s for the packaged 1.5B
    model on 2 cores, its int8 engine build included), or at once on a thread of its own with `preload()` (the server does, so that the
    first document question does not wait for it; a call that needs it meanwhile waits); if it cannot be created
    (not prepared), is overloaded (`EngineBusy`) or fails before its first token, the call falls
    back to the small model and the orchestrator emits a Notice saying why. A large model that
    could not be loaded is not retried for `retry_after_s`.
  * a turn may name its model ("small" or "large", `UserInput.model`: the web chat's model menu);
    every call of that turn then goes to it, with the same fallback.
  Routing only ever picks an engine; both engines see exactly the same messages and tools.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from assistant.engine.base import Engine, TokenDelta
from assistant.engine.taps import generate_kwargs
from assistant.errors import AssistantError, EngineBusy

SMALL, LARGE = "small", "large"
# a request for a piece of writing: a story, poem, letter, joke... ("Write a Python function" is not)
WRITING = re.compile(
    r"^\s*(?:please\s+)?(?:(?:can|could|would)\s+you\s+(?:please\s+)?)?(?:write|compose|draft|create|make\s+up|invent|tell"
    r"|give)\s+(?:me\s+)?(?:a|an|some|the|one|two|three|\d+)?\s*(?:[\w'-]+\s+){0,4}?(?:story|stories|poems?|haiku|"
    r"limerick|songs?|lyrics|letter|speech|essay|note|message|jokes?|tale|toast|e-?mail|quote|verse|sonnet|rhyme|"
    r"slogan|tweet|post|dialogue|fable|riddle|bedtime)\b", re.I)

LOADER_THREAD = "load-large-model"  # `preload`'s thread (assistant/server/app.py `exit_if_loading`)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoutingPolicy:
    long_prompt_tokens: int = 1536  # prompts at least this long go to the large model
    large_for_documents: bool = True  # calls that carry retrieved passages go to the large model
    large_after_tools: bool = True  # calls that follow a tool step of this turn go to the large model
    large_for_questions: bool = True  # every other turn too, unless it is a writing request (`WRITING`)
    retry_after_s: float = 300.0  # after the large model failed to load, use the small one this long


@dataclass(frozen=True)
class Route:
    role: str  # SMALL or LARGE
    reason: str  # why, for logs and the stored message meta


class Router:
    """Picks the engine for one call and streams from it, falling back to the small engine."""

    def __init__(self, small: Engine, large: Engine | Callable[[], Engine] | None = None,
                 policy: RoutingPolicy | None = None) -> None:
        self.small = small
        self._large = large if isinstance(large, Engine) else None
        self._large_factory = None if isinstance(large, Engine) or large is None else large
        self.policy = policy or RoutingPolicy()
        self._lock = threading.Lock()
        self._loading = False  # `preload` is creating the large engine
        self._large_failed_at = 0.0
        self._large_error = ""
        self._closed = False

    @property
    def has_large(self) -> bool:
        return self._large is not None or self._large_factory is not None

    def choose(self, *, prompt_tokens: int, has_documents: bool, after_tool_step: bool, prefer: str = "",
               writing: bool = False) -> Route:
        """The engine for one call; `prefer` ("small" or "large") is the user's choice for the turn, `writing`
        whether the turn asks for a piece of writing (`WRITING`)."""
        p = self.policy
        if not self.has_large:
            return Route(SMALL, "no large model configured")
        if prefer in (SMALL, LARGE):
            return Route(prefer, "chosen for this turn")
        if prompt_tokens >= p.long_prompt_tokens:
            return Route(LARGE, f"long prompt ({prompt_tokens} tokens)")
        if has_documents and p.large_for_documents:
            return Route(LARGE, "document passages")
        if after_tool_step and p.large_after_tools:
            return Route(LARGE, "tool step")
        if writing:
            return Route(SMALL, "writing request")
        if p.large_for_questions:  # not worth waiting for while it loads, nor a notice when it cannot (a document is)
            if self._loading:
                return Route(SMALL, "question, while the large model loads")
            return Route(SMALL, "question, the large model is unavailable") if self._failed_lately() else Route(
                LARGE, "question")
        return Route(SMALL, "simple turn")

    def _failed_lately(self) -> bool:
        """Whether the large engine could not be created within the last `retry_after_s`."""
        return bool(self._large_failed_at) and time.monotonic() - self._large_failed_at < self.policy.retry_after_s

    def large(self) -> Engine:
        """The large engine, created on first use; raises AssistantError when it cannot be."""
        with self._lock:
            if self._large is not None:
                return self._large
            if self._failed_lately():
                raise EngineBusy(f"the large model is unavailable ({self._large_error})")
            try:
                self._large = self._large_factory()  # type: ignore[misc]
            except AssistantError as e:
                self._large_failed_at, self._large_error = time.monotonic(), str(e)
                raise
            return self._large

    @property
    def context_window(self) -> int:
        """The window every prompt must fit: the smallest of the engines that may get it (the large
        engine counts once it is loaded; until then its window is unknown and the first long turn
        that reaches it is checked by the engine itself)."""
        windows = [self.small.context_window] + ([self._large.context_window] if self._large is not None else [])
        return min(windows)

    def engine(self, route: Route) -> Engine:
        return self.large() if route.role == LARGE else self.small

    def generate(self, route: Route, *args, notices: list[str], tap: Any = None,
                 **kwargs) -> tuple[Engine, Iterator[TokenDelta]]:
        """(engine used, its delta stream). A large-model failure before the first delta falls back to
        the small engine and appends a user-facing line to `notices`. `tap` (assistant/engine/taps.py)
        goes to the engine that answers when it can fill it, and is declined otherwise."""
        if route.role == SMALL:
            return self.small, self.small.generate(*args, **generate_kwargs(self.small, tap, kwargs))
        try:
            engine = self.large()
            stream = engine.generate(*args, **generate_kwargs(engine, tap, kwargs))
            first = next(stream, None)
        except AssistantError as e:
            notices.append(f"The large model is not available right now ({e}); the small model answers instead.")
            return self.small, self.small.generate(*args, **generate_kwargs(self.small, tap, kwargs))
        return engine, _prepend(first, stream)

    def preload(self, done: Callable[[Engine | None, str], None] | None = None) -> threading.Thread | None:
        """Create the large engine now, on a thread of its own; `done(engine or None, error)` is called
        when it is ready or could not be loaded. None when there is nothing to load."""
        if self._large is not None or self._large_factory is None:
            return None

        def load() -> None:
            engine, error = None, ""
            try:
                engine = self.large()
            except AssistantError as e:
                error = str(e)
                log.warning("the large model could not be loaded: %s", e)
            finally:
                self._loading = False
            if self._closed:  # closed while it loaded: nothing else will close it
                self.close()
            elif done is not None:
                done(engine, error)

        thread = threading.Thread(target=load, name=LOADER_THREAD, daemon=True)
        self._loading = True
        thread.start()
        return thread

    def close(self) -> None:
        """Safe to call twice, and while `preload` is loading (the loader closes what it loaded)."""
        self._closed = True
        if self._large is not None:
            self._large.close()


def _prepend(first: TokenDelta | None, rest: Iterator[TokenDelta]) -> Iterator[TokenDelta]:
    if first is not None:
        yield first
    yield from rest
