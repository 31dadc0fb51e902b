"""The Jupyter front end: `Chat`, a chat widget, and the `%%assistant` cell magic.

    from ui.widget import Chat
    chat = Chat()                                  # the in-process assistant (AssistantConfig.load())
    chat = Chat(url="http://127.0.0.1:7860", key="sk-asst-...")   # a running `assistant serve`
    chat                                           # transcript, text box, Send (needs a widget front end)
    answer = chat.ask("What is the warranty period?")   # streams into the cell, returns the final text
    chat.last.sources · chat.last.artifacts · chat.last.images() · chat.history() · chat.new()

    %load_ext ui.widget
    %%assistant [--url URL] [--key KEY] [--new]
    The question, on the lines of the cell.

Design note — one renderer, two displays, two backends:
  * A backend turns a `UserInput` into an iterator of TurnEvents: `InProcessBackend` calls the
    `Assistant` facade (built lazily once per kernel and shared by every in-process Chat, because an
    embedded index has one owner process); `RemoteBackend` POSTs to /api/turns and parses the
    server-sent events back into the same event classes, so nothing above it knows which one runs.
    Refusals (401, 404, 429, no server) become an `Error` event with the fix, like every other failure.
    Documents: over a server a turn searches only what the key may see (the server's rule, as in the
    REST API); in process the notebook is the local single user and searches the whole library.
  * `TurnResult.add(event)` folds the stream into one record (`chat.last`): text, sources, tool steps,
    artifacts resolved to files on this machine, verdicts, usage, spoken audio.
  * `render_html` / `render_text` draw a TurnResult; the same HTML feeds both displays: the widget's
    synced traitlets (`turns`, `live`; the ESM below only sets innerHTML), and a plain rich output
    (`text/html` + `text/plain`) updated in place with a display id while text streams. The plain one
    needs no JavaScript, so a notebook executed headlessly (nbclient) keeps the answer, its numbered
    sources, tool steps as <details> and plots inline.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import itertools
import json
import os
import tempfile
import threading
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from assistant.errors import AssistantError
from assistant.keys import artifact_file
from assistant.events import (AudioChunk, Done, Error, ImageDescribed, Notice, SafetyVerdict, Source, Sources,
                              TextDelta, ToolCallFinished, ToolCallStarted, Transcribed, TurnEvent, TurnStarted, Usage)
from assistant.seams import Attachment, UserInput, close_if_closable

try:
    import anywidget
    import traitlets
except ImportError as e:  # the notebook extra is not installed
    raise ImportError(f"The notebook widget needs {e.name}: pip install -e '.[ui]' (anywidget, ipykernel).") from e

EVENT_TYPES: dict[str, type[TurnEvent]] = {cls.type: cls for cls in (
    TurnStarted, Transcribed, ImageDescribed, TextDelta, ToolCallStarted, ToolCallFinished, Sources, SafetyVerdict,
    AudioChunk, Usage, Notice, Error, Done)}
IMAGE_SUFFIXES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".gif": "image/gif",
                  ".webp": "image/webp", ".svg": "image/svg+xml"}
MAX_INLINE_IMAGE_BYTES = 4 * 1024 * 1024  # larger plots are listed by path, not embedded in the notebook
MAX_SNIPPET_CHARS = 240  # of a source's snippet shown under the answer
REFRESH_INTERVAL_S = 0.1  # how often streamed text redraws the displays


# -- the server's events, back from SSE -----------------------------------------------------------

def event_from_dict(data: dict[str, Any]) -> TurnEvent | None:
    """The TurnEvent of `event.to_dict()` (audio with `pcm16_b64`); None for a type this client does
    not know (a newer server), so old notebooks keep working. Raises ValueError when malformed."""
    cls = EVENT_TYPES.get(str(data.get("type", "")))
    if cls is None:
        return None
    try:
        if cls is AudioChunk:
            return AudioChunk(int(data["sample_rate"]), base64.b64decode(data.get("pcm16_b64", "")))
        kwargs = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        if cls is Sources:
            names = {f.name for f in dataclasses.fields(Source)}
            kwargs["sources"] = tuple(Source(**{k: v for k, v in s.items() if k in names}) for s in data["sources"])
            kwargs["dropped_markers"] = tuple(data.get("dropped_markers", ()))
        if cls is ToolCallFinished:
            kwargs["artifacts"] = tuple(data.get("artifacts", ()))
        return cls(**kwargs)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"malformed {cls.type!r} event from the server ({e}): {str(data)[:200]}") from e


def parse_sse(lines: Iterable[str]) -> Iterator[TurnEvent]:
    """TurnEvents from the lines of a text/event-stream body (`event:` + `data:` blocks, blank-line
    separated; comments and unknown fields ignored, several `data:` lines joined by newlines)."""
    kind, data = "", []
    for line in itertools.chain(lines, [""]):
        line = line.rstrip("\r")
        if not line:
            if data:
                payload = json.loads("\n".join(data))
                payload.setdefault("type", kind)
                event = event_from_dict(payload)
                if event is not None:
                    yield event
            kind, data = "", []
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            kind = value
        elif name == "data":
            data.append(value)


# -- backends: UserInput in, TurnEvents out -------------------------------------------------------

def _failed(conversation_id: str | None, message: str) -> Iterator[TurnEvent]:
    yield Error(message)
    yield Done(conversation_id or "", "", "", "error")


_SHARED: dict[str, Any] = {}  # the kernel's in-process Assistant, built on first use
_SHARED_LOCK = threading.Lock()


def shared_assistant() -> Any:
    """The in-process Assistant of this kernel (AssistantConfig.load(): ASSISTANT_* env, ASSISTANT_CONFIG)."""
    with _SHARED_LOCK:
        if "assistant" not in _SHARED:
            import atexit

            from assistant.app import build_assistant
            from assistant.config import AssistantConfig

            _SHARED["assistant"] = build_assistant(AssistantConfig.load())
            atexit.register(_SHARED["assistant"].close)
        return _SHARED["assistant"]


class InProcessBackend:
    """The Assistant facade in this process: `assistant` as given (not closed here), or the kernel's shared one."""

    def __init__(self, assistant: Any = None) -> None:
        self._assistant = assistant

    @property
    def ready(self) -> bool:
        return self._assistant is not None or "assistant" in _SHARED

    @property
    def assistant(self) -> Any:
        if self._assistant is None:
            self._assistant = shared_assistant()
        return self._assistant

    def turn(self, conversation_id: str | None, user_input: UserInput, *, max_tokens: int | None = None,
             cancel: threading.Event | None = None) -> Iterator[TurnEvent]:
        try:
            assistant = self.assistant
            params = assistant.default_params(max_tokens=max_tokens) if max_tokens else None
            yield from assistant.turn(conversation_id, user_input, params=params, cancel=cancel)
        except AssistantError as e:  # could not start: a bad config, a missing model, an unknown conversation
            yield from _failed(conversation_id, str(e))

    def history(self, conversation_id: str) -> list[dict[str, Any]]:
        return json.loads(self.assistant.conversations.export(conversation_id))["messages"]

    def artifact(self, ref: str, conversation_id: str) -> Path | None:
        """A tool's artifact (a path, or the code tool's content id under <data_dir>/artifacts/<conversation>/)."""
        if Path(ref).is_file():
            return Path(ref)
        return artifact_file(self.assistant.config.data_dir, conversation_id, ref)

    def describe(self) -> str:
        return "in-process"

    def close(self) -> None:
        pass  # the assistant is the caller's, or the kernel's (closed at exit)


class RemoteBackend:
    """A running server's turn endpoint: POST {url}/api/turns, server-sent TurnEvents back."""

    def __init__(self, url: str, key: str | None = None, *, timeout_s: float = 300.0) -> None:
        import httpx

        self.url = url.rstrip("/")
        self.key = key if key is not None else os.environ.get("ASSISTANT_API_KEY") or None
        self._client = httpx.Client(timeout=httpx.Timeout(30.0, read=timeout_s),
                                    headers={"Authorization": f"Bearer {self.key}"} if self.key else {})
        self.ready = True
        self._downloads: tempfile.TemporaryDirectory | None = None  # artifacts fetched from the server

    def turn(self, conversation_id: str | None, user_input: UserInput, *, max_tokens: int | None = None,
             cancel: threading.Event | None = None) -> Iterator[TurnEvent]:
        import httpx

        if user_input.files:
            yield from _failed(conversation_id, "The turn endpoint takes no files: ingest them on the server "
                                                "(`assistant ingest`) or use the in-process Chat().")
            return
        body: dict[str, Any] = {"text": user_input.text, "conversation_id": conversation_id, "speak": user_input.speak,
                                "images": [_b64_part(a) for a in user_input.images]}
        if user_input.audio is not None:
            body["audio"] = _b64_part(user_input.audio)
        if max_tokens:
            body["max_tokens"] = max_tokens
        done, turn_id, cancel_sent = False, "", False
        try:
            with self._client.stream("POST", f"{self.url}/api/turns", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    yield from _failed(conversation_id, self._refusal(response))
                    return
                for event in parse_sse(response.iter_lines()):
                    turn_id = event.message_id if isinstance(event, TurnStarted) else turn_id
                    if cancel is not None and cancel.is_set() and turn_id and not cancel_sent:
                        cancel_sent = True  # the server stops and keeps the partial answer; its Done follows
                        self._client.post(f"{self.url}/api/turns/{turn_id}/cancel")
                    done = done or isinstance(event, Done)
                    yield event
        except httpx.ConnectError as e:
            yield from _failed(conversation_id, f"Cannot reach the assistant server at {self.url} ({e}): start it "
                                                "with `assistant serve`, or check the url.")
            return
        except httpx.TimeoutException:
            yield from _failed(conversation_id, f"The server at {self.url} stopped answering (timed out).")
            return
        except (httpx.HTTPError, ValueError) as e:
            yield from _failed(conversation_id, f"The connection to {self.url} failed mid-answer: {e}")
            return
        if not done:
            yield from _failed(conversation_id, f"The server at {self.url} closed the stream before the answer was done.")

    def _refusal(self, response: Any) -> str:
        try:
            detail = response.json().get("detail") or response.json().get("error", {}).get("message")
        except (ValueError, AttributeError):
            detail = response.text[:300]
        if isinstance(detail, list):  # FastAPI's validation errors
            detail = "; ".join(str(d.get("msg", d)) for d in detail)
        status = response.status_code
        if status == 401:
            fix = ("the key was refused (wrong or revoked): check Chat(url, key=...)" if self.key else
                   "this server needs a key: Chat(url, key='sk-asst-...') or ASSISTANT_API_KEY "
                   "(an admin creates one with `assistant keys create --name NAME --tier free`)")
            return f"The server at {self.url} answered 401: {fix}."
        if status == 404:
            return (f"The server at {self.url} does not know this conversation (another key's, or deleted): "
                    f"start a new one with chat.new(). ({detail})")
        if status in (429, 503):
            retry = response.headers.get("retry-after")
            return f"The server is busy ({status}): {detail}" + (f" Try again in {retry} s." if retry else "")
        return f"The server at {self.url} refused the question ({status}): {detail}"

    def history(self, conversation_id: str) -> list[dict[str, Any]]:
        response = self._client.get(f"{self.url}/api/conversations/{conversation_id}")
        if response.status_code != 200:
            raise AssistantError(self._refusal(response))
        return response.json()["messages"]

    def artifact(self, ref: str, conversation_id: str) -> Path | None:
        """A tool's artifact, fetched from the server (GET /api/conversations/{id}/artifacts/{ref}) into a
        folder of this machine's temp dir that lives as long as the backend; None when the server has none."""
        if not ref.isalnum():
            return None
        if self._downloads is None:
            self._downloads = tempfile.TemporaryDirectory(prefix="assistant-widget-")
        response = self._client.get(f"{self.url}/api/conversations/{conversation_id}/artifacts/{ref}")
        if response.status_code != 200:
            return None
        name = response.headers.get("content-disposition", "").rpartition("filename=")[2].strip('"') or "artifact"
        path = Path(self._downloads.name) / f"{ref}-{Path(name).name}"
        path.write_bytes(response.content)
        return path

    def describe(self) -> str:
        return self.url

    def close(self) -> None:
        self._client.close()
        if self._downloads is not None:
            self._downloads.cleanup()


def _b64_part(attachment: Attachment) -> dict[str, str]:
    return {"name": attachment.name, "data": base64.b64encode(attachment.read()).decode()}


# -- one turn, folded ----------------------------------------------------------------------------

@dataclass
class ToolStep:
    call_id: str
    name: str  # tool name
    arguments: dict[str, Any]  # as the model called it
    ok: bool | None = None  # None while the tool runs
    summary: str = ""  # its short result
    artifacts: tuple[str, ...] = ()  # ids/paths as the tool reported them
    skipped: bool = False  # not run: the model repeated a call it already made (not a failure)


@dataclass
class TurnResult:
    """One turn as the notebook sees it (`chat.last`); filled event by event while it streams."""

    question: str = ""
    text: str = ""  # the answer: streamed so far, then the stored final text (Done)
    conversation_id: str = ""
    message_id: str = ""  # the stored answer
    finish_reason: str = ""  # "" while running; then stop | length | cancelled | error | blocked
    sources: list[Source] = field(default_factory=list)  # cited passages: marker, doc, page, snippet
    tool_steps: list[ToolStep] = field(default_factory=list)
    artifacts: list[Path] = field(default_factory=list)  # files the tools produced, found on this machine
    verdicts: list[SafetyVerdict] = field(default_factory=list)
    usage: Usage | None = None
    heard: str = ""  # the transcript of a spoken question
    image_descriptions: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    audio: bytes = field(default=b"", repr=False)  # the spoken answer: mono s16le at sample_rate
    sample_rate: int = 0

    @property
    def ok(self) -> bool:
        return self.finish_reason in ("stop", "length") and not self.errors

    def add(self, event: TurnEvent, resolve: Callable[[str], Path | None] = lambda ref: None) -> None:
        if isinstance(event, TurnStarted):
            self.conversation_id, self.message_id = event.conversation_id, event.message_id
        elif isinstance(event, TextDelta):
            self.text += event.text
        elif isinstance(event, ToolCallStarted):
            self.tool_steps.append(ToolStep(event.call_id, event.name, dict(event.arguments)))
        elif isinstance(event, ToolCallFinished):
            step = next((s for s in reversed(self.tool_steps) if s.call_id == event.call_id), None)
            if step is None:
                step = ToolStep(event.call_id, event.name, {})
                self.tool_steps.append(step)
            step.ok, step.summary, step.artifacts = event.ok, event.summary, tuple(event.artifacts)
            step.skipped = event.skipped
            found = [resolve(ref) for ref in event.artifacts]
            self.artifacts += [p for p in found if p is not None and p not in self.artifacts]
        elif isinstance(event, Sources):
            self.sources = list(event.sources)
        elif isinstance(event, SafetyVerdict):
            self.verdicts.append(event)
        elif isinstance(event, Usage):
            self.usage = event
        elif isinstance(event, Transcribed):
            self.heard = event.text
        elif isinstance(event, ImageDescribed):
            self.image_descriptions.append(event.description)
        elif isinstance(event, AudioChunk):
            self.audio, self.sample_rate = self.audio + event.pcm16, event.sample_rate
        elif isinstance(event, Notice):
            self.notices.append(event.message)
        elif isinstance(event, Error):
            self.errors.append(event.message)
        elif isinstance(event, Done):
            self.text, self.finish_reason = event.text, event.finish_reason
            self.conversation_id = event.conversation_id or self.conversation_id
            self.message_id = event.message_id or self.message_id

    def images(self) -> list[Any]:
        """The image artifacts (plots) as PIL images."""
        from PIL import Image

        out = []
        for path in self.artifacts:
            if path.suffix.lower() in IMAGE_SUFFIXES and path.suffix.lower() != ".svg":
                with Image.open(path) as image:
                    image.load()
                    out.append(image.copy())
        return out

    def audio_wav(self) -> bytes:
        """The spoken answer as a WAV file (b"" when the turn was not spoken)."""
        if not self.audio:
            return b""
        buffer = io.BytesIO()
        with wave.open(buffer, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(self.sample_rate)
            w.writeframes(self.audio)
        return buffer.getvalue()


# -- rendering ------------------------------------------------------------------------------------

def source_line(source: Source) -> str:
    """`[1] manual.pdf p. 3 — the snippet`"""
    page = f" p. {source.page}" if source.page is not None else ""
    snippet = " ".join(source.snippet.split())
    snippet = snippet if len(snippet) <= MAX_SNIPPET_CHARS else snippet[:MAX_SNIPPET_CHARS - 1] + "…"
    return f"[{source.marker}] {source.doc}{page} — {snippet}"


def _step_title(step: ToolStep) -> str:
    mark = "…" if step.ok is None else "✓" if step.ok else "↺" if step.skipped else "✗"
    return f"{step.name} {mark} {step.summary}".rstrip()


def render_text(result: TurnResult) -> str:
    lines = [f"You: {result.question or result.heard}"] if (result.question or result.heard) else []
    lines += [f"[tool] {_step_title(s)}" for s in result.tool_steps]
    lines.append(result.text)
    lines += [f"[file] {p}" for p in result.artifacts]
    if result.sources:
        lines += ["", "Sources:", *map(source_line, result.sources)]
    lines += [f"[safety] {v.reason or v.category}" for v in result.verdicts if not v.allowed or v.category]
    lines += [f"[notice] {m}" for m in result.notices] + [f"[error] {m}" for m in result.errors]
    return "\n".join(lines).strip()


def _esc(text: Any) -> str:
    return html.escape(str(text))


def render_html(result: TurnResult, *, live: bool = False) -> str:
    """The turn as self-contained HTML (inline styles, images as data: URLs); everything shown escaped."""
    muted = "color:#666;font-size:0.9em"
    out = ['<div class="assistant-turn" style="margin:0.4em 0 0.8em 0">']
    if result.question or result.heard:
        said = _esc(result.question or result.heard) + (" <i>(spoken)</i>" if result.heard else "")
        out.append(f'<div style="margin-bottom:0.3em"><b>You:</b> {said}</div>')
    out += [f'<div style="{muted}">picture {i}: {_esc(d)}</div>' for i, d in enumerate(result.image_descriptions, 1)]
    for step in result.tool_steps:
        args = "\n".join(f"{k} = {v if isinstance(v, str) else json.dumps(v)}" for k, v in step.arguments.items())
        out.append(f'<details style="{muted}"><summary>tool: {_esc(_step_title(step))}</summary>'
                   f'<pre style="white-space:pre-wrap">{_esc(args)}</pre></details>')
    answer = _esc(result.text) + (" ▍" if live else "")
    out.append(f'<div style="white-space:pre-wrap"><b>Assistant:</b> {answer}</div>')
    for path in result.artifacts:
        mime = IMAGE_SUFFIXES.get(path.suffix.lower())
        if mime and path.stat().st_size <= MAX_INLINE_IMAGE_BYTES:
            data = base64.b64encode(path.read_bytes()).decode()
            out.append(f'<div><img alt="{_esc(path.name)}" style="max-width:100%" src="data:{mime};base64,{data}"></div>')
        else:
            out.append(f'<div style="{muted}">file: <code>{_esc(path)}</code></div>')
    if result.audio:
        data = base64.b64encode(result.audio_wav()).decode()
        out.append(f'<audio controls src="data:audio/wav;base64,{data}"></audio>')
    if result.sources:
        items = "".join(f"<li>{_esc(source_line(s))}</li>" for s in result.sources)
        out.append(f'<div style="{muted};margin-top:0.3em"><b>Sources</b>'
                   f'<ul style="list-style:none;padding-left:0;margin:0">{items}</ul></div>')
    for v in result.verdicts:
        if not v.allowed or v.category:
            out.append(f'<div style="color:#a60">safety ({_esc(v.stage)}): {_esc(v.reason or v.category)}</div>')
    out += [f'<div style="{muted}">{_esc(m)}</div>' for m in result.notices]
    out += [f'<div style="color:#b00"><b>Error:</b> {_esc(m)}</div>' for m in result.errors]
    out.append("</div>")
    return "".join(out)


class _CellView:
    """The plain rich output of one turn in the running cell, redrawn in place (display id) as it streams.
    Only under IPython; outside a kernel (a terminal IPython) it shows the final turn once."""

    def __init__(self, enabled: bool) -> None:
        from IPython import get_ipython

        shell = get_ipython() if enabled else None
        self.enabled, self.streams = shell is not None, hasattr(shell, "kernel")
        self.handle: Any = None

    def draw(self, result: TurnResult, *, final: bool) -> None:
        if not self.enabled or not (final or self.streams):
            return
        from IPython.display import display

        bundle = {"text/html": render_html(result, live=not final), "text/plain": render_text(result)}
        if self.handle is None:
            self.handle = display(bundle, raw=True, display_id=True)
        else:
            self.handle.update(bundle, raw=True)


# -- the widget -----------------------------------------------------------------------------------

_ESM = """
function render({ model, el }) {
  el.classList.add("assistant-chat");
  const log = document.createElement("div"), live = document.createElement("div");
  const form = document.createElement("form"), input = document.createElement("textarea");
  const send = document.createElement("button"), fresh = document.createElement("button");
  input.rows = 2; input.placeholder = "Ask a question (Enter sends, Shift+Enter for a new line)";
  send.type = "submit"; send.textContent = "Send"; fresh.type = "button"; fresh.textContent = "New chat";
  form.append(input, send, fresh); el.append(log, live, form);
  const drawLog = () => { log.innerHTML = model.get("turns").join(""); };
  const drawLive = () => { live.innerHTML = model.get("live"); send.disabled = model.get("busy");
                           live.scrollIntoView({ block: "nearest" }); };
  model.on("change:turns", drawLog); model.on("change:live", drawLive); model.on("change:busy", drawLive);
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    const text = input.value.trim();
    if (!text || model.get("busy")) return;
    model.send({ type: "ask", text }); input.value = "";
  });
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); form.requestSubmit(); }
  });
  fresh.addEventListener("click", () => model.send({ type: "new" }));
  drawLog(); drawLive();
}
export default { render };
"""
_CSS = """
.assistant-chat { border: 1px solid #ddd; border-radius: 6px; padding: 0.5em; max-height: 40em; overflow-y: auto; }
.assistant-chat form { display: flex; gap: 0.4em; margin-top: 0.4em; }
.assistant-chat textarea { flex: 1; font: inherit; }
"""


def _attachment(value: Any, what: str) -> Attachment:
    """A path, bytes, an Attachment or a PIL image as one file of the turn."""
    if isinstance(value, Attachment):
        return value
    if isinstance(value, (str, Path)):
        path = Path(value)
        if not path.is_file():
            raise FileNotFoundError(f"The {what} {path} does not exist: check the path.")
        return Attachment(path.name, path=path)
    if isinstance(value, (bytes, bytearray)):
        return Attachment("recording.wav" if what == "recording" else "picture.png", data=bytes(value))
    if hasattr(value, "save"):  # a PIL image
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return Attachment("picture.png", data=buffer.getvalue())
    raise TypeError(f"A {what} must be a path, bytes, an Attachment or a PIL image, not {type(value).__name__}.")


class Chat(anywidget.AnyWidget):
    """One conversation in a notebook. In-process unless `url` names a running server (`key` its API
    key, default $ASSISTANT_API_KEY); `assistant` passes an Assistant to use (tests)."""

    _esm = _ESM
    _css = _CSS
    turns = traitlets.List(traitlets.Unicode()).tag(sync=True)  # finished turns, rendered
    live = traitlets.Unicode("").tag(sync=True)  # the turn being answered, rendered
    busy = traitlets.Bool(False).tag(sync=True)

    def __init__(self, *, url: str | None = None, key: str | None = None, assistant: Any = None,
                 conversation_id: str | None = None, max_tokens: int | None = None, show: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if url and assistant is not None:
            raise ValueError("Give url= (a running server) or assistant= (in this process), not both.")
        self.backend: InProcessBackend | RemoteBackend = RemoteBackend(url, key) if url else InProcessBackend(assistant)
        self.conversation_id = conversation_id  # None: the next question starts a conversation
        self.max_tokens = max_tokens  # answer length limit; None = the assistant's default
        self.show = show  # ask() draws the turn in the running cell's output
        self.last: TurnResult | None = None
        self.results: list[TurnResult] = []  # this widget's turns, oldest first
        self._turn_lock = threading.Lock()
        self.on_msg(self._on_message)

    def ask(self, text: str = "", *, images: Sequence[Any] = (), audio: Any = None, speak: bool = False,
            show: bool | None = None) -> str:
        """Answer one question in this chat's conversation; streams into the displays and returns the
        final text ("" when it failed: the reason is in chat.last.errors and shown)."""
        user_input = UserInput(text, _attachment(audio, "recording") if audio is not None else None,
                               tuple(_attachment(i, "picture") for i in images), speak=speak)
        return self._run(user_input, self.show if show is None else show).text

    def new(self) -> None:
        """Start a new conversation (the next question opens it)."""
        self.conversation_id, self.turns, self.live = None, [], ""

    def history(self) -> list[dict[str, Any]]:
        """The stored conversation: messages (role, content, status, meta with sources and tool steps)."""
        return self.backend.history(self.conversation_id) if self.conversation_id else []

    def close(self) -> None:
        if getattr(self, "backend", None) is not None:
            self.backend.close()
        super().close()

    def _run(self, user_input: UserInput, show: bool) -> TurnResult:
        with self._turn_lock:  # one turn at a time in a conversation
            result = TurnResult(question=user_input.text, conversation_id=self.conversation_id or "")
            self.last, self.busy, view = result, True, _CellView(show)
            if not self.backend.ready:
                result.notices.append("Loading the assistant (first question only)...")
            cancel = threading.Event()
            events = self.backend.turn(self.conversation_id, user_input, max_tokens=self.max_tokens, cancel=cancel)
            resolve = lambda ref: self.backend.artifact(ref, result.conversation_id)  # noqa: E731
            try:
                self._draw(result, view, final=False)
                result.notices.clear()
                drawn = time.monotonic()
                try:
                    for event in events:
                        result.add(event, resolve)
                        if time.monotonic() - drawn >= REFRESH_INTERVAL_S:
                            self._draw(result, view, final=False)
                            drawn = time.monotonic()
                except KeyboardInterrupt:  # stop the answer, keep what was written (stored as partial)
                    cancel.set()
                    for event in events:
                        result.add(event, resolve)
                    result.finish_reason = result.finish_reason or "cancelled"
            finally:
                close_if_closable(events)
                self.busy = False
            self.conversation_id = result.conversation_id or self.conversation_id
            self.results.append(result)
            self.turns, self.live = [*self.turns, render_html(result)], ""
            view.draw(result, final=True)
            return result

    def _draw(self, result: TurnResult, view: _CellView, *, final: bool) -> None:
        self.live = render_html(result, live=not final)
        view.draw(result, final=final)

    def _on_message(self, _widget: Any, content: dict[str, Any], _buffers: Any) -> None:
        """The ESM's text box: {"type": "ask", "text"} runs a turn in the background; {"type": "new"}."""
        if content.get("type") == "new":
            self.new()
        elif content.get("type") == "ask" and str(content.get("text", "")).strip() and not self.busy:
            threading.Thread(target=self._ask_from_widget, args=(str(content["text"]),), daemon=True).start()

    def _ask_from_widget(self, text: str) -> None:
        try:
            self._run(UserInput(text), show=False)
        except Exception as e:  # a bug of ours: show it where the user is looking
            self.live = f'<div style="color:#b00"><b>Error:</b> {_esc(type(e).__name__)}: {_esc(e)}</div>'

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        """The widget view, plus the transcript as HTML/text for front ends that run no JavaScript."""
        bundle = super()._repr_mimebundle_(**kwargs)
        data, meta = bundle if isinstance(bundle, tuple) else (bundle, {})
        where = f"assistant chat ({self.backend.describe()}, conversation {self.conversation_id or 'new'})"
        transcript = "".join(self.turns) or f'<div style="color:#666">{_esc(where)}: ask with chat.ask("...")</div>'
        return {**data, "text/html": transcript, "text/plain": where}, meta


# -- %%assistant ----------------------------------------------------------------------------------

_MAGIC_CHATS: dict[tuple[str, str], Chat] = {}  # (url, key) -> the magic's chat; ("", "") = in-process
_MAGIC_CURRENT: list[tuple[str, str]] = [("", "")]  # the one used by a cell without --url


def magic_chat() -> Chat:
    """The Chat the %%assistant magic uses now (`magic_chat().last` is the last cell's answer)."""
    where = _MAGIC_CURRENT[0]
    if where not in _MAGIC_CHATS:
        _MAGIC_CHATS[where] = Chat(url=where[0] or None, key=where[1] or None)
    return _MAGIC_CHATS[where]


def assistant_magic(line: str, cell: str) -> None:
    """%%assistant [--url URL] [--key KEY] [--new]: the cell is the question; the answer streams below it,
    with its sources. Cells share one conversation per kernel (per server with --url) until --new."""
    import argparse
    import shlex

    parser = argparse.ArgumentParser(prog="%%assistant", add_help=False, exit_on_error=False)
    parser.add_argument("--url", default=None)
    parser.add_argument("--key", default=None)
    parser.add_argument("--new", action="store_true")
    try:
        args = parser.parse_args(shlex.split(line))
    except (argparse.ArgumentError, ValueError, SystemExit) as e:  # argparse exits on unknown flags
        print(f"%%assistant: bad arguments {line!r} ({e}). Usage: %%assistant [--url URL] [--key KEY] [--new], the question below.")
        return
    if args.url or args.key:
        _MAGIC_CURRENT[0] = ((args.url or _MAGIC_CURRENT[0][0]).rstrip("/"), args.key or "")
    chat = magic_chat()
    if args.new:
        chat.new()
    if not cell.strip():
        print("%%assistant: write the question on the lines below %%assistant.")
        return
    chat.ask(cell.strip(), show=True)


def load_ipython_extension(ip: Any) -> None:
    """`%load_ext ui.widget` registers the %%assistant cell magic."""
    ip.register_magic_function(assistant_magic, magic_kind="cell", magic_name="assistant")
