"""Tools the agent can call: the contract (`base`), the explicit registry (`registry`), and the tools
themselves (`retrieval`: search/read the user's documents; `python_tool`: the sandboxed interpreter
from `code_interpreter`)."""

from tools.base import Tool, ToolContext, ToolInputError, ToolResult, ToolUnavailable
from tools.registry import ToolRegistry

__all__ = ["Tool", "ToolContext", "ToolInputError", "ToolResult", "ToolUnavailable", "ToolRegistry"]
