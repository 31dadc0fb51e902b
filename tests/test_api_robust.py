"""Robustness of the /v1 API and of the engine behind it.

* Client mistakes are a 400 in OpenAI's error shape (fast, a scripted engine behind the API).
* Nothing blocks the event loop: while a slow request is generating, /v1/models still answers.
* On the real packaged model (`real`): each bad request is refused while a healthy stream that started
  before it finishes with its full answer; a failure injected into one request inside a LocalEngine
  step fails that request alone, and a failing batched forward does not kill the engine thread.

Timing is never asserted beyond generous "answers within N seconds while the other is still running".
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from typing import Any, Iterator

import httpx
import pytest

from assistant.engine.base import Engine, SamplingParams, TokenDelta
from assistant.engine.fake import ScriptedEngine
from assistant.errors import EngineError
from tests.conftest import serve_in_thread

USER = {"role": "user", "content": "hi"}
ERROR_KEYS = {"message", "type", "param", "code"}


@contextlib.contextmanager
def _serve(engine: Engine, **kw: Any) -> Iterator[str]:
    """The /v1 router on a real uvicorn server in a thread (one event loop, like the product's)."""
    from fastapi import FastAPI

    from assistant.server.openai import create_api

    app = FastAPI()
    app.include_router(create_api(engine, model_name="test-model", **kw))
    with serve_in_thread(app, timeout_s=20) as base:
        yield base


def _assert_openai_400(response: httpx.Response, param: str | None = "any") -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["type"] == "invalid_request_error" and error["code"] is None
    assert isinstance(error["message"], str) and error["message"]
    if param != "any":
        assert error["param"] == param, error
    return error


# -- the bad requests (raw bodies: NaN is not JSON, but Python's json accepts it) -----------------

BAD: dict[str, tuple[bytes, str | None]] = {  # case -> (body, the `param` the error must name)
    "stop [1]": (b'{"messages": [{"role": "user", "content": "hi"}], "stop": [1]}', "stop"),
    "NaN temperature": (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
    "messages [99999999]": (b'{"messages": [99999999]}', "messages[0]"),
    "string seed": (b'{"messages": [{"role": "user", "content": "hi"}], "seed": "42"}', "seed"),
    "invalid JSON": (b'{"messages": [{"role": "user", "content": "hi"}', None),
    "wrong role": (b'{"messages": [{"role": "wizard", "content": "hi"}]}', "messages[0].role"),
}
# rejected by the chat template (see `real_engine`), not by the schema: valid JSON, valid shapes
TEMPLATE_ERROR = (b'{"messages": [{"role": "assistant", "content": "I speak first."}]}', "messages")

MORE_BAD: list[tuple[Any, str | None]] = [
    ([], None),  # not an object
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content"),
    ({"messages": [USER, {"role": "tool", "content": "x", "tool_calls": []}]}, "messages[1]"),
    ({"messages": [USER], "temperature": 2.5}, "temperature"),
    ({"messages": [USER], "temperature": "0.7"}, "temperature"),
    ({"messages": [USER], "temperature": -1}, "temperature"),
    ({"messages": [USER], "top_p": 0}, "top_p"),
    ({"messages": [USER], "top_p": 1.5}, "top_p"),
    ({"messages": [USER], "top_k": -1}, "top_k"),
    ({"messages": [USER], "max_tokens": 0}, "max_tokens"),
    ({"messages": [USER], "max_tokens": 1.5}, "max_tokens"),
    ({"messages": [USER], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [USER], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": [USER], "stop": [""]}, "stop"),
    ({"messages": [USER], "stop": 7}, "stop"),
    ({"messages": [USER], "seed": 1.5}, "seed"),
    ({"messages": [USER], "seed": True}, "seed"),
    ({"messages": [USER], "stream": "yes"}, "stream"),
    ({"messages": [USER], "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"messages": [USER], "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": [USER], "tools": {"name": "x"}}, "tools"),
    ({"messages": [USER], "model": 3}, "model"),
    ({"messages": [USER], "n": 2}, "n"),
]


@pytest.fixture
def scripted():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from assistant.server.openai import create_api

    engine = ScriptedEngine()
    app = FastAPI()
    app.include_router(create_api(engine, model_name="test-model"))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield engine, client


@pytest.mark.parametrize("case", list(BAD))
def test_bad_request_is_a_400_in_openai_shape(scripted, case):
    engine, client = scripted
    body, param = BAD[case]
    _assert_openai_400(client.post("/v1/chat/completions", content=body), param)
    assert engine.prompts == []  # refused before any engine work


@pytest.mark.parametrize("body,param", MORE_BAD, ids=[str(p) for _, p in MORE_BAD])
def test_more_client_mistakes_are_400s(scripted, body, param):
    engine, client = scripted
    _assert_openai_400(client.post("/v1/chat/completions", content=json.dumps(body)), param)
    assert engine.prompts == []


def test_valid_requests_keep_working(scripted):
    engine, client = scripted
    engine.add("one", "two", "three")
    parts = {"messages": [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
                          USER], "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 7, "stop": "\n\n",
             "max_completion_tokens": 9, "stream": False, "stream_options": None, "logprobs": False, "user": "x"}
    r = client.post("/v1/chat/completions", json=parts)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "one"
    assert engine.prompts[-1] == [{"role": "system", "content": "Be brief."}, USER]
    # an agent turn: assistant tool call with null content, then the tool's result; tools are forwarded
    tools = [{"type": "function", "function": {"name": "python", "description": "run code",
                                               "parameters": {"type": "object", "properties": {}}}}]
    turn = [USER, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "python", "arguments": '{"code": "1+1"}'}}]},
            {"role": "tool", "name": "python", "tool_call_id": "c1", "content": "2"}]
    r = client.post("/v1/chat/completions", json={"model": "test-model", "messages": turn, "tools": tools, "stop": ["a", "b"]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "two"
    assert engine.prompts[-1][1] == {"role": "assistant", "content": "", "tool_calls": turn[1]["tool_calls"]}
    assert engine.prompts[-1][2] == turn[2] and engine.tools_seen[-1] == tools
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": [USER], "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 2


def test_engine_failures_keep_the_openai_shape(scripted):
    engine, client = scripted  # no script left: the scripted engine raises EngineError on first read
    r = client.post("/v1/chat/completions", json={"messages": [USER]})
    assert r.status_code == 500 and set(r.json()["error"]) == ERROR_KEYS and r.json()["error"]["type"] == "server_error"
    with client.stream("POST", "/v1/chat/completions", json={"messages": [USER], "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    error = json.loads(events[-2])["error"]
    assert r.status_code == 200 and events[-1] == "[DONE]" and set(error) == ERROR_KEYS and "scripted" in error["message"]


def test_wrong_api_key_is_a_401_in_openai_shape():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from assistant.server.openai import create_api

    app = FastAPI()
    app.include_router(create_api(ScriptedEngine(["ok"]), model_name="m", api_keys=("k",)))
    client = TestClient(app)
    for r in (client.get("/v1/models"), client.post("/v1/chat/completions", json={"messages": [USER]},
                                                    headers={"Authorization": "Bearer nope"})):
        assert r.status_code == 401 and set(r.json()["error"]) == ERROR_KEYS
    assert client.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200


class _TemplateRaises(ScriptedEngine):
    def generate(self, prompt, params, *, tools=None, cancel=None):
        from jinja2 import TemplateError

        raise TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")


def test_chat_template_error_is_a_400():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from assistant.server.openai import create_api

    app = FastAPI()
    app.include_router(create_api(_TemplateRaises(), model_name="m"))
    error = _assert_openai_400(TestClient(app).post("/v1/chat/completions", json={"messages": [USER]}), "messages")
    assert "roles must alternate" in error["message"]


# -- the event loop stays free -------------------------------------------------------------------


class _GatedEngine(Engine):
    """Blocks until released, either inside `generate` itself (a long prompt's template and
    tokenising) or while the answer is being read (generation)."""

    name = "gated"

    def __init__(self, block_in_call: bool) -> None:
        self.block_in_call = block_in_call
        self.entered, self.release = threading.Event(), threading.Event()

    def count_tokens(self, messages, *, tools=None) -> int:
        return 1

    def _wait(self) -> None:
        self.entered.set()
        assert self.release.wait(60)

    def generate(self, prompt, params, *, tools=None, cancel=None):
        if self.block_in_call:
            self._wait()
        return self._deltas()

    def _deltas(self):
        if not self.block_in_call:
            self._wait()
        yield TokenDelta("done", (1,), "stop", 1, 1)


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
@pytest.mark.parametrize("block_in_call", [False, True], ids=["slow-generation", "slow-encode"])
def test_a_slow_request_does_not_block_the_event_loop(stream, block_in_call):
    engine = _GatedEngine(block_in_call)
    result: dict[str, Any] = {}

    def slow_request() -> None:
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [USER], "stream": stream}, timeout=60)
        result["status"], result["text"] = r.status_code, r.text

    with _serve(engine) as url:
        slow = threading.Thread(target=slow_request)
        slow.start()
        try:
            assert engine.entered.wait(20), "the slow request never reached the engine"
            # the loop is free: another route answers while the slow request is still running
            models = httpx.get(f"{url}/v1/models", timeout=10)
            assert models.status_code == 200 and models.json()["data"][0]["id"] == "test-model"
            assert slow.is_alive()  # (it reads the whole body, streamed or not)
            assert not result
        finally:
            engine.release.set()
            slow.join(timeout=30)
    assert result["status"] == 200 and "done" in result["text"]


# -- the real model: bad requests beside a healthy stream; failures inside an engine step --------

HEALTHY = {"messages": [{"role": "user", "content": "Count from 1 to 60, separated by commas."}],
           "max_tokens": 24, "stream": True}
# Qwen's template renders any role order; this guard makes it raise like the Llama/Mistral/Gemma
# templates do (HF's raise_exception -> jinja2 TemplateError) and renders nothing otherwise.
GUARD = ("{%- if messages[0]['role'] == 'assistant' %}"
         "{{- raise_exception('Conversations must start with a system or user message') }}{%- endif %}")


@pytest.fixture(scope="module")
def real_engine(models_dir):
    from assistant.config import AssistantConfig
    from assistant.engine.local import LocalEngine

    config = AssistantConfig.load(env={}, overrides={"models_dir": str(models_dir), "engine.kv_cache_mb": 64})
    engine = LocalEngine.from_config(config)
    engine.tokenizer.chat_template = GUARD + engine.tokenizer.chat_template
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def real_server(real_engine):
    with _serve(real_engine) as url:
        yield url


def _stream(url: str, body: dict[str, Any], out: dict[str, Any], started: threading.Event) -> None:
    """Read one SSE stream into `out` (text, finish, errors); `started` is set on the first text."""
    out.update(text="", finish=None, errors=[])
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["errors"].append(chunk["error"])
                for choice in chunk.get("choices", []):
                    out["text"] += choice["delta"].get("content") or ""
                    out["finish"] = choice["finish_reason"] or out["finish"]
                    if out["text"]:
                        started.set()
    finally:
        started.set()


@pytest.fixture(scope="module")
def healthy_answer(real_server) -> str:
    out: dict[str, Any] = {}
    _stream(real_server, HEALTHY, out, threading.Event())
    assert out["status"] == 200 and not out["errors"] and out["finish"] in ("length", "stop") and out["text"]
    return out["text"]


@pytest.mark.real
@pytest.mark.parametrize("case", [*BAD, "chat-template error"])
def test_bad_request_fails_alone_beside_a_healthy_stream(real_server, healthy_answer, case):
    body, param = TEMPLATE_ERROR if case == "chat-template error" else BAD[case]
    healthy: dict[str, Any] = {}
    started = threading.Event()
    thread = threading.Thread(target=_stream, args=(real_server, HEALTHY, healthy, started))
    thread.start()
    try:
        assert started.wait(60), "the healthy stream did not start"
        bad = httpx.post(f"{real_server}/v1/chat/completions", content=body, timeout=30)
        still_streaming = thread.is_alive()
    finally:
        thread.join(timeout=120)
    error = _assert_openai_400(bad, param)
    if case == "chat-template error":
        assert "start with a system or user message" in error["message"]
    assert still_streaming, "the healthy stream ended before the bad request was answered"
    assert healthy["status"] == 200 and not healthy["errors"]
    assert healthy["text"] == healthy_answer


@pytest.mark.real
@pytest.mark.parametrize("prompt,params", [
    ([99999999], SamplingParams(max_tokens=4)),
    ([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, stop=(1,))),  # type: ignore[arg-type]
    ([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, temperature=math.nan)),
    ([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, temperature=0.5, seed="42")),  # type: ignore[arg-type]
], ids=["token-out-of-vocab", "stop [1]", "NaN temperature", "string seed"])
def test_local_engine_refuses_bad_input_before_queueing_it(real_engine, prompt, params):
    with pytest.raises(ValueError):
        real_engine.generate(prompt, params)
    assert not real_engine.scheduler.has_work


FAIL_MARK = "<<fail-here>>"  # the stop string that marks the request whose part of the step fails
ISOLATION_PROMPT = [{"role": "user", "content": "Write a haiku about the sea."}]


def _text(deltas) -> str:
    return "".join(d.text for d in deltas)


def _start_together(engine, *requests) -> list[Any]:
    """Submit requests so the engine thread schedules them in the same step: it cannot take its lock
    (and schedule) until all are queued."""
    with engine._cond:
        return [engine.generate(prompt, params) for prompt, params in requests]


def _read(stream) -> tuple[str, Exception | None]:
    text = ""
    try:
        for d in stream:
            text += d.text
    except EngineError as e:
        return text, e
    return text, None


@pytest.mark.real
@pytest.mark.parametrize("where", ["step inputs", "stop matcher", "sampling"])
def test_a_failure_inside_one_request_of_a_step_fails_only_that_request(real_engine, monkeypatch, where):
    from assistant.engine import local

    engine = real_engine
    healthy = SamplingParams(max_tokens=12)
    reference = _text(engine.generate(ISOLATION_PROMPT, healthy))
    seen_in_same_step: list[int] = []

    say = [{"role": "user", "content": "Say anything."}]
    if where == "step inputs":  # a token id outside the vocabulary slips past submit()'s checks
        doomed = SamplingParams(max_tokens=12)
        real_inputs = engine._inputs

        def spy(scheduled):
            if any(r is corrupted for r, _ in scheduled):
                seen_in_same_step.append(len(scheduled))
            return real_inputs(scheduled)

        monkeypatch.setattr(engine, "_inputs", spy)
        with engine._cond:
            corrupted = engine.submit(engine.encode(say), doomed)
            corrupted.prompt_ids[-1] = 10**9
            bad = engine._stream(corrupted)
            good = engine.generate(ISOLATION_PROMPT, healthy)
    elif where == "stop matcher":
        class FailingStops(local.StopMatcher):
            def push(self, new_text: str) -> str:
                if FAIL_MARK in self.stop and self.text:  # its second token
                    seen_in_same_step.append(len(engine.scheduler.running))
                    raise RuntimeError("stop matcher broke")
                return super().push(new_text)

        monkeypatch.setattr(local, "StopMatcher", FailingStops)
        doomed = SamplingParams(max_tokens=12, stop=(FAIL_MARK,))
    else:
        real_sample = local.sample

        def failing_sample(logits, params, generator=None):
            if params.seed == 666:
                seen_in_same_step.append(len(engine.scheduler.running))
                raise RuntimeError("sampling broke")
            return real_sample(logits, params, generator)

        monkeypatch.setattr(local, "sample", failing_sample)
        doomed = SamplingParams(max_tokens=12, temperature=0.7, seed=666)

    if where != "step inputs":
        bad, good = _start_together(engine, (say, doomed), (ISOLATION_PROMPT, healthy))
    bad_text, bad_error = _read(bad)
    good_text, good_error = _read(good)
    assert seen_in_same_step and seen_in_same_step[0] == 2  # both requests were in the failing step
    assert isinstance(bad_error, EngineError)
    assert ("invalid token ids" if where == "step inputs" else "broke") in str(bad_error)
    assert good_error is None and good_text == reference
    monkeypatch.undo()
    assert _text(engine.generate(ISOLATION_PROMPT, healthy)) == reference  # the engine still serves
    assert engine._thread.is_alive() and not engine.scheduler.has_work


@pytest.mark.real
def test_a_failing_batched_forward_fails_its_step_but_not_the_engine(real_engine, monkeypatch):
    engine = real_engine
    params = SamplingParams(max_tokens=8)
    reference = _text(engine.generate(ISOLATION_PROMPT, params))
    real_forward = engine.model.forward
    calls = []

    def forward_fails_once(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("forward broke")
        return real_forward(*args, **kw)

    monkeypatch.setattr(engine.model, "forward", forward_fails_once)
    first, second = _start_together(engine, (ISOLATION_PROMPT, params), (ISOLATION_PROMPT, params))
    for stream in (first, second):
        _, error = _read(stream)
        assert isinstance(error, EngineError) and "forward broke" in str(error)
    assert engine._thread.is_alive()
    assert _text(engine.generate(ISOLATION_PROMPT, params)) == reference
    assert not engine.scheduler.has_work
