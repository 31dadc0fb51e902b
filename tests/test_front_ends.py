"""One question through every front end — the terminal CLI, the web chat's API (gradio_client), the
turn endpoint (SSE) and the /v1 route with the `assistant` model — against one Assistant built by
the composition root: each path stores the same turn (question, answer, sources on page 3)."""

from __future__ import annotations

import io
import json
import threading
import time

import httpx
import pytest

from assistant.errors import AssistantError
from tests.agent_fakes import MANUAL, FakeRetriever, make_assistant
from tests.conftest import require_module, serve_in_thread

QUESTION = "What is the warranty period of the Zephyr X2?"
ANSWER = "The warranty period is 7 years [1]."



@pytest.fixture
def served(tmp_path):
    require_module("gradio")
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


# -- the web chat's turns search only the logged-in key's documents -----------------------------------


@pytest.fixture
def keyed(tmp_path):
    """The real app with the web chat mounted (keys configured: a login), a scripted engine, a SQLite
    store and the real document pipeline (hash embedder); alice and bob each uploaded one document."""
    require_module("gradio")
    from fastapi.testclient import TestClient

    from assistant.app import build_assistant
    from assistant.config import AssistantConfig
    from assistant.server.app import create_app
    from assistant.store import Store
    from tests.test_rest_api import GARDEN, SECRET, ReadingEngine, stream

    engine = ReadingEngine()
    config = AssistantConfig.load(env={}, overrides={"data_dir": str(tmp_path), "retrieval.embedder": "hash-64",
                                                     "safety.enabled": False})
    # a SQLite file, as the product uses: the in-memory store is one connection shared by every thread,
    # where a gradio worker's write could be rolled back by another thread returning that connection
    assistant = build_assistant(config, engine=engine, store=Store(f"sqlite:///{tmp_path / 'assistant.db'}"), tools=[])
    app = create_app(assistant)
    keys = {name: assistant.keys.create(name, "paid") for name in ("alice", "bob")}
    rest = TestClient(app)
    for name, upload in (("alice", SECRET), ("bob", GARDEN)):
        stream(rest, "/api/documents", files=[("file", upload)], headers={"Authorization": f"Bearer {keys[name][1]}"})
    yield assistant, engine, app, keys
    assistant.close()


def test_the_web_chats_turns_search_only_the_logged_in_keys_documents(keyed, tmp_path):
    from gradio_client import Client

    import uvicorn

    from tests.conftest import free_port

    assistant, engine, app, keys = keyed
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.05)
    try:
        base = f"http://127.0.0.1:{server.config.port}"
        clients = [Client(base + "/", verbose=False, headers={"Authorization": f"Bearer {keys[name][1]}"})
                   for name in ("alice", "bob")]
        _check_web_chat_turns(assistant, engine, keys, *clients, tmp_path)
    finally:
        server.should_exit = server.force_exit = True  # (the clients' event streams would hold it 10 s)
        thread.join(timeout=10)


def _check_web_chat_turns(assistant, engine, keys, as_alice, as_bob, tmp_path):
    from gradio_client import handle_file

    from tests.test_rest_api import retrieved

    bob = keys["bob"][0]
    shown = as_bob.predict("What is the vault code in my document?", api_name="/ask")
    assert "4471" not in retrieved(engine.prompts[-1]) and "alice_plans" not in shown
    assert "The garden gate is green." in retrieved(engine.prompts[-1])  # his own document is searched
    as_bob.predict(api_name="/regenerate")
    assert "4471" not in retrieved(engine.prompts[-1])
    # a file attached to a message belongs to bob and (the default) to this conversation only
    trip = tmp_path / "bob_trip.txt"
    trip.write_text("The hotel of the trip is called Seagull Inn.\n")
    as_bob.predict(api_name="/new_chat")
    as_bob.predict({"text": "What is the hotel of the trip called, in my document?", "files": [handle_file(str(trip))]},
                   [], api_name="/chat")
    assert "Seagull" in retrieved(engine.prompts[-1])
    (doc_id,) = [d["doc_id"] for d in assistant.documents.list() if d["file_name"] == "bob_trip.txt"]
    cid = assistant.owners.links()[doc_id]
    assert assistant.owners.owner("document", doc_id) == bob.id and assistant.owners.documents_of(cid) == [doc_id]
    assert assistant.owners.owner("conversation", cid) == bob.id
    assert [m.content for m in assistant.conversations.history(cid)][0].startswith("What is the hotel")
    as_bob.predict(api_name="/new_chat")
    as_bob.predict("What is the hotel of the trip called, in my document?", api_name="/ask")  # another conversation
    assert "Seagull" not in retrieved(engine.prompts[-1])
    as_alice.predict("What is the hotel of the trip called, in my document?", api_name="/ask")
    assert "Seagull" not in retrieved(engine.prompts[-1]) and "4471" in retrieved(engine.prompts[-1])
    with pytest.raises(Exception, match="No conversation"):
        as_alice.predict(cid, api_name="/resume")


def test_the_web_chat_lists_removes_and_deletes_documents_by_the_rest_apis_rule(keyed, tmp_path):
    from assistant.seams import Attachment
    from ui.gradio_app import LIBRARY, WebChat

    assistant, engine, _, keys = keyed
    (alice, _), (bob, _) = keys["alice"], keys["bob"]
    web = WebChat(assistant)
    cid = web.start("Trip", bob.id)
    events = list(web.attach((Attachment("bob_trip.txt", b"The hotel is called Seagull Inn.\n"),), bob.id, cid))
    assert events[-1].ok and "this conversation" in events[-1].summary
    list(web.attach((Attachment("bob_shelf.txt", b"Shelf notes.\n"),), bob.id, cid, LIBRARY))
    library, own = web.documents(bob.id, cid)
    assert sorted(d["file_name"] for d in library) == ["bob_notes.txt", "bob_shelf.txt"]
    assert [d["file_name"] for d in own] == ["bob_trip.txt"] and all(d["removable"] for d in [*library, *own])
    assert [d["file_name"] for d in web.documents(bob.id, None)[1]] == []  # another conversation's view
    names = lambda key, c=None: sorted(d["file_name"] for part in web.documents(key, c) for d in part)  # noqa: E731
    assert names(alice.id, cid) == ["alice_plans.txt"] and names("") == []  # neither alice nor the local user
    scope = web.scope(bob.id, cid)
    assert {d["file_name"] for d in assistant.documents.list() if d["doc_id"] in scope} == \
        {"bob_notes.txt", "bob_shelf.txt", "bob_trip.txt"}
    alices = next(d["doc_id"] for d in assistant.documents.list() if d["file_name"] == "alice_plans.txt")
    with pytest.raises(AssistantError, match="No document"):
        web.remove_document(alices, bob.id)
    shelf = next(d["doc_id"] for d in library if d["file_name"] == "bob_shelf.txt")
    assert web.remove_document(shelf, bob.id) == "bob_shelf.txt"
    web.delete(cid, bob.id)  # the conversation takes its file with it
    assert sorted(d["file_name"] for d in assistant.documents.list()) == ["alice_plans.txt", "bob_notes.txt"]
    assert not (tmp_path / "uploads" / "documents" / bob.id / "conversations" / cid).exists()
    with pytest.raises(Exception):
        assistant.conversations.get(cid)


def test_files_attached_in_a_chat_are_in_its_sandbox_folder_and_data_files_only_there(keyed, tmp_path):
    """Every file attached in a chat is also at /data in its code sandbox (assistant/keys.py
    conversation_files, mounted by sandbox/executor.py); a data file that is not a document (JSON) goes
    only there; deleting the chat deletes that folder too."""
    from assistant.events import Notice
    from assistant.keys import conversation_files
    from assistant.seams import Attachment
    from ui.gradio_app import LIBRARY, WebChat

    assistant, _, app, keys = keyed
    bob, bob_key = keys["bob"]
    web = WebChat(assistant)
    cid = web.start("Numbers", bob.id)
    before = {d["file_name"] for d in assistant.documents.list()}
    events = list(web.attach((Attachment("readings.json", b"[1, 2]"),), bob.id, cid))
    assert isinstance(events[-1], Notice) and "readings.json" in events[-1].message and "/data/" in events[-1].message
    events = list(web.attach((Attachment("numbers.csv", b"n\n1\n2\n"), Attachment("more.json", b"[3]")), bob.id, cid,
                             LIBRARY))
    assert events[-1].ok and "more.json saved for the code interpreter at /data/" in events[-1].summary
    folder = conversation_files(tmp_path, cid)
    assert (folder / "numbers.csv").read_bytes() == b"n\n1\n2\n" and (folder / "readings.json").read_bytes() == b"[1, 2]"
    assert {d["file_name"] for d in assistant.documents.list()} - before == {"numbers.csv"}  # JSON is no document
    assert not list((tmp_path / "uploads" / "documents").rglob("*.json"))  # one copy, the sandbox's

    from fastapi.testclient import TestClient

    from tests.test_rest_api import stream
    rest, auth = TestClient(app), {"Authorization": f"Bearer {bob_key}"}
    stream(rest, "/api/documents", files=[("file", ("api.txt", b"From the API.\n"))], data={"conversation_id": cid},
           headers=auth)
    assert (folder / "api.txt").read_bytes() == b"From the API.\n"
    assert rest.delete(f"/api/conversations/{cid}", headers=auth).status_code == 200
    assert not folder.exists()


def test_the_terminal_chat_loads_the_large_model_in_the_background_only_for_a_person(tmp_path):
    """A person types while it loads; a pipe's answers must not depend on how far the load got."""
    import io

    from tests.agent_fakes import make_assistant
    from ui.terminal import run_repl

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assistant, _ = make_assistant(tmp_path, "Hi.", "Hi again.")
    calls = []
    assistant.models.preload_large = lambda done=None: calls.append(done) or True
    err = io.StringIO()
    assert run_repl(assistant.config, assistant=assistant, stdin=io.StringIO("hello\n"), stdout=io.StringIO(),
                    stderr=err) == 0
    assert calls == [] and "large model" not in err.getvalue()
    assert run_repl(assistant.config, assistant=assistant, stdin=Tty("hello\n"), stdout=io.StringIO(), stderr=err) == 0
    assert len(calls) == 1 and "(loading the large model in the background)" in err.getvalue()


_STOP_WHILE_LOADING = """
import sys, threading, time
import torch
from assistant.routing import LOADER_THREAD
from assistant.server.app import exit_if_loading

def load():  # the large model's background load: native calls that release and retake the GIL
    while True:
        torch.zeros(1 << 22).add_(1)

threading.Thread(target=load, name=LOADER_THREAD, daemon=True).start()
time.sleep(0.3)
try:
    if sys.argv[1] == "interrupt":
        raise KeyboardInterrupt
finally:
    if sys.argv[2] == "guarded":
        exit_if_loading()
"""


@pytest.mark.parametrize("how, status", [("stop", 0), ("interrupt", 130)])
def test_stopping_the_server_while_the_large_model_loads_exits_cleanly(tmp_path, how, status):
    """`assistant serve` stopped while the large model still loads: without `exit_if_loading` the interpreter's
    shutdown aborts the process (SIGABRT, "terminate called without an active exception"); with it the
    process ends with the status it was about to have."""
    import signal
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    script = tmp_path / "stop.py"
    script.write_text(_STOP_WHILE_LOADING)

    def run(guard: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script), how, guard], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=120)

    if sys.version_info < (3, 14):  # later Pythons park such threads instead of ending them
        unguarded = run("plain")
        assert unguarded.returncode == -signal.SIGABRT, unguarded.stderr[-400:]  # the failure the guard exists for
    guarded = run("guarded")
    assert guarded.returncode == status, guarded.stderr[-400:]
    assert "terminate called" not in guarded.stderr
