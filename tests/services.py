"""Throwaway real services for the `real` tests: a PostgreSQL server and a redis-server, each started
in a temp dir on loopback and removed afterwards. No running system service is used or needed, only
the Debian binaries (`apt-get install postgresql redis-server`, which `make test` does as root).

`postgres_server()` and `redis_server()` are context managers yielding a URL; tests/conftest.py wraps
them as the module-scoped fixtures `pg_url` and `redis_url`. A missing binary skips the test on a
laptop and fails it under ASSISTANT_REQUIRE_REAL=1 (`need`).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

from tests.conftest import free_port, need

STARTUP_TIMEOUT_S = 10


def _as_postgres(cmd: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: as root, run its tools as the `postgres` user."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """initdb + pg_ctl in a temp dir, Unix socket only (no TCP listener); yields a SQLAlchemy URL."""
    bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    need(bool(bins), "PostgreSQL server binaries", "apt-get install postgresql (make test installs it as root)")
    bindir = Path(bins[-1]).parent
    root = Path(tempfile.mkdtemp(prefix="pgtest-"))
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
        shutil.chown(sock, "postgres")
    port = free_port()  # names the socket file (.s.PGSQL.<port>); nothing listens on TCP
    try:
        subprocess.run(_as_postgres([str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust"]),
                       check=True, capture_output=True)
        subprocess.run(_as_postgres([str(bindir / "pg_ctl"), "-D", str(data), "-w", "-l", str(root / "log"), "-o",
                                     f"-p {port} -k {sock} -c listen_addresses=''", "start"]),
                       check=True, capture_output=True)
        yield f"postgresql+psycopg://postgres@/postgres?host={sock}&port={port}"
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run(_as_postgres([str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "stop"]),
                           capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """redis-server on a free loopback port, no persistence; yields redis://127.0.0.1:PORT/0."""
    binary = shutil.which("redis-server")
    need(binary is not None, "redis-server", "apt-get install redis-server (make does it as root)")
    import redis

    port = free_port()
    folder = Path(tempfile.mkdtemp(prefix="redistest-"))
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not start"
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)
