"""`FakeExecutor`: runs code IN THIS PROCESS. It is NOT a sandbox: tests only, never for user code.

It keeps the real executor's contract so tools and the orchestrator can be unit-tested without
Docker: a namespace per conversation that persists between runs, a trailing expression's repr
printed, tracebacks returned as results, output truncated with the same marker, artifacts = files
written under the conversation's temporary work dir (the fake `chdir`s there for the run), and the
same `SessionPool` (bounded, LRU-evicted). No limits are enforced: no timeout, memory or network cap.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from assistant.config import SandboxConfig
from sandbox.base import Artifact, CodeOutput, Executor, truncate_output
from sandbox.pool import SessionPool
from sandbox.kernel import execute  # the real kernel's cell semantics, in-process

_CWD_LOCK = threading.Lock()  # chdir is process-wide


@dataclass
class FakeSession:
    work_dir: Path
    namespace: dict = field(default_factory=lambda: {"__name__": "__main__"})
    num_runs: int = 0


class FakeExecutor(Executor):
    """In-process executor for unit tests. NOT a sandbox: the code can do anything this process can."""

    def __init__(self, config: SandboxConfig | None = None, *, clock=time.monotonic):
        self.config = config or SandboxConfig()
        self.num_created = 0  # sessions created so far (tests check reuse and eviction)
        self._pool: SessionPool[FakeSession] = SessionPool(
            self._start, self._stop, max_sessions=self.config.max_containers, idle_s=self.config.idle_reap_s,
            clock=clock,
        )  # fmt: skip

    def run(self, code: str, conversation_id: str) -> CodeOutput:
        started = time.monotonic()
        with self._pool.acquire(conversation_id) as slot:
            session = slot.session
            session.num_runs += 1
            before = _scan(session.work_dir)
            out, err = io.StringIO(), io.StringIO()
            with _CWD_LOCK, _chdir(session.work_dir), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                exit_code = execute(code, session.namespace, f"<cell {session.num_runs}>")
            files = _changed(session.work_dir, before, self.config.max_artifact_bytes)
        limit = self.config.max_output_bytes
        return CodeOutput(
            stdout=truncate_output(out.getvalue().encode(), limit),
            stderr=truncate_output(err.getvalue().encode(), limit),
            exit_code=exit_code,
            files=files,
            duration_s=time.monotonic() - started,
        )

    def reset(self, conversation_id: str) -> None:
        self._pool.remove(conversation_id)

    def close(self) -> None:
        self._pool.close()

    def conversations(self) -> list[str]:
        return self._pool.keys()

    def reap_idle(self) -> list[str]:
        return self._pool.reap_idle()

    def _start(self, conversation_id: str) -> FakeSession:
        self.num_created += 1
        return FakeSession(Path(tempfile.mkdtemp(prefix="fake-sandbox-")))

    def _stop(self, session: FakeSession) -> None:
        shutil.rmtree(session.work_dir, ignore_errors=True)


@contextlib.contextmanager
def _chdir(path: Path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _scan(root: Path) -> dict[str, tuple[int, int]]:
    found = {}
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if path.is_file() and not any(part.startswith(".") for part in rel.parts):
            st = path.stat()
            found[rel.as_posix()] = (st.st_mtime_ns, st.st_size)
    return found


def _changed(root: Path, before: dict, budget: int) -> tuple[Artifact, ...]:
    after = _scan(root)
    files = []
    for name in sorted(n for n in after if before.get(n) != after[n]):
        size = after[name][1]
        data = (root / name).read_bytes() if size <= budget else None
        budget -= size if data is not None else 0
        files.append(Artifact(name, size, data))
    return tuple(files)
