"""Scale-out, end to end: two `assistant serve` processes share one PostgreSQL, one Redis and one LLM
server, and hold no state of their own (issue #16, "8. Scale-out"; deploy/compose.yaml is this
topology with N replicas behind nginx).

What runs, all on loopback and started by the test:
  * a throwaway PostgreSQL and redis-server (tests/services.py);
  * the LLM server: a ScriptedEngine behind this project's own OpenAI-compatible /v1 router, on a
    real uvicorn in a thread. It stands in for vLLM (engine.remote_url) and records every prompt it
    is sent, so the test can see what each replica put into the model's context;
  * replicas A and B: `python -m assistant.cli serve` subprocesses, each with its own empty data dir,
    configured only through ASSISTANT_* variables and one TOML file, as in the compose file. The
    safety classifiers are off (safety.enabled = false) to keep each replica at ~170 MB instead of
    ~670 MB; they keep no per-process state (audit rows live in the store) and have their own tests.

What it shows: one conversation served alternately (A, B, A) is one conversation, and each replica
sent the model the turns the other one wrote; one key's requests-per-minute bucket is shared (the
429 comes at the tier's count summed over both replicas, with Retry-After); the usage ledger rows of
both replicas are in PostgreSQL, and neither replica created a SQLite store of its own; a turn that
A streams is stopped by a cancel sent to B (assistant/server/redis_turns.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from assistant.engine.fake import ScriptedEngine
from tests.conftest import REPO_ROOT, free_port, serve_in_thread

pytestmark = pytest.mark.real

STARTUP_TIMEOUT_S = 40
RPM = 4  # the "tiny" tier's requests per minute: the burst the two replicas share
MODEL = "stand-in"  # the LLM server's model id, also the replicas' public id for it
TIERS_TOML = f"""\
[server]
default_tier = "tiny"
[server.tiers.tiny]
rpm = {RPM}
[server.tiers.roomy]
rpm = 0
"""
ANSWERS = ["Nice to meet you, Ada.", "Your name is Ada.", "You asked me two questions before this one."]
QUESTIONS = ["My name is Ada.", "What is my name?", "How many questions did I ask before this one?"]


class SlowScriptedEngine(ScriptedEngine):
    """A ScriptedEngine that waits `delay_s` after each token: a turn long enough to cancel."""

    delay_s = 0.0

    def generate(self, prompt, params, *, tools=None, cancel=None):
        for delta in super().generate(prompt, params, tools=tools, cancel=cancel):
            yield delta
            if delta.finish_reason is None and self.delay_s:
                time.sleep(self.delay_s)


@pytest.fixture(scope="module")
def llm_server() -> Iterator[tuple[object, str]]:
    """The stand-in for vLLM: (its ScriptedEngine, its base URL)."""
    from fastapi import FastAPI

    from assistant.server.openai import create_api

    engine = SlowScriptedEngine()
    app = FastAPI()
    app.include_router(create_api(engine, model_name=MODEL))
    with serve_in_thread(app, timeout_s=20) as url:
        yield engine, url


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, pg_url, redis_url, llm_server):
    """Replicas A and B, and two keys created with the CLI in the shared store: {"a": url, "b": url, ...}."""
    root = tmp_path_factory.mktemp("scale-out")
    config = root / "assistant.toml"
    config.write_text(TIERS_TOML)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASSISTANT_")}
    env.update(ASSISTANT_CONFIG=str(config), ASSISTANT_STORE_URL=pg_url, ASSISTANT_SERVER_REDIS_URL=redis_url,
               ASSISTANT_ENGINE_REMOTE_URL=llm_server[1], ASSISTANT_ENGINE_REMOTE_MODEL=MODEL,
               ASSISTANT_ENGINE_MODEL=MODEL, ASSISTANT_SAFETY_ENABLED="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")

    def cli(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "assistant.cli", *args, "--data-dir", str(root / "cli")],
                              env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"assistant {' '.join(args)} failed:\n{done.stderr}"
        return done.stdout.strip()

    with contextlib.ExitStack() as stack:
        urls, procs = {}, {}
        for name in ("a", "b"):
            port = free_port()
            urls[name] = f"http://127.0.0.1:{port}"
            procs[name] = stack.enter_context(_replica(env, root / f"data-{name}", port, root / f"{name}.log"))
        # while they start: keys are read from the store on every request, none is cached by a replica
        keys = {"chat": cli("keys", "create", "--tier", "roomy", "--name", "chat"),
                "limited": cli("keys", "create", "--tier", "tiny", "--name", "limited")}
        for name, url in urls.items():
            _wait_until_up(url, procs[name], root / f"{name}.log")
        yield {**urls, "keys": keys, "root": root, "pg_url": pg_url}


@contextlib.contextmanager
def _replica(env: dict[str, str], data_dir: Path, port: int, log: Path) -> Iterator[subprocess.Popen]:
    data_dir.mkdir()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "assistant.cli", "serve", "--data-dir", str(data_dir),
                                 "--port", str(port)], env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _wait_until_up(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            httpx.get(f"{url}/v1/models", timeout=2)  # any answer (401 without a key) means it serves
            return
        except httpx.TransportError:
            time.sleep(0.2)
    pytest.fail(f"replica {url} did not start (exit status {proc.poll()}, waited at most {STARTUP_TIMEOUT_S} s):\n"
                f"{log.read_text()}")


def _bearer(key: str, request_id: str = "") -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **({"x-request-id": request_id} if request_id else {})}


def _events(text: str) -> list[dict]:
    """The `data:` objects of a text/event-stream body, in order."""
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]


def _served(data_dir: Path, expected: set[str]) -> set[str]:
    """Request ids in a replica's own access log (logs/access.jsonl in its data dir), once `expected` are
    there: a streamed response's line is written when its stream closes, just after the client has it."""
    log = data_dir / "logs" / "access.jsonl"
    deadline = time.monotonic() + 5
    while True:
        ids = {json.loads(line)["request_id"] for line in log.read_text().splitlines() if line.strip()}
        if expected <= ids or time.monotonic() > deadline:
            return ids
        time.sleep(0.05)


def _ledger(pg_url: str, expected: set[str]) -> dict[str, tuple[str, str]]:
    """request id -> (key id, status) of every usage row in PostgreSQL, once `expected` are there (a
    streamed turn's row is written when its stream closes)."""
    from sqlalchemy import create_engine, select

    from assistant.usage import usage

    db = create_engine(pg_url)
    deadline = time.monotonic() + 5
    try:
        while True:
            with db.connect() as c:
                rows = c.execute(select(usage.c.request_id, usage.c.key_id, usage.c.status)).all()
            ledger = {r.request_id: (r.key_id, r.status) for r in rows}
            if expected <= set(ledger) or time.monotonic() > deadline:
                return ledger
            time.sleep(0.05)
    finally:
        db.dispose()


def test_replicas_serve_one_conversation_alternately(cluster, llm_server):
    engine, _ = llm_server
    key = cluster["keys"]["chat"]
    engine.script[:] = ANSWERS
    created = httpx.post(f"{cluster['a']}/api/conversations", json={"title": "scale-out"}, headers=_bearer(key))
    assert created.status_code == 201, created.text
    conversation = created.json()["id"]
    first_prompt = len(engine.prompts)
    replicas = ["a", "b", "a"]
    for i, (replica, question) in enumerate(zip(replicas, QUESTIONS)):
        r = httpx.post(f"{cluster[replica]}/api/conversations/{conversation}/turns", json={"text": question},
                       headers=_bearer(key, f"turn-{i + 1}-{replica}"), timeout=30)
        assert r.status_code == 200, r.text
        done = _events(r.text)[-1]
        assert done["type"] == "done" and done["text"] == ANSWERS[i], r.text

    # every turn went to the replica it was sent to (each one's own access log), and to no other
    served_a = _served(cluster["root"] / "data-a", {"turn-1-a", "turn-3-a"})
    served_b = _served(cluster["root"] / "data-b", {"turn-2-b"})
    assert {"turn-1-a", "turn-3-a"} <= served_a and "turn-2-b" not in served_a
    assert "turn-2-b" in served_b and not {"turn-1-a", "turn-3-a"} & served_b

    # the model saw the earlier turns: B sent turn 1 (written by A), A sent turn 2 (written by B)
    prompts = engine.prompts[first_prompt:]
    assert len(prompts) == 3, f"one LLM call per turn expected, got {len(prompts)}"
    seen = [" ".join(str(m.get("content", "")) for m in prompt) for prompt in prompts]
    assert QUESTIONS[0] in seen[1] and ANSWERS[0] in seen[1]
    assert all(text in seen[2] for text in (QUESTIONS[0], ANSWERS[0], QUESTIONS[1], ANSWERS[1]))

    # the stored conversation is the same, complete and in order, from either replica
    for replica in ("a", "b"):
        got = httpx.get(f"{cluster[replica]}/api/conversations/{conversation}", headers=_bearer(key))
        assert got.status_code == 200, got.text
        messages = [(m["role"], m["content"]) for m in got.json()["messages"] if m["role"] in ("user", "assistant")]
        assert messages == [pair for q, a in zip(QUESTIONS, ANSWERS) for pair in (("user", q), ("assistant", a))]
    listed = httpx.get(f"{cluster['b']}/api/conversations", headers=_bearer(key)).json()["data"]
    assert [c["id"] for c in listed] == [conversation]  # B knows the owner A recorded

    # another key sees nothing of it, on either replica (ownership is in the store, not in A)
    other = _bearer(cluster["keys"]["limited"])
    assert httpx.get(f"{cluster['b']}/api/conversations/{conversation}", headers=other).status_code == 404

    # each replica's turns are in the one usage ledger, in PostgreSQL; no replica kept a store of its own
    ids = [f"turn-{i + 1}-{r}" for i, r in enumerate(replicas)]
    ledger = _ledger(cluster["pg_url"], set(ids))
    turns = [ledger.get(request_id) for request_id in ids]
    assert all(row is not None and row[1] == "ok" for row in turns), turns
    assert not list(cluster["root"].glob("data-*/assistant.db*"))


def test_replicas_share_one_keys_rate_limit_and_ledger(cluster, llm_server):
    engine, _ = llm_server
    key = cluster["keys"]["limited"]
    engine.script[:] = ["ok"] * (RPM + 2)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    order = ["a", "b"] * (RPM // 2 + 1)  # A, B, A, B, ... one more than the tier allows, then one on each
    responses = []
    for i, replica in enumerate(order):
        responses.append(httpx.post(f"{cluster[replica]}/v1/chat/completions", json=body,
                                    headers=_bearer(key, f"limit-{i + 1}-{replica}"), timeout=30))
    statuses = [r.status_code for r in responses]
    assert statuses == [200] * RPM + [429] * (len(order) - RPM), [r.text for r in responses]
    # one bucket: each replica's answer counts the other's requests
    assert [r.headers["x-ratelimit-remaining-requests"] for r in responses[:RPM]] == \
        [str(RPM - n) for n in range(1, RPM + 1)]
    for refused in responses[RPM:]:
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.headers["x-ratelimit-limit-requests"] == str(RPM)
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    refused_on = {order[i] for i in range(RPM, len(order))}
    assert refused_on == {"a", "b"}  # both replicas refuse once the shared bucket is empty

    # every request of both replicas has its usage row in PostgreSQL: answered ones "ok", refused ones marked
    ids = [f"limit-{i + 1}-{r}" for i, r in enumerate(order)]
    ledger = _ledger(cluster["pg_url"], set(ids))
    assert set(ids) <= set(ledger), sorted(set(ids) - set(ledger))
    key_ids = {ledger[request_id][0] for request_id in ids}
    assert len(key_ids) == 1 and "" not in key_ids
    assert [ledger[request_id][1] for request_id in ids] == \
        ["ok"] * RPM + ["rate_limited"] * (len(order) - RPM)


def test_a_turn_streamed_by_one_replica_is_cancelled_through_the_other(cluster, llm_server):
    engine, _ = llm_server
    key = cluster["keys"]["chat"]
    words = 150
    engine.script[:] = [["word "] * words]
    engine.delay_s = 0.2  # 30 s if nothing stops it
    unknown = httpx.post(f"{cluster['b']}/api/turns/no-such-turn/cancel", headers=_bearer(key), timeout=10)
    assert unknown.status_code == 404, unknown.text
    try:
        events, started = [], time.monotonic()
        with httpx.stream("POST", f"{cluster['a']}/api/turns", json={"text": "Tell me a long story."},
                          headers=_bearer(key, "cancel-a"), timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(json.loads(line[len("data: "):]))
                if events[-1]["type"] == "text_delta" and sum(e["type"] == "text_delta" for e in events) == 3:
                    turn = next(e["message_id"] for e in events if e["type"] == "turn_started")
                    cancelled = httpx.post(f"{cluster['b']}/api/turns/{turn}/cancel", headers=_bearer(key), timeout=10)
                    assert cancelled.status_code == 200, cancelled.text  # B does not run it, A does
        elapsed = time.monotonic() - started
    finally:
        engine.delay_s = 0.0
    done = events[-1]
    assert done["type"] == "done" and done["finish_reason"] == "cancelled", events[-3:]
    assert 0 < done["text"].count("word") < words and elapsed < 15, (done["text"].count("word"), elapsed)
    stored = httpx.get(f"{cluster['b']}/api/conversations/{done['conversation_id']}", headers=_bearer(key)).json()
    assert stored["messages"][-1]["content"] == done["text"]  # the partial answer is kept, as with a local cancel
