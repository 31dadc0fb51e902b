"""`DockerExecutor`: runs a conversation's code in its own warm, locked-down Docker container.

NOTE on the design: each conversation gets one container whose main process is the kernel
(sandbox/kernel.py, under docker-init), a Python interpreter that keeps its variables between runs
like a notebook. We talk to it over the container's attached stdin/stdout (one JSON line each way),
so a warm run costs a socket round trip rather than a `docker exec` (~80 ms) and a fresh python3.
Every limit from SANDBOX.md is set at creation: no network, memory == memory+swap, CPU quota, pids
cap, read-only root, size-capped noexec tmpfs as the only writable place (/tmp, the work dir), all
capabilities dropped, no-new-privileges, uid 65534 (besides /tmp only /dev/shm is writable: 16 MB of
POSIX shared memory for multiprocessing, charged to the memory limit). The wall-clock limit is ours: when no reply comes
in time the container is removed (killed) and the next run gets a fresh one; the same happens when
the kernel dies (OOM, os._exit). `runtime="runsc"` (gVisor) uses the same code path.

Containers carry labels naming this process; ones left by a dead process are removed at start. A
container also ends itself when we disappear: stdin closes (stdin_once) and the kernel exits.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from assistant.config import SandboxConfig
from assistant.errors import ToolUnavailable
from sandbox.base import UPLOADS_MOUNT, Artifact, CodeOutput, Executor, join_truncated
from sandbox.pool import SessionPool, Slot
from sandbox.setup import ENABLE_COMMAND, check_socket_access, image_exists, ping_daemon, runsc_available

log = logging.getLogger(__name__)

LABEL = "org.offline-assistant.sandbox"
WORK_DIR = "/tmp"  # the size-capped tmpfs; must match sandbox/kernel.py
KERNEL_SOURCE = (Path(__file__).parent / "kernel.py").read_bytes()
BOOT = (  # read the kernel's source from stdin (length line, then bytes) and run it
    "import sys;n=int(sys.stdin.buffer.readline());"
    "exec(compile(sys.stdin.buffer.read(n),'/sandbox/kernel.py','exec'))"
)
MAX_START_S = 30.0  # container start + kernel ready
DOCKER_API_TIMEOUT_S = 120.0  # removing a gVisor container full of processes can take a while under load
MAX_STDERR_KEPT = 65536  # the kernel's own stderr (crash reports), for diagnostics
RUNSC_MIN_PIDS = 4096  # host pids cap under gVisor: the sentry's threads and stubs; the nproc ulimit caps the code (at 512 a fork bomb crashed the sentry)


class _KernelGone(Exception):
    """The kernel exited or was killed (`exited`), or its channel carried something that is not a reply."""

    def __init__(self, message: str, *, exited: bool = False):
        super().__init__(message)
        self.exited = exited


class _Channel:
    """The attached stdin/stdout of a container: docker's multiplexed frames -> JSON lines."""

    def __init__(self, sock, max_line: int):
        self._owner = sock  # docker-py's wrapper; keeps the connection alive
        self._sock = getattr(sock, "_sock", sock)  # the raw socket under it
        self._raw, self._out, self.err = bytearray(), bytearray(), bytearray()
        self._searched = 0  # bytes of _out already searched for a newline
        self._max_line = max_line

    def send(self, obj: dict) -> None:
        self._sock.sendall(json.dumps(obj).encode() + b"\n")

    def send_raw(self, data: bytes) -> None:
        self._sock.sendall(data)

    def receive(self, timeout: float) -> dict:
        """The next JSON line; TimeoutError when none in time, _KernelGone on EOF or garbage."""
        deadline = time.monotonic() + timeout
        while True:
            i = self._out.find(b"\n", self._searched)
            if i >= 0:
                line = bytes(self._out[:i])
                del self._out[: i + 1]
                self._searched = 0
                try:
                    return json.loads(line)
                except ValueError as e:
                    raise _KernelGone(f"unreadable reply from the kernel: {line[:200]!r}") from e
            self._searched = len(self._out)
            if len(self._out) > self._max_line:
                raise _KernelGone("reply from the kernel too long")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            self._sock.settimeout(remaining)
            try:
                chunk = self._sock.recv(1 << 20)
            except socket.timeout:
                raise TimeoutError from None
            except OSError as e:
                raise _KernelGone(str(e), exited=True) from e
            if not chunk:
                raise _KernelGone("the kernel's output closed", exited=True)
            self._raw += chunk
            self._demux()

    def _demux(self) -> None:
        while len(self._raw) >= 8:  # header: stream (1 = stdout, 2 = stderr), 3 zero bytes, u32 BE size
            size = int.from_bytes(self._raw[4:8], "big")
            if len(self._raw) < 8 + size:
                return
            payload = self._raw[8 : 8 + size]
            if self._raw[0] == 1:
                self._out += payload
            elif len(self.err) < MAX_STDERR_KEPT:
                self.err += payload
            del self._raw[: 8 + size]

    def close(self) -> None:
        for s in (self._sock, self._owner):
            try:
                s.close()
            except OSError:
                pass


@dataclass
class _Box:
    """One conversation's container and the channel to its kernel."""

    container_id: str
    channel: _Channel


class DockerExecutor(Executor):
    """The real sandbox. `uploads_root/<conversation_id>` (when given) is mounted read-only at /data."""

    def __init__(self, config: SandboxConfig, *, uploads_root: Path | None = None, client=None):
        self.config = config
        self.uploads_root = Path(uploads_root).resolve() if uploads_root is not None else None
        self._client = client or connect(config)
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        remove_orphans(self._client)
        self._pool: SessionPool[_Box] = SessionPool(
            self._start, self._stop, max_sessions=config.max_containers, idle_s=config.idle_reap_s
        )
        self._closed = threading.Event()
        interval = min(60.0, max(1.0, config.idle_reap_s / 4))
        self._reaper = threading.Thread(target=self._reap_loop, args=(interval,), name="sandbox-reaper", daemon=True)
        self._reaper.start()

    # -- Executor ---------------------------------------------------------------------------------

    def run(self, code: str, conversation_id: str) -> CodeOutput:
        started = time.monotonic()
        cfg = self.config
        request = {"code": code, "max_output": cfg.max_output_bytes, "max_artifact_bytes": cfg.max_artifact_bytes}
        with self._pool.acquire(conversation_id) as slot:
            box = slot.session
            try:
                box.channel.send(request)
                return _to_output(box.channel.receive(timeout=cfg.timeout_s), started)
            except TimeoutError:
                self._pool.discard(slot)
                return CodeOutput(
                    stdout="",
                    stderr=f"Timed out: the code ran longer than {cfg.timeout_s:g} s and was stopped. "
                    "The Python session was restarted: variables and files are gone.",
                    exit_code=137,
                    duration_s=time.monotonic() - started,
                    timed_out=True,
                )
            except (_KernelGone, OSError) as e:
                return self._kernel_died(slot, e, started)

    def reset(self, conversation_id: str) -> None:
        self._pool.remove(conversation_id)

    def close(self) -> None:
        self._closed.set()
        self._pool.close()

    def conversations(self) -> list[str]:
        """Conversations with a warm container, least recently used first."""
        return self._pool.keys()

    def container_id(self, conversation_id: str) -> str | None:
        """The id of a conversation's warm container (None if it has none); for tests and ops."""
        box = self._pool.peek(conversation_id)
        return box.container_id if box is not None else None

    # -- container lifecycle ------------------------------------------------------------------------

    def _start(self, conversation_id: str) -> _Box:
        import docker.errors
        from docker.types import Mount, Ulimit

        cfg = self.config
        num_threads = str(max(1, int(cfg.cpus)))
        host: dict[str, Any] = dict(
            init=True,  # docker-init as pid 1 reaps orphans; the kernel is its child
            network_mode="none",
            mem_limit=f"{cfg.memory_mb}m",
            memswap_limit=f"{cfg.memory_mb}m",  # == mem_limit: no swap on top
            nano_cpus=int(cfg.cpus * 1e9),
            pids_limit=cfg.pids_limit,
            read_only=True,
            tmpfs={WORK_DIR: f"rw,nosuid,nodev,noexec,size={cfg.tmpfs_mb}m,mode=1777"},
            shm_size="16m",
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            mounts=[],
        )
        if cfg.runtime == "runsc":
            host.update(
                runtime="runsc",
                pids_limit=max(RUNSC_MIN_PIDS, cfg.pids_limit),
                ulimits=[Ulimit(name="nproc", soft=cfg.pids_limit, hard=cfg.pids_limit)],
            )
        uploads = self._uploads_dir(conversation_id)
        if uploads is not None:
            host["mounts"].append(Mount(target=UPLOADS_MOUNT, source=str(uploads), type="bind", read_only=True))
        api = self._client.api
        container_id = None
        try:
            container_id = api.create_container(
                cfg.image,
                command=["python3", "-u", "-c", BOOT],
                name=f"assistant-sandbox-{_slug(conversation_id)[:32]}-{uuid.uuid4().hex[:6]}",
                labels={LABEL: "1", f"{LABEL}.owner": self._owner, f"{LABEL}.conversation": conversation_id[:256]},
                user="65534:65534",
                working_dir=WORK_DIR,
                environment={
                    "HOME": WORK_DIR,
                    "LANG": "C.UTF-8",
                    "MPLBACKEND": "Agg",
                    "MPLCONFIGDIR": f"{WORK_DIR}/.config/matplotlib",
                    "PYTHONDONTWRITEBYTECODE": "1",
                    "OPENBLAS_NUM_THREADS": num_threads,
                    "OMP_NUM_THREADS": num_threads,
                },
                stdin_open=True,
                # (docker-py sets StdinOnce with stdin_open: our attach closing closes the kernel's stdin)
                tty=False,
                network_disabled=True,
                host_config=api.create_host_config(**host),
            )["Id"]
            sock = api.attach_socket(container_id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
            channel = _Channel(sock, max_line=2 * cfg.max_artifact_bytes + 8 * cfg.max_output_bytes + (1 << 20))
            api.start(container_id)
            channel.send_raw(b"%d\n" % len(KERNEL_SOURCE) + KERNEL_SOURCE)
            hello = channel.receive(timeout=MAX_START_S)
            if not hello.get("ready"):
                raise _KernelGone(f"unexpected greeting {hello!r}")
            return _Box(container_id, channel)
        except (docker.errors.DockerException, _KernelGone, TimeoutError, OSError) as e:
            detail = _logs(api, container_id) if container_id is not None else ""
            if container_id is not None:
                _remove(api, container_id)
            raise ToolUnavailable(
                f"Could not start a sandbox container from {cfg.image} (runtime {cfg.runtime}): {e}{detail}. "
                f"If the engine or image is missing, run: {ENABLE_COMMAND}"
            ) from e

    def _stop(self, box: _Box) -> None:
        box.channel.close()
        try:
            _remove(self._client.api, box.container_id)
        except Exception as e:  # noqa: BLE001 - e.g. dockerd went away; remove_orphans retries later
            log.warning("Could not remove sandbox container %s: %s", box.container_id[:12], e)

    def _kernel_died(self, slot: Slot[_Box], error: Exception, started: float) -> CodeOutput:
        box = slot.session
        exit_code, oom = 137, False
        exited = getattr(error, "exited", True)
        try:
            if exited:  # the container is stopping: its exit code and OOM flag tell what happened
                api = self._client.api
                exit_code = int(api.wait(box.container_id, timeout=10).get("StatusCode", 137))
                oom = bool(api.inspect_container(box.container_id)["State"].get("OOMKilled"))
        except Exception:  # noqa: BLE001 - best effort: the container is going away anyway
            pass
        self._pool.discard(slot)
        if oom:
            why = f"ran out of memory (limit {self.config.memory_mb} MB) and was killed"
        elif exited:
            why = f"exited with code {exit_code} ({error})"
        else:
            why = f"was stopped because {error}"
        return CodeOutput(
            stdout="",
            stderr=f"The Python session {why}. It was restarted: variables and files are gone.",
            exit_code=exit_code,
            duration_s=time.monotonic() - started,
            oom=oom,
        )

    def _uploads_dir(self, conversation_id: str) -> Path | None:
        if self.uploads_root is None:
            return None
        path = (self.uploads_root / _slug(conversation_id)).resolve()  # as assistant/keys.py conversation_files
        if path.parent != self.uploads_root:
            raise ValueError(f"conversation id {conversation_id!r} does not name a directory under uploads")
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _reap_loop(self, interval: float) -> None:
        while not self._closed.wait(interval):
            try:
                self._pool.reap_idle()
            except Exception:  # noqa: BLE001 - keep reaping; a failed removal is retried by remove_orphans
                pass


def connect(config: SandboxConfig):
    """A docker client for a ready engine with the image (and runtime); ToolUnavailable otherwise."""
    check_socket_access()
    client = ping_daemon(timeout=DOCKER_API_TIMEOUT_S)
    if client is None:
        raise ToolUnavailable(f"The Docker engine is not running, so the code tool is off. Enable it with: {ENABLE_COMMAND}")
    if not image_exists(client, config.image):
        raise ToolUnavailable(f"The sandbox image {config.image} is not built. Build it with: {ENABLE_COMMAND}")
    if config.runtime == "runsc" and not runsc_available(client):
        raise ToolUnavailable(
            f"sandbox.runtime is runsc but gVisor is not registered with Docker. Enable it with: "
            f"{ENABLE_COMMAND} --runtime runsc"
        )
    return client


def remove_orphans(client) -> list[str]:
    """Remove sandbox containers that no live process owns (stopped, or owned by a dead pid here)."""
    removed = []
    host = socket.gethostname()
    for info in client.api.containers(all=True, filters={"label": f"{LABEL}=1"}):
        owner = info.get("Labels", {}).get(f"{LABEL}.owner", "")
        owner_host, _, rest = owner.partition(":")
        alive = info.get("State") in ("running", "created") and owner_host == host and _pid_alive(rest.partition(":")[0])
        if not alive:
            _remove(client.api, info["Id"])
            removed.append(info["Id"])
    return removed


def _pid_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
        return True
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True


def _remove(api, container_id: str) -> None:
    import docker.errors

    try:
        api.remove_container(container_id, force=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as e:
        if "already in progress" not in str(e):
            raise


def _logs(api, container_id: str) -> str:
    try:
        text = api.logs(container_id, stdout=False, stderr=True, tail=20).decode(errors="replace").strip()
        return f"; container stderr: {text}" if text else ""
    except Exception:  # noqa: BLE001
        return ""


def _to_output(reply: dict, started: float) -> CodeOutput:
    """The kernel's reply as a CodeOutput; _KernelGone when it is not a reply (the code wrote on our channel)."""
    try:
        return CodeOutput(
            stdout=join_truncated(*_window(reply["stdout"])),
            stderr=join_truncated(*_window(reply["stderr"])),
            exit_code=int(reply["exit"]),
            files=tuple(
                Artifact(str(f["name"]), int(f["size"]), base64.b64decode(f["data"]) if f["data"] is not None else None)
                for f in reply["files"]
            ),
            duration_s=time.monotonic() - started,
            oom=bool(reply["oom"]),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise _KernelGone(f"malformed reply from the kernel ({e!r})") from e


def _window(triple: list) -> tuple[bytes, bytes, int]:
    head, tail, total = triple
    return head.encode(), tail.encode(), int(total)


def _slug(conversation_id: str) -> str:
    """A conversation id as a file or container name (assistant/keys.py slug: the same rule)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", conversation_id).strip(".") or "_"
