"""The web chat's history endpoints with a scripted engine, driven by a real gradio_client."""


import pytest

from tests.agent_fakes import MANUAL, FakeRetriever, make_assistant
from tests.conftest import free_port



@pytest.fixture
def served(tmp_path):
    pytest.importorskip("gradio")
    from gradio_client import Client

    from ui.gradio_app import build_app

    assistant, engine = make_assistant(tmp_path, "Paris.", "Rome.", "Roma!", "Seven years [1].",
                                       retriever=FakeRetriever({}))
    orch = assistant.orchestrator
    app = build_app(assistant)
    app.queue()
    port = free_port()
    app.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, ssr_mode=False)
    try:
        yield orch, engine, Client(f"http://127.0.0.1:{port}/", verbose=False)
    finally:
        app.close()


def test_conversation_resume_and_regenerate(served):
    orch, engine, client = served
    assert client.predict(api_name="/conversation") == ""
    assert "Paris" in client.predict("Capital of France?", api_name="/ask")
    cid = client.predict(api_name="/conversation")
    assert cid and orch.store.get_conversation(cid)
    assert "Rome" in client.predict("And of Italy?", api_name="/ask")
    history = client.predict(api_name="/regenerate")[0]
    assert "Roma!" in str(history[-1]["content"]) and len(history) == 4
    assert [m.content for m in orch.store.history(cid)][-1] == "Roma!"
    # a second client (a new browser session, or the same user after a restart) resumes by id
    from gradio_client import Client

    other = Client(client.src, verbose=False)
    history = other.predict(cid, api_name="/resume")
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    assert other.predict(api_name="/conversation") == cid
    handle = orch.tools.get("search_documents").handle
    handle._retriever = FakeRetriever(MANUAL)  # documents were ingested meanwhile
    handle.refresh()
    answer = other.predict("warranty period?", api_name="/ask")
    assert "Seven years [1]." in answer and "zephyr_manual.pdf, p. 3" in answer
    assert [m["content"] for m in engine.prompts[-1] if m["role"] == "user"] == [
        "Capital of France?", "And of Italy?", "warranty period?"]
