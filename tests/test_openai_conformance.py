"""The /v1 API as the official `openai` SDK sees it.

Scripted engine (fast): tool calls in OpenAI's shape (auto, required, a named function, none),
streamed and not; tool results fed back; JSON mode; stream usage; embeddings (hash embedder); every
error status of the issue's list, as the SDK's typed exceptions, each in OpenAI's error shape.
Real packaged model (`real`): a streamed chat, the model list, a forced and an auto tool call parsed
as `tool_calls`, a tool result fed back, embeddings with the packaged MiniLM, and usage.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest

from tests.conftest import serve_in_thread
from tests.gateway_fakes import USER, assert_openai_error, make_app

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now.",
                                          "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
def served(tmp_path):
    assistant, engine, app = make_app(tmp_path)
    with serve_in_thread(app, timeout_s=20) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="not-needed-on-loopback", max_retries=0)
        yield assistant, engine, client, url


def test_auto_tool_call_comes_back_as_tool_calls(served):
    _, engine, client, _ = served
    engine.add("Let me check.\n" + CALL)
    r = client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=[USER], tools=[WEATHER, CLOCK])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert engine.tools_seen[-1] == [WEATHER, CLOCK]


def test_streamed_tool_call_deltas(served):
    _, engine, client, _ = served
    engine.add(["Checking", " now. ", "<tool", "_call>\n{\"name\": \"get_weather\", ", "\"arguments\": {\"city\": \"Oslo\"}}",
                "\n</tool_call>"])
    text, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=[USER], tools=[WEATHER],
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    assert text.strip() == "Checking now." and "<tool" not in text  # call text never shown as content
    assert finish == "tool_calls" and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo"}
    assert usage.completion_tokens == 6 and usage.total_tokens == usage.prompt_tokens + 6


def test_a_named_tool_choice_forces_that_call(served):
    _, engine, client, _ = served
    engine.add('{"city": "Rome"}}\n</tool_call>')  # the model continues the prefilled call
    r = client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=[USER], tools=[CLOCK, WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    prefix = engine.prompts[-1][-1]
    assert prefix["role"] == "assistant" and prefix["content"].endswith('"name": "get_weather", "arguments": ')
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Rome"}


def test_required_tool_choice_lets_the_model_pick_the_tool(served):
    _, engine, client, _ = served
    engine.add(['get_time", ', '"arguments": {}}\n</tool_call>'])
    stream = client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=[USER], tools=[CLOCK, WEATHER],
                                            tool_choice="required", stream=True)
    chunks = list(stream)
    assert engine.prompts[-1][-1]["content"].endswith('{"name": "')
    calls = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["get_time"] and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_hides_the_tools(served):
    _, engine, client, _ = served
    engine.add("No tools today.")
    r = client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=[USER], tools=[WEATHER], tool_choice="none")
    assert engine.tools_seen[-1] is None and r.choices[0].message.content == "No tools today."
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls


def test_a_tool_result_is_fed_back(served):
    _, engine, client, _ = served
    engine.add("It is 21 °C in Paris.")
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 °C, sunny"}]
    r = client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=messages, tools=[WEATHER])
    assert r.choices[0].message.content == "It is 21 °C in Paris."
    sent = engine.prompts[-1]
    assert sent[2] == {"role": "tool", "tool_call_id": "call_1", "content": "21 °C, sunny"}
    assert sent[1]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_json_mode_prefills_an_object(served):
    _, engine, client, _ = served
    engine.add('"answer": 42}')
    r = client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=[USER], response_format={"type": "json_object"})
    assert json.loads(r.choices[0].message.content) == {"answer": 42}
    assert engine.prompts[-1][-1]["content"] == "{"


def test_stop_max_completion_tokens_and_seed_reach_the_engine(served):
    _, engine, client, _ = served
    engine.add(["one ", "two ", "three ", "four "])
    r = client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=[USER], max_completion_tokens=2, seed=7,
                                       stop=["four"])
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content == "one two "
    assert r.usage.completion_tokens == 2 and r.usage.prompt_tokens_details.cached_tokens == 0


def test_logprobs_in_openais_shape_streamed_and_not(served):
    _, engine, client, url = served
    engine.add(["Par", "is"], ["Par", "is"], "plain")
    r = client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=[USER], logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == ["Par", "is"] and content[0].bytes == list(b"Par")
    assert content[0].logprob == pytest.approx(math.log(0.5))
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("Par", pytest.approx(math.log(0.5))),
                                                                        ("?", pytest.approx(math.log(0.25)))]
    streamed = [c.choices[0].logprobs for c in client.chat.completions.create(
        model="qwen2.5-coder-0.5b", messages=[USER], logprobs=True, stream=True) if c.choices]
    assert [t.token for lp in streamed if lp for t in lp.content] == ["Par", "is"]
    assert all(t.top_logprobs == [] for lp in streamed if lp for t in lp.content)  # top_logprobs left out: none
    assert client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=[USER]).choices[0].logprobs is None
    post = lambda body: httpx.post(f"{url}/v1/chat/completions", json={"messages": [USER], **body})  # noqa: E731
    for body in ({"model": "assistant", "logprobs": True}, {"logprobs": True, "tools": [WEATHER]},
                 {"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}):
        assert assert_openai_error(post(body), 400)["param"] in ("logprobs", "top_logprobs"), body
    assert len(engine.prompts) == 3


def test_penalties_and_logit_bias_reach_the_engine(served):
    _, engine, client, url = served
    engine.add("ok")
    client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=[USER], presence_penalty=0.5,
                                   frequency_penalty=-1, logit_bias={"42": -100, "7": 2.5})
    params = engine.params[-1]
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1.0)
    assert params.logit_bias == ((42, -100.0), (7, 2.5))
    post = lambda body: httpx.post(f"{url}/v1/chat/completions", json={"messages": [USER], **body})  # noqa: E731
    for body in ({"presence_penalty": 2.5}, {"logit_bias": {"x": 1}}, {"logit_bias": {"5": 101}}):
        assert assert_openai_error(post(body), 400)["param"] in ("presence_penalty", "logit_bias"), body
    assert len(engine.prompts) == 1


class CharTokenizer:
    """What /v1/completions needs of a tokenizer: one id per character, and the three FIM tokens."""

    unk_token_id = 0
    FIM = {"<|fim_prefix|>": 1, "<|fim_suffix|>": 2, "<|fim_middle|>": 3}

    def __init__(self, fim=True):
        self.fim = fim

    def __call__(self, text, add_special_tokens=True):
        ids = []
        while text:
            special = next((t for t in self.FIM if text.startswith(t) and self.fim), None)
            ids.append(self.FIM[special] if special else ord(text[0]))
            text = text[len(special):] if special else text[1:]
        return {"input_ids": ids}

    def convert_tokens_to_ids(self, token):
        return self.FIM.get(token, 0) if self.fim else 0

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_text_completions_plain_fill_in_the_middle_echo_and_streamed(served):
    _, engine, client, url = served
    engine.tokenizer = CharTokenizer()
    engine.add(["lo", " world"], ["a + b\n", "\nprint(add(1, 2))", "\nmore"], ["lo"], ["lo", " world"])
    r = client.completions.create(model="qwen2.5-coder-0.5b", prompt="Hel")
    assert r.object == "text_completion" and r.choices[0].text == "lo world" and r.choices[0].finish_reason == "stop"
    assert engine.prompts[-1] == [ord(c) for c in "Hel"] and engine.params[-1].max_tokens == 16  # OpenAI's default
    assert r.usage.completion_tokens == 2 and r.choices[0].logprobs is None
    suffix = "\n\nprint(add(1, 2))\n"
    r = client.completions.create(model="qwen2.5-coder-0.5b", prompt="def add(a, b):\n    return ", suffix=suffix)
    assert r.choices[0].text == "a + b\n\n"  # the model wrote the suffix again: cut at its first line
    assert engine.prompts[-1] == [1, *map(ord, "def add(a, b):\n    return "), 2, *map(ord, suffix), 3]
    r = client.completions.create(model="qwen2.5-coder-0.5b", prompt="Hel", echo=True, max_tokens=3)
    assert r.choices[0].text == "Hello" and engine.params[-1].max_tokens == 3
    chunks = list(client.completions.create(model="qwen2.5-coder-0.5b", prompt="Hel", logprobs=1, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "lo world"
    scored = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for lp in scored for t in lp.tokens] == ["lo", " world"]
    assert [o for lp in scored for o in lp.text_offset] == [0, 2]
    assert scored[0].top_logprobs == [{"lo": pytest.approx(math.log(0.5))}]
    assert chunks[-1].usage.completion_tokens == 2
    post = lambda body: httpx.post(f"{url}/v1/completions", json=body)  # noqa: E731
    for body, param in (({"prompt": "x", "model": "assistant"}, "model"), ({"prompt": "x", "max_tokens": 0}, None),
                        ({"prompt": "x", "logprobs": 6}, "logprobs"), ({"prompt": ["a", "b"]}, "prompt"),
                        ({"prompt": [5, 6], "suffix": "y"}, "suffix"), ({"prompt": [5, -1], "echo": True}, "prompt"), ({"prompt": "x", "model": "gpt-3.5-turbo-instruct"},
                                                                        "model")):
        assert assert_openai_error(post(body), 404 if body.get("model", "").startswith("gpt") else 400)["param"] == param
    engine.tokenizer = CharTokenizer(fim=False)
    assert "fill-in-the-middle" in assert_openai_error(post({"prompt": "x", "suffix": "y"}), 400)["message"]
    del engine.tokenizer  # a remote engine has none
    assert "/v1/chat/completions" in assert_openai_error(post({"prompt": "x"}), 400)["message"]
    assert len(engine.prompts) == 4


def test_models_list_the_chat_models_the_assistant_and_the_embedder(served):
    _, _, client, _ = served
    ids = [m.id for m in client.models.list()]
    assert ids == ["qwen2.5-coder-0.5b", "assistant", "hash-64"]
    assert client.models.retrieve("hash-64").id == "hash-64"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_embeddings_float_and_base64(served):
    _, _, client, url = served
    r = client.embeddings.create(model="hash-64", input=["the cat sat", "a dog ran"])  # the SDK asks for base64
    assert len(r.data) == 2 and len(r.data[0].embedding) == 64 and r.usage.prompt_tokens == 6
    assert abs(sum(x * x for x in r.data[0].embedding) - 1.0) < 1e-4
    plain = httpx.post(f"{url}/v1/embeddings", json={"model": "hash-64", "input": "the cat sat",
                                                      "encoding_format": "float"}).json()
    assert plain["data"][0]["embedding"] == pytest.approx(r.data[0].embedding, abs=1e-6)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="x")
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="hash-64", input=[])


# -- every error of the list, with its status and OpenAI's shape ---------------------------

def test_each_client_mistake_has_its_status(served, tmp_path):
    assistant, engine, client, url = served
    post = lambda body, **kw: httpx.post(f"{url}/v1/chat/completions", **body, **kw)  # noqa: E731
    assert_openai_error(post({"content": b'{"messages": ['}), 400)  # invalid JSON
    assert_openai_error(post({"json": {"messages": [USER], "temperature": "hot"}}), 400)  # wrong type
    assert_openai_error(post({"json": {"messages": [{"role": "wizard", "content": "hi"}]}}), 400)  # bad shape
    assert_openai_error(post({"json": {"messages": [USER], "tools": [WEATHER], "tool_choice":
                                       {"type": "function", "function": {"name": "nope"}}}}), 400)
    assert_openai_error(post({"json": {"messages": [USER], "model": "gpt-4"}}), 404, code="model_not_found")
    assert_openai_error(post({"content": json.dumps({"messages": [USER], "pad": "x" * (5 << 20)}).encode()}), 413)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[USER])
    _, key = assistant.keys.create("k", "free")
    assert_openai_error(post({"json": {"messages": [USER]}}), 401, code="invalid_api_key")  # missing key
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=[USER])  # a wrong key
    assert engine.prompts == []


def test_rate_limit_is_the_sdks_rate_limit_error(tmp_path):
    assistant, _, app = make_app(tmp_path, "a", "b", tiers={"free": {"rpm": 1}})
    _, key = assistant.keys.create("k", "free")
    with serve_in_thread(app, timeout_s=20) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        raw = client.chat.completions.with_raw_response.create(model="qwen2.5-coder-0.5b", messages=[USER])
        assert raw.headers["x-ratelimit-remaining-requests"] == "0" and raw.headers["x-request-id"]
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=[USER])
    assert int(caught.value.response.headers["retry-after"]) >= 1
    assert caught.value.body["code"] == "rate_limit_exceeded"


# -- the real packaged model ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_client(models_dir, tmp_path_factory):
    from assistant.app import build_assistant
    from assistant.config import AssistantConfig
    from assistant.server.app import create_app
    from tests.conftest import need

    try:
        import ingest.embed  # noqa: F401
        embedder_ok = True
    except ImportError:
        embedder_ok = False
    need(embedder_ok, "the ingest extra (packaged embedder)", "pip install -e '.[ingest]' (make does it)")
    data = tmp_path_factory.mktemp("real")
    config = AssistantConfig.load(env={}, overrides={"data_dir": str(data), "models_dir": str(models_dir),
                                                     "engine.kv_cache_mb": 64})
    assistant = build_assistant(config, tools=[])
    try:
        with serve_in_thread(create_app(assistant, web_chat=False), timeout_s=60) as url:
            yield assistant, openai.OpenAI(base_url=f"{url}/v1", api_key="local", max_retries=0, timeout=300)
    finally:
        assistant.close()


@pytest.mark.real
def test_the_sdk_against_the_real_model(real_client):
    assistant, client = real_client
    model = "qwen2.5-coder-0.5b"
    assert {"qwen2.5-coder-0.5b", "assistant", "all-minilm-l6-v2"} <= {m.id for m in client.models.list()}

    text, usage = "", None
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                                max_tokens=12, stream=True, stream_options={"include_usage": True}):
        text += "".join(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage or usage
    assert text.strip() and usage.completion_tokens >= 1 and usage.prompt_tokens > 5

    scored = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                            max_tokens=6, logprobs=True, top_logprobs=3)
    tokens = scored.choices[0].logprobs.content
    ended = scored.choices[0].finish_reason == "stop"  # the end-of-sequence token has no logprob
    assert len(tokens) == scored.usage.completion_tokens - ended and tokens[0].token.strip()
    assert "".join(t.token for t in tokens) == scored.choices[0].message.content
    for t in tokens:  # greedy: every token is its place's most likely one
        assert t.logprob <= 0 and len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)

    # a text completion, filled in between a prefix and a suffix with the coder model's FIM tokens
    middle = client.completions.create(model=model, prompt="def add(a, b):\n    return ", max_tokens=8,
                                       suffix="\n\n\nprint(add(2, 3))\n", logprobs=2)
    assert "a + b" in middle.choices[0].text.replace("a+b", "a + b"), middle.choices[0].text
    assert "".join(middle.choices[0].logprobs.tokens) == middle.choices[0].text
    # the prompt scored, nothing written (what evaluation harnesses ask): Paris is likelier than Berlin
    likely = {}
    for city in ("Paris", "Berlin"):
        text = f"The capital of France is {city}."
        scored = client.completions.create(model=model, prompt=text, echo=True, logprobs=1, max_tokens=0)
        lp = scored.choices[0].logprobs
        assert scored.choices[0].text == text and "".join(lp.tokens) == text and scored.usage.completion_tokens == 0
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[:2] == [0, len(lp.tokens[0])]
        assert len(lp.tokens) == scored.usage.prompt_tokens and all(v <= 0 for v in lp.token_logprobs[1:])
        likely[city] = sum(lp.token_logprobs[1:])
    assert likely["Paris"] > likely["Berlin"] + 2, likely

    ask = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    forced = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER], max_tokens=40,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = forced.choices[0].message.tool_calls[0]
    assert forced.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert "paris" in json.loads(call.function.arguments).get("city", "").lower()

    auto = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER], max_tokens=40)
    assert auto.choices[0].finish_reason == "tool_calls", auto.choices[0].message
    assert auto.choices[0].message.tool_calls[0].function.name == "get_weather"

    back = ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "sunny"}'}]
    # "none": answer from the result (the 0.5B model otherwise tends to call the tool once more)
    answer = client.chat.completions.create(model=model, messages=back, tools=[WEATHER], tool_choice="none",
                                            max_tokens=30)
    assert "21" in (answer.choices[0].message.content or ""), answer.choices[0].message

    emb = client.embeddings.create(model="all-minilm-l6-v2", input=["The cat sat on the mat.", "A feline rested."])
    assert len(emb.data[0].embedding) == 384 and emb.usage.prompt_tokens > 5
    rows = assistant.usage.rows()
    assert [(r.model, r.status) for r in rows][1:7] == [(model, "length"), (model, middle.choices[0].finish_reason
                                                        .replace("stop", "ok"))] + [(model, "length")] * 2 + [
        (model, "tool_calls")] * 2
    assert rows[-1].model == "all-minilm-l6-v2" and rows[-1].prompt_tokens == emb.usage.prompt_tokens
    assert len(rows) == 9 and sum(r.completion_tokens for r in rows) > 10


def test_template_messages_turn_string_arguments_into_objects_and_mark_a_prefix():
    from assistant.engine.loading import template_messages

    sent = [USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "content": "2"}, {"role": "assistant", "content": "{", "prefix": True}]
    messages, prefixed = template_messages(sent)
    assert prefixed and "prefix" not in messages[-1]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # the caller's copy is untouched
    assert template_messages([USER]) == ([USER], False)
