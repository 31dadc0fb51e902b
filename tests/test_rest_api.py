"""The stateful REST API (assistant/server/rest.py) over the real app with fakes at the engine seam, the
in-memory store and the real document pipeline (embedded index, hash embedder): conversations and
documents, their turns and uploads streamed as SSE, ownership by key, the error shape, the limits."""

from __future__ import annotations

import json
import re

import httpx
from fastapi.testclient import TestClient

from tests.conftest import serve_in_thread
from assistant.engine.base import TokenDelta
from assistant.engine.fake import ScriptedEngine
from tests.gateway_fakes import GatedEngine, assert_openai_error, bearer, make_app

NOTES = ("notes.txt", b"The warranty period is seven years.\n")


class CancellableEngine(GatedEngine):
    """A GatedEngine that stops, as a real engine does, once its request is cancelled."""

    def generate(self, prompt, params, *, tools=None, cancel=None):
        deltas = super().generate(prompt, params, tools=tools, cancel=cancel)
        try:
            for delta in deltas:
                if cancel is not None and cancel.is_set():
                    yield TokenDelta("", (), "cancelled", delta.num_prompt_tokens, delta.num_generated_tokens)
                    return
                yield delta
        finally:
            deltas.close()


def read_events(body: str) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event; every data names its own type."""
    out = []
    for block in filter(None, body.split("\n\n")):
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        data = json.loads(fields["data"])
        assert data["type"] == fields["event"], block
        out.append((fields["event"], data))
    return out


def stream(client: TestClient, path: str, **kwargs) -> list[tuple[str, dict]]:
    response = client.post(path, **kwargs)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return read_events(response.text)


def two_keys(tmp_path, *script, **server):
    assistant, engine, app = make_app(tmp_path, *script, **server)
    alice = bearer(assistant.keys.create("alice", "paid")[1])
    bob = bearer(assistant.keys.create("bob", "paid")[1])
    return assistant, TestClient(app), alice, bob


# -- conversations ------------------------------------------------------------------------------------


def test_conversations_are_created_listed_renamed_and_deleted(tmp_path):
    assistant, _, app = make_app(tmp_path)
    client = TestClient(app)
    created = client.post("/api/conversations", json={"title": "Trip"})
    assert created.status_code == 201
    cid = created.json()["id"]
    assert created.json()["title"] == "Trip" and created.json()["head_id"] is None
    untitled = client.post("/api/conversations").json()["id"]  # no body: an untitled one
    assert [c["id"] for c in client.get("/api/conversations").json()["data"]] == [untitled, cid]

    renamed = client.patch(f"/api/conversations/{cid}", json={"title": "  Trip to Rome "})
    assert renamed.status_code == 200 and renamed.json()["title"] == "Trip to Rome"
    assert assistant.conversations.get(cid).title == "Trip to Rome"
    assert client.get(f"/api/conversations/{cid}").json()["title"] == "Trip to Rome"

    assert client.delete(f"/api/conversations/{cid}").json() == {"id": cid, "deleted": True}
    assert_openai_error(client.get(f"/api/conversations/{cid}"), 404, code="not_found")
    assert_openai_error(client.delete(f"/api/conversations/{cid}"), 404, code="not_found")
    assert [c["id"] for c in client.get("/api/conversations").json()["data"]] == [untitled]


def test_a_conversation_turn_streams_the_same_events_as_api_turns(tmp_path):
    assistant, _, app = make_app(tmp_path, "Hello there.", "Hello there.")
    client = TestClient(app)
    cid = client.post("/api/conversations", json={"title": "t"}).json()["id"]
    events = stream(client, f"/api/conversations/{cid}/turns", json={"text": "Hi"})
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "turn_started" and kinds[-1] == "done" and "text_delta" in kinds
    assert "".join(d["text"] for k, d in events if k == "text_delta") == "Hello there."
    assert events[0][1]["conversation_id"] == cid and events[-1][1]["finish_reason"] == "stop"
    stored = client.get(f"/api/conversations/{cid}").json()["messages"]
    assert [(m["role"], m["content"]) for m in stored] == [("user", "Hi"), ("assistant", "Hello there.")]
    # the same stream as the stateless-id endpoint's, event for event
    assert [kind for kind, _ in stream(client, "/api/turns", json={"text": "Hi"})] == kinds


def test_regenerate_answers_the_latest_question_again_on_a_new_branch(tmp_path):
    assistant, _, app = make_app(tmp_path, "First.", "Second.")
    client = TestClient(app)
    cid = client.post("/api/conversations").json()["id"]
    stream(client, f"/api/conversations/{cid}/turns", json={"text": "Q"})
    question, answer = [m["id"] for m in client.get(f"/api/conversations/{cid}").json()["messages"]]
    events = stream(client, f"/api/conversations/{cid}/messages/{answer}/regenerate")
    assert events[-1][1]["text"] == "Second."
    assert [m.content for m in assistant.conversations.history(cid)] == ["Q", "Second."]
    assert [m.content for m in assistant.conversations.siblings(answer)] == ["First.", "Second."]
    error = assert_openai_error(client.post(f"/api/conversations/{cid}/messages/{question}/regenerate"), 400)
    assert "edit" in error["message"]
    assert_openai_error(client.post(f"/api/conversations/{cid}/messages/nope/regenerate"), 404)


def test_edit_changes_a_question_on_a_new_branch_and_answers_it(tmp_path):
    assistant, _, app = make_app(tmp_path, "About cats.", "About dogs.", "Other.")
    client = TestClient(app)
    cid = client.post("/api/conversations").json()["id"]
    stream(client, f"/api/conversations/{cid}/turns", json={"text": "Tell me about cats"})
    question, answer = [m.id for m in assistant.conversations.history(cid)]
    events = stream(client, f"/api/conversations/{cid}/messages/{question}/edit",
                    json={"text": "Tell me about dogs", "max_tokens": 20})
    assert events[-1][1]["text"] == "About dogs."
    assert [m.content for m in assistant.conversations.history(cid)] == ["Tell me about dogs", "About dogs."]
    assert len(assistant.conversations.siblings(question)) == 2  # the old branch is kept
    assert "only a question" in assert_openai_error(
        client.post(f"/api/conversations/{cid}/messages/{answer}/edit", json={"text": "x"}), 400)["message"]
    other = client.post("/api/conversations").json()["id"]  # a message of another conversation is not found
    assert_openai_error(client.post(f"/api/conversations/{other}/messages/{question}/edit", json={"text": "x"}), 404)


def test_a_turn_started_here_is_cancelled_at_api_turns(tmp_path):
    engine = CancellableEngine(num_tokens=200)
    assistant, _, app = make_app(tmp_path, engine=engine)
    cid = TestClient(app).post("/api/conversations").json()["id"]
    with serve_in_thread(app, timeout_s=20) as url:
        with httpx.stream("POST", f"{url}/api/conversations/{cid}/turns", json={"text": "Go"}, timeout=30) as r:
            lines = r.iter_lines()
            started = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
            assert started["type"] == "turn_started"
            cancelled = httpx.post(f"{url}/api/turns/{started['message_id']}/cancel", timeout=30)
            assert cancelled.json() == {"cancelled": started["message_id"]}
            engine.open_all()
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert rest[-1]["type"] == "done" and rest[-1]["finish_reason"] == "cancelled"
    answer = assistant.conversations.history(cid)[-1]
    assert answer.role == "assistant" and len(answer.content) < 200


# -- ownership ----------------------------------------------------------------------------------------


def test_another_keys_conversation_is_not_found(tmp_path):
    assistant, client, alice, bob = two_keys(tmp_path, "Hi Alice.")
    cid = client.post("/api/conversations", json={"title": "Alice's"}, headers=alice).json()["id"]
    stream(client, f"/api/conversations/{cid}/turns", json={"text": "Hi"}, headers=alice)
    question, answer = [m.id for m in assistant.conversations.history(cid)]
    for method, path, body in [
        ("GET", f"/api/conversations/{cid}", None),
        ("PATCH", f"/api/conversations/{cid}", {"title": "mine now"}),
        ("DELETE", f"/api/conversations/{cid}", None),
        ("POST", f"/api/conversations/{cid}/turns", {"text": "Hi"}),
        ("POST", f"/api/conversations/{cid}/messages/{answer}/regenerate", {}),
        ("POST", f"/api/conversations/{cid}/messages/{question}/edit", {"text": "x"}),
    ]:
        assert_openai_error(client.request(method, path, json=body, headers=bob), 404, code="not_found")
    assert client.get("/api/conversations", headers=bob).json()["data"] == []
    mine = client.get("/api/conversations", headers=alice).json()["data"]
    assert [(c["id"], c["title"]) for c in mine] == [(cid, "Alice's")]  # untouched by bob's attempts
    assert len(assistant.conversations.history(cid)) == 2
    assert_openai_error(client.get("/api/conversations"), 401, code="invalid_api_key")
    # deleting drops the owner row with the conversation
    client.delete(f"/api/conversations/{cid}", headers=alice)
    assert assistant.owners.owner("conversation", cid) is None


def test_another_keys_document_is_not_found(tmp_path):
    assistant, client, alice, bob = two_keys(tmp_path)
    done = {}
    for who, headers in (("alice", alice), ("bob", bob)):  # the same file name: two documents
        done[who] = stream(client, "/api/documents", files=[("file", NOTES)], headers=headers)[-1][1]
    (alices,), (bobs,) = done["alice"]["documents"], done["bob"]["documents"]
    assert alices["doc_id"] != bobs["doc_id"]
    assert [d["doc_id"] for d in client.get("/api/documents", headers=alice).json()["data"]] == [alices["doc_id"]]
    assert [d["doc_id"] for d in client.get("/api/documents", headers=bob).json()["data"]] == [bobs["doc_id"]]
    assert_openai_error(client.delete(f"/api/documents/{alices['doc_id']}", headers=bob), 404, code="not_found")
    assert len(assistant.documents.list()) == 2
    assert client.delete(f"/api/documents/{alices['doc_id']}", headers=alice).json()["deleted"] is True
    assert [d["doc_id"] for d in assistant.documents.list()] == [bobs["doc_id"]]
    assert assistant.owners.owner("document", alices["doc_id"]) is None
    bob_id = assistant.keys.list()[1].id  # alice's saved copy is gone, bob's kept
    assert [p.parent.name for p in (tmp_path / "uploads" / "documents").glob("*/notes.txt")] == [bob_id]
    assert_openai_error(client.get("/api/documents"), 401)


def test_the_open_servers_user_sees_documents_no_key_owns(tmp_path):
    assistant, _, app = make_app(tmp_path)
    client = TestClient(app)
    library = tmp_path / "library.md"
    library.write_text("# Library\n\nShared notes.\n")
    (cli,) = assistant.documents.ingest([library])  # as `assistant ingest` does: no owner
    assert [d["doc_id"] for d in client.get("/api/documents").json()["data"]] == [cli.doc_id]
    _, key = assistant.keys.create("k", "free")
    assert client.get("/api/documents", headers=bearer(key)).json()["data"] == []
    assert_openai_error(client.delete(f"/api/documents/{cli.doc_id}", headers=bearer(key)), 404)
    assert library.exists() and len(assistant.documents.list()) == 1


# -- documents ----------------------------------------------------------------------------------------


def test_an_upload_streams_progress_then_each_file_then_the_documents(tmp_path):
    assistant, _, app = make_app(tmp_path)
    client = TestClient(app)
    events = stream(client, "/api/documents", files=[("file", NOTES), ("file", ("tool.exe", b"MZ\x90"))])
    kinds = [kind for kind, _ in events]
    assert kinds[-1] == "done" and kinds.count("file") == 2
    progress = [d for k, d in events if k == "progress"]
    assert {p["stage"] for p in progress} == {"pages", "chunks", "pages_done"}
    assert all(p["file_name"] == "notes.txt" and p["count"] >= 1 for p in progress)
    assert kinds.index("progress") < kinds.index("file")
    done = events[-1][1]
    (doc,) = done["documents"]
    assert doc["file_name"] == "notes.txt" and doc["status"] == "added" and doc["num_pages"] == 1 and doc["doc_id"]
    (failed,) = done["failed"]
    assert failed["file_name"] == "tool.exe" and "unsupported" in failed["error"]
    listed = client.get("/api/documents").json()["data"]
    assert [(d["doc_id"], d["file_name"], d["num_pages"]) for d in listed] == [(doc["doc_id"], "notes.txt", 1)]
    assert "path" not in listed[0]  # the server's folders are not shown
    folder = tmp_path / "uploads" / "documents" / "local"
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]  # the failed file was not kept
    again = stream(client, "/api/documents", files=[("file", NOTES)])[-1][1]
    assert again["documents"][0]["status"] == "unchanged" and len(client.get("/api/documents").json()["data"]) == 1
    assert client.delete(f"/api/documents/{doc['doc_id']}").json() == {"id": doc["doc_id"], "deleted": True}
    assert client.get("/api/documents").json()["data"] == [] and not (folder / "notes.txt").exists()


def test_uploads_may_be_larger_than_bodies_up_to_the_upload_limit(tmp_path):
    _, _, app = make_app(tmp_path, max_body_bytes=1000, max_upload_bytes=20_000)
    client = TestClient(app)
    text = b"Seven years of warranty. " * 200  # 5000 bytes: past max_body_bytes, within max_upload_bytes
    done = stream(client, "/api/documents", files=[("file", ("big.txt", text))])[-1][1]
    assert done["documents"][0]["status"] == "added"
    huge = client.post("/api/documents", files=[("file", ("huge.txt", b"x" * 30_000))])
    assert "server.max_upload_bytes" in assert_openai_error(huge, 413, code="request_too_large")["message"]
    assert [d["file_name"] for d in client.get("/api/documents").json()["data"]] == ["big.txt"]


def test_uploads_are_admitted_by_the_gateway(tmp_path):
    assistant, _, app = make_app(tmp_path, tiers={"free": {"rpm": 1, "tpm": 100000}})
    _, key = assistant.keys.create("k", "free")
    client = TestClient(app)
    stream(client, "/api/documents", files=[("file", NOTES)], headers=bearer(key))
    refused = client.post("/api/documents", files=[("file", ("b.txt", b"more"))], headers=bearer(key))
    assert_openai_error(refused, 429, code="rate_limit_exceeded")
    assert [(r.model, r.status) for r in assistant.usage.rows()] == [("documents", "ok"), ("documents", "rate_limited")]


# -- bad input and the schema -------------------------------------------------------------------------


def test_client_mistakes_are_400s_in_the_error_shape(tmp_path):
    _, _, app = make_app(tmp_path)
    client = TestClient(app)
    cid = client.post("/api/conversations").json()["id"]
    json_body = {"content-type": "application/json"}
    assert "not valid JSON" in assert_openai_error(
        client.patch(f"/api/conversations/{cid}", content=b"{", headers=json_body), 400)["message"]
    assert assert_openai_error(client.patch(f"/api/conversations/{cid}", json={"title": "  "}), 400)["param"] == "title"
    assert assert_openai_error(client.patch(f"/api/conversations/{cid}", json={}), 400)["param"] == "title"
    assert_openai_error(client.post("/api/conversations", json={"title": 5}), 400)
    assert_openai_error(client.post("/api/conversations", json=["t"]), 400)
    assert_openai_error(client.post(f"/api/conversations/{cid}/turns", json={"text": " "}), 400)
    assert assert_openai_error(client.post(f"/api/conversations/{cid}/turns", json={"text": "hi", "max_tokens": 0}),
                               400)["param"] == "max_tokens"
    bad_audio = {"audio": {"name": "q.wav", "data": "***"}}
    assert "base64" in assert_openai_error(client.post(f"/api/conversations/{cid}/turns", json=bad_audio), 400)["message"]
    assert assert_openai_error(client.post("/api/documents"), 400)["param"] == "file"
    assert assert_openai_error(client.post("/api/documents", files=[("file", ("..", b"x"))]), 400)["param"] == "file"
    assert_openai_error(client.post("/api/documents", files=[("file", NOTES), ("file", NOTES)]), 400)
    assert_openai_error(client.delete("/api/documents/nope"), 404, code="not_found")
    assert_openai_error(client.post("/api/conversations/nope/turns", json={"text": "hi"}), 404)
    assert client.get("/api/conversations").json()["data"][0]["id"] == cid  # nothing else was created


def test_the_openapi_schema_describes_the_routes(tmp_path):
    _, _, app = make_app(tmp_path)
    schema = TestClient(app).get("/openapi.json").json()
    paths = schema["paths"]
    assert set(paths["/api/conversations"]) == {"get", "post"}
    assert set(paths["/api/conversations/{conversation_id}"]) == {"get", "patch", "delete"}
    for path in ("/api/conversations/{conversation_id}/turns",
                 "/api/conversations/{conversation_id}/messages/{message_id}/regenerate",
                 "/api/conversations/{conversation_id}/messages/{message_id}/edit"):
        assert "post" in paths[path]
    assert set(paths["/api/documents"]) == {"get", "post"} and "delete" in paths["/api/documents/{doc_id}"]
    rename = paths["/api/conversations/{conversation_id}"]["patch"]["requestBody"]["content"]["application/json"]
    assert rename["schema"]["$ref"].endswith("/Rename")
    assert "multipart/form-data" in paths["/api/documents"]["post"]["requestBody"]["content"]
    assert "title" in schema["components"]["schemas"]["Rename"]["properties"]


# -- what a turn may search: the caller's documents only (the turn's document scope) ------------------

SECRET = ("alice_plans.txt", b"The vault code is 4471. Only Alice knows the vault code.\n")
GARDEN = ("bob_notes.txt", b"The garden gate is green. The gate code is not written down.\n")
SEARCH = "What is the vault code in my document?"
PATHS = ("conversation", "turns", "regenerate", "edit", "v1", "v1-stream")


class ReadingEngine(ScriptedEngine):
    """Answers every turn alike (`answer`); a question "read NAME" (with tools offered) first calls
    read_document on NAME, and the answer follows the tool's observation."""

    answer = "The vault code is 4471 [1]."

    def generate(self, prompt, params, *, tools=None, cancel=None):
        question = next(m["content"] for m in reversed(prompt) if m["role"] == "user")
        called = any(m["role"] == "tool" for m in prompt)
        if tools and question.startswith("read ") and not called:
            call = {"name": "read_document", "arguments": {"document": question.split()[1]}}
            self.script = [f"<tool_call>{json.dumps(call)}</tool_call>"]
        else:
            self.script = [self.answer]
        return super().generate(prompt, params, tools=tools, cancel=cancel)


def v1_events(response) -> list[tuple[str, dict]]:
    """The `assistant.<type>` SSE events of a streamed /v1 answer (the extra events OpenAI clients ignore)."""
    out = []
    for block in filter(None, response.text.split("\n\n")):
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        if fields.get("event", "").startswith("assistant."):
            out.append((fields["event"].removeprefix("assistant."), json.loads(fields["data"])))
    return out


def turn_via(client, path: str, headers: dict, question: str, cid: str | None = None) -> list[tuple[str, dict]]:
    """One turn of `question` through one HTTP turn path, as (event type, data)."""
    if path == "conversation":
        cid = cid or client.post("/api/conversations", headers=headers).json()["id"]
        return stream(client, f"/api/conversations/{cid}/turns", json={"text": question}, headers=headers)
    if path == "turns":
        return stream(client, "/api/turns", json={"text": question, "conversation_id": cid}, headers=headers)
    if path == "regenerate":
        started, *_, done = turn_via(client, "conversation", headers, question, cid)
        cid = started[1]["conversation_id"]
        return stream(client, f"/api/conversations/{cid}/messages/{done[1]['message_id']}/regenerate",
                      headers=headers)
    if path == "edit":
        started = turn_via(client, "conversation", headers, "Hello", cid)[0][1]
        return stream(client, f"/api/conversations/{started['conversation_id']}/messages/"
                              f"{started['user_message_id']}/edit", json={"text": question}, headers=headers)
    body = {"model": "assistant", "messages": [{"role": "user", "content": question}]}
    if path == "v1":
        reply = client.post("/v1/chat/completions", json=body, headers=headers)
        assert reply.status_code == 200, reply.text
        return [("sources", {"sources": reply.json()["sources"]})]
    response = client.post("/v1/chat/completions", json={**body, "stream": True}, headers=headers)
    assert response.status_code == 200, response.text
    return v1_events(response)


def retrieved(prompt) -> str:
    """The document text a prompt holds: the prefetched passages and the tools' observations."""
    return "\n".join(str(m["content"]) for m in prompt if m["role"] == "tool" or
                     m["role"] == "system" and str(m["content"]).startswith("Passages"))


def cited(events) -> set[str]:
    return {s["doc"] for kind, data in events if kind == "sources" for s in data["sources"]}


def tool_steps(events) -> list[dict]:
    return [data for kind, data in events if kind == "tool_call_finished"]


def keys_with_documents(tmp_path, **server):
    engine = ReadingEngine()
    assistant, _, app = make_app(tmp_path, engine=engine, **server)
    client = TestClient(app)
    alice = bearer(assistant.keys.create("alice", "paid")[1])
    bob = bearer(assistant.keys.create("bob", "paid")[1])
    for headers, upload in ((alice, SECRET), (bob, GARDEN)):
        assert stream(client, "/api/documents", files=[("file", upload)], headers=headers)[-1][1]["documents"]
    return assistant, engine, client, alice, bob


def test_another_keys_document_is_never_searched_read_or_cited_in_any_turn(tmp_path):
    assistant, engine, client, alice, bob = keys_with_documents(tmp_path)
    for path in PATHS:
        before = len(engine.prompts)
        events = turn_via(client, path, bob, SEARCH)
        prompts = json.dumps(engine.prompts[before:])
        assert "4471" not in prompts and "alice_plans" not in prompts, path
        assert "alice_plans.txt" not in cited(events), path
        if path != "v1":  # (the plain /v1 answer has no tool steps to show)
            (prefetched,) = [s for s in tool_steps(events) if s["name"] == "search_documents"]
            assert "alice_plans" not in prefetched["summary"], path
        if path == "regenerate":
            continue  # (answers the question again: "read ..." is not a question it can send)
        before = len(engine.prompts)
        outside = turn_via(client, path, bob, "read alice_plans.txt")
        unknown = turn_via(client, path, bob, "read carol_plans.txt")
        if path != "v1":  # the same answer as for a name that is nowhere
            reads = [[s for s in tool_steps(e) if s["name"] == "read_document"] for e in (outside, unknown)]
            assert [[(s["ok"], s["summary"]) for s in r] for r in reads] == [
                [(False, f"No document '{name}'. Documents: bob_notes.txt.")]
                for name in ("alice_plans.txt", "carol_plans.txt")], path
        assert "_plans" not in json.dumps(engine.prompts[before:]), path  # no model call about either (edit: "Hello")
    reply = client.post("/v1/chat/completions", headers=bob,
                        json={"model": "assistant", "messages": [{"role": "user", "content": "read alice_plans.txt"}]})
    assert reply.json()["choices"][0]["message"]["content"].startswith(
        "No document 'alice_plans.txt'. Documents: bob_notes.txt. Upload it ")
    # alice's own turns find, read and cite it, through every path
    for path in PATHS:
        before = len(engine.prompts)
        events = turn_via(client, path, alice, SEARCH)
        assert "The vault code is 4471." in json.dumps(engine.prompts[before:]), path
        assert cited(events) == {"alice_plans.txt"}, path
    turn_via(client, "conversation", alice, "read alice_plans.txt")
    assert "alice_plans.txt p. 1: The vault code is 4471." in engine.prompts[-1][-1]["content"]  # read_document


def test_a_conversations_document_is_searched_only_in_that_conversation_and_goes_with_it(tmp_path):
    assistant, engine, client, alice, bob = keys_with_documents(tmp_path)
    trip = client.post("/api/conversations", json={"title": "Trip"}, headers=alice).json()["id"]
    other = client.post("/api/conversations", json={"title": "Other"}, headers=alice).json()["id"]
    hotel = ("hotel.txt", b"The hotel of the trip is called Seagull Inn.\n")
    assert_openai_error(client.post("/api/documents", files=[("file", hotel)], data={"conversation_id": trip},
                                    headers=bob), 404)  # not bob's conversation
    (doc,) = stream(client, "/api/documents", files=[("file", hotel)], data={"conversation_id": trip},
                    headers=alice)[-1][1]["documents"]
    listed = lambda path: [d["doc_id"] for d in client.get(path, headers=alice).json()["data"]]  # noqa: E731
    assert listed(f"/api/conversations/{trip}/documents") == [doc["doc_id"]]
    assert listed(f"/api/documents?conversation_id={trip}") == [doc["doc_id"]]
    assert listed(f"/api/conversations/{other}/documents") == listed(f"/api/documents?conversation_id={other}") == []
    everything = client.get("/api/documents", headers=alice).json()["data"]
    assert {(d["file_name"], d["conversation_id"]) for d in everything} == {("alice_plans.txt", None),
                                                                            ("hotel.txt", trip)}
    assert_openai_error(client.get(f"/api/conversations/{trip}/documents", headers=bob), 404)
    question = "What is the hotel of the trip called, in my document?"
    engine.answer = "The hotel of the trip is called Seagull Inn [1]."
    for path in ("conversation", "turns"):
        assert cited(turn_via(client, path, alice, question, trip)) == {"hotel.txt"}, path
        assert "Seagull" in retrieved(engine.prompts[-1]), path
        events = turn_via(client, path, alice, question, other)  # the same key, another conversation
        assert "Seagull" not in retrieved(engine.prompts[-1]) and "hotel.txt" not in cited(events), path
        events = turn_via(client, path, alice, question)  # a new conversation
        assert "Seagull" not in retrieved(engine.prompts[-1]) and "hotel.txt" not in cited(events), path
    turn_via(client, "v1", alice, question)
    assert "Seagull" not in retrieved(engine.prompts[-1])
    saved = tmp_path / "uploads" / "documents" / assistant.keys.list()[0].id / "conversations" / trip / "hotel.txt"
    assert saved.exists()
    assert client.delete(f"/api/conversations/{trip}", headers=alice).json() == {"id": trip, "deleted": True}
    assert {d["file_name"] for d in assistant.documents.list()} == {"alice_plans.txt", "bob_notes.txt"}
    assert not saved.exists() and not saved.parent.exists()
    assert assistant.owners.documents_of(trip) == [] and assistant.owners.owner("document", doc["doc_id"]) is None
    assert [d["file_name"] for d in client.get("/api/documents", headers=alice).json()["data"]] == ["alice_plans.txt"]


def operator_library(tmp_path, **server):
    """An app with one key's document and one the operator ingested with the CLI (no owner)."""
    assistant, engine, client, alice, bob = keys_with_documents(tmp_path, **server)
    handbook = tmp_path / "handbook.md"
    handbook.write_text("# Handbook\n\nThe office vault code is 9902.\n")
    (cli,) = assistant.documents.ingest([handbook])
    return assistant, engine, client, alice, cli.doc_id


def test_the_operators_library_is_private_unless_shared(tmp_path):
    assistant, engine, client, alice, handbook = operator_library(tmp_path / "private")
    assert handbook not in [d["doc_id"] for d in client.get("/api/documents", headers=alice).json()["data"]]
    engine.answer = "The office vault code is 9902 [1]."
    for path in ("conversation", "v1"):
        events = turn_via(client, path, alice, "What is the office vault code in the handbook document?")
        assert "9902" not in retrieved(engine.prompts[-1]) and "handbook.md" not in cited(events), path
    assert_openai_error(client.delete(f"/api/documents/{handbook}", headers=alice), 404)

    assistant, engine, client, alice, handbook = operator_library(tmp_path / "shared", shared_library=True)
    listed = {d["doc_id"]: d["shared"] for d in client.get("/api/documents", headers=alice).json()["data"]}
    assert listed[handbook] is True and list(listed.values()).count(False) == 1  # her own, and the shared one
    engine.answer = "The office vault code is 9902 [1]."
    for path in ("conversation", "v1"):
        events = turn_via(client, path, alice, "What is the office vault code in the handbook document?")
        assert "9902" in retrieved(engine.prompts[-1]) and "handbook.md" in cited(events), path
    assert_openai_error(client.delete(f"/api/documents/{handbook}", headers=alice), 403, code="permission_denied")
    assert handbook in [d["doc_id"] for d in assistant.documents.list()]


def test_the_local_user_searches_what_no_key_owns_and_the_cli_searches_everything(tmp_path):
    engine = ReadingEngine()
    assistant, _, app = make_app(tmp_path, engine=engine)
    client = TestClient(app)  # an open server: the key-less local user
    handbook = tmp_path / "handbook.md"
    handbook.write_text("# Handbook\n\nThe office vault code is 9902.\n")
    assistant.documents.ingest([handbook]).__next__()
    stream(client, "/api/documents", files=[("file", SECRET)])
    for path in PATHS:
        events = turn_via(client, path, {}, "What is the vault code in my documents?")
        assert {"9902", "4471"} <= set(re.findall(r"\d{4}", retrieved(engine.prompts[-1]))), path
        assert cited(events) == {"alice_plans.txt"}, path
    # a key's upload is not the local user's (nor, without a scope, hidden from the in-process CLI)
    key = bearer(assistant.keys.create("k", "free")[1])
    stream(client, "/api/documents", files=[("file", GARDEN)], headers=key)
    local = assistant.owners.access("").scope(None, lambda: [d["doc_id"] for d in assistant.documents.list()])
    assert len(local) == 2 and len(assistant.documents.list()) == 3
    list(assistant.turn(None, "What does the garden gate document say?"))  # the CLI: no scope
    assert "The garden gate is green." in retrieved(engine.prompts[-1])
