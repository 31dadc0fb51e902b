"""The stateful REST API (assistant/server/rest.py) over the real app with fakes at the engine seam, the
in-memory store and the real document pipeline (embedded index, hash embedder): conversations and
documents, their turns and uploads streamed as SSE, ownership by key, the error shape, the limits."""

from __future__ import annotations

import json

import httpx
from fastapi.testclient import TestClient

from tests.conftest import serve_in_thread
from assistant.engine.base import TokenDelta
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
