"""The stateful REST API: conversations and documents, each the resource of the key that made it.

    GET    /api/conversations                      the caller's conversations, newest first
    POST   /api/conversations                      {"title"?} -> 201, a new empty conversation
    GET    /api/conversations/{id}                 the stored active branch (messages with their meta)
    PATCH  /api/conversations/{id}                 {"title"}: rename
    DELETE /api/conversations/{id}                 the conversation, all its messages and its documents
    POST   /api/conversations/{id}/turns           {"text", "max_tokens"?, "audio"?, "images"?, "speak"?} -> SSE
    POST   /api/conversations/{id}/messages/{message_id}/regenerate   {"max_tokens"?} -> SSE: the latest
                                                   answer (message_id) again, the old one kept as a sibling
    POST   /api/conversations/{id}/messages/{message_id}/edit         {"text", "max_tokens"?} -> SSE: the
                                                   question (message_id) changed on a new branch, answered
    GET    /api/conversations/{id}/documents       the documents that belong to that conversation
    GET    /api/conversations/{id}/artifacts/{aid} a file the code tool made there (a plot), by its id
    GET    /api/documents[?conversation_id=ID]     the caller's documents (or one conversation's)
    POST   /api/documents                          multipart, one or more `file` parts and an optional
                                                   `conversation_id` field -> SSE: `progress` (file_name,
                                                   stage, count), `file` (one per file: added, updated,
                                                   unchanged or failed and why), then `done` (documents
                                                   with doc_id and num_pages, failed)
    DELETE /api/documents/{doc_id}                 remove a document from the library (and its upload)

The turn routes stream exactly what POST /api/turns streams, through the same `TurnRunner`
(turns.py): admission, the usage ledger, and POST /api/turns/{message_id}/cancel stops them.
Uploads are saved under <data_dir>/uploads/documents/<key id, or "local">/ (a document's id is
its path's, so two keys' files of one name are two documents; a conversation's files go one folder
further, conversations/<id>/) and ingested one upload at a time (the embedded index has one writer),
in a worker that finishes even when the client goes away.

Ownership is the gateway's rule (gateway.may_see; for documents assistant/keys.py DocumentAccess): a
key sees what it created, the key-less local user of an open server what no key owns, and anything
else is a 404, never a 403 — except removing a document of the operator's library that a key sees
read-only through `server.shared_library`, which is a 403. Every turn searches exactly the documents
the caller can list here (TurnRunner.scope), less other conversations' files: an upload with a
`conversation_id` is searched only in that conversation's turns, and deleted with the conversation.
Errors have the API's one shape, {"error": {message, type, param, code}} (completions.error_response):
400 for a bad body (not FastAPI's 422), 404 for an unknown or foreign id.
"""

from __future__ import annotations

import logging
import mimetypes
import queue
import shutil
import threading
from dataclasses import asdict
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator

from fastapi import APIRouter, Depends, File, Form, HTTPException, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, Response
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

from assistant.errors import AssistantError, StoreError
from assistant.keys import artifact_file, remove_conversation_files, share_with_sandbox, upload_folder
from assistant.server.auth import Principal, key_checker
from assistant.server.completions import error_response
from assistant.server.gateway import Refusal
from assistant.server.schemas import Edit, NewConversation, Regenerate, Rename, TurnInput, first_error
from assistant.server.streaming import ClosingStreamingResponse, server_sent
from assistant.server.turns import TurnRunner

log = logging.getLogger(__name__)
MAX_UPLOAD_FILES = 32  # files per upload request
CODES = {401: "invalid_api_key", 403: "permission_denied", 404: "not_found"}


class ApiError(HTTPException):
    """An HTTP error that names the request field at fault (`param`)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(status, message)
        self.param = param


class ApiRoute(APIRoute):
    """Errors in the API's one shape: FastAPI's 422 for a bad body becomes a 400, an HTTPException
    (401 from the key check, 404s) an error_response."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                return error_response(400, *_bad_body(e.errors()))
            except HTTPException as e:
                return error_response(e.status_code, str(e.detail), getattr(e, "param", None), headers=e.headers,
                                      code=CODES.get(e.status_code))

        return handle


def _bad_body(errors: Any) -> tuple[str, str | None]:
    """(message, param) of FastAPI's validation errors, the field named as the client named it."""
    error = errors[0]
    loc = tuple(error.get("loc", ()))
    loc = loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc
    if error.get("type") == "json_invalid":
        return f"The request body is not valid JSON ({error.get('ctx', {}).get('error', 'decode error')}).", None
    if not loc and error.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return "The request body must be a JSON object.", None
    return first_error([{**error, "loc": loc}])


def _refused(refusal: Refusal) -> Response:
    return error_response(refusal.status, refusal.message, None, refusal.type, refusal.headers, refusal.code)


def create_rest_api(runner: TurnRunner) -> APIRouter:
    """The routes above over the runner's assistant and gateway (see the module docstring)."""
    assistant, gateway = runner.assistant, runner.gateway
    router = APIRouter(prefix="/api", route_class=ApiRoute, dependencies=[Depends(key_checker(gateway.auth))])
    uploads = Path(assistant.config.data_dir).resolve() / "uploads" / "documents"
    one_writer = threading.Lock()  # the library's writes (uploads, deletions) run one at a time

    def visible(request: Request, conversation_id: str) -> None:
        runner.check_visible(request.state.principal, conversation_id)

    def message_in(conversation_id: str, message_id: str) -> Any:
        try:
            message = assistant.conversations.message(message_id)
        except StoreError:
            message = None
        if message is None or message.conversation_id != conversation_id:
            raise ApiError(404, f"No message {message_id!r} in conversation {conversation_id!r}.")
        return message

    def summary(conversation_id: str) -> dict[str, Any]:
        return asdict(assistant.conversations.get(conversation_id))

    async def streamed(request: Request, text: str, max_tokens: int | None,
                       start: Callable[[Any, threading.Event], Iterator[Any]]) -> Any:
        response = await runner.run(request, text, max_tokens, start)
        return _refused(response) if isinstance(response, Refusal) else response

    # -- conversations ----------------------------------------------------------------------------
    @router.get("/conversations")
    def list_conversations(request: Request) -> dict[str, Any]:
        """The caller's conversations, most recently updated first."""
        principal = request.state.principal
        return {"data": [asdict(c) for c in assistant.conversations.list()
                         if gateway.may_see(principal, "conversation", c.id)]}

    @router.post("/conversations", status_code=201)
    def create_conversation(request: Request, body: NewConversation | None = None) -> dict[str, Any]:
        """A new, empty conversation owned by the caller's key."""
        conversation_id = assistant.conversations.start((), title=body.title if body else "")
        gateway.claim(request.state.principal, "conversation", conversation_id)
        return summary(conversation_id)

    @router.get("/conversations/{conversation_id}")
    def get_conversation(conversation_id: str, request: Request) -> Response:
        """The stored active branch: every message with its meta (sources, tool steps, usage)."""
        visible(request, conversation_id)
        return Response(assistant.conversations.export(conversation_id), media_type="application/json")

    @router.patch("/conversations/{conversation_id}")
    def rename_conversation(conversation_id: str, body: Rename, request: Request) -> dict[str, Any]:
        visible(request, conversation_id)
        assistant.conversations.rename(conversation_id, body.title)
        return summary(conversation_id)

    @router.get("/conversations/{conversation_id}/artifacts/{artifact_id}")
    def get_artifact(conversation_id: str, artifact_id: str, request: Request) -> Any:
        """A file the code tool made in the conversation (a plot), by the id its tool step carries."""
        visible(request, conversation_id)
        path = artifact_file(assistant.config.data_dir, conversation_id, artifact_id)
        if path is None:
            raise HTTPException(404, f"No artifact {artifact_id!r} in this conversation.")
        return FileResponse(path, media_type=mimetypes.guess_type(path.name)[0] or "application/octet-stream",
                            filename=path.name.split("-", 1)[-1])

    @router.delete("/conversations/{conversation_id}")
    def delete_conversation(conversation_id: str, request: Request) -> dict[str, Any]:
        """The conversation, its messages, and the documents that belong to it."""
        visible(request, conversation_id)
        assistant.conversations.delete(conversation_id)
        gateway.forget("conversation", conversation_id)
        doc_ids = gateway.owners.documents_of(conversation_id) if gateway.owners is not None else []
        records = {d["doc_id"]: d for d in assistant.documents.list()} if doc_ids else {}
        for doc_id in doc_ids:
            remove_document(doc_id, records.get(doc_id))
        remove_conversation_files(assistant.config.data_dir, request.state.principal.key_id, conversation_id)
        return {"id": conversation_id, "deleted": True}

    @router.post("/conversations/{conversation_id}/turns")
    async def conversation_turn(conversation_id: str, body: TurnInput, request: Request) -> Any:
        """One turn, streamed as server-sent TurnEvents (the events of POST /api/turns)."""
        await run_in_threadpool(visible, request, conversation_id)
        principal = request.state.principal
        return await streamed(request, body.text, body.max_tokens, lambda params, cancel: assistant.turn(
            conversation_id, body.user_input(), params=params, cancel=cancel,
            scope=runner.scope(principal, conversation_id)))

    def check_latest_answer(conversation_id: str, message_id: str) -> None:
        message = message_in(conversation_id, message_id)
        path = assistant.conversations.history(conversation_id)
        question = path[-2] if len(path) > 1 and path[-1].role == "assistant" else None
        if message.role != "assistant" or question is None or message.parent_id != question.id:
            raise ApiError(400, f"Message {message_id} is not the latest answer: only that one is answered again "
                                "(to ask an earlier question again, edit it: POST .../messages/{id}/edit).")
        if question.status == "blocked":
            raise ApiError(400, "The latest question was blocked by the safety policy: edit it instead.")

    @router.post("/conversations/{conversation_id}/messages/{message_id}/regenerate")
    async def regenerate(conversation_id: str, message_id: str, request: Request,
                         body: Regenerate | None = None) -> Any:
        """The latest answer again, on a new branch (the old answer stays, a sibling); SSE."""
        await run_in_threadpool(visible, request, conversation_id)
        await run_in_threadpool(check_latest_answer, conversation_id, message_id)
        principal = request.state.principal
        return await streamed(request, "", body.max_tokens if body else None, lambda params, cancel:
                              assistant.regenerate(conversation_id, params=params, cancel=cancel,
                                                   scope=runner.scope(principal, conversation_id)))

    @router.post("/conversations/{conversation_id}/messages/{message_id}/edit")
    async def edit(conversation_id: str, message_id: str, body: Edit, request: Request) -> Any:
        """The question `message_id` replaced by `text` on a new branch, and answered; SSE."""
        await run_in_threadpool(visible, request, conversation_id)
        message = await run_in_threadpool(message_in, conversation_id, message_id)
        if message.role != "user":
            raise ApiError(400, f"Message {message_id} is an answer: only a question (a user message) is edited.")
        principal = request.state.principal
        return await streamed(request, body.text, body.max_tokens, lambda params, cancel: assistant.edit(
            conversation_id, message_id, body.text, params=params, cancel=cancel,
            scope=runner.scope(principal, conversation_id)))

    # -- documents --------------------------------------------------------------------------------
    def documents_of(principal: Principal, conversation_id: str | None = None) -> list[dict[str, Any]]:
        """The caller's documents as the API lists them (one conversation's, with `conversation_id`)."""
        access = gateway.documents(principal)
        records = assistant.documents.list()
        if access is None:
            return [_document(d) for d in records if conversation_id is None]
        return [_document(d, access) for d in records if access.may_see(d["doc_id"], conversation_id)]

    def remove_document(doc_id: str, record: dict[str, Any] | None) -> None:
        """Delete a document from the index, its owner and link rows, and its uploaded copy."""
        with one_writer:
            if record is not None:
                assistant.documents.delete(doc_id)
        gateway.forget("document", doc_id)
        path = Path(record["path"]) if record is not None else None
        if path is not None and path.is_relative_to(uploads):  # an uploaded copy; elsewhere it is the user's file
            path.unlink(missing_ok=True)

    @router.get("/documents")
    def list_documents(request: Request, conversation_id: str | None = None) -> dict[str, Any]:
        """The caller's documents: the library's and every conversation's (`conversation_id` in each
        record), or only one conversation's with `?conversation_id=`."""
        if conversation_id is not None:
            visible(request, conversation_id)
        return {"data": documents_of(request.state.principal, conversation_id)}

    @router.get("/conversations/{conversation_id}/documents")
    def conversation_documents(conversation_id: str, request: Request) -> dict[str, Any]:
        """The documents that belong to this conversation (searched only in its turns)."""
        visible(request, conversation_id)
        return {"data": documents_of(request.state.principal, conversation_id)}

    @router.delete("/documents/{doc_id}")
    def delete_document(doc_id: str, request: Request) -> dict[str, Any]:
        principal = request.state.principal
        access = gateway.documents(principal)
        found = next((d for d in assistant.documents.list() if d["doc_id"] == doc_id), None)
        if found is None or access is not None and not access.may_see(doc_id):
            raise ApiError(404, f"No document with id {doc_id!r}: list them with GET /api/documents.")
        if access is not None and not access.mine(doc_id):
            raise ApiError(403, f"Document {doc_id!r} is in the operator's shared library: it is read-only for "
                                "API keys (the operator removes it with `assistant docs delete`).")
        remove_document(doc_id, found)
        return {"id": doc_id, "deleted": True}

    @router.post("/documents")
    async def upload_documents(request: Request, file: list[UploadFile] = File(
            description=f"the documents (PDF, DOCX, Markdown, text, HTML, pictures), up to {MAX_UPLOAD_FILES}"),
            conversation_id: str | None = Form(None, description="make them documents of this conversation only: "
                                               "searched in its turns, deleted with it (default: the library)")) -> Any:
        """Save and ingest the files into the caller's library (or one of its conversations), streaming
        progress as server-sent events."""
        if not assistant.documents.available:
            raise ApiError(501, "Documents are not part of this build: run `make setup` or pip install -e '.[ingest]'.")
        if len(file) > MAX_UPLOAD_FILES:
            raise ApiError(400, f"{len(file)} files were sent; at most {MAX_UPLOAD_FILES} per request.", "file")
        names = [_file_name(f.filename) for f in file]
        if len(set(names)) < len(names):
            raise ApiError(400, "Two files have the same name: send them in separate requests.", "file")
        principal = request.state.principal
        conversation_id = (conversation_id or "").strip() or None
        if conversation_id is not None:
            await run_in_threadpool(visible, request, conversation_id)
        ticket = await gateway.admit(request, principal, "documents", 0)
        if isinstance(ticket, Refusal):
            return _refused(ticket)
        folder = upload_folder(assistant.config.data_dir, principal.key_id, conversation_id)
        try:
            paths = await run_in_threadpool(_save, folder, names, file)
            if conversation_id is not None:  # also at /data in the conversation's sandbox
                await run_in_threadpool(share_with_sandbox, assistant.config.data_dir, conversation_id, paths)
        except BaseException:
            await run_in_threadpool(ticket.finish, "error")
            raise

        def claim(doc_id: str) -> None:
            gateway.claim(principal, "document", doc_id)
            if conversation_id is not None and gateway.owners is not None:
                gateway.owners.link(doc_id, conversation_id)

        events = ingest_stream(assistant.documents, paths, claim, one_writer, ticket.finish)
        return ClosingStreamingResponse(events, media_type="text/event-stream", headers=ticket.headers)

    return router


def _file_name(given: str | None) -> str:
    """The upload's base name (a client's folders dropped), or a 400 for one that cannot be a file."""
    name = PurePosixPath((given or "").replace("\\", "/")).name
    if not name or name.startswith(".") or len(name) > 255:
        raise ApiError(400, f"File name {given!r} cannot be saved: give each file a plain name (e.g. manual.pdf).",
                       "file")
    return name


def _save(folder: Path, names: list[str], files: list[UploadFile]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, upload in zip(names, files):
        upload.file.seek(0)
        with open(folder / name, "wb") as out:
            shutil.copyfileobj(upload.file, out)
        paths.append(folder / name)
    return paths


def _document(record: dict[str, Any], access: Any = None) -> dict[str, Any]:
    """A library record as the API shows it (not the server's paths or the ledger's flags), with the
    conversation it belongs to (None: the library) and whether it is the operator's, read-only."""
    keys = ("doc_id", "file_name", "format", "num_pages", "num_chunks", "size", "ingested_at", "warnings")
    shown = {k: record.get(k) for k in keys}
    doc_id = record.get("doc_id", "")
    shown["conversation_id"] = access.conversation.get(doc_id) if access is not None else None
    shown["shared"] = bool(access is not None and access.shared(doc_id))
    return shown


def _file_result(result: Any) -> dict[str, Any]:
    return {"file_name": result.path.name, "status": result.status, "doc_id": result.doc_id or None,
            "num_pages": result.num_pages, "num_chunks": result.num_chunks, "error": result.error or None,
            "warnings": list(result.warnings)}


def _drop_failed(documents: Any, results: list[Any]) -> None:
    """Delete the saved copies of files that could not be ingested (unless an earlier version is in the library)."""
    failed = [r.path for r in results if r.status == "failed"]
    if failed:
        kept = {d["path"] for d in documents.list()}
        for path in failed:
            if str(path.resolve()) not in kept:
                path.unlink(missing_ok=True)


def ingest_stream(documents: Any, paths: list[Path], claim: Callable[[str], None], lock: threading.Lock,
                  finish: Callable[[str], None]) -> Iterator[str]:
    """Ingest `paths` in a worker thread, started now, and stream what happens as SSE. The worker
    finishes when the client goes away: each document is claimed for the caller as it lands, and
    `finish(status)` (the gateway ticket's) runs when all are done."""
    events: queue.Queue[str | None] = queue.Queue()

    def work() -> None:
        results: list[Any] = []
        failed = False

        def progress(stage: str, count: int) -> None:
            events.put(server_sent("progress", {"type": "progress", "file_name": paths[len(results)].name,
                                                "stage": stage, "count": count}))

        try:
            with lock:
                for result in documents.ingest(paths, progress):
                    if result.status != "failed":
                        claim(result.doc_id)
                    results.append(result)
                    events.put(server_sent("file", {"type": "file", **_file_result(result)}))
                _drop_failed(documents, results)
        except Exception as e:  # ours (the index, the embedder), not the files'
            failed = True
            log.exception("ingesting an upload failed")
            message = str(e) if isinstance(e, AssistantError) else f"Ingestion failed: {type(e).__name__}: {e}"
            events.put(server_sent("error", {"type": "error", "message": message}))
        finally:
            finish("error" if failed else "ok")
            files = [_file_result(r) for r in results]
            events.put(server_sent("done", {"type": "done", "documents": [f for f in files if f["status"] != "failed"],
                                            "failed": [f for f in files if f["status"] == "failed"]}))
            events.put(None)

    threading.Thread(target=work, name="ingest-upload", daemon=True).start()

    def stream() -> Iterator[str]:
        while (event := events.get()) is not None:
            yield event

    return stream()

