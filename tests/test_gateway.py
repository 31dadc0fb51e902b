"""The API gateway over the real app (create_app) with fakes at the engine seam: keys and tiers,
ownership, rate limits, the usage ledger, admission control, request ids, trace context, metrics."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from assistant.errors import ConfigError
from assistant.server.admission import Admission
from assistant.server.auth import Authenticator, check_bind
from tests.conftest import serve_in_thread
from tests.gateway_fakes import USER, GatedEngine, assert_openai_error, bearer, make_app

CHAT = "/v1/chat/completions"


def test_an_open_server_needs_no_key_until_one_is_created(tmp_path):
    assistant, engine, app = make_app(tmp_path, "one", "two")
    client = TestClient(app)
    assert client.post(CHAT, json={"messages": [USER]}).status_code == 200
    record, key = assistant.keys.create("alice", "free")
    assert key.startswith("sk-asst-") and record.id in key
    assert_openai_error(client.post(CHAT, json={"messages": [USER]}), 401, code="invalid_api_key")
    assert_openai_error(client.get("/v1/models", headers=bearer(key + "x")), 401)
    r = client.post(CHAT, json={"messages": [USER]}, headers=bearer(key))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "two"
    assistant.keys.revoke(record.id)  # revoked: refused at once, no cache
    assert_openai_error(client.get("/v1/models", headers=bearer(key)), 401)


def test_keys_are_stored_only_as_hashes(tmp_path):
    from sqlalchemy import text

    assistant, _, _ = make_app(tmp_path)
    record, key = assistant.keys.create("bob", "paid")
    with assistant.keys._db.connect() as c:
        dump = json.dumps([list(map(str, row)) for row in c.execute(text("SELECT * FROM api_keys")).all()])
    secret = key.removeprefix("sk-asst-").partition("-")[2]  # token_urlsafe: may itself hold "-"
    assert key not in dump and secret not in dump and secret[:16] not in dump and record.id in dump
    assert assistant.keys.verify(key).tier == "paid"
    assert assistant.keys.verify(key[:-1] + ("A" if key[-1] != "A" else "B")) is None
    assert assistant.keys.verify("sk-asst-zz") is None and assistant.keys.verify("") is None


def test_binding_beyond_loopback_without_keys_is_refused(tmp_path):
    assistant, _, _ = make_app(tmp_path)
    auth = Authenticator.from_config(assistant.config, assistant.keys)
    check_bind("127.0.0.1", auth)
    check_bind("::1", auth)
    with pytest.raises(ConfigError, match="assistant keys create"):
        check_bind("0.0.0.0", auth)
    assistant.keys.create("ops", "free")
    check_bind("0.0.0.0", auth)


def test_a_tier_sees_only_its_models(tmp_path):
    tiers = {"free": {"models": "qwen2.5-coder-0.5b"}, "paid": {}}
    assistant, _, app = make_app(tmp_path, "ok", tiers=tiers)
    _, free = assistant.keys.create("f", "free")
    client = TestClient(app)
    ids = [m["id"] for m in client.get("/v1/models", headers=bearer(free)).json()["data"]]
    assert ids == ["qwen2.5-coder-0.5b"]
    assert_openai_error(client.post(CHAT, json={"model": "assistant", "messages": [USER]}, headers=bearer(free)),
                        404, code="model_not_found")
    assert client.post(CHAT, json={"model": "qwen2.5-coder-0.5b", "messages": [USER]}, headers=bearer(free)).status_code == 200


def test_conversations_belong_to_the_key_that_made_them(tmp_path):
    assistant, _, app = make_app(tmp_path, "Hello there.", "Again.")
    _, alice = assistant.keys.create("alice", "paid")
    _, bob = assistant.keys.create("bob", "paid")
    client = TestClient(app)
    r = client.post(CHAT, json={"model": "assistant", "messages": [{"role": "user", "content": "Hi"}]},
                    headers=bearer(alice))
    assert r.status_code == 200, r.text
    cid = r.json()["conversation_id"]
    assert client.get(f"/api/conversations/{cid}", headers=bearer(alice)).status_code == 200
    assert client.get(f"/api/conversations/{cid}", headers=bearer(bob)).status_code == 404  # not 403
    assert client.post("/api/turns", json={"text": "More?", "conversation_id": cid}, headers=bearer(bob)).status_code == 404
    with client.stream("POST", "/api/turns", json={"text": "More?", "conversation_id": cid}, headers=bearer(alice)) as s:
        assert s.status_code == 200 and "Again." in s.read().decode()
    # /api/turns without an id makes a conversation that belongs to the caller
    with client.stream("POST", "/api/turns", json={"text": "New"}, headers=bearer(bob)) as s:
        started = json.loads(next(line for line in s.iter_lines() if line.startswith("data: "))[6:])
    assert client.get(f"/api/conversations/{started['conversation_id']}", headers=bearer(alice)).status_code == 404
    assert client.get(f"/api/conversations/{started['conversation_id']}", headers=bearer(bob)).status_code == 200


def test_rate_limit_is_a_429_with_retry_after_and_openai_headers(tmp_path):
    assistant, _, app = make_app(tmp_path, *["ok"] * 5, tiers={"free": {"rpm": 2, "tpm": 100000}})
    _, key = assistant.keys.create("k", "free")
    client = TestClient(app)
    first = client.post(CHAT, json={"messages": [USER], "max_tokens": 5}, headers=bearer(key))
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "2" and first.headers["x-ratelimit-remaining-requests"] == "1"
    assert first.headers["x-ratelimit-limit-tokens"] == "100000" and "x-ratelimit-reset-tokens" in first.headers
    assert client.post(CHAT, json={"messages": [USER], "max_tokens": 5}, headers=bearer(key)).status_code == 200
    third = client.post(CHAT, json={"messages": [USER], "max_tokens": 5}, headers=bearer(key))
    error = assert_openai_error(third, 429, code="rate_limit_exceeded")
    assert int(third.headers["retry-after"]) >= 1 and "2 requests per minute" in error["message"]
    assert third.headers["x-ratelimit-remaining-requests"] == "0"
    rows = assistant.usage.rows()
    assert [r.status for r in rows] == ["ok", "ok", "rate_limited"]
    metrics = client.get("/metrics").text
    assert 'assistant_rate_limit_rejections_total{reason="requests"} 1.0' in metrics


def test_daily_quota_is_a_429_insufficient_quota(tmp_path):
    assistant, _, app = make_app(tmp_path, "a b c d e f", "x", tiers={"free": {"daily_tokens": 5}})
    _, key = assistant.keys.create("k", "free")
    client = TestClient(app)
    assert client.post(CHAT, json={"messages": [USER]}, headers=bearer(key)).status_code == 200
    r = client.post(CHAT, json={"messages": [USER]}, headers=bearer(key))
    assert_openai_error(r, 429, code="insufficient_quota")
    assert "retry-after" in r.headers


def test_usage_ledger_rows_per_request_and_key(tmp_path):
    assistant, _, app = make_app(tmp_path, "Paris is nice.", ["a", "b", "c"], "Hello.")
    _, key = assistant.keys.create("k", "paid")
    client = TestClient(app)
    r = client.post(CHAT, json={"messages": [USER]}, headers=bearer(key))
    usage = r.json()["usage"]
    with client.stream("POST", CHAT, json={"messages": [USER], "max_tokens": 2, "stream": True}, headers=bearer(key)) as s:
        s.read()
    client.post(CHAT, json={"model": "assistant", "messages": [USER]}, headers=bearer(key))
    rows = assistant.usage.rows(key_id=assistant.keys.list()[0].id)
    assert [(r.model, r.status) for r in rows] == [("qwen2.5-coder-0.5b", "ok"), ("qwen2.5-coder-0.5b", "length"),
                                                  ("assistant", "ok")]
    assert rows[0].prompt_tokens == usage["prompt_tokens"] and rows[0].completion_tokens == usage["completion_tokens"]
    assert rows[1].completion_tokens == 2 and all(r.latency_ms >= 0 and r.request_id.startswith("req_") for r in rows)
    assert rows[2].completion_tokens > 0 and rows[2].prompt_tokens > 0


def test_a_cancelled_stream_records_its_partial_usage(tmp_path):
    engine = GatedEngine(num_tokens=200)
    assistant, _, app = make_app(tmp_path, engine=engine)
    with serve_in_thread(app, timeout_s=20) as url:
        with httpx.stream("POST", f"{url}{CHAT}", json={"messages": [USER], "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            for _ in range(3):
                engine.step.release()
            seen = 0
            for line in lines:
                if '"content": "x"' in line:
                    seen += 1
                    if seen == 3:
                        break
        deadline = time.monotonic() + 20
        while not engine.closed.is_set() and time.monotonic() < deadline:
            engine.step.release()  # one token at a time, until the server notices the client is gone
            time.sleep(0.05)
        while not assistant.usage.rows() and time.monotonic() < deadline:
            time.sleep(0.05)
    (row,) = assistant.usage.rows()
    assert engine.closed.is_set()  # the engine request was cancelled, not run to its end
    assert row.status == "cancelled" and 3 <= row.completion_tokens < 100 and row.prompt_tokens == 3


def test_a_full_queue_is_refused_at_once_with_retry_after(tmp_path):
    engine = GatedEngine(num_tokens=2)
    assistant, _, app = make_app(tmp_path, engine=engine, max_running=1, max_queued=1)
    results: dict[str, int] = {}

    def call(name: str) -> None:
        results[name] = httpx.post(f"{url}{CHAT}", json={"messages": [USER]}, timeout=30).status_code

    with serve_in_thread(app, timeout_s=20) as url:
        first = threading.Thread(target=call, args=("first",))
        first.start()
        deadline = time.monotonic() + 10
        while engine.calls < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        queued = threading.Thread(target=call, args=("queued",))
        queued.start()
        while app.state.gateway.admission.num_waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        start = time.monotonic()
        refused = httpx.post(f"{url}{CHAT}", json={"messages": [USER]}, timeout=30)
        assert time.monotonic() - start < 5  # at once, not after the others
        assert_openai_error(refused, 503, code="server_busy")
        assert int(refused.headers["retry-after"]) >= 1
        metrics = httpx.get(f"{url}/metrics").text
        assert "assistant_queue_depth 1.0" in metrics and "assistant_running_streams 1.0" in metrics
        engine.open_all()
        for t in (first, queued):
            t.join(timeout=30)
    assert results == {"first": 200, "queued": 200}
    busy = [r for r in assistant.usage.rows() if r.request_id == refused.headers["x-request-id"]]
    assert [r.status for r in busy] == ["busy"]  # a refused request has its ledger row too (bench/load.py found it missing)


def test_admission_serves_higher_priority_first():
    async def scenario() -> list[str]:
        admission = Admission(max_running=1, max_queued=10)
        order: list[str] = []
        assert await admission.acquire(0)

        async def wait(name: str, priority: int) -> None:
            assert await admission.acquire(priority)
            order.append(name)
            admission.release()

        tasks = [asyncio.create_task(wait("free-1", 0)), asyncio.create_task(wait("free-2", 0))]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(wait("paid", 10)))
        await asyncio.sleep(0)
        assert admission.num_waiting == 3
        admission.release()
        await asyncio.gather(*tasks)
        assert admission.num_running == 0 and admission.num_waiting == 0
        return order

    assert asyncio.run(scenario()) == ["paid", "free-1", "free-2"]


def test_admission_refuses_when_the_line_is_full_and_survives_cancelled_waiters():
    async def scenario() -> None:
        admission = Admission(max_running=1, max_queued=1)
        assert await admission.acquire()
        waiter = asyncio.create_task(admission.acquire())
        await asyncio.sleep(0)
        assert not await admission.acquire()  # line full: refused at once
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        admission.release()
        assert admission.num_running == 0 and admission.num_waiting == 0
        assert await admission.acquire()

    asyncio.run(scenario())


def test_every_response_has_a_request_id_and_continues_the_trace(tmp_path):
    _, _, app = make_app(tmp_path, "ok")
    client = TestClient(app)
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    r = client.get("/v1/models", headers={"traceparent": parent, "x-request-id": "my-id-1"})
    assert r.headers["x-request-id"] == "my-id-1"
    version, trace, span, flags = r.headers["traceparent"].split("-")
    assert trace == "4bf92f3577b34da6a3ce929d0e0e4736" and span != "00f067aa0ba902b7" and flags == "01"
    for response in (client.get("/v1/models", headers={"traceparent": "garbage"}),
                     client.post(CHAT, content=b"{"), client.get("/api/conversations/nope")):
        assert response.headers["x-request-id"].startswith("req_")
        assert len(response.headers["traceparent"].split("-")[1]) == 32


def test_an_oversized_body_is_refused_before_it_is_read(tmp_path):
    assistant, engine, app = make_app(tmp_path, max_body_bytes=1000)
    client = TestClient(app)
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]}).encode()
    assert_openai_error(client.post(CHAT, content=big), 413, code="request_too_large")

    def chunked():  # no content-length: counted as it arrives
        for i in range(0, len(big), 500):
            yield big[i:i + 500]

    with serve_in_thread(app, timeout_s=20) as url:
        r = httpx.post(f"{url}{CHAT}", content=chunked(), timeout=30)
    assert_openai_error(r, 413, code="request_too_large")
    assert engine.prompts == []


def test_upload_routes_take_bodies_up_to_the_upload_limit(tmp_path):
    _, _, app = make_app(tmp_path, max_body_bytes=1000, max_upload_bytes=20_000)
    client = TestClient(app)
    recording = {"file": ("q.wav", b"x" * 5000), "model": (None, "whisper-1")}
    beyond_body = client.post("/v1/audio/transcriptions", files=recording)
    # past max_body_bytes, within max_upload_bytes: it reaches the route, which says it is not audio
    assert "not an audio file" in assert_openai_error(beyond_body, 400)["message"]
    huge = client.post("/v1/audio/transcriptions", files={"file": ("q.wav", b"x" * 30_000)})
    assert "server.max_upload_bytes" in assert_openai_error(huge, 413, code="request_too_large")["message"]
    chat = client.post(CHAT, content=json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]}))
    assert "server.max_body_bytes" in assert_openai_error(chat, 413)["message"]


def test_metrics_expose_latency_histograms_and_requests_by_status(tmp_path):
    _, _, app = make_app(tmp_path, ["a", "b", "c"])
    client = TestClient(app)
    with client.stream("POST", CHAT, json={"messages": [USER], "stream": True}) as s:
        s.read()
    client.post(CHAT, json={"messages": [USER], "model": "nope"})
    text = client.get("/metrics").text
    assert 'assistant_requests_total{route="/v1/chat/completions",status="200"} 1.0' in text
    assert 'assistant_requests_total{route="/v1/chat/completions",status="404"} 1.0' in text
    assert 'assistant_time_to_first_token_seconds_count{model="qwen2.5-coder-0.5b"} 1.0' in text
    assert 'assistant_inter_token_latency_seconds_count{model="qwen2.5-coder-0.5b"} 2.0' in text
    assert 'assistant_generated_tokens_total{model="qwen2.5-coder-0.5b"} 3.0' in text


@pytest.mark.parametrize("path,sent", [
    (CHAT, {"messages": [USER], "stream": True}),
    (CHAT, {"model": "assistant", "messages": [USER], "stream": True}),
    ("/api/turns", {"text": "Hello?"}),
], ids=["raw", "assistant-model", "turn"])
def test_a_client_that_left_while_queued_gives_its_slot_back(tmp_path, path, sent):
    """A request admitted after its client went away (it waited in line, the client gave up) starts no
    stream anyone reads: its slot must come back and its usage row be written all the same. Found by
    bench/load.py: 16 such slots stayed taken for good and the server answered nothing more."""
    import socket

    engine = GatedEngine(num_tokens=3)
    assistant, _, app = make_app(tmp_path, engine=engine, max_running=1, max_queued=1)
    admission = app.state.gateway.admission
    body = json.dumps(sent).encode()
    with serve_in_thread(app, timeout_s=20) as url:
        first = threading.Thread(target=lambda: httpx.post(f"{url}{CHAT}", json={"messages": [USER], "stream": True},
                                                           timeout=30))
        first.start()
        deadline = time.monotonic() + 10
        while engine.calls < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as gone:  # waits in line, then hangs up
            gone.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            while admission.num_waiting < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert admission.num_waiting == 1
        engine.open_all()
        first.join(timeout=30)
        deadline = time.monotonic() + 30  # a turn starts (safety check, stored question) before it is closed
        while (admission.num_running or admission.num_waiting) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (admission.num_running, admission.num_waiting) == (0, 0)
    assert sorted(r.status for r in assistant.usage.rows()) == ["cancelled", "length"]
