"""The code interpreter behind the `python` tool: runs code in the conversation's sandbox and turns
the output into an observation for the model (lazy `setup()`, `forward(code, conversation_id)`).
Whatever the code does wrong (exception, timeout, out of memory) comes back as text for the model;
only our own failures (no Docker, no image) raise `ToolUnavailable`, whose message says how to fix it.
Artifacts (plots, CSVs) are saved under `artifacts_dir/<conversation>/` and referenced by id, so the
UI can show them while the model only sees a short line per file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from assistant.config import AssistantConfig
from sandbox.base import CodeOutput, Executor, truncate_output

MAX_OBSERVATION_BYTES = 6000  # of stdout and of stderr shown to the model (the executor keeps more)


@dataclass(frozen=True)
class ArtifactRef:
    """A file the code produced, as the UI and the model refer to it."""

    id: str  # content address, stable for identical files
    name: str  # path relative to the sandbox work dir
    mime_type: str  # e.g. "image/png"
    size: int  # bytes
    path: Path | None  # where it was saved on the host; None when too large to bring back


@dataclass(frozen=True)
class CodeToolResult:
    """The tool's answer: `text` for the model, `artifacts` for the UI, `output` for logs/tests."""

    text: str
    artifacts: tuple[ArtifactRef, ...]
    output: CodeOutput

    @property
    def ok(self) -> bool:
        return self.output.ok

    def __str__(self) -> str:
        return self.text


class CodeInterpreter:
    """Runs code in a conversation's sandbox session and saves what it writes. The model-facing
    contract (name, description, inputs) is the `python` tool's, in tools/python_tool.py."""

    def __init__(
        self,
        config: AssistantConfig | None = None,
        *,
        executor: Executor | None = None,
        artifacts_dir: Path | None = None,
    ):
        self.config = config or AssistantConfig()
        self.executor = executor  # built by setup() on first use unless given (tests pass a FakeExecutor)
        self.artifacts_dir = Path(artifacts_dir or Path(self.config.data_dir) / "artifacts")

    def setup(self) -> None:
        """Connect to the sandbox engine (raises ToolUnavailable with the enabling command if it is off)."""
        if self.executor is None:
            from sandbox.executor import DockerExecutor

            self.executor = DockerExecutor(self.config.sandbox, uploads_root=Path(self.config.data_dir) / "uploads")

    def forward(self, code: str, conversation_id: str) -> CodeToolResult:
        if not isinstance(code, str):
            raise TypeError(f"python tool: `code` must be a string, got {type(code).__name__}")
        self.setup()
        output = self.executor.run(code, conversation_id)
        artifacts = tuple(self._save(conversation_id, f) for f in output.files)
        return CodeToolResult(format_observation(output, artifacts), artifacts, output)

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()

    def _save(self, conversation_id: str, artifact) -> ArtifactRef:
        path = None
        if artifact.data is not None:
            folder = self.artifacts_dir / _slug(conversation_id)
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{artifact.id}-{_slug(Path(artifact.name).name)}"
            path.write_bytes(artifact.data)
        return ArtifactRef(artifact.id, artifact.name, artifact.mime_type, artifact.size, path)


def format_observation(output: CodeOutput, artifacts: tuple[ArtifactRef, ...] = ()) -> str:
    """The text the model reads: status, stdout, stderr (tracebacks), and one line per artifact."""
    if output.timed_out:
        status = "Timed out (the session was restarted: variables and files are gone)."
    elif output.oom:
        status = "Out of memory."
    elif output.exit_code == 0:
        status = "Finished."
    else:
        status = f"Failed (exit code {output.exit_code})."
    parts = [status]
    for label, text in (("stdout", output.stdout), ("stderr", output.stderr)):
        if text.strip():
            parts.append(f"[{label}]\n{truncate_output(text.encode(), MAX_OBSERVATION_BYTES).rstrip()}")
    for ref in artifacts:
        where = f"artifact id {ref.id}" if ref.path is not None else "too large to return"
        parts.append(f"[file] {ref.name} ({ref.mime_type}, {ref.size:,} bytes; {where})")
    if len(parts) == 1:
        parts.append("(no output)")
    return "\n".join(parts)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text).strip(".") or "_"
