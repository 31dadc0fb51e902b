"""Pure helpers of the web chat: TurnEvents and stored messages -> Chatbot messages, Markdown and HTML.

Nothing here touches Gradio or the network, so every piece is unit-tested without a browser
(tests/test_ui_render.py). `TurnView` is the one place a turn's event stream becomes what the page
shows: the user's message (typed or transcribed), one collapsible panel per tool step (code, output,
errors, plots and files inline), the answer as it streams, numbered sources, safety notices and the
usage meter.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from assistant.events import (AudioChunk, Done, Error, ImageDescribed, Notice, SafetyVerdict, Source, Sources,
                              TextDelta, ToolCallFinished, ToolCallStarted, Transcribed, TurnEvent, TurnStarted, Usage)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".svg")
MAX_SNIPPET_CHARS = 160  # a source's evidence shown under the answer
STOPPED = "_(stopped)_"


def format_sources(sources: Iterable[Source | dict]) -> str:
    """Numbered sources with document, page and snippet, as Markdown ("" when there are none)."""
    lines = []
    for s in sources:
        s = s if isinstance(s, dict) else {"marker": s.marker, "doc": s.doc, "page": s.page, "snippet": s.snippet}
        where = f"{s['doc']}" + (f", p. {s['page']}" if s.get("page") is not None else "")
        snippet = " ".join(str(s.get("snippet") or "").split())
        if len(snippet) > MAX_SNIPPET_CHARS:
            snippet = snippet[:MAX_SNIPPET_CHARS - 1].rstrip() + "…"
        lines.append(f"- **[{s['marker']}]** {where}" + (f" — “{snippet}”" if snippet else ""))
    return "\n\n**Sources**\n\n" + "\n".join(lines) if lines else ""


def usage_meter(usage: Usage | dict | None) -> str:
    """The token usage and context-window meter, as HTML ("" before the first turn)."""
    if usage is None:
        return ""
    u = usage if isinstance(usage, dict) else {"prompt_tokens": usage.prompt_tokens,
                                                "completion_tokens": usage.completion_tokens,
                                                "context_window": usage.context_window,
                                                "dropped_messages": usage.dropped_messages}
    used = int(u.get("prompt_tokens", 0)) + int(u.get("completion_tokens", 0))
    window = max(int(u.get("context_window", 0)), 1)
    percent = min(100, round(100 * used / window))
    text = (f"{u.get('prompt_tokens', 0)} prompt + {u.get('completion_tokens', 0)} answer tokens · "
            f"{used:,} of {window:,} context ({percent}%)")
    if u.get("dropped_messages"):
        text += f" · {u['dropped_messages']} old messages left out"
    level = "high" if percent >= 85 else "mid" if percent >= 60 else "low"
    return (f'<div class="usage-meter" title="context window"><div class="bar {level}">'
            f'<span style="width:{percent}%"></span></div><span class="usage-text">{html.escape(text)}</span></div>')


def safety_notice(verdict: SafetyVerdict) -> dict:
    """A notice that says what was blocked, quarantined or redacted, and why."""
    what = {"input": "Your message was blocked" if not verdict.allowed else "Your message was flagged",
            "retrieved": "A document passage was quarantined (shown to the model as data only)",
            "tool": "A tool's output was quarantined (shown to the model as data only)",
            "output": "Part of the answer was redacted"}.get(verdict.stage, f"Safety ({verdict.stage})")
    category = verdict.category.replace("_", " ") if verdict.category else "policy"
    body = verdict.reason or f"Matched {category}."
    if verdict.detector:
        body += f"\n\n_detector: {verdict.detector}, score {verdict.score:.2f} ≥ {verdict.threshold:.2f}_"
    return {"role": "assistant", "content": body,
            "metadata": {"title": f"Safety: {what} ({category})", "status": "done"}}


def tool_panel(started: ToolCallStarted, finished: ToolCallFinished | None = None) -> dict:
    """One tool step as a collapsible Chatbot message: its code or arguments, then output or error."""
    args = dict(started.arguments)
    code = args.pop("code", None)
    parts = []
    if code:
        parts.append(f"```python\n{code}\n```")
    if args:
        parts.append("\n".join(f"- **{k}**: `{v}`" for k, v in args.items()))
    if finished is not None:
        label = "Note" if finished.skipped else "Output" if finished.ok else "Error"
        summary = finished.summary.strip() or ("done" if finished.ok else "failed")
        parts.append(f"**{label}**\n\n```text\n{summary}\n```" if "\n" in summary else f"**{label}:** {summary}")
    state = "" if finished is None or finished.ok else " (repeated, not run)" if finished.skipped else " (failed)"
    title = f"{_tool_title(started.name)}{state}"
    return {"role": "assistant", "content": "\n\n".join(parts) or "…",
            "metadata": {"title": title, "status": "pending" if finished is None else "done", "id": started.call_id}}


def _tool_title(name: str) -> str:
    return {"python": "Ran Python in the sandbox", "ingest": "Reading the attached files",
            "search_documents": "Searched the library"}.get(name, f"Tool: {name}")


def artifact_message(path: Path) -> dict:
    """A file the code produced, inline: images are shown, other files offered for download."""
    return {"role": "assistant", "content": {"path": str(path), "alt_text": path.name}}


@dataclass
class TurnView:
    """What one turn shows, built from its events (feed them in order, read `messages()` at any time).

    `resolve_artifact` turns a ToolCallFinished artifact (a path, or the code tool's artifact id) into a
    file on disk, or None when it cannot be shown."""

    question: str = ""  # what the user typed ("" for a recording until its transcript arrives)
    attachments: tuple[str, ...] = ()  # names of attached files and pictures, shown under the question
    resolve_artifact: Callable[[str], Path | None] = lambda ref: Path(ref) if Path(ref).is_file() else None
    answer: str = ""
    conversation_id: str | None = None
    user_message_id: str = ""
    message_id: str = ""
    finish_reason: str = ""
    status: str = ""  # one line for the status bar
    usage: Usage | None = None
    audio: list[AudioChunk] = field(default_factory=list)  # chunks not yet handed to the player
    _steps: list[dict] = field(default_factory=list)  # tool panels, notices and artifacts, in order
    _calls: dict[str, ToolCallStarted] = field(default_factory=dict)
    _sources: str = ""

    def feed(self, event: TurnEvent) -> None:
        if isinstance(event, TextDelta):
            self.answer += event.text
            self.status = "Answering…"
        elif isinstance(event, TurnStarted):
            self.conversation_id = event.conversation_id
            self.user_message_id, self.message_id = event.user_message_id, event.message_id
            self.status = "Thinking…"
        elif isinstance(event, Transcribed):
            self.question = f"{self.question}\n{event.text}".strip() if self.question else event.text
            self.status = "Transcribed the recording."
        elif isinstance(event, ImageDescribed):
            self._steps.append({"role": "assistant", "content": event.description,
                                "metadata": {"title": f"Picture {event.index}: what it shows", "status": "done"}})
        elif isinstance(event, ToolCallStarted):
            self._calls[event.call_id] = event
            self._steps.append(tool_panel(event))
            self.status = f"{_tool_title(event.name)}…"
        elif isinstance(event, ToolCallFinished):
            started = self._calls.get(event.call_id) or ToolCallStarted(event.call_id, event.name, {})
            panel = tool_panel(started, event)
            for i, step in enumerate(self._steps):
                if step.get("metadata", {}).get("id") == event.call_id:
                    self._steps[i] = panel
                    break
            else:
                self._steps.append(panel)
            for ref in event.artifacts:
                path = self.resolve_artifact(ref)
                if path is not None:
                    self._steps.append(artifact_message(path))
            self.status = f"{event.name}: {'ok' if event.ok else 'repeated, not run' if event.skipped else 'failed'}"
        elif isinstance(event, Sources):
            self._sources = format_sources(event.sources)
        elif isinstance(event, SafetyVerdict):
            self._steps.append(safety_notice(event))
        elif isinstance(event, AudioChunk):
            self.audio.append(event)
        elif isinstance(event, Usage):
            self.usage = event
        elif isinstance(event, Notice):
            self.status = event.message
        elif isinstance(event, Error):
            self.status = event.message
            self.answer += f"\n\n**Error:** {event.message}"
        elif isinstance(event, Done):
            self.conversation_id = event.conversation_id or self.conversation_id
            self.message_id = event.message_id or self.message_id
            self.finish_reason = event.finish_reason
            if event.finish_reason not in ("error",):
                self.answer = event.text  # the stored answer: verified markers only
            self.status = {"cancelled": "Stopped.", "length": "Stopped at the answer-length limit.",
                           "blocked": "Blocked by the safety policy.", "error": self.status or "Failed."
                           }.get(event.finish_reason, "Done.")

    def take_audio(self) -> list[AudioChunk]:
        chunks, self.audio = self.audio, []
        return chunks

    def user_message(self) -> dict | None:
        text = self.question
        if self.attachments:
            text += ("\n\n" if text else "") + " ".join(f"[attached: `{name}`]" for name in self.attachments)
        return {"role": "user", "content": text} if text else None

    def messages(self) -> list[dict]:
        """The turn as Chatbot messages: question, steps, answer (with sources)."""
        out = []
        user = self.user_message()
        if user is not None:
            out.append(user)
        out.extend(self._steps)
        answer = self.answer
        if self.finish_reason == "cancelled":
            answer = f"{answer} {STOPPED}".strip()
        if answer or not self.finish_reason:
            out.append({"role": "assistant", "content": (answer or "…") + self._sources})
        return out


def history_messages(messages: Iterable[Any]) -> list[dict]:
    """Stored messages (the active branch) as Chatbot messages, sources under each answer."""
    out = []
    for m in messages:
        if m.role not in ("user", "assistant"):
            continue
        content = m.content
        meta = m.meta or {}
        if m.role == "user" and meta.get("audio") and not content:
            content = meta["audio"].get("transcript", "")
        if m.role == "assistant":
            if meta.get("finish_reason") == "cancelled" or m.status == "partial":
                content = f"{content} {STOPPED}".strip()
            content += format_sources(meta.get("sources", []))
        out.append({"role": m.role, "content": content or "…"})
    return out


def may_see(owner: str | None, key_id: str) -> bool:
    """The gateway's rule (assistant/server/gateway.py): a key sees what it created; the key-less local
    user of an open server sees what no key owns."""
    return owner == key_id if key_id else owner is None


def visible_conversations(conversations: Iterable[Any], owner_of: Callable[[str], str | None], key_id: str,
                          query: str = "") -> list[Any]:
    """The conversations `key_id` may see, whose title holds `query` (case-insensitive)."""
    q = query.strip().lower()
    return [c for c in conversations
            if may_see(owner_of(c.id), key_id) and (not q or q in (c.title or "").lower())]


def conversation_label(c: Any) -> str:
    return (c.title or "New chat").strip()[:60] or "New chat"


def document_label(d: dict) -> str:
    """A library record as one line: its file name, size in chunks, and whether it is read-only."""
    name = d.get("file_name") or d.get("doc") or d.get("name") or d.get("id") or d.get("doc_id") or "?"
    extra = f" · {d['num_chunks']} chunks" if d.get("num_chunks") else ""
    return f"{name}{extra}" + (" · shared, read-only" if d.get("shared") else "")


def library_markdown(documents: list[dict], *, available: bool = True, conversation: Iterable[dict] = ()) -> str:
    """The caller's documents — this conversation's (searched only in it), then the library's (searched
    in every conversation) — or what to do when there are none or documents are unavailable."""
    if not available:
        return "_Documents are not part of this build: run `make setup`._"
    conversation = list(conversation)
    if not documents and not conversation:
        return ("_The library is empty: attach a PDF, DOCX, MD, TXT, HTML file or a picture to a message, "
                "for this conversation or for the library (the choice under the chat)._")
    parts = []
    if conversation:
        parts.append("**This conversation**\n\n" + "\n".join(f"- {document_label(d)}" for d in conversation))
    parts.append("**Library**\n\n" + ("\n".join(f"- {document_label(d)}" for d in documents) or "_empty_"))
    return "\n\n".join(parts)
