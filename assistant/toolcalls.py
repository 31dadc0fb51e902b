"""Tool calls in model output: finding them while streaming, parsing, validating, and the messages
that carry a call and its result back into the prompt.

Formats accepted (all seen from Qwen2.5-Coder-0.5B with tools in its chat template):
  * Qwen's native `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (one or more);
  * the same JSON in a ```json fence (what the 0.5B model usually writes);
  * a reply that is nothing but that JSON object.
A reply that writes out the template's `<tools>` list instead (`TOOLS_ECHO`) is no call, and no answer either.
JSON is parsed leniently (extra closing braces, a missing one, `"a" + "b"` string concatenation),
because a repairable call is cheaper than a repair round trip; anything still unreadable is a
`MalformedCall` whose `error` is fed back to the model as the observation of one repair attempt.

`ToolCallSplitter` decides, delta by delta, which text is answer (streamed to the user at once) and
which may be a tool call (held back until the reply ends): the tail of the text that could be the
start of a call marker is withheld; once a marker is seen, everything from it on is held.
"""

from __future__ import annotations

import difflib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable

OPENERS = ("<tool_call>", "```json", "```JSON", "```\n{", "<tools>")
# the chat template's list of tools, written back as the reply: the 1.5B model's answer to "Give me a recipe for
# pancakes." with the tools offered (1 of 100 general questions, 2026-12-01); asked again without tools
TOOLS_ECHO = re.compile(r"<tools>.*?(?:</tools>|$)", re.S)
TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
FENCED_JSON = re.compile(r"```(?:json|JSON)?\s*\n?(\{.*?)(?:```|$)", re.S)
NEAR_NAME = 0.75  # difflib ratio at which an unknown tool name is taken for a misspelt real one
CALL_FORMAT = '<tool_call>\n{"name": "<tool name>", "arguments": {<arguments as JSON>}}\n</tool_call>'


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:12])


@dataclass(frozen=True)
class MalformedCall:
    raw: str  # what the model wrote
    error: str  # why it is not a usable call, written for the model
    not_a_call: bool = False  # JSON naming no tool with no arguments object: content, not a call attempt


@dataclass(frozen=True)
class ParsedReply:
    text: str  # the reply without its tool-call blocks (what the user would read)
    calls: tuple[ToolCall, ...] = ()
    malformed: tuple[MalformedCall, ...] = ()

    @property
    def wants_tools(self) -> bool:
        return bool(self.calls or self.malformed)


class ToolCallSplitter:
    """Feed deltas; get back the part that is safe to show now. `finish()` parses the whole reply."""

    def __init__(self, tool_names: Iterable[str]) -> None:
        self.tool_names = set(tool_names)
        self.buffer = ""
        self.shown = 0  # characters of `buffer` already released as answer text
        self.held = False  # a call marker was seen: nothing more is released while streaming

    def feed(self, text: str) -> str:
        self.buffer += text
        if not self.tool_names or self.held:
            if not self.tool_names:
                return self._release(len(self.buffer))
            return ""
        start = self._marker_start()
        if start is not None:
            self.held = True
            return self._release(start)
        stripped = self.buffer.lstrip()
        if stripped.startswith("{") or not stripped:
            return ""  # a reply that opens with "{" may be a bare JSON call: wait
        return self._release(len(self.buffer) - _partial_opener_len(self.buffer))

    def finish(self) -> tuple[ParsedReply, str]:
        """Parse the whole reply; return it and the text not yet released (answer text to show)."""
        reply = parse_reply(self.buffer, self.tool_names) if self.tool_names else ParsedReply(self.buffer)
        if reply.wants_tools:
            return reply, ""
        return reply, self._release(len(self.buffer))

    def _release(self, end: int) -> str:
        end = max(end, self.shown)
        out, self.shown = self.buffer[self.shown:end], end
        return out

    def _marker_start(self) -> int | None:
        found = [i for i in (self.buffer.find(o) for o in OPENERS) if i >= 0]
        return min(found) if found else None


def _partial_opener_len(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a call marker."""
    best = 0
    for opener in OPENERS:
        for n in range(min(len(opener) - 1, len(text)), 0, -1):
            if text.endswith(opener[:n]):
                best = max(best, n)
                break
    return best


def parse_reply(text: str, tool_names: Iterable[str]) -> ParsedReply:
    """Find tool calls in a finished reply (see the module docstring for the formats)."""
    names = set(tool_names)
    blocks = [(m.start(), m.end(), m.group(1)) for m in TOOL_CALL_BLOCK.finditer(text)]
    if not blocks:
        blocks = [(m.start(), m.end(), m.group(1)) for m in FENCED_JSON.finditer(text) if _looks_like_call(m.group(1))]
    if not blocks and text.strip().startswith("{") and _looks_like_call(text):
        blocks = [(0, len(text), text)]
    if not blocks and (echo := TOOLS_ECHO.search(text)):
        return ParsedReply(TOOLS_ECHO.sub("", text).strip(), (), (MalformedCall(
            echo.group(0), "That is the list of tools, not an answer; answer in plain text.", not_a_call=True),))
    calls, malformed = [], []
    for _, _, raw in blocks:
        result = parse_call(raw, names)
        (calls if isinstance(result, ToolCall) else malformed).append(result)
    rest, last = [], 0
    for start, end, _ in blocks:
        rest.append(text[last:start])
        last = end
    rest.append(text[last:])
    return ParsedReply("".join(rest).strip(), tuple(calls), tuple(malformed))


def _looks_like_call(raw: str) -> bool:
    return bool(re.search(r'"name"\s*:', raw)) and bool(re.search(r'"(arguments|parameters)"\s*:', raw))


def parse_call(raw: str, tool_names: set[str]) -> ToolCall | MalformedCall:
    """One call from the text of one block; the error of a MalformedCall is meant for the model."""
    obj, error = loads_lenient(raw)
    if obj is None:
        return MalformedCall(raw, f"Your tool call is not valid JSON ({error}). Write it exactly as:\n{CALL_FORMAT}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return MalformedCall(raw, f'A tool call needs a "name" and an "arguments" object. Write it as:\n{CALL_FORMAT}')
    name = obj["name"].strip()
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI style: arguments as a JSON string
        arguments, _ = loads_lenient(arguments)
    if not isinstance(arguments, dict) and name not in tool_names:  # {"name": "Paris", "arguments": [...]}
        return MalformedCall(raw, f"There is no tool named {name!r}; answer in plain text.", not_a_call=True)
    if not isinstance(arguments, dict):
        return MalformedCall(raw, f'The "arguments" of {name} must be a JSON object. Write the call as:\n{CALL_FORMAT}')
    if name not in tool_names:
        near = difflib.get_close_matches(name, sorted(tool_names), n=1, cutoff=NEAR_NAME)
        if near:  # a misspelt tool ("pyhton", "search_document"): worth a repair
            return MalformedCall(raw, f"There is no tool named {name!r}; did you mean {near[0]!r}? Write the call "
                                      f"as:\n{CALL_FORMAT}")
        # a made-up tool ({"name": "hello grandma", "arguments": {...}}): the 0.5B model, shown the list of
        # tools in a repair, answered with the repair's own words; asked again without tools, it answers
        return MalformedCall(raw, f"There is no tool named {name!r}; answer in plain text.", not_a_call=True)
    return ToolCall(name, arguments)


def loads_lenient(raw: str) -> tuple[Any, str]:
    """json.loads with the repairs small models need; returns (object or None, error message)."""
    text = raw.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    # "line 1"\n + "line 2" (one string per source line, joined with +) -> "line 1\nline 2"
    joined = re.sub(r'"\s*\+\s*"', "", re.sub(r'"[ \t]*(?:\r?\n[ \t]*\+|\+[ \t]*\r?\n)\s*"', r"\\n", text))
    candidates = [text, joined]
    first_error = ""
    for candidate in candidates:
        for attempt in (candidate, candidate + "}", candidate + "}}"):
            try:
                obj, _ = json.JSONDecoder(strict=False).raw_decode(attempt)  # ignores trailing extra braces
                return obj, ""
            except json.JSONDecodeError as e:
                first_error = first_error or f"{e.msg} at line {e.lineno} column {e.colno}"
    return None, first_error


# -- prompt messages for one step -----------------------------------------------------------------


def call_message(text: str, calls: Iterable[ToolCall]) -> dict[str, Any]:
    """The assistant turn that made the calls, in the form chat templates (Qwen's too) render."""
    return {"role": "assistant", "content": text,
            "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in calls]}


def result_message(name: str, content: str, call_id: str = "") -> dict[str, Any]:
    message = {"role": "tool", "name": name, "content": content}
    if call_id:
        message["tool_call_id"] = call_id
    return message


def repair_messages(reply_text: str, malformed: MalformedCall) -> list[dict[str, Any]]:
    """The broken attempt and the validation error as its observation, for the one repair step."""
    return [{"role": "assistant", "content": reply_text},
            {"role": "tool", "name": "error", "content": malformed.error}]
