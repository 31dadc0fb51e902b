"""ToolRegistry: the explicit list of tools the agent may offer, and which are on per conversation.

Nothing is discovered by import side effects: the application registers each tool instance it wants
(`default_registry(config)` builds the product's set). Every tool is enabled by default; a
conversation can switch tools off and on again (`disable(cid, "python")`). The per-conversation
switches live in memory, for the life of the process: a restarted server offers every tool again.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

from assistant.seams import close_if_closable
from tools.base import Tool


class ToolRegistry:
    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        self._disabled: dict[str, set[str]] = {}  # conversation id -> names switched off
        self._lock = threading.Lock()
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> Tool:
        if not isinstance(tool, Tool):
            raise TypeError(f"{tool!r} is not a tools.base.Tool; wrap it (see tools/python_tool.py)")
        if tool.name in self._tools:
            raise ValueError(f"a tool named {tool.name!r} is already registered")
        self._tools[tool.name] = tool
        return tool

    def unregister(self, name: str) -> None:
        self._tools.pop(name, None)

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def __len__(self) -> int:
        return len(self._tools)

    def __contains__(self, name: str) -> bool:
        return name in self._tools

    # -- per conversation -----------------------------------------------------------------------
    def disable(self, conversation_id: str, name: str) -> None:
        self._require(name)
        with self._lock:
            self._disabled.setdefault(conversation_id, set()).add(name)

    def enable(self, conversation_id: str, name: str) -> None:
        self._require(name)
        with self._lock:
            self._disabled.get(conversation_id, set()).discard(name)

    def enabled(self, conversation_id: str | None) -> list[Tool]:
        """Tools offered in this conversation, in registration order (stable: good for prefix caches)."""
        off = self._disabled.get(conversation_id or "", set())
        return [t for name, t in self._tools.items() if name not in off and _available(t)]

    def specs(self, conversation_id: str | None) -> list[dict[str, Any]]:
        return [t.spec() for t in self.enabled(conversation_id)]

    def close(self) -> None:
        """Close the tools that hold resources (the sandbox's containers)."""
        for tool in self._tools.values():
            close_if_closable(tool)

    def _require(self, name: str) -> None:
        if name not in self._tools:
            raise KeyError(f"no tool named {name!r}; registered: {', '.join(self._tools) or 'none'}")


def _available(tool: Tool) -> bool:
    """A tool with an `available()` check (e.g. the sandbox) is offered only when its backend is up."""
    check = getattr(tool, "available", None)
    return bool(check()) if callable(check) else True


def default_registry(config: Any, *, handle: Any = None, code_tool: Any = None, python: bool = True) -> ToolRegistry:
    """The product's tools: document search/read over `handle` (a tools.retrieval.RetrieverHandle, None
    when documents are not part of this build) and `python` when the sandbox package is present.
    Backends are created lazily, on first use."""
    registry = ToolRegistry()
    if handle is not None:
        from tools.retrieval import ReadDocumentTool, SearchDocumentsTool

        registry.register(SearchDocumentsTool(handle))
        registry.register(ReadDocumentTool(handle))
    if not python:
        return registry
    try:
        from tools.python_tool import PythonTool
    except ImportError:  # the sandbox subsystem is not part of this build
        return registry
    registry.register(PythonTool.from_config(config, code_tool=code_tool))
    return registry
