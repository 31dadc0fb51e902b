"""The executor contract: `Executor.run(code, conversation_id) -> CodeOutput`, plus output truncation.

Errors are split the smolagents way: whatever the *code* does wrong (syntax error, exception, timeout,
out of memory, sys.exit) is a normal `CodeOutput` the model reads; only *our* failures (no engine, no
image, a broken daemon) raise `ToolUnavailable`.
"""

from __future__ import annotations

import hashlib
import mimetypes
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

UPLOADS_MOUNT = "/data"  # where a conversation's files appear in its sandbox, read-only


TRUNCATION_MARKER = "\n[... {num_bytes:,} bytes of output truncated ...]\n"


@dataclass(frozen=True)
class Artifact:
    """A file the code wrote (new or changed) under the sandbox's work dir during one run."""

    name: str  # path relative to the work dir, e.g. "plot.png" or "out/table.csv"
    size: int  # bytes on the sandbox's disk
    data: bytes | None  # the content; None when it did not fit in max_artifact_bytes (listed only)

    @property
    def id(self) -> str:
        """Content address (sha256 prefix), stable across runs for identical files."""
        return hashlib.sha256(self.data or self.name.encode()).hexdigest()[:16]

    @property
    def mime_type(self) -> str:
        return mimetypes.guess_type(self.name)[0] or "application/octet-stream"


@dataclass(frozen=True)
class CodeOutput:
    """What one run produced. A failing program is still a normal result, never an exception."""

    stdout: str  # standard output (and the repr of a trailing expression), truncated with a marker
    stderr: str  # standard error: tracebacks, warnings, our note on timeout/OOM; truncated likewise
    exit_code: int  # 0 ok, 1 uncaught exception, N for sys.exit(N), 137 killed (timeout / out of memory)
    files: tuple[Artifact, ...] = field(default=())  # artifacts written during this run, by name
    duration_s: float = 0.0  # wall-clock time of the run, container start included when cold
    timed_out: bool = False  # killed at the wall-clock limit; the conversation's state was lost
    oom: bool = False  # something was killed for memory; if the interpreter itself, state was lost

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.oom


class Executor(ABC):
    """Runs Python for a conversation; state (variables, files in the work dir) persists between runs."""

    @abstractmethod
    def run(self, code: str, conversation_id: str) -> CodeOutput:
        """Run `code` in the conversation's interpreter (created on first use) and return its output."""

    @abstractmethod
    def reset(self, conversation_id: str) -> None:
        """Forget a conversation's state (its interpreter and files); the next run starts fresh."""

    @abstractmethod
    def close(self) -> None:
        """Release every interpreter this executor holds."""

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def truncate_output(data: bytes, max_bytes: int) -> str:
    """Decode `data`, keeping its first and last max_bytes/2 bytes around a marker when it is longer."""
    if len(data) <= max_bytes:
        return data.decode("utf-8", errors="replace")
    half = max_bytes // 2
    return join_truncated(data[:half], data[len(data) - half :], len(data))


def join_truncated(head: bytes, tail: bytes, total: int) -> str:
    """Reassemble an output of `total` bytes of which only `head` and `tail` were kept."""
    cut = total - len(head) - len(tail)
    if cut <= 0:
        return (head + tail[-cut:]).decode("utf-8", errors="replace")  # overlapping (or adjacent) windows
    return (
        head.decode("utf-8", errors="replace")
        + TRUNCATION_MARKER.format(num_bytes=cut)
        + tail.decode("utf-8", errors="replace")
    )
