"""Shared fixtures and the `real` marker policy.

Tests marked `real` use real packaged models and real services. On a laptop where one is missing
they skip; with ASSISTANT_REQUIRE_REAL=1 (CI) a missing one is a failure, never a silent skip.
Use `need(condition, what, fix)` inside such a test to express the requirement.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

REQUIRE_REAL = os.environ.get("ASSISTANT_REQUIRE_REAL") == "1"
REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app, *, timeout_s: float = 60) -> Iterator[str]:
    """An ASGI app on a real uvicorn server in a thread (one event loop, like the product's);
    yields its base URL and stops it afterwards."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def need(condition: bool, what: str, fix: str) -> None:
    """Skip (laptop) or fail (CI) when a real dependency is missing."""
    if condition:
        return
    message = f"{what} is missing: {fix}"
    if REQUIRE_REAL:
        pytest.fail(f"ASSISTANT_REQUIRE_REAL=1 and {message}", pytrace=False)
    pytest.skip(message)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """Every test runs as the product does: no hub, no telemetry."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")


@pytest.fixture(scope="module")
def models_dir() -> Path:
    """Prepared models shared by every test data dir (prepared once by `make test`); the default
    chat model must be there (skip on a laptop, fail under ASSISTANT_REQUIRE_REAL=1)."""
    from assistant.models import prepared_path, resolve_model_name

    path = Path(os.environ.get("ASSISTANT_MODELS_DIR", REPO_ROOT / "data" / "models")).resolve()
    need(prepared_path(resolve_model_name("qwen2.5-coder-0.5b"), path) is not None,
         f"the prepared default model in {path}",
         "run `make test` or `assistant models prepare` (set ASSISTANT_MODELS_DIR to share it)")
    return _without_large(path)


@functools.lru_cache(maxsize=None)
def _without_large(path: Path) -> Path:
    """The models dir as the tests see it: engine.large_model = "auto" routes document turns to the 1.5B
    model wherever it is prepared (`make run` prepares it), which would make every document test
    load it (~10 GB, 3x slower). Unless ASSISTANT_TEST_LARGE=1, tests get a view of the models dir
    without it (symlinks to everything else), as on a CI machine that never prepared it."""
    from assistant.models import resolve_model_name

    large = resolve_model_name("large").name
    if os.environ.get("ASSISTANT_TEST_LARGE") == "1" or not (path / large).exists():
        return path
    view = Path(tempfile.mkdtemp(prefix="models-view-"))
    atexit.register(shutil.rmtree, view, True)  # symlinks only: the models themselves stay
    for entry in path.iterdir():
        if entry.name != large:
            (view / entry.name).symlink_to(entry)
    return view


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    """A real, throwaway PostgreSQL server (tests/services.py), one per test module."""
    from tests.services import postgres_server

    with postgres_server() as url:
        yield url


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """A real, throwaway redis-server on a free loopback port (tests/services.py), one per test module."""
    from tests.services import redis_server

    with redis_server() as url:
        yield url


def tiny_qwen(models_dir: Path, path: Path, *, num_layers: int = 2) -> Path:
    """A randomly initialised tiny Qwen2 (hidden 64) with the packaged model's real tokenizer and chat
    template, saved as a local HF directory in `path`: the engine loads it as it loads a user's own
    checkpoint."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    source = models_dir / "qwen2.5-coder-0.5b"
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=151645, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    shutil.copy(source / "generation_config.json", path / "generation_config.json")
    return path


def media_model(name: str) -> Path:
    """The prepared directory of a packaged speech/vision model ("tiny.en", "base", "joe", "lite0"),
    prepared on first use into the shared models dir; skip on a laptop without its package, fail in CI."""
    from assistant.errors import ModelError
    from assistant.models.media import media_model_dir, resolve_media_model

    spec = resolve_media_model(name)
    path = Path(os.environ.get("ASSISTANT_MODELS_DIR", REPO_ROOT / "data" / "models")).resolve()
    try:
        return media_model_dir(name, path)
    except ModelError as e:
        need(False, f"the packaged model {spec.name} ({e})", f"run `make setup` or {spec.install_command}")
        raise


def pytest_runtest_logfinish(nodeid, location):
    """ASSISTANT_TEST_RSS=<file>: append each test's resident memory after it ran (to find what grows)."""
    path = os.environ.get("ASSISTANT_TEST_RSS")
    if path:
        import resource

        with open("/proc/self/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with open(path, "a") as out:
            out.write(f"{rss // 1024}\t{peak // 1024}\t{nodeid}\n")


@pytest.fixture
def closing():
    """`closing(obj)` returns obj and closes it when the test ends, failed or not: an Assistant that is
    never closed keeps its engine thread, and with it the model's memory, until the process exits."""
    opened: list = []
    yield lambda obj: opened.append(obj) or obj
    for obj in reversed(opened):
        obj.close()


def _give_memory_back() -> None:
    """Free what finished tests left, and hand the heap back to the OS: a closed Assistant's ~3 GB stayed
    resident in glibc's arenas (measured 6.0 GB built -> 3.1 GB closed -> 0.65 GB after malloc_trim),
    and served apps were kept alive by FastAPI's caches, so the real suite's one process grew past 22 GB
    on a 23 GB machine."""
    import ctypes
    import gc
    import sys

    # FastAPI (0.165) caches what it learns about endpoint functions in module-level lru_caches; each
    # endpoint is a closure over its app's Assistant, so every app a test served stayed alive
    fastapi_models = sys.modules.get("fastapi.dependencies.models")
    for value in vars(fastapi_models).values() if fastapi_models else ():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


@pytest.fixture(autouse=True)
def _trim_after_real_tests(request):
    yield
    if request.node.get_closest_marker("real"):
        _give_memory_back()


@pytest.fixture(scope="module", autouse=True)
def _trim_after_each_module():
    yield  # torn down after the module's own fixtures (servers, assistants) have closed
    _give_memory_back()


def require_module(name: str, fix: str = "run `make setup` (pip install -e '.[media,ui,test]')"):
    """`pytest.importorskip` that obeys ASSISTANT_REQUIRE_REAL: a missing package fails in CI instead of
    skipping its tests quietly. Usable at module level."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as e:
        message = f"{name} cannot be imported ({e}): {fix}"
        if REQUIRE_REAL:
            pytest.fail(f"ASSISTANT_REQUIRE_REAL=1 and {message}", pytrace=False)
        pytest.skip(message, allow_module_level=True)
