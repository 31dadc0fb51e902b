"""The /v1 API and RemoteEngine against each other on loopback, with a scripted engine behind the API."""

from __future__ import annotations


import httpx
import pytest

from assistant.engine.base import SamplingParams
from assistant.engine.fake import ScriptedEngine
from assistant.engine.remote import RemoteEngine
from assistant.errors import EngineError
from tests.conftest import free_port, serve_in_thread


@pytest.fixture
def server():
    from fastapi import FastAPI

    from assistant.server.openai import create_api

    engine = ScriptedEngine()
    app = FastAPI()
    app.include_router(create_api(engine, model_name="test-model", api_keys=("sekret",)))
    with serve_in_thread(app, timeout_s=20) as url:
        yield engine, url


MESSAGES = [{"role": "user", "content": "hi"}]


def test_remote_engine_streams_from_the_api(server):
    engine, url = server
    engine.add(["Hel", "lo ", "there"])
    remote = RemoteEngine(url, api_key="sekret")
    deltas = list(remote.generate(MESSAGES, SamplingParams(max_tokens=50)))
    assert "".join(d.text for d in deltas) == "Hello there"
    assert [d.text for d in deltas if d.text] == ["Hel", "lo ", "there"]  # streamed, not buffered
    assert deltas[-1].finish_reason == "stop" and deltas[-1].num_generated_tokens == 3
    assert remote.model == "test-model"  # discovered through /v1/models
    assert engine.prompts[-1] == MESSAGES


def test_stop_and_max_tokens_are_forwarded(server):
    engine, url = server
    engine.add(["a", "b", "STOP", "c"], ["1", "2", "3", "4"])
    remote = RemoteEngine(url, api_key="sekret", model="test-model")
    assert "".join(d.text for d in remote.generate(MESSAGES, SamplingParams(stop=("STOP",)))) == "ab"
    last = list(remote.generate(MESSAGES, SamplingParams(max_tokens=2)))[-1]
    assert last.finish_reason == "length"


def test_logprobs_make_the_round_trip(server):
    engine, url = server
    engine.add(["Par", "is"], "plain")
    remote = RemoteEngine(url, api_key="sekret", model="test-model")
    scored = [s for d in remote.generate(MESSAGES, SamplingParams(logprobs=1)) for s in d.logprobs]
    assert [(s.token, [t for t, _ in s.top]) for s in scored] == [("Par", ["Par"]), ("is", ["is"])]
    assert scored[0].logprob == pytest.approx(-0.6931, abs=1e-4)
    assert not any(d.logprobs for d in remote.generate(MESSAGES, SamplingParams()))


def test_penalties_and_logit_bias_are_forwarded(server):
    engine, url = server
    engine.add("ok")
    remote = RemoteEngine(url, api_key="sekret", model="test-model")
    list(remote.generate(MESSAGES, SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, logit_bias=((9, 3.0),))))
    got = engine.params[-1]
    assert (got.presence_penalty, got.frequency_penalty, got.logit_bias) == (1.0, 0.5, ((9, 3.0),))


def test_non_streaming_and_auth(server):
    engine, url = server
    engine.add("Paris.")
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "test-model", "messages": MESSAGES},
                   headers={"Authorization": "Bearer sekret"})
    body = r.json()
    assert r.status_code == 200 and body["choices"][0]["message"]["content"] == "Paris."
    assert body["usage"]["completion_tokens"] == 2  # "Pari", "s."
    assert httpx.get(f"{url}/v1/models").status_code == 401
    bad = httpx.post(f"{url}/v1/chat/completions", json={"messages": []}, headers={"Authorization": "Bearer sekret"})
    assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]


def test_structured_tool_calls_become_native_text(server):
    remote = RemoteEngine(server[1], api_key="sekret", model="m")
    lines = [
        'data: {"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"name":"python","arguments":"{\\"co"}}]}}]}',
        'data: {"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"de\\": \\"1+1\\"}"}}]},'
        '"finish_reason":"tool_calls"}]}',
        "data: [DONE]",
    ]
    last = list(remote._parse(iter(lines), None))[-1]
    assert last.text == '<tool_call>\n{"name": "python", "arguments": {"code": "1+1"}}\n</tool_call>'


def test_unreachable_server_says_how_to_fix():
    remote = RemoteEngine(f"http://127.0.0.1:{free_port()}", model="m")
    with pytest.raises(EngineError, match="Cannot reach the LLM server.*engine.remote_url"):
        list(remote.generate(MESSAGES, SamplingParams()))
