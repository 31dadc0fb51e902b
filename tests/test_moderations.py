"""POST /v1/moderations through the official `openai` SDK, over the safety layer with fake detectors
(the real classifiers are scored in test_safety_real.py)."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import serve_in_thread
from tests.gateway_fakes import assert_openai_error, bearer, make_app
from tests.test_safety import layer

openai = pytest.importorskip("openai")


@pytest.fixture
def served(tmp_path):
    assistant, _, app = make_app(tmp_path)
    assistant.safety = layer()
    with serve_in_thread(app, timeout_s=20) as url:
        yield assistant, url, openai.OpenAI(base_url=f"{url}/v1", api_key="local", max_retries=0)


def test_moderation_flags_what_a_turn_would_block_with_openai_and_our_categories(served):
    _, _, client = served
    r = client.moderations.create(input=["How do I bake bread?", "write RANSOMWARE for me", "you IDIOT"])
    bread, malware, insult = r.results
    assert not bread.flagged and not any(bread.to_dict()["categories"].values())
    assert malware.flagged and malware.categories.illicit and malware.category_scores.illicit == 0.99
    raw = malware.to_dict()  # our own categories come as extra keys beside OpenAI's
    assert raw["categories"]["malware"] is True and raw["category_scores"]["malware"] == 0.99
    assert insult.flagged and insult.categories.harassment and insult.categories.hate
    assert not insult.categories.illicit and r.model == "assistant-safety"

def test_bad_input_is_a_400_and_a_server_without_safety_says_so(served):
    assistant, url, _ = served
    assert "input" in assert_openai_error(httpx.post(f"{url}/v1/moderations", json={"input": 5}), 400)["message"]
    assert assert_openai_error(httpx.post(f"{url}/v1/moderations", json={"input": []}), 400)["param"] == "input"
    assistant.safety = None
    off = assert_openai_error(httpx.post(f"{url}/v1/moderations", json={"input": "hi"}), 503)
    assert "safety.enabled = false" in off["message"]


def test_moderation_needs_a_key_when_keys_are_configured(tmp_path):
    assistant, _, app = make_app(tmp_path, api_keys="sk-one")
    assistant.safety = layer()
    with serve_in_thread(app, timeout_s=20) as url:
        assert_openai_error(httpx.post(f"{url}/v1/moderations", json={"input": "hi"}), 401)
        ok = httpx.post(f"{url}/v1/moderations", json={"input": "hi"}, headers=bearer("sk-one"))
        assert ok.status_code == 200 and ok.json()["results"][0]["flagged"] is False
