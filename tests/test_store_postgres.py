"""The store on a real PostgreSQL server, through exactly the code path SQLite uses.

The test starts its own throwaway server (initdb + pg_ctl in a temp dir, Unix socket only), so it
needs the server binaries (`apt-get install postgresql`, which `make test` does as root) but no
running service.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from assistant.store import Store
from tests.conftest import need

pytestmark = pytest.mark.real


def _as_postgres(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@pytest.fixture(scope="module")
def pg_url():
    bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    need(bool(bins), "PostgreSQL server binaries", "apt-get install postgresql (make test installs it as root)")
    bindir = Path(bins[-1]).parent
    root = Path(tempfile.mkdtemp(prefix="pgtest-"))
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
        shutil.chown(sock, "postgres")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run(_as_postgres([str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust"]),
                   check=True, capture_output=True)
    subprocess.run(_as_postgres([str(bindir / "pg_ctl"), "-D", str(data), "-w", "-l", str(root / "log"), "-o",
                                 f"-p {port} -k {sock} -c listen_addresses=''", "start"]), check=True, capture_output=True)
    try:
        yield f"postgresql+psycopg://postgres@/postgres?host={sock}&port={port}"
    finally:
        subprocess.run(_as_postgres([str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "stop"]), capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def test_conversation_round_trip_and_branches(pg_url):
    store = Store(pg_url)
    c = store.create_conversation("pg")
    store.add_message(c.id, "user", "q1")
    a1 = store.add_message(c.id, "assistant", "", status="partial")
    store.update_message(a1.id, content="a1", status="complete", meta={"usage": {"prompt_tokens": 5}})
    store.add_message(c.id, "user", "q2")
    store.add_message(c.id, "user", "q2 edited", parent_id=a1.id)
    assert [m.content for m in store.history(c.id)] == ["q1", "a1", "q2 edited"]
    assert store.get_message(a1.id).meta == {"usage": {"prompt_tokens": 5}}
    store.close()
    reopened = Store(pg_url)  # committed: a new connection pool sees everything
    assert [m.content for m in reopened.history(c.id)] == ["q1", "a1", "q2 edited"]
    reopened.delete_conversation(c.id)
    assert reopened.list_conversations() == []
    reopened.close()
