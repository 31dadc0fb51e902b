"""Escape/containment suite against the REAL Docker engine (and gVisor's runsc where installed).

A missing engine or image skips on a laptop and fails in CI (ASSISTANT_REQUIRE_REAL=1); runsc is
optional everywhere and skips cleanly when it is not installed. No timing assertions here: see
bench/sandbox.py for latencies.
"""

from __future__ import annotations

import dataclasses
import shutil
import socket
import struct
import uuid

import pytest

from assistant.config import SandboxConfig
from assistant.errors import ToolUnavailable
from tests.conftest import need

pytestmark = pytest.mark.real

CONFIG = dataclasses.replace(
    SandboxConfig(), memory_mb=512, pids_limit=64, timeout_s=60, max_output_bytes=65536, max_containers=8
)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _connect(config: SandboxConfig):
    from sandbox.executor import connect

    try:
        return connect(config), ""
    except ToolUnavailable as e:
        return None, str(e)


@pytest.fixture(scope="module", params=["runc", "runsc"])
def runtime(request) -> str:
    need(_sdk_installed(), "the docker SDK", "pip install -r requirements/sandbox.txt")
    client, why = _connect(CONFIG)
    need(client is not None, "the Docker engine and sandbox image", f"{why} (as root: assistant sandbox setup)")
    if request.param == "runsc":
        from sandbox.setup import runsc_available

        if shutil.which("runsc") is None or not runsc_available(client):
            pytest.skip("gVisor (runsc) is optional and not installed: assistant sandbox setup --runtime runsc")
    return request.param


def _sdk_installed() -> bool:
    try:
        import docker  # noqa: F401

        return True
    except ImportError:
        return False


@pytest.fixture(scope="module")
def uploads_root(tmp_path_factory):
    return tmp_path_factory.mktemp("uploads")


@pytest.fixture(scope="module")
def executor(runtime, uploads_root):
    from sandbox.executor import DockerExecutor

    ex = DockerExecutor(dataclasses.replace(CONFIG, runtime=runtime), uploads_root=uploads_root)
    yield ex
    ex.close()


@pytest.fixture
def conv() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


def run_ok(executor, code: str, conversation: str) -> str:
    out = executor.run(code, conversation)
    assert out.exit_code == 0 and not out.timed_out, (out.stdout, out.stderr)
    return out.stdout


# -- isolation -------------------------------------------------------------------------------------


def test_no_network_only_loopback(executor, conv):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    try:
        stdout = run_ok(
            executor,
            f"""
import socket
print("interfaces", sorted(name for _, name in socket.if_nameindex()))
for host in ("127.0.0.1", "8.8.8.8", "deb.debian.org"):
    try:
        socket.create_connection((host, {port} if host == "127.0.0.1" else 80), timeout=3)
        print("CONNECTED", host)
    except OSError as e:
        print("blocked", host, type(e).__name__)
""",
            conv,
        )
    finally:
        listener.close()
    assert "interfaces ['lo']" in stdout
    assert "CONNECTED" not in stdout
    assert "blocked 127.0.0.1 ConnectionRefusedError" in stdout  # the host's listener is not reachable


def test_runs_as_nobody_without_capabilities(executor, runtime, conv):
    stdout = run_ok(
        executor,
        "import os\nstatus = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)\n"
        "print(os.getuid(), os.getgid(), status['CapEff'].strip(), status['CapBnd'].strip(), status.get('NoNewPrivs', '-').strip())",
        conv,
    )
    uid, gid, cap_eff, cap_bnd, no_new_privs = stdout.split()
    assert (uid, gid) == ("65534", "65534")
    assert int(cap_eff, 16) == 0 and int(cap_bnd, 16) == 0
    assert no_new_privs == ("1" if runtime == "runc" else "-")  # gVisor's /proc does not show the flag


def test_writes_outside_the_work_dir_fail(executor, conv):
    stdout = run_ok(
        executor,
        """
import errno
for path in ("/etc/evil", "/evil", "/usr/lib/evil", "/var/tmp/evil", "/data/evil"):
    try:
        open(path, "w").write("x")
        print("WROTE", path)
    except OSError as e:
        print(path, errno.errorcode[e.errno])
open("/tmp/fine.txt", "w").write("ok")
print("work dir writable")
""",
        conv,
    )
    assert "WROTE" not in stdout
    results = dict(line.split() for line in stdout.splitlines() if line.startswith("/"))
    assert len(results) == 5 and set(results.values()) <= {"EROFS", "EACCES"}  # gVisor checks permissions first
    assert results["/var/tmp/evil"] == "EROFS"  # a world-writable dir: only the read-only root stops it
    assert "work dir writable" in stdout


def test_conversations_cannot_see_each_others_files(executor, conv):
    run_ok(executor, "open('secret.txt', 'w').write('only mine'); secret = 1", conv)
    other = run_ok(
        executor,
        "import os\nprint(sorted(os.listdir('/tmp')))\n"
        "try:\n    open('/tmp/secret.txt')\n    print('LEAK')\nexcept FileNotFoundError:\n    print('not found')\n"
        "print('secret' in globals())",
        conv + "-other",
    )
    assert "not found" in other and "LEAK" not in other and "secret.txt" not in other
    assert other.strip().endswith("False")
    assert executor.container_id(conv) != executor.container_id(conv + "-other")


def test_uploads_are_mounted_read_only(executor, conv, uploads_root):
    executor.reset(conv)
    folder = uploads_root / conv
    folder.mkdir(exist_ok=True)
    (folder / "numbers.csv").write_text("n\n1\n2\n3\n")
    folder.chmod(0o755)
    stdout = run_ok(executor, "import pandas as pd\nprint(pd.read_csv('/data/numbers.csv')['n'].sum())", conv)
    assert stdout.strip() == "6"


# -- resource limits -----------------------------------------------------------------------------------


def test_memory_bomb_is_reported_as_oom_and_the_host_is_fine(executor, conv):
    run_ok(executor, "before = 1", conv)
    out = executor.run("blob = bytearray(1024**3)\nblob[::4096] = b'x' * len(blob[::4096])\nprint('SURVIVED')", conv)
    assert out.oom and "SURVIVED" not in out.stdout and not out.timed_out
    assert "memory" in out.stderr
    assert run_ok(executor, "print('alive')", conv).strip() == "alive"  # a fresh session
    from sandbox.setup import ping_daemon

    assert ping_daemon() is not None  # the engine (and this process) carry on


def test_fork_bomb_stops_at_the_pids_cap(executor, conv):
    stdout = run_ok(
        executor,
        """
import os, time
children = []
try:
    for _ in range(1000):
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        children.append(pid)
except OSError as e:
    print("stopped after", len(children), e.strerror)
for pid in children:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
""",
        conv,
    )
    assert "stopped after" in stdout
    assert int(stdout.split("stopped after")[1].split()[0]) < CONFIG.pids_limit


def test_real_fork_bomb_leaves_the_session_usable(executor, conv):
    out = executor.run("import os\nwhile True:\n    os.fork()", conv)
    assert out.exit_code != 0 and not out.timed_out
    assert run_ok(executor, "print('alive')", conv).strip() == "alive"


def test_infinite_loop_is_killed_at_the_timeout_and_the_container_recreated(runtime, conv):
    from sandbox.executor import DockerExecutor

    with DockerExecutor(dataclasses.replace(CONFIG, runtime=runtime, timeout_s=3)) as ex:
        run_ok(ex, "state = 'kept'", conv)
        first = ex.container_id(conv)
        assert run_ok(ex, "print(state)", conv).strip() == "kept"  # state persists between runs
        out = ex.run("while True:\n    pass", conv)
        assert out.timed_out and out.exit_code != 0 and "Timed out" in out.stderr
        assert ex.container_id(conv) is None  # removed at once
        after = ex.run("print(state)", conv)
        assert "NameError" in after.stderr  # a fresh interpreter
        assert ex.container_id(conv) not in (None, first)


def test_huge_stdout_is_truncated_with_a_marker(executor, conv):
    out = executor.run("print('x' * 10_000_000)", conv)
    assert out.exit_code == 0
    assert "bytes of output truncated" in out.stdout
    assert len(out.stdout.encode()) <= CONFIG.max_output_bytes + 200
    assert out.stdout.startswith("xxxx") and out.stdout.rstrip().endswith("xxxx")


# -- results -------------------------------------------------------------------------------------


def test_malformed_code_returns_the_traceback(executor, conv):
    out = executor.run("def broken(:\n    pass", conv)
    assert out.exit_code == 1 and "SyntaxError" in out.stderr
    out = executor.run("import json\njson.loads('{not json')", conv)
    assert out.exit_code == 1 and "JSONDecodeError" in out.stderr and 'File "<cell' in out.stderr


def test_state_persists_between_runs(executor, conv):
    run_ok(executor, "import numpy as np\nvalues = np.arange(10)", conv)
    assert run_ok(executor, "int(values.sum())", conv).strip() == "45"
    assert run_ok(executor, "open('notes.txt', 'w').write('kept')", conv) is not None
    assert run_ok(executor, "print(open('notes.txt').read())", conv).strip() == "kept"


def test_matplotlib_plot_comes_back_as_png(executor, conv):
    out = executor.run(
        "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('sandbox')\nplt.savefig('plot.png', dpi=50)",
        conv,
    )
    assert out.exit_code == 0, out.stderr
    (png,) = [f for f in out.files if f.name == "plot.png"]
    assert png.data is not None and png.data[:8] == PNG_SIGNATURE and png.size == len(png.data)
    width, height = struct.unpack(">II", png.data[16:24])  # the IHDR chunk
    assert width > 100 and height > 100 and png.mime_type == "image/png"


def test_tool_returns_artifacts_and_text(executor, conv, tmp_path):
    from tools.code_interpreter import CodeInterpreter

    tool = CodeInterpreter(executor=executor, artifacts_dir=tmp_path)
    result = tool.forward("import pandas as pd\npd.DataFrame({'a': [1, 2]}).to_csv('t.csv')\nprint('rows', 2)", conv)
    assert result.ok and "rows 2" in result.text and "t.csv" in result.text
    assert result.artifacts[0].path.read_text().startswith(",a")


def test_setup_command_is_idempotent(tmp_path, capsys):
    import os

    from assistant.cli import main

    need(os.geteuid() == 0 or os.access("/var/run/docker.sock", os.W_OK), "root or Docker access", "run as root")
    need(_connect(CONFIG)[0] is not None, "the Docker engine and sandbox image", "assistant sandbox setup (as root)")
    assert main(["sandbox", "setup", "--data-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "[2/4] Docker daemon: running." in out and "present" in out and "Sandbox ready" in out
    assert err == ""


def test_code_writing_on_the_kernel_channel_only_breaks_its_own_session(executor, conv):
    out = executor.run("import os\nfor fd in range(3, 10):\n    try:\n        os.write(fd, b'{\"junk\": 1}\\n')\n    except OSError:\n        pass", conv)
    assert not out.timed_out  # a garbled reply restarts that conversation's session, nothing more
    assert run_ok(executor, "print('alive')", conv).strip() == "alive"


def test_parallel_conversations_do_not_mix(executor):
    from concurrent.futures import ThreadPoolExecutor

    conversations = [f"parallel-{uuid.uuid4().hex[:6]}-{i}" for i in range(3)]

    def work(conversation: str) -> str:
        run_ok(executor, f"me = {conversation!r}", conversation)
        return run_ok(executor, "import time\ntime.sleep(0.2)\nprint(me)", conversation).strip()

    with ThreadPoolExecutor(len(conversations)) as pool:
        assert list(pool.map(work, conversations)) == conversations
