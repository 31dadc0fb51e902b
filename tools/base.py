"""The tool contract: what the agent loop needs from anything the model may call.

A tool is a class with `name`, `description`, a JSON-schema `inputs` mapping (argument name ->
{"type", "description", optional "enum", "items", "nullable"}), an `output_type`, a `forward(...)`
whose parameters are exactly the input names (plus an optional `ctx: ToolContext`), and an optional
`setup()` that loads heavy things on first use. The declaration is checked when the class is
defined (smolagents-style), so a broken tool fails at import, not at the model's first call.

Errors are split in two:
  * the *model's* mistakes (unknown tool, bad arguments, code that raises, a document that does not
    exist) become `ToolResult(ok=False, text=...)` observations the model reads on its next step;
    tools signal them by raising `ToolInputError` or by returning a result with ok=False;
  * *our* failures (a backend not installed or not running) raise `ToolUnavailable` (assistant.errors)
    whose message says how to enable it; the orchestrator turns that into an Error event.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from assistant.errors import ToolUnavailable

__all__ = ["Tool", "ToolContext", "ToolInputError", "ToolResult", "ToolUnavailable", "validate_arguments"]

JSON_TYPES = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (dict,),
}
OUTPUT_TYPES = ("string", "object")
NAME_PATTERN = re.compile(r"[a-z_][a-z0-9_]{0,63}")


class ToolInputError(Exception):
    """The model called a tool wrongly; the message is shown to the model as the observation."""


@dataclass
class ToolContext:
    """What a tool may know about the turn it runs in."""

    conversation_id: str  # the conversation the call belongs to (the sandbox keeps one session per id)
    sources: Any = None  # the turn's citations.SourceLedger: retrieval tools register passages here
    extra: dict[str, Any] = field(default_factory=dict)  # free slots for tools (e.g. artifacts dir)


@dataclass(frozen=True)
class ToolResult:
    """One tool call's outcome: `text` is what the model reads; `summary` what the UI shows."""

    text: str  # observation fed back to the model
    ok: bool = True  # False: the model's call failed (bad arguments, code raised, ...)
    summary: str = ""  # one short line for display; defaults to the start of `text`
    artifacts: tuple[str, ...] = ()  # ids/paths of files the tool produced
    data: Any = None  # the raw result for programmatic callers (never shown to the model)

    def short(self, max_chars: int = 160) -> str:
        text = (self.summary or self.text).strip().replace("\n", " ")
        return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


class Tool:
    """Base class. Subclasses declare the class attributes below and implement `forward`."""

    name: ClassVar[str]  # what the model calls: lowercase letters, digits, underscores
    description: ClassVar[str]  # what it does and when to use it, written for the model
    inputs: ClassVar[dict[str, dict[str, Any]]]  # argument name -> JSON schema of that argument
    output_type: ClassVar[str] = "string"  # "string" or "object"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if inspect.isabstract(cls) or cls.__dict__.get("abstract", False):
            return
        check_tool_class(cls)

    def __init__(self) -> None:
        self._is_set_up = False

    # -- to override ----------------------------------------------------------------------------
    def setup(self) -> None:
        """Load heavy things (models, connections). Called once, before the first forward()."""

    def forward(self, *args: Any, **kwargs: Any) -> str | ToolResult:
        raise NotImplementedError

    # -- used by the agent loop -----------------------------------------------------------------
    def spec(self) -> dict[str, Any]:
        """The OpenAI-style function spec that goes into the model's chat template."""
        properties = {}
        for arg, schema in self.inputs.items():
            properties[arg] = {k: v for k, v in schema.items() if k != "nullable"}
        required = [arg for arg, schema in self.inputs.items() if not schema.get("nullable")]
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "properties": properties, "required": required}}}

    def __call__(self, arguments: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """Validate `arguments`, set up on first use, run. Model mistakes come back as ok=False."""
        try:
            arguments = validate_arguments(self.name, self.inputs, arguments)
        except ToolInputError as e:
            return ToolResult(str(e), ok=False, summary="invalid arguments")
        if not getattr(self, "_is_set_up", False):
            self.setup()  # ToolUnavailable propagates: it is our failure, not the model's
            self._is_set_up = True
        if "ctx" in inspect.signature(self.forward).parameters:
            arguments = {**arguments, "ctx": ctx}
        try:
            out = self.forward(**arguments)
        except ToolInputError as e:
            return ToolResult(f"Error: {e}", ok=False, summary=str(e))
        if isinstance(out, ToolResult):
            return out
        return ToolResult(out if isinstance(out, str) else str(out))


def check_tool_class(cls: type) -> None:
    """Raise TypeError naming what is wrong with a tool's declaration."""
    where = f"tool class {cls.__name__}"
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise TypeError(f"{where}: `name` must match {NAME_PATTERN.pattern}, got {name!r}")
    if not isinstance(getattr(cls, "description", None), str) or not cls.description.strip():
        raise TypeError(f"{where}: `description` must be a non-empty string written for the model")
    if cls.output_type not in OUTPUT_TYPES:
        raise TypeError(f"{where}: `output_type` must be one of {OUTPUT_TYPES}, got {cls.output_type!r}")
    inputs = getattr(cls, "inputs", None)
    if not isinstance(inputs, dict):
        raise TypeError(f"{where}: `inputs` must be a dict of argument name -> JSON schema")
    for arg, schema in inputs.items():
        if not isinstance(schema, dict) or not {"type", "description"} <= set(schema):
            raise TypeError(f"{where}: input {arg!r} needs at least 'type' and 'description'")
        if schema["type"] not in JSON_TYPES:
            raise TypeError(f"{where}: input {arg!r} has type {schema['type']!r}; use one of {', '.join(JSON_TYPES)}")
    if cls.forward is Tool.forward:
        raise TypeError(f"{where}: implement forward({', '.join(inputs)})")
    params = inspect.signature(cls.forward).parameters
    names = [p for p in params if p not in ("self", "ctx")]
    if set(names) != set(inputs):
        raise TypeError(f"{where}: forward() takes {names} but inputs declare {list(inputs)}; they must match")


def validate_arguments(tool: str, inputs: dict[str, dict[str, Any]], arguments: Any) -> dict[str, Any]:
    """Check `arguments` against the tool's input schema; raise ToolInputError saying what to fix."""
    if not isinstance(arguments, dict):
        raise ToolInputError(f"Arguments of {tool} must be a JSON object like {_example(inputs)}.")
    unknown = sorted(set(arguments) - set(inputs))
    if unknown:
        raise ToolInputError(f"{tool} has no argument {unknown[0]!r}; its arguments are: {', '.join(inputs)}.")
    out: dict[str, Any] = {}
    for arg, schema in inputs.items():
        value = arguments.get(arg)
        if value is None:
            if not schema.get("nullable"):
                raise ToolInputError(f"{tool} needs the argument {arg!r} ({schema['description']}).")
            out[arg] = None
            continue
        out[arg] = _check_value(tool, arg, schema, value)
    return out


def _check_value(tool: str, arg: str, schema: dict[str, Any], value: Any) -> Any:
    kind = schema["type"]
    if kind == "integer" and isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)  # small models quote numbers; accept the obvious
    if kind == "array" and not isinstance(value, (list, tuple)) and "items" in schema:
        value = [value]
    ok = isinstance(value, JSON_TYPES[kind]) and not (kind in ("integer", "number") and isinstance(value, bool))
    if not ok:
        raise ToolInputError(f"{tool}: argument {arg!r} must be a {kind}, got {type(value).__name__} {value!r:.60}.")
    if "enum" in schema and value not in schema["enum"]:
        raise ToolInputError(f"{tool}: argument {arg!r} must be one of {schema['enum']}, got {value!r}.")
    if kind == "array" and "items" in schema:
        value = [_check_value(tool, f"{arg}[{i}]", {"description": "", **schema["items"]}, v) for i, v in enumerate(value)]
    return value


def _example(inputs: dict[str, dict[str, Any]]) -> str:
    samples = {"string": '"..."', "integer": "1", "number": "1.0", "boolean": "true", "array": "[...]", "object": "{...}"}
    return "{" + ", ".join(f'"{a}": {samples[s["type"]]}' for a, s in inputs.items()) + "}"
