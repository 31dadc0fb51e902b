"""One question through every front end — the terminal CLI, the web chat's API (gradio_client), the
turn endpoint (SSE) and the /v1 route with the `assistant` model — against one Assistant built by
the composition root: each path stores the same turn (question, answer, sources on page 3)."""

from __future__ import annotations

import io
import json

import httpx
import pytest

from tests.agent_fakes import MANUAL, FakeRetriever, make_assistant
from tests.conftest import serve_in_thread

QUESTION = "What is the warranty period of the Zephyr X2?"
ANSWER = "The warranty period is 7 years [1]."



@pytest.fixture
def served(tmp_path):
    pytest.importorskip("gradio")
    from assistant.server.app import create_app

    assistant, engine = make_assistant(tmp_path, *[ANSWER] * 8, retriever=FakeRetriever(MANUAL))
    with serve_in_thread(create_app(assistant)) as base:
        yield assistant, engine, base


def _stored_turn(assistant, conversation_id):
    user, answer = assistant.conversations.history(conversation_id)[-2:]
    pages = sorted({s["page"] for s in answer.meta.get("sources", [])})
    return (user.role, user.content, answer.role, answer.content, answer.status, pages)


def _sse_events(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]


def test_every_front_end_stores_the_same_turn(served):
    assistant, engine, base = served
    expected = ("user", QUESTION, "assistant", ANSWER, "complete", [3])
    turns = {}

    # 1. the terminal chat (`assistant chat` in a pipe)
    from ui.terminal import run_repl

    out, err = io.StringIO(), io.StringIO()
    assert run_repl(assistant.config, assistant=assistant, stdin=io.StringIO(QUESTION + "\n"), stdout=out, stderr=err) == 0
    assert ANSWER in out.getvalue()
    turns["cli"] = assistant.conversations.list()[0].id

    # 2. the web chat's API
    from gradio_client import Client

    client = Client(base + "/", verbose=False)
    shown = client.predict(QUESTION, api_name="/ask")
    assert ANSWER in shown and "zephyr_manual.pdf, p. 3" in shown  # sources rendered under the answer
    turns["web"] = client.predict(api_name="/conversation")

    # 3. the turn endpoint, streaming TurnEvents
    with httpx.stream("POST", base + "/api/turns", json={"text": QUESTION}, timeout=30) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(response)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "turn_started" and kinds[-1] == "done" and "text_delta" in kinds
    sources = next(e for e in events if e["type"] == "sources")["sources"]
    assert [s["page"] for s in sources] == [3]
    turns["turn_api"] = events[-1]["conversation_id"]
    stored = httpx.get(f"{base}/api/conversations/{turns['turn_api']}", timeout=10).json()
    assert [m["content"] for m in stored["messages"]][-2:] == [QUESTION, ANSWER]

    # 4. the OpenAI-compatible route with the full assistant behind the model id `assistant`
    body = {"model": "assistant", "messages": [{"role": "user", "content": QUESTION}]}
    reply = httpx.post(base + "/v1/chat/completions", json=body, timeout=30).json()
    assert reply["choices"][0]["message"]["content"] == ANSWER
    assert [s["page"] for s in reply["sources"]] == [3]
    turns["v1"] = reply["conversation_id"]

    assert len(set(turns.values())) == 4  # four conversations ...
    for path, cid in turns.items():
        assert _stored_turn(assistant, cid) == expected, path  # ... holding the same stored turn
    # every path sent the model the same prompt (same passages, same question)
    assert all(p == engine.prompts[0] for p in engine.prompts[1:4])
