"""`python`: the sandbox's code interpreter (tools/code_interpreter.py) behind the Tool contract.

A thin wrapper: the interpreter keeps its own declaration and executor; this adds argument
validation, the conversation id from the ToolContext, and one hint for small models that define a
function but never print its value (the run then produced nothing to read).
"""

from __future__ import annotations

import re
from typing import Any

from assistant.seams import close_if_closable
from tools.base import Tool, ToolContext, ToolResult

NO_OUTPUT_HINT = "Nothing was printed. Call the tool again with code that prints the value you need."
DEFINED_ONLY_HINT = "Nothing was printed: the code only defined {name}(). Call the tool again with print({name}(...)), giving the argument the question asks for."


class PythonTool(Tool):
    name = "python"
    description = (
        "Run Python 3 code in a sandbox (no network) and read what it prints. Variables persist between "
        "calls in this conversation. Files the user attached are in /data (read-only; os.listdir('/data')). "
        "Always print() the result you need."
    )
    inputs = {"code": {"type": "string", "description": "Python source to run; print the result"}}

    def __init__(self, interpreter: Any) -> None:
        super().__init__()
        self.interpreter = interpreter  # a code_interpreter.CodeInterpreter (or anything with forward(code, cid))
        self._available: bool | None = None

    @classmethod
    def from_config(cls, config: Any, *, code_tool: Any = None) -> "PythonTool":
        if code_tool is None:
            from tools.code_interpreter import CodeInterpreter

            code_tool = CodeInterpreter(config)
        return cls(code_tool)

    def setup(self) -> None:
        setup = getattr(self.interpreter, "setup", None)
        if setup is not None:
            setup()  # raises ToolUnavailable with the command that enables the sandbox

    def available(self) -> bool:
        """Whether the sandbox can be reached; checked once (the tool is not offered when it cannot)."""
        if self._available is None:
            try:
                self.setup()
                self._is_set_up = self._available = True
            except Exception:  # ToolUnavailable, or Docker not installed at all
                self._available = False
        return self._available

    def close(self) -> None:
        close_if_closable(self.interpreter)

    def forward(self, code: str, ctx: ToolContext) -> ToolResult:
        result = self.interpreter.forward(code, ctx.conversation_id)
        text = str(result)
        ok = bool(getattr(result, "ok", True))
        output = getattr(result, "output", None)
        printed = bool(getattr(output, "stdout", "").strip()) if output is not None else "(no output)" not in text
        if ok and not printed and not getattr(result, "artifacts", ()):
            defined = re.findall(r"^def ([A-Za-z_]\w*)\(", code, re.M)
            text = f"{text}\n{DEFINED_ONLY_HINT.format(name=defined[-1]) if defined else NO_OUTPUT_HINT}"
        artifacts = tuple(str(a.id) for a in getattr(result, "artifacts", ()))
        first = next((line for line in getattr(output, "stdout", "").splitlines() if line.strip()), "")
        summary = (first or text.splitlines()[0]) if ok else text.splitlines()[0]
        return ToolResult(text, ok=ok, summary=summary, artifacts=artifacts, data=result)
