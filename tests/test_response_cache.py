"""The semantic response cache (assistant/server/response_cache.py): what hits, what never does, expiry,
and the /v1 path that serves from it (scripted engine, the deterministic hash embedder)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from assistant.engine.base import SamplingParams, TokenDelta
from assistant.server.response_cache import ResponseCache, content_words, recording, same_terms
from ingest.embed import HashEmbedder
from tests.gateway_fakes import bearer, make_app

CHAT = "/v1/chat/completions"


bag_of_words = HashEmbedder(256).embed  # the project's deterministic fake: hashed lower-case words


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def ask(text, system="Be brief."):
    return [{"role": "system", "content": system}, {"role": "user", "content": text}]


ANSWER = {"text": "Paris.", "token_ids": [1, 2], "finish_reason": "stop", "num_prompt_tokens": 9, "num_generated_tokens": 2}


def stored(cache, scope, messages, params=SamplingParams(max_tokens=16)):
    exact, text = cache.key(scope, "m", messages, params)
    _, vector = cache.get(exact, text)
    cache.put(exact, text, vector, ANSWER)


def lookup(cache, scope, messages, params=SamplingParams(max_tokens=16)):
    return cache.get(*cache.key(scope, "m", messages, params))[0]


def test_the_word_guard_keeps_rewording_and_stops_changed_content():
    assert content_words("Can you tell me what the capitals of France are?") == ("capital", "france")
    assert same_terms("what's the capital of france", "What is the capital of France?")
    assert same_terms("Please, how do I reverse a list in Python?", "How do I reverse a Python list?")
    assert not same_terms("What is the capital of Germany?", "What is the capital of France?")
    assert not same_terms("Convert 5 km to miles", "Convert 50 km to miles")
    assert not same_terms("advantages of Rust", "disadvantages of Rust")
    assert not same_terms("Convert 100 Fahrenheit to Celsius", "Convert 100 Celsius to Fahrenheit")
    assert same_terms("Is Python's GIL gone?", "is the GIL of python gone")


def test_a_paraphrase_hits_and_near_misses_do_not():
    cache = ResponseCache(embed=bag_of_words, threshold=0.6, clock=Clock())
    stored(cache, "k1", ask("What is the capital of France?"))
    assert lookup(cache, "k1", ask("what is the capital of france")) == ANSWER
    assert lookup(cache, "k1", ask("What is the capital of Germany?")) is None  # close vector, other name
    assert lookup(cache, "k1", ask("Explain how a hash map works.")) is None  # far vector
    assert cache.stats.hits == 1 and cache.stats.lookups == 4


def test_the_exact_part_of_the_key_must_match():
    cache = ResponseCache(embed=bag_of_words, threshold=0.6, clock=Clock())
    stored(cache, "k1", ask("What is the capital of France?"))
    assert lookup(cache, "k2", ask("What is the capital of France?")) is None  # another key
    assert lookup(cache, "k1", ask("What is the capital of France?", system="Be verbose.")) is None
    assert lookup(cache, "k1", ask("What is the capital of France?"), SamplingParams(max_tokens=17)) is None
    assert lookup(cache, "k1", ask("What is the capital of France?")) == ANSWER


def test_entries_expire_and_the_oldest_go_first():
    clock = Clock()
    cache = ResponseCache(embed=bag_of_words, threshold=0.999, ttl_s=60, max_entries=2, clock=clock)
    stored(cache, "k", ask("What is the capital of France?"))
    clock.now = 59
    assert lookup(cache, "k", ask("What is the capital of France?")) == ANSWER
    clock.now = 61
    assert lookup(cache, "k", ask("What is the capital of France?")) is None and cache.stats.expired == 1
    for q in ("Name a prime.", "Name a colour.", "Name a fruit."):
        stored(cache, "k", ask(q))
    assert len(cache) == 2 and cache.stats.evicted == 1
    assert lookup(cache, "k", ask("Name a prime.")) is None and lookup(cache, "k", ask("Name a fruit.")) == ANSWER


def test_only_finished_answers_are_recorded():
    got = []
    deltas = [TokenDelta("Par", (1,)), TokenDelta("is.", (2,), "stop", 9, 2)]
    assert [d.text for d in recording(iter(deltas), got.append)] == ["Par", "is."]
    assert got == [ANSWER]
    got.clear()
    list(recording(iter([TokenDelta("Par", (1,)), TokenDelta("", (), "cancelled", 9, 1)]), got.append))
    assert got == []
    assert not ResponseCache.eligible(SamplingParams(temperature=0.7), None, False)
    assert not ResponseCache.eligible(SamplingParams(), [{"type": "function"}], False)
    assert not ResponseCache.eligible(SamplingParams(), None, True)
    assert ResponseCache.eligible(SamplingParams(), None, False)


def test_the_api_answers_a_repeated_request_from_the_cache_per_key_and_tier(tmp_path):
    tiers = {"free": {}, "paid": {"response_cache": True}}
    assistant, engine, app = make_app(tmp_path, "Paris.", "Paris!", "Berlin.", "Paris?", tiers=tiers,
                                      settings={"engine.response_cache": True, "engine.response_cache_threshold": 0.5})
    _, paid = assistant.keys.create("p", "paid")
    _, other = assistant.keys.create("o", "paid")
    _, free = assistant.keys.create("f", "free")
    client = TestClient(app)

    def content(question, key, **extra):
        r = client.post(CHAT, json={"messages": [{"role": "user", "content": question}], **extra}, headers=bearer(key))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"], r.json()["usage"]

    first, _ = content("What is the capital of France?", paid)
    again, usage = content("What is the capital of France?", paid)
    assert first == again == "Paris." and len(engine.prompts) == 1  # the engine was not asked again
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
    assert content("What is the capital of France?", other)[0] == "Paris!"  # another key: its own answers
    assert content("What is the capital of Germany?", paid)[0] == "Berlin."  # a near miss goes to the engine
    assert content("What is the capital of France?", free)[0] == "Paris?"  # a tier without the cache
    assert len(engine.prompts) == 4
    engine.add('"city": "Paris"}')
    json_mode = content("What is the capital of France?", paid, response_format={"type": "json_object"})[0]
    assert json_mode == '{"city": "Paris"}' and len(engine.prompts) == 5  # JSON mode is not the plain answer
    stream = client.post(CHAT, json={"messages": [{"role": "user", "content": "What is the capital of France?"}],
                                     "stream": True}, headers=bearer(paid))
    assert stream.status_code == 200 and "Paris." in stream.text and len(engine.prompts) == 5
    metrics = client.get("/metrics").text
    assert 'assistant_response_cache_total{result="hit"} 2.0' in metrics
    assert 'assistant_response_cache_total{result="miss"} 4.0' in metrics
