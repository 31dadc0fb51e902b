"""The turn's seams: what a turn takes in, and the slots that guards and modalities plug into.

Every slot has a no-op default, so the core runs with nothing plugged in:
  * `UserInput`          text plus optional audio, images and files, from any front end;
  * `PreStage`           speech -> text and image -> description, before anything else sees the turn;
  * `InputGuard`         checks the user's message before it is stored, and every retrieved or tool
                         text before it enters the context (the agent loop's `observe()`);
  * `StreamTransformer`  wraps the one place where answer text is emitted: an output guard (redaction,
                         one sentence of hold-back) or a sentence-to-speech transformer that adds
                         AudioChunk events. Transformers are chained in order; what the last one emits
                         is what the user sees and what is stored.
The real backends (tools/speech, tools/vision, assistant/safety) implement these; tests plug in fakes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from assistant.errors import ToolUnavailable
from assistant.events import TurnEvent


def close_if_closable(obj: Any) -> None:
    """Close `obj` when it can be closed: a token or event stream (the engine stops generating, a
    generator's `finally` runs), a tool or a retriever holding resources. Anything else is left alone."""
    close = getattr(obj, "close", None)
    if callable(close):
        close()


@dataclass(frozen=True)
class Attachment:
    """One file of a turn: bytes in memory or a path on disk (exactly one of the two)."""

    name: str  # file name as the user gave it, e.g. "question.wav"
    data: bytes = field(default=b"", repr=False)
    path: Path | None = None
    mime_type: str = ""  # "" = guess from the name

    def read(self) -> bytes:
        return self.path.read_bytes() if self.path is not None else self.data


@dataclass(frozen=True)
class UserInput:
    """What a user sends in one turn. `text` may be empty when audio carries the question."""

    text: str = ""
    audio: Attachment | None = None  # speech; its transcript becomes the user's message
    images: tuple[Attachment, ...] = ()  # pictures; their descriptions enter the model's context
    files: tuple[Attachment, ...] = ()  # documents to ingest before the question is answered
    speak: bool = False  # also answer in speech (AudioChunk events), whatever the config's default
    model: str = ""  # "" = routed per engine call (assistant/routing.py); "small" or "large" = that model all turn

    @classmethod
    def of(cls, value: "UserInput | str") -> "UserInput":
        return value if isinstance(value, UserInput) else cls(text=value)


@dataclass(frozen=True)
class Verdict:
    """A guard's decision about one text."""

    allowed: bool = True
    category: str = ""  # e.g. "prompt_injection"
    score: float = 0.0
    threshold: float = 0.0
    detector: str = ""  # which detector decided
    reason: str = ""  # for the user: why, and what they can do
    # a second opinion still reading (InputGuard.check_early): call it for the final verdict, which may block
    pending: Callable[[], "Verdict"] | None = field(default=None, compare=False)
    # what the pending opinion would read from the turn's own prefill (assistant/engine/taps.py): the
    # orchestrator hands it to the turn's first model call, which fills it or declines it
    tap: Any = field(default=None, compare=False)
    # a check that waits to be started (InputGuard.check_beside): the orchestrator starts it once the
    # turn's own Python work is done and its model call is next, so the two do not queue for the GIL
    begin: Callable[[], Any] | None = field(default=None, compare=False)

    def final(self) -> "Verdict":
        """This verdict, or the second opinion's when one is pending (waits for it)."""
        return self.pending() if self.pending is not None else self


ALLOWED = Verdict()


class InputGuard(Protocol):
    """A guard may also offer `for_conversation(conversation_id) -> InputGuard` (the guard bound to that
    conversation's policy); the orchestrator uses it when present."""

    def check(self, text: str, *, where: str) -> Verdict:
        """where: "input" (the user's message), "retrieved" (document passages) or "tool" (tool output).
        An allowed verdict with a category is a warning the user is shown. It may also offer
        `check_early(text, where=...)`: the same verdict, except that a slow second opinion may still be
        `pending` (the orchestrator lets the turn start and shows nothing until it resolves), and
        `check_beside(text, where=..., cancel=...)`: every detector pending, started by `Verdict.begin`
        beside the turn's first model call, `cancel` set when they block."""
        ...


class AllowAll:
    """The default input guard: lets everything through."""

    def check(self, text: str, *, where: str) -> Verdict:
        return ALLOWED


class StreamTransformer:
    """Wraps emitted answer text. `feed` gets each TextDelta (and any event an earlier transformer
    emitted) and returns the events to emit in its place; `finish` flushes what it held back at the end
    of the answer, or of a part of it that ended early (a loop stopped before a notice): it may be called
    again, and then flushes only what was fed since. The default passes everything through."""

    def feed(self, event: TurnEvent) -> Sequence[TurnEvent]:
        return (event,)

    def finish(self) -> Sequence[TurnEvent]:
        return ()

    def for_turn(self, conversation_id: str) -> "StreamTransformer":
        """The instance that serves one answer. A transformer with per-answer state (an output guard's
        held-back sentence) returns a fresh one; the default shares this instance."""
        return self


class PreStage(Protocol):
    def transcribe(self, audio: Attachment) -> str:
        """The words spoken in `audio` ("" when there is no speech)."""
        ...

    def describe(self, image: Attachment) -> str:
        """A compact description of the image for the model's context."""
        ...


class NoModalities:
    """The default pre-stage: no speech or vision backend is plugged in, so such input is refused
    with a message that says so (never silently dropped)."""

    def transcribe(self, audio: Attachment) -> str:
        raise ToolUnavailable(f"Speech input ({audio.name}) is not available in this build: type the question instead.")

    def describe(self, image: Attachment) -> str:
        raise ToolUnavailable(f"Image input ({image.name}) is not available in this build: describe the picture in words.")
