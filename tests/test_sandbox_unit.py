"""Fast tests of the sandbox's pure logic: truncation, the session pool, the fake executor, the tool."""

from __future__ import annotations

import dataclasses

import pytest

from assistant.config import SandboxConfig
from assistant.errors import ToolUnavailable
from sandbox import kernel, setup
from sandbox.base import TRUNCATION_MARKER, join_truncated, truncate_output
from sandbox.fake import FakeExecutor
from sandbox.pool import SessionPool
from tools.code_interpreter import CodeInterpreter, format_observation

MARKER_TEXT = TRUNCATION_MARKER.split("{")[0].strip()  # "[..."


# -- truncation ----------------------------------------------------------------------------------


def test_short_output_is_kept_whole():
    assert truncate_output(b"hello\n", 100) == "hello\n"


def test_long_output_keeps_head_and_tail_around_a_marker():
    data = b"A" * 500 + b"B" * 1000 + b"C" * 500
    text = truncate_output(data, 1000)
    assert text.startswith("A" * 500) and text.endswith("C" * 500)
    assert "1,000 bytes of output truncated" in text
    assert "B" not in text


def test_join_truncated_with_touching_windows_has_no_marker():
    assert join_truncated(b"ab", b"cd", 4) == "abcd"


def test_kernel_window_roundtrips_through_join(tmp_path):
    path = tmp_path / "out"
    path.write_bytes("é".encode() * 3000)  # multi-byte characters cut in the middle
    head, tail, total = kernel.read_window(str(path), 1000)
    text = join_truncated(head.encode(), tail.encode(), total)
    assert MARKER_TEXT in text and len(text.encode()) < 1200
    path.write_bytes(b"small")
    assert join_truncated(*(lambda h, t, n: (h.encode(), t.encode(), n))(*kernel.read_window(str(path), 1000))) == "small"


# -- session pool --------------------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make_pool(max_sessions=2, idle_s=100.0):
    created, destroyed, clock = [], [], Clock()

    def create(key):
        created.append(key)
        return {"key": key}

    pool = SessionPool(create, lambda s: destroyed.append(s["key"]), max_sessions=max_sessions, idle_s=idle_s, clock=clock)
    return pool, created, destroyed, clock


def test_pool_reuses_a_conversations_session():
    pool, created, destroyed, _ = make_pool()
    for _ in range(3):
        with pool.acquire("a") as slot:
            assert slot.session == {"key": "a"}
    assert created == ["a"] and destroyed == []


def test_pool_evicts_least_recently_used():
    pool, created, destroyed, _ = make_pool(max_sessions=2)
    for key in ("a", "b", "a", "c"):  # "b" is the least recently used when "c" arrives
        with pool.acquire(key):
            pass
    assert destroyed == ["b"]
    assert pool.keys() == ["a", "c"]


def test_pool_never_evicts_a_session_in_use():
    pool, _, destroyed, _ = make_pool(max_sessions=1)
    with pool.acquire("a"):
        with pytest.raises(ToolUnavailable, match="max_containers"):
            with pool.acquire("b"):
                pass
    assert destroyed == []


def test_pool_reaps_idle_sessions():
    pool, _, destroyed, clock = make_pool(idle_s=10)
    with pool.acquire("a"):
        pass
    clock.now = 5
    with pool.acquire("b"):
        pass
    clock.now = 12
    assert pool.reap_idle() == ["a"]
    assert destroyed == ["a"] and pool.keys() == ["b"]


def test_pool_discard_recreates_on_next_use():
    pool, created, destroyed, _ = make_pool()
    with pool.acquire("a") as slot:
        pool.discard(slot)
    with pool.acquire("a"):
        pass
    assert created == ["a", "a"] and destroyed == ["a"]


def test_pool_forgets_a_failed_creation():
    def create(key):
        raise ToolUnavailable("no engine")

    pool = SessionPool(create, lambda s: None, max_sessions=1, idle_s=10)
    with pytest.raises(ToolUnavailable):
        with pool.acquire("a"):
            pass
    assert pool.keys() == []


# -- fake executor (NOT a sandbox) ----------------------------------------------------------------


@pytest.fixture
def fake():
    executor = FakeExecutor(dataclasses.replace(SandboxConfig(), max_containers=2, max_output_bytes=1000))
    yield executor
    executor.close()


def test_fake_keeps_state_and_prints_the_last_expression(fake):
    assert fake.run("x = 20", "c1").ok
    out = fake.run("x + 22", "c1")
    assert out.stdout.strip() == "42" and out.exit_code == 0


def test_fake_returns_tracebacks_as_results(fake):
    out = fake.run("def f(:\n    pass", "c1")
    assert out.exit_code == 1 and "SyntaxError" in out.stderr
    out = fake.run("1 / 0", "c1")
    assert out.exit_code == 1 and "ZeroDivisionError" in out.stderr


def test_fake_truncates_output(fake):
    out = fake.run("print('x' * 100_000)", "c1")
    assert MARKER_TEXT in out.stdout and len(out.stdout) < 1200


def test_fake_returns_written_files_as_artifacts(fake):
    out = fake.run("open('table.csv', 'w').write('a,b\\n1,2\\n')", "c1")
    assert [(f.name, f.data) for f in out.files] == [("table.csv", b"a,b\n1,2\n")]
    assert fake.run("print(open('table.csv').read())", "c1").files == ()  # unchanged: not sent again


def test_fake_pool_is_bounded(fake):
    for conversation in ("a", "b", "c"):
        fake.run(f"name = {conversation!r}", conversation)
    assert fake.conversations() == ["b", "c"]
    assert "NameError" in fake.run("name", "a").stderr  # "a" was evicted: fresh state


# -- the tool -------------------------------------------------------------------------------------


def test_tool_contract():
    from tools.python_tool import PythonTool

    assert PythonTool.name == "python" and PythonTool.output_type == "string"
    assert PythonTool.inputs["code"]["type"] == "string"


def test_tool_reports_output_errors_and_files(tmp_path, fake):
    tool = CodeInterpreter(executor=fake, artifacts_dir=tmp_path)
    result = tool.forward("open('a.txt', 'w').write('hi'); print('done')", "conv/1")
    assert result.ok and "done" in result.text and "a.txt" in result.text
    (ref,) = result.artifacts
    assert ref.path.read_bytes() == b"hi" and ref.path.parent.parent == tmp_path and ref.id in result.text
    failed = tool.forward("raise ValueError('bad input')", "conv/1")
    assert not failed.ok and "ValueError: bad input" in failed.text and "exit code 1" in str(failed)


def test_observation_of_a_timeout_says_state_was_lost():
    from sandbox.base import CodeOutput

    text = format_observation(CodeOutput("", "", 137, timed_out=True))
    assert "Timed out" in text and "restarted" in text


# -- setup without root ---------------------------------------------------------------------------


def test_setup_without_root_names_the_enabling_command(monkeypatch):
    monkeypatch.setattr(setup.shutil, "which", lambda name: None)
    monkeypatch.setattr(setup.os, "geteuid", lambda: 1000)
    with pytest.raises(ToolUnavailable) as e:
        setup.ensure_engine_installed(say=lambda line: None)
    assert setup.ENABLE_COMMAND in str(e.value) and "docker.io" in str(e.value)


def test_executor_without_engine_is_unavailable(monkeypatch, tmp_path):
    from sandbox.executor import DockerExecutor

    monkeypatch.setattr(setup, "DOCKER_SOCKET", str(tmp_path / "no-docker.sock"))
    with pytest.raises(ToolUnavailable, match="sandbox setup"):
        DockerExecutor(SandboxConfig())


def test_agent_wrapper_reads_the_interpreters_result(tmp_path, fake):
    pytest.importorskip("tools.python_tool")
    from tools.base import ToolContext
    from tools.python_tool import PythonTool

    tool = PythonTool(CodeInterpreter(executor=fake, artifacts_dir=tmp_path))
    ok = tool({"code": "open('p.txt', 'w').write('x'); print(6 * 7)"}, ToolContext(conversation_id="c9"))
    assert ok.ok and ok.summary == "42" and len(ok.artifacts) == 1 and "p.txt" in ok.text
    failed = tool({"code": "import nope"}, ToolContext(conversation_id="c9"))
    assert not failed.ok and "ModuleNotFoundError" in failed.text
