"""Sandboxed code execution: one warm Docker container per conversation (see ../shared/docs/SANDBOX.md).

- `base`      the `Executor` contract and its results (`CodeOutput`, `Artifact`), output truncation.
- `pool`      `SessionPool`: one session per conversation, bounded, LRU-evicted, reaped when idle.
- `executor`  `DockerExecutor`: the real sandbox (docker SDK; runc or gVisor's runsc).
- `kernel`    the Python process that runs inside each container (sent in at start, not imported here).
- `fake`      `FakeExecutor`: in-process, NOT a sandbox, for unit tests only.
- `setup`     `assistant sandbox setup`: install + start the engine, build the image locally.
"""

from sandbox.base import Artifact, CodeOutput, Executor

__all__ = ["Artifact", "CodeOutput", "Executor"]
