"""TurnEvent: the one typed event stream from the orchestrator to every front end.

The Gradio app, the terminal REPL, the Jupyter widget and the SSE API are thin adapters over an
`Iterator[TurnEvent]`; non-streaming callers just drain it. `to_dict()` gives the JSON form.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class TurnEvent:
    type: ClassVar[str] = "event"

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class TurnStarted(TurnEvent):
    """First event of every turn: the ids a front end needs to cancel, regenerate or edit it."""

    type: ClassVar[str] = "turn_started"
    conversation_id: str
    user_message_id: str  # the stored question (edit it with Orchestrator.edit)
    message_id: str  # the stored answer being written; also the turn's id for cancel


@dataclass(frozen=True)
class Transcribed(TurnEvent):
    """The pre-stage turned speech into the text that becomes the user's message."""

    type: ClassVar[str] = "transcribed"
    text: str


@dataclass(frozen=True)
class ImageDescribed(TurnEvent):
    """The pre-stage described an image of the turn; the description enters the model's context."""

    type: ClassVar[str] = "image_described"
    index: int  # 1-based position of the image in the turn
    description: str


@dataclass(frozen=True)
class TextDelta(TurnEvent):
    type: ClassVar[str] = "text_delta"
    text: str  # new answer text (whole characters)


@dataclass(frozen=True)
class ToolCallStarted(TurnEvent):
    type: ClassVar[str] = "tool_call_started"
    call_id: str  # unique within the turn
    name: str  # tool name
    arguments: dict[str, Any]  # validated arguments


@dataclass(frozen=True)
class ToolCallFinished(TurnEvent):
    type: ClassVar[str] = "tool_call_finished"
    call_id: str
    name: str
    ok: bool  # False when the tool reported an error (fed back to the model as an observation)
    summary: str  # short result for display
    artifacts: tuple[str, ...] = ()  # ids/paths of files the tool produced
    skipped: bool = False  # not run: the model repeated a call it already made this turn (not a failure)


@dataclass(frozen=True)
class Source:
    marker: int  # the [n] used in the answer
    doc: str  # document name
    page: int | None  # 1-based page, None for page-less formats
    snippet: str  # the retrieved text shown as evidence
    chunk_id: str = ""  # id of the retrieved chunk


@dataclass(frozen=True)
class Sources(TurnEvent):
    type: ClassVar[str] = "sources"
    sources: tuple[Source, ...]
    dropped_markers: tuple[int, ...] = ()  # cited markers that matched no retrieved chunk


@dataclass(frozen=True)
class SafetyVerdict(TurnEvent):
    """A guard acted: the user's message was blocked, or retrieved/tool text was quarantined."""

    type: ClassVar[str] = "safety"
    stage: str  # "input" (the user's message) | "retrieved" | "tool" (text entering the context) | "output"
    allowed: bool  # False: blocked (input) or quarantined (retrieved / tool text, fenced as data)
    category: str = ""  # e.g. "prompt_injection", "offensive", "pii"
    reason: str = ""  # for the user: what happened and what they can do
    score: float = 0.0  # the detector's score
    threshold: float = 0.0  # the score at which it acts
    detector: str = ""  # which detector fired


@dataclass(frozen=True)
class AudioChunk(TurnEvent):
    """Speech of the answer, emitted by a text-to-speech stream transformer (see assistant/seams.py)."""

    type: ClassVar[str] = "audio"
    sample_rate: int
    pcm16: bytes = field(repr=False)  # mono little-endian 16-bit samples

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "sample_rate": self.sample_rate, "num_bytes": len(self.pcm16)}


@dataclass(frozen=True)
class Usage(TurnEvent):
    type: ClassVar[str] = "usage"
    prompt_tokens: int
    completion_tokens: int
    context_window: int
    dropped_messages: int = 0  # history messages left out to fit the window
    cached_tokens: int = 0  # prompt tokens served from the engine's prefix cache
    num_steps: int = 1  # engine calls this turn (tool steps + final answer)
    breakdown: dict[str, int] = field(default_factory=dict)  # prompt tokens per part (see context.py)
    # every call's prompt tokens together: what the turn consumed (prompt_tokens is the last call's, the
    # context the answer was written in; cached_tokens counts every call's too)
    total_prompt_tokens: int = 0


@dataclass(frozen=True)
class Notice(TurnEvent):
    type: ClassVar[str] = "notice"
    message: str  # something the user should know (model fallback, truncated history, ...)
    replaces_answer: str = ""  # the text that now stands instead of the streamed answer (a withdrawn one)


@dataclass(frozen=True)
class Error(TurnEvent):
    type: ClassVar[str] = "error"
    message: str  # user-facing, with the fix when there is one


@dataclass(frozen=True)
class Done(TurnEvent):
    type: ClassVar[str] = "done"
    conversation_id: str
    message_id: str  # stored assistant message
    text: str  # the whole answer
    finish_reason: str  # "stop" | "length" | "cancelled" | "error" | "blocked"
