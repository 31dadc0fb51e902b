"""`assistant sandbox setup`: install the Docker engine, start it, and build the sandbox image locally.

Every step checks first and does nothing when its work is already done, so a second run takes about a
second. The steps (see ../shared/docs/SANDBOX.md for why each looks the way it does):

1. engine   `docker.io` (+ `debootstrap`, + `runsc` when asked for) from Debian, when missing.
2. daemon   `dockerd --bridge=none --iptables=false --ip-forward=false` in its own session
            (`setsid nohup`), logging to <data_dir>/logs/dockerd.log, so it outlives this process.
3. gVisor   (only with runtime "runsc") registers runsc in /etc/docker/daemon.json, reloads dockerd.
4. image    debootstrap bookworm minbase + python3, numpy, pandas, matplotlib; docs and locales
            trimmed; the matplotlib font cache prebuilt; `docker import`ed as SandboxConfig.image.

Installing and starting need root. Without it (or without Docker) `ToolUnavailable` is raised with
the exact command that enables the code tool; the rest of the product keeps working.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

from assistant.config import AssistantConfig, SandboxConfig
from assistant.errors import ToolUnavailable

DOCKER_SOCKET = "/var/run/docker.sock"
DOCKER_PIDFILE = "/var/run/docker.pid"
DAEMON_JSON = Path("/etc/docker/daemon.json")
DAEMON_ARGS = ["--bridge=none", "--iptables=false", "--ip-forward=false"]
DEBIAN_SUITE = "bookworm"
IMAGE_PACKAGES = ["python3", "python3-numpy", "python3-pandas", "python3-matplotlib"]
MPL_CACHE_DIR = "/opt/mplconfig"  # prebuilt matplotlib font cache inside the image (copied at start)
ENABLE_COMMAND = "sudo .venv/bin/assistant sandbox setup"
MAX_DAEMON_WAIT_S = 60.0

Say = Callable[[str], None]


def setup_sandbox(config: AssistantConfig, *, rebuild: bool = False, say: Say = print) -> None:
    """Make the code sandbox ready: engine installed and running, image built. Idempotent."""
    sandbox = config.sandbox
    log_dir = Path(config.data_dir) / "logs"
    started = time.monotonic()
    runtimes = ["runsc"] if sandbox.runtime == "runsc" else []
    ensure_engine_installed(with_runsc=bool(runtimes), say=say)
    client = ensure_daemon_running(log_dir, say=say)
    if runtimes:
        ensure_runsc_registered(client, log_dir, say=say)
    else:
        say("[3/4] gVisor runtime: not requested (sandbox.runtime = runc).")
    ensure_image(client, sandbox, log_dir, rebuild=rebuild, say=say)
    say(f"Sandbox ready ({sandbox.image}, runtime {sandbox.runtime}) in {time.monotonic() - started:.1f}s.")


# -- 1. engine ----------------------------------------------------------------------------------


def _is_root() -> bool:
    return os.geteuid() == 0


def _missing_packages(with_runsc: bool) -> list[str]:
    wanted = {"docker.io": "dockerd", "debootstrap": "debootstrap"}
    if with_runsc:
        wanted["runsc"] = "runsc"
    return [pkg for pkg, binary in wanted.items() if shutil.which(binary) is None]


def ensure_engine_installed(*, with_runsc: bool = False, say: Say = print) -> None:
    missing = _missing_packages(with_runsc)
    if not missing:
        say("[1/4] Docker engine: installed.")
        return
    if not _is_root():
        raise ToolUnavailable(
            f"The code sandbox needs {', '.join(missing)} (not installed). Enable it with: {ENABLE_COMMAND}"
        )
    say(f"[1/4] Docker engine: installing {' '.join(missing)} from Debian (about a minute)...")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
    ):
        _run(cmd, env=env, what="Installing the Docker engine")
    still = _missing_packages(with_runsc)
    if still:
        raise ToolUnavailable(f"apt-get finished but {', '.join(still)} is still missing; see the apt output above.")


# -- 2. daemon ----------------------------------------------------------------------------------


def docker_client(timeout: float = 10.0):
    """A docker SDK client for the local engine; ToolUnavailable when the SDK is not installed."""
    try:
        import docker
    except ImportError as e:
        raise ToolUnavailable(
            "The docker Python SDK is missing: run `.venv/bin/pip install -r requirements/sandbox.txt`."
        ) from e
    return docker.DockerClient(base_url=f"unix://{DOCKER_SOCKET}", timeout=timeout)


def ping_daemon(timeout: float = 10.0):
    """A client (with `timeout` for its later calls) when dockerd answers, else None."""
    if not os.path.exists(DOCKER_SOCKET):
        return None
    try:
        import docker.errors
    except ImportError:
        docker_client(timeout)  # raises ToolUnavailable with the install command
    try:
        client = docker_client(timeout)  # asks the daemon for its API version: fails when it is down
    except docker.errors.DockerException:
        return None
    try:
        client.ping()
        return client
    except Exception:  # noqa: BLE001 - any failure means "not ready"
        client.close()
        return None


def _daemon_pid() -> int | None:
    try:
        pid = int(Path(DOCKER_PIDFILE).read_text().strip())
        is_dockerd = Path(f"/proc/{pid}/comm").read_text().strip() == "dockerd"  # not a reused pid
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        return pid if is_dockerd and state not in ("Z", "X") else None  # a killed, unreaped one is dead
    except (OSError, ValueError):
        return None


def check_socket_access() -> None:
    """ToolUnavailable when dockerd's socket exists but this user may not use it."""
    if os.path.exists(DOCKER_SOCKET) and not os.access(DOCKER_SOCKET, os.R_OK | os.W_OK):
        raise ToolUnavailable(
            f"No permission to use the Docker engine ({DOCKER_SOCKET}), so the code tool is off. Run the "
            "assistant as root, or add your user to the docker group: sudo usermod -aG docker $USER"
        )


def ensure_daemon_running(log_dir: Path, *, say: Say = print):
    check_socket_access()
    client = ping_daemon()
    if client is not None:
        say("[2/4] Docker daemon: running.")
        return client
    if _daemon_pid() is None:  # none starting either: start one
        if not _is_root():
            raise ToolUnavailable(f"The Docker daemon is not running. Enable the code sandbox with: {ENABLE_COMMAND}")
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir.resolve() / "dockerd.log"
        say(f"[2/4] Docker daemon: starting (log: {log_path})...")
        with open(log_path, "ab") as log:
            subprocess.Popen(  # == setsid nohup dockerd ... </dev/null >>log 2>&1 &
                ["dockerd", *DAEMON_ARGS],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                close_fds=True,
            )
    else:
        say("[2/4] Docker daemon: starting (already launched), waiting...")
    return _wait_for_daemon(log_dir)


def _wait_for_daemon(log_dir: Path):
    deadline = time.monotonic() + MAX_DAEMON_WAIT_S
    while time.monotonic() < deadline:
        client = ping_daemon()
        if client is not None:
            return client
        time.sleep(0.2)
    raise ToolUnavailable(
        f"dockerd did not become ready within {MAX_DAEMON_WAIT_S:.0f}s; see {log_dir / 'dockerd.log'}, "
        f"then retry: {ENABLE_COMMAND}"
    )


# -- 3. gVisor ----------------------------------------------------------------------------------


def runsc_available(client) -> bool:
    """Whether dockerd knows the runsc runtime."""
    try:
        return "runsc" in (client.info().get("Runtimes") or {})
    except Exception:  # noqa: BLE001
        return False


def ensure_runsc_registered(client, log_dir: Path, *, say: Say = print) -> None:
    if runsc_available(client):
        say("[3/4] gVisor runtime: registered.")
        return
    if not _is_root():
        raise ToolUnavailable(f"gVisor (runsc) is not registered with Docker. Enable it with: {ENABLE_COMMAND}")
    say("[3/4] gVisor runtime: registering runsc in /etc/docker/daemon.json...")
    settings = json.loads(DAEMON_JSON.read_text()) if DAEMON_JSON.exists() else {}
    # The default ptrace platform: --platform=kvm hangs on these machines.
    settings.setdefault("runtimes", {})["runsc"] = {"path": shutil.which("runsc"), "runtimeArgs": ["--network=none"]}
    DAEMON_JSON.parent.mkdir(parents=True, exist_ok=True)
    DAEMON_JSON.write_text(json.dumps(settings, indent=2) + "\n")
    pid = _daemon_pid()
    if pid is not None:
        os.kill(pid, signal.SIGHUP)  # dockerd reloads its runtimes on SIGHUP
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not runsc_available(client):
        time.sleep(0.2)
    if not runsc_available(client):
        raise ToolUnavailable(f"dockerd did not pick up runsc; see {log_dir / 'dockerd.log'}.")


# -- 4. image -----------------------------------------------------------------------------------


def image_exists(client, image: str) -> bool:
    import docker.errors

    try:
        client.images.get(image)
        return True
    except docker.errors.ImageNotFound:
        return False


def ensure_image(client, sandbox: SandboxConfig, log_dir: Path, *, rebuild: bool = False, say: Say = print) -> None:
    if not rebuild and image_exists(client, sandbox.image):
        say(f"[4/4] Sandbox image {sandbox.image}: present.")
        return
    if not _is_root():
        raise ToolUnavailable(f"The sandbox image {sandbox.image} is missing. Build it with: {ENABLE_COMMAND}")
    say(f"[4/4] Sandbox image {sandbox.image}: building from Debian {DEBIAN_SUITE} (about 2-3 minutes)...")
    log_dir.mkdir(parents=True, exist_ok=True)
    build_image(sandbox.image, sandbox.debian_mirror, log_dir.resolve() / "sandbox-image.log", say=say)


def build_image(image: str, mirror: str, log_path: Path, *, say: Say = print) -> None:
    """debootstrap a minimal Debian with python3 + scientific libs and `docker import` it as `image`."""
    root = Path(tempfile.mkdtemp(prefix="assistant-sandbox-rootfs-", dir="/var/tmp"))
    try:
        with open(log_path, "a") as log:
            cmd = [
                "debootstrap", "--variant=minbase", f"--include={','.join(IMAGE_PACKAGES)}",
                DEBIAN_SUITE, str(root), mirror,
            ]  # fmt: skip
            _run_logged(cmd, log, say, what="debootstrap")
            say("  prebuilding the matplotlib font cache...")
            _run_logged(
                ["chroot", str(root), "/usr/bin/env", "-i", f"MPLCONFIGDIR={MPL_CACHE_DIR}", "MPLBACKEND=Agg",
                 "/usr/bin/python3", "-c", "import matplotlib.pyplot as plt; plt.figure()"],
                log, say, what="matplotlib font cache", show=False,
            )  # fmt: skip
            say("  trimming docs, locales and package caches...")
            _trim_rootfs(root)
            say(f"  importing into Docker as {image}...")
            changes = [
                "USER 65534:65534",
                "WORKDIR /tmp",
                "ENV HOME=/tmp LANG=C.UTF-8 MPLBACKEND=Agg PYTHONDONTWRITEBYTECODE=1",
                "LABEL org.offline-assistant.sandbox=1",
            ]
            tar = subprocess.Popen(
                ["tar", "--numeric-owner", "--sort=name", "-C", str(root), "-c", "."],
                stdout=subprocess.PIPE, stderr=log,
            )  # fmt: skip
            imp = subprocess.run(
                ["docker", "import", *[a for c in changes for a in ("-c", c)], "-", image],
                stdin=tar.stdout, stdout=log, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            tar.stdout.close()
            if tar.wait() != 0 or imp.returncode != 0:
                raise ToolUnavailable(f"docker import of {image} failed: {imp.stderr.strip()} (log: {log_path})")
    finally:
        shutil.rmtree(root, ignore_errors=True)


# Removed from the image: docs, locales, caches; static libraries; the C compiler proper (pulled in by
# pythran; nothing at run time compiles, and /tmp is noexec anyway); the libraries' own test suites.
TRIM_PATTERNS = (
    "usr/share/doc/*", "usr/share/man/*", "usr/share/info/*", "usr/share/locale/*", "usr/share/lintian/*",
    "var/cache/apt/*", "var/cache/debconf/*-old", "var/lib/apt/lists/*", "var/log/*",
    "usr/lib/**/*.a", "usr/lib/gcc/*/*/cc1", "usr/lib/gcc/*/*/cc1plus", "usr/lib/gcc/*/*/lto1",
    "usr/bin/*-lto-dump-*",
    *(f"usr/lib/python3/dist-packages/{pkg}/**/tests" for pkg in ("numpy", "pandas", "matplotlib", "scipy", "sympy")),
    "usr/lib/python3/dist-packages/sympy/integrals/rubi/rubi_tests",
)  # fmt: skip


def _trim_rootfs(root: Path) -> None:
    for pattern in TRIM_PATTERNS:
        for path in sorted(root.glob(pattern), reverse=True):  # children before parents
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


# Phase lines of debootstrap worth showing; per-package lines only go to the log.
_PER_PACKAGE = ("I: Retrieving ", "I: Validating ", "I: Extracting ", "I: Unpacking ", "I: Configuring ")
_PHASES = ("I: Retrieving Release", "I: Unpacking required", "I: Unpacking the base", "I: Configuring required",
           "I: Configuring the base", "I: Installing ", "I: Resolving", "I: Base system")  # fmt: skip


def _run_logged(cmd: list[str], log, say: Say, *, what: str, show: bool = True) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    for line in proc.stdout:
        log.write(line)
        tail = (tail + [line.rstrip()])[-20:]
        if show and (line.startswith(_PHASES) or not line.startswith(_PER_PACKAGE)):
            say(f"  {line.rstrip()}")
    if proc.wait() != 0:
        raise ToolUnavailable(f"{what} failed (exit {proc.returncode}); last lines:\n" + "\n".join(tail))


def _run(cmd: list[str], *, env: dict | None = None, what: str) -> None:
    proc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ToolUnavailable(f"{what} failed: `{' '.join(cmd)}` exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
