"""The Gradio web chat: a thin renderer of the turn's event stream, over the `Assistant` facade
(assistant/app.py). The server (assistant/server/app.py) mounts it at / with `mount_web_chat`, which
adds the login screen when API keys are configured; ui/render.py turns events into what is shown.

Each browser session (and each `gradio_client.Client`) keeps its conversation id in a `gr.State`, so
a conversation continues across turns and is stored server-side; the Chatbot only renders. Who is
calling is the `username` Gradio gets from the login (a key id; "" for the open server's local user),
and every handler applies the gateway's ownership rule (render.may_see) to the conversations it reads.

Documents follow the REST API's rule (assistant/keys.py DocumentAccess): the files a message carries
are saved under the caller's upload folder, ingested and claimed for the logged-in key before the
turn, and every turn searches only what the caller may see (`WebChat.scope`). A choice under the chat
says where attached files go: **this conversation** (the default) or **the library**. The default is
the conversation because a file dropped into a chat is usually about that chat (as in ChatGPT's and
Open WebUI's chats), and it is the private choice: a file reaches every other conversation's search
only when the user says so; a conversation's files go when the conversation is deleted. The
"Documents" panel lists both kinds and removes the caller's own. Every file attached in a chat is also
at /data in that chat's code sandbox (read-only), and data files that are not documents (JSON, Parquet,
...) go only there, so "plot column B of the CSV I uploaded" works.
API endpoints (for gradio_client and scripts):
  /chat   (message, history) -> (cleared textbox, history)   streaming, used by the web page
  /ask    (message) -> answer text                            streaming, same conversation state
  /new_chat () -> ()                                          start a new conversation
  /conversation () -> conversation id                         the session's current conversation ("" if none)
  /resume (conversation id) -> history                        continue a stored conversation (after a restart)
  /regenerate () -> history                                   answer the last question again (new branch)
  /stop   () -> ()                                            cancel the session's running answer in the engine
"""

import io
import mimetypes
import secrets
import threading
import wave
from pathlib import Path
from typing import Any, Iterator

from assistant.errors import AssistantError
from assistant.events import Done, Error, Notice, ToolCallFinished, ToolCallStarted, TurnEvent, TurnStarted
from assistant.keys import remove_conversation_files, share_with_sandbox, upload_folder
from assistant.seams import Attachment, UserInput
from sandbox.base import UPLOADS_MOUNT
from ui.render import (TurnView, conversation_label, document_label, history_messages, library_markdown, may_see,
                       usage_meter, visible_conversations)

AUTO_MODEL = "Automatic"
TITLE = "Offline Assistant"
LOCAL_USER = "local"  # the login's user name for the open server's key-less user
COOKIE = "assistant-web-session"
AUDIO_SUFFIXES = {".wav", ".mp3", ".ogg", ".oga", ".webm", ".flac", ".m4a", ".opus"}
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp", ".tif", ".tiff"}
DOCUMENT_TYPES = [".pdf", ".docx", ".md", ".txt", ".html", ".htm", "image", "audio"]
CONVERSATION, LIBRARY = "conversation", "library"  # where attached files go (see the module docstring)

CSS = """
#status { min-height: 1.5em; font-size: .9em; opacity: .85 }
.usage-meter { display: flex; gap: .5em; align-items: center; font-size: .8em; flex-wrap: wrap }
.usage-meter .bar { width: 8em; height: .5em; background: #8883; border-radius: .25em; overflow: hidden }
.usage-meter .bar span { display: block; height: 100%; background: #3a7 }
.usage-meter .bar.mid span { background: #c90 } .usage-meter .bar.high span { background: #c33 }
@media (max-width: 480px) {
  .gradio-container { padding: 4px !important }
  #controls { flex-wrap: wrap } #controls > * { min-width: 30% !important }
  #chat { height: 55vh !important }
}
"""

# Esc stops the running answer (Enter sends and Shift+Enter adds a line: the textbox's own keys).
HEAD = """<script>
document.addEventListener('keydown', (e) => {
  if (e.key === 'Escape') { const b = document.querySelector('#stop'); if (b) b.click(); }
});
// On a phone the history sidebar would cover the chat: start with it closed there.
(function closeSidebarWhenNarrow(tries) {
  const toggle = document.querySelector('button[aria-label="Toggle Sidebar"]');
  if (toggle) { if (window.innerWidth < 700) toggle.click(); return; }
  if (tries > 0) setTimeout(() => closeSidebarWhenNarrow(tries - 1), 100);
})(100);
</script>"""


def key_id_of(request: Any) -> str:
    """The caller's key id from Gradio's login ("" for the local user of an open server)."""
    user = getattr(request, "username", None) if request is not None else None
    return "" if user in (None, "", LOCAL_USER) else str(user)


def split_attachments(paths: list[str]) -> tuple[Attachment | None, tuple[Attachment, ...], tuple[Attachment, ...]]:
    """The textbox's files as (recording, pictures, documents)."""
    audio, images, files = None, [], []
    for p in paths:
        path = Path(p)
        item = Attachment(path.name, path=path, mime_type=mimetypes.guess_type(path.name)[0] or "")
        suffix = path.suffix.lower()
        if suffix in AUDIO_SUFFIXES and audio is None:
            audio = item
        elif suffix in IMAGE_SUFFIXES:
            images.append(item)
        else:
            files.append(item)
    return audio, tuple(images), tuple(files)


def wav_bytes(chunks: list[Any]) -> bytes:
    """AudioChunk events (16-bit mono PCM) as one WAV file, for the streaming player."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(chunks[0].sample_rate)
        w.writeframes(b"".join(c.pcm16 for c in chunks))
    return buffer.getvalue()


class WebChat:
    """The handlers behind the page, over one Assistant (each a plain method, testable without a browser)."""

    def __init__(self, assistant: Any) -> None:
        self.assistant = assistant
        self._cancels: dict[str, threading.Event] = {}  # browser session -> its running answer's cancel
        self._lock = threading.Lock()
        self._writer = threading.Lock()  # the library's writes from this chat run one at a time

    # -- ownership ------------------------------------------------------------------------------
    def owner_of(self, conversation_id: str) -> str | None:
        owners = getattr(self.assistant, "owners", None)
        return owners.owner("conversation", conversation_id) if owners is not None else None

    def check(self, conversation_id: str, key_id: str) -> None:
        """Raise (as "not found", like the REST API's 404) unless `key_id` may see the conversation."""
        self.assistant.conversations.get(conversation_id)  # StoreError when it does not exist
        if not may_see(self.owner_of(conversation_id), key_id):
            raise AssistantError(f"No conversation with id {conversation_id!r}.")

    def claim(self, conversation_id: str, key_id: str) -> None:
        """Record the caller's key as the owner of a new conversation, which takes the key's tier's
        safety policy (as a conversation started over REST or /v1 does)."""
        owners = getattr(self.assistant, "owners", None)
        if owners is not None and key_id and self.owner_of(conversation_id) is None:
            owners.claim("conversation", conversation_id, key_id)
            policy = self.tier_policy(key_id)
            if policy:
                self.assistant.safety.set_policy(conversation_id, policy)

    def tier_policy(self, key_id: str) -> str | None:
        """The safety policy the key's tier names (None: the server's, or safety is off)."""
        from assistant.server.auth import Authenticator

        if getattr(self.assistant, "safety", None) is None or not key_id or key_id == LOCAL_USER:
            return None
        tier = Authenticator.from_config(self.assistant.config, getattr(self.assistant, "keys", None)).tier_of(key_id)
        return (tier.safety_policy or None) if tier is not None else None

    def conversations(self, key_id: str, query: str = "") -> list[Any]:
        return visible_conversations(self.assistant.conversations.list(), self.owner_of, key_id, query)

    def start(self, title: str, key_id: str) -> str:
        """A new conversation owned by the caller (made before a turn whose files belong to it)."""
        cid = self.assistant.conversations.start((), title=title[:60])
        self.claim(cid, key_id)
        return cid

    def delete(self, conversation_id: str, key_id: str) -> None:
        """The conversation, its owner row, and the documents that belong to it (and their uploads)."""
        self.check(conversation_id, key_id)
        self.assistant.conversations.delete(conversation_id)
        owners = getattr(self.assistant, "owners", None)
        if owners is not None:
            owners.forget("conversation", conversation_id)
            for doc_id in owners.documents_of(conversation_id):
                self._remove(doc_id)
        remove_conversation_files(self.assistant.config.data_dir, key_id, conversation_id)

    # -- documents (the REST API's rule: assistant/keys.py DocumentAccess) -----------------------
    def access(self, key_id: str) -> Any:
        owners = getattr(self.assistant, "owners", None)
        return owners.access(key_id, shared_library=self.assistant.config.server.shared_library) \
            if owners is not None else None

    def records(self) -> list[dict]:
        documents = self.assistant.documents
        return documents.list() if documents.available else []

    def scope(self, key_id: str, conversation_id: str | None) -> frozenset[str] | None:
        """The doc ids a turn of `conversation_id` by `key_id` may search (None: no owners kept, no limit)."""
        access = self.access(key_id)
        if access is None:
            return None
        return access.scope(conversation_id, lambda: [d["doc_id"] for d in self.records()])

    def documents(self, key_id: str, conversation_id: str | None) -> tuple[list[dict], list[dict]]:
        """(the library's documents the caller sees, those of `conversation_id`), each record with
        `shared` (the operator's, read-only) and `removable` (the caller's own)."""
        access = self.access(key_id)
        library: list[dict] = []
        conversation: list[dict] = []
        for d in self.records():
            doc_id = d.get("doc_id", "")
            if access is None:
                library.append({**d, "shared": False, "removable": True})
                continue
            if not access.may_see(doc_id):
                continue
            record = {**d, "shared": access.shared(doc_id), "removable": access.mine(doc_id)}
            link = access.conversation.get(doc_id)
            if link is None:
                library.append(record)
            elif link == conversation_id:
                conversation.append(record)
        return library, conversation

    def remove_document(self, doc_id: str, key_id: str) -> str:
        """Remove one of the caller's documents; returns its file name."""
        access = self.access(key_id)
        record = next((d for d in self.records() if d.get("doc_id") == doc_id), None)
        if record is None or access is not None and not access.mine(doc_id):
            raise AssistantError(f"No document with id {doc_id!r} that you may remove.")
        self._remove(doc_id, record)
        return document_label({"file_name": record.get("file_name")})

    def _remove(self, doc_id: str, record: dict | None = None) -> None:
        record = record or next((d for d in self.records() if d.get("doc_id") == doc_id), None)
        with self._writer:
            if record is not None:
                self.assistant.documents.delete(doc_id)
        owners = getattr(self.assistant, "owners", None)
        if owners is not None:
            owners.forget("document", doc_id)
            owners.unlink(doc_id)
        path = Path(record["path"]) if record is not None and record.get("path") else None
        uploads = Path(self.assistant.config.data_dir).resolve() / "uploads" / "documents"
        if path is not None and path.is_relative_to(uploads):  # an uploaded copy, not a file of the user's
            path.unlink(missing_ok=True)

    def attach(self, files: tuple[Attachment, ...], key_id: str, conversation_id: str | None,
               where: str = CONVERSATION) -> Iterator[TurnEvent]:
        """Save and ingest a message's files for the caller — into conversation `conversation_id` only
        (`where` = CONVERSATION, which needs the id) or into the library — claiming each document for
        the caller's key; yields the ingest step's events. Raises AssistantError when no file could be
        read (the question would be about nothing)."""
        if not self.assistant.documents.available:
            raise AssistantError("Attached files need the document tools: run `make setup` or "
                                 "pip install -e '.[ingest]'.")
        linked = conversation_id if where == CONVERSATION else None
        folder = upload_folder(self.assistant.config.data_dir, key_id, linked)
        folder.mkdir(parents=True, exist_ok=True)
        saved = []
        for f in files:
            target = folder / (Path(f.name).name or "upload")
            target.write_bytes(f.read())
            saved.append(target)
        from ingest.parse import is_supported

        # data files (JSON, Parquet, ...) are not documents: they are only for the code interpreter
        paths = [p for p in saved if is_supported(p)] if conversation_id else saved
        data = [p for p in saved if p not in paths]
        if conversation_id:
            share_with_sandbox(self.assistant.config.data_dir, conversation_id, saved)
        for p in data:
            p.unlink(missing_ok=True)  # its copy at /data is the one kept
        if data and not paths:
            yield Notice(f"{', '.join(p.name for p in data)}: saved for the code interpreter, which reads "
                         f"{'it' if len(data) == 1 else 'them'} at {UPLOADS_MOUNT}/ (read-only).")
            return
        yield ToolCallStarted("ingest_files", "ingest", {"files": [p.name for p in paths],
                                                         "to": "this conversation" if linked else "the library"})
        owners = getattr(self.assistant, "owners", None)
        with self._writer:
            results = list(self.assistant.documents.ingest(paths))
        for r in results:
            if r.status != "failed" and owners is not None:
                if key_id and owners.owner("document", r.doc_id) is None:
                    owners.claim("document", r.doc_id, key_id)
                if linked:
                    owners.link(r.doc_id, linked)
        failed = [f"{r.path.name}: {r.error}" for r in results if r.status == "failed"]
        if failed:  # their saved copies go, unless an earlier version of one is in the library
            kept = {d.get("path") for d in self.records()}
            for r in results:
                if r.status == "failed" and str(r.path.resolve()) not in kept:
                    r.path.unlink(missing_ok=True)
        summary = "; ".join(failed) or f"ingested {len(results)} file(s) into " + (
            "this conversation" if linked else "the library")
        if data:
            summary += f"; {', '.join(p.name for p in data)} saved for the code interpreter at {UPLOADS_MOUNT}/"
        yield ToolCallFinished("ingest_files", "ingest", not failed, summary)
        if failed and len(failed) == len(results):
            raise AssistantError(f"No attached file could be read: {summary}")

    # -- turns ----------------------------------------------------------------------------------
    def params(self, temperature: float | None = None, max_tokens: float | None = None) -> Any:
        overrides: dict[str, Any] = {}
        if temperature is not None:
            overrides["temperature"] = float(temperature)
        if max_tokens:
            overrides["max_tokens"] = int(max_tokens)
        return self.assistant.default_params(**overrides)

    def begin(self, session: str) -> threading.Event:
        cancel = threading.Event()
        with self._lock:
            self._cancels[session] = cancel
        return cancel

    def stop(self, session: str) -> bool:
        with self._lock:
            cancel = self._cancels.get(session)
        if cancel is None:
            return False
        cancel.set()
        return True

    def run(self, view: TurnView, events: Iterator[Any], cid: str | None, key_id: str) -> Iterator[TurnView]:
        """Feed the turn's events to `view`, claiming a new conversation for the caller's key."""
        for event in events:
            view.feed(event)
            if isinstance(event, TurnStarted) and event.conversation_id != cid:
                self.claim(event.conversation_id, key_id)
                cid = event.conversation_id
            yield view

    def resolve_artifact(self, ref: str) -> Path | None:
        """A tool's artifact (a path, or the code tool's artifact id under <data_dir>/artifacts/)."""
        path = Path(ref)
        if path.is_file():
            return path
        root = Path(self.assistant.config.data_dir) / "artifacts"
        if not root.is_dir() or "/" in ref or not ref:
            return None
        return next(iter(sorted(root.glob(f"*/{ref}-*"))), None)

    def history(self, cid: str | None) -> list[dict]:
        return history_messages(self.assistant.conversations.history(cid)) if cid else []

    def branch(self, cid: str | None) -> tuple[Any, int, int]:
        """(the deepest message of the active branch that has alternatives, its position, their count)."""
        if not cid:
            return None, 0, 0
        for m in reversed(self.assistant.conversations.history(cid)):
            siblings = self.assistant.conversations.siblings(m.id)
            if len(siblings) > 1:
                return m, [s.id for s in siblings].index(m.id) + 1, len(siblings)
        return None, 0, 0


def build_app(assistant: Any) -> Any:
    import gradio as gr

    web = WebChat(assistant)
    ids = assistant.models.ids()
    defaults = assistant.default_params()

    with gr.Blocks(title=TITLE, fill_height=True) as app:
        conversation = gr.State(None)
        with gr.Sidebar(open=True, label="Conversations", elem_id="sidebar"):
            new = gr.Button("+ New chat", elem_id="new-chat", variant="primary")
            search = gr.Textbox(placeholder="Search titles", show_label=False, elem_id="search", lines=1)
            past = gr.Radio(choices=[], show_label=False, elem_id="conversations", container=False)
            with gr.Accordion("This conversation", open=False, elem_id="manage"):
                title_box = gr.Textbox(label="Title", elem_id="rename-box", lines=1)
                with gr.Row():
                    rename = gr.Button("Rename", elem_id="rename", size="sm")
                    delete = gr.Button("Delete", elem_id="delete", variant="stop", size="sm")
                with gr.Row():
                    export_md = gr.Button("Export .md", elem_id="export-md", size="sm")
                    export_json = gr.Button("Export .json", elem_id="export-json", size="sm")
                exported = gr.File(label="Export", visible=False, elem_id="export-file")
            with gr.Accordion("Documents", open=False, elem_id="library-panel"):
                library = gr.Markdown(elem_id="library")
                with gr.Row():
                    doomed = gr.Dropdown(choices=[], label="Remove a document", elem_id="remove-choice",
                                         scale=3, min_width=120)
                    remove_doc = gr.Button("Remove", elem_id="remove-document", variant="stop", size="sm",
                                           scale=1, min_width=60)
        gr.Markdown(f"### {TITLE}\nRuns fully offline on this machine.", elem_id="header")
        chatbot = gr.Chatbot(label="Chat", elem_id="chat", editable="user", scale=1, min_height=300,
                             buttons=["copy"], placeholder="Ask a question, attach a document or a picture, "
                             "or record your voice.")
        box = gr.MultimodalTextbox(placeholder="Ask anything · Enter sends · Shift+Enter new line · Esc stops",
                                   show_label=False, sources=["upload", "microphone"], file_count="multiple",
                                   file_types=DOCUMENT_TYPES, autofocus=True, elem_id="input")
        with gr.Row(elem_id="controls"):
            stop = gr.Button("■ Stop", elem_id="stop", variant="stop", size="sm")
            again = gr.Button("↻ Regenerate", elem_id="regenerate", size="sm")
            # shown only while the open conversation has another version of an answer (branch_controls)
            older = gr.Button("◀", elem_id="branch-prev", size="sm", min_width=40, visible=False)
            branch_label = gr.Markdown("", elem_id="branch")
            newer = gr.Button("▶", elem_id="branch-next", size="sm", min_width=40, visible=False)
            speak = gr.Checkbox(label="Voice answers", value=bool(assistant.config.speech.speak_answers),
                                elem_id="speak")
            attach_to = gr.Radio(choices=[("Files: this chat", CONVERSATION), ("Files: library", LIBRARY)],
                                 value=CONVERSATION, show_label=False, container=False, elem_id="attach-to")
        status = gr.Markdown("", elem_id="status")
        usage = gr.HTML("", elem_id="usage")
        player = gr.Audio(label="Voice answer", streaming=True, autoplay=True, interactive=False,
                          elem_id="player", visible=bool(assistant.config.speech.speak_answers))
        with gr.Accordion("Advanced", open=False, elem_id="advanced"):
            model = gr.Dropdown(choices=[(AUTO_MODEL, "auto"), *ids], value="auto", label="Model", elem_id="model",
                                info="Automatic: document and tool-heavy turns go to the large model when one is "
                                "configured, the rest to the small one.")
            temperature = gr.Slider(0.0, 1.5, value=defaults.temperature, step=0.05, label="Temperature",
                                    elem_id="temperature")
            max_tokens = gr.Slider(16, 4096, value=defaults.max_tokens, step=16, label="Max answer tokens",
                                   elem_id="max-tokens")

        # -- handlers ---------------------------------------------------------------------------
        def sidebar(cid: str | None, query: str, request: gr.Request):
            found = web.conversations(key_id_of(request), query or "")
            choices = [(conversation_label(c), c.id) for c in found[:100]]
            title = next((c.title for c in found if c.id == cid), "")
            return gr.update(choices=choices, value=cid if any(c.id == cid for c in found) else None), title

        def library_text(cid: str | None, request: gr.Request):
            try:
                shelf, own = web.documents(key_id_of(request), cid)
            except AssistantError as e:
                return f"_{e}_", gr.update(choices=[], value=None)
            choices = [(("this chat: " if d in own else "") + document_label(d), d["doc_id"])
                       for d in [*own, *shelf] if d.get("removable")]
            return (library_markdown(shelf, available=assistant.documents.available, conversation=own),
                    gr.update(choices=choices, value=None))

        def remove_document(doc_id: str | None, cid: str | None, request: gr.Request):
            if not doc_id:
                return (*library_text(cid, request), "Choose a document to remove first.")
            try:
                name = web.remove_document(doc_id, key_id_of(request))
            except AssistantError as e:
                return (*library_text(cid, request), str(e))
            return (*library_text(cid, request), f"Removed {name}.")

        def turn_outputs(view: TurnView, history: list[dict], cid: str | None):
            audio = view.take_audio()
            return (history + view.messages(), view.conversation_id or cid, view.status,
                    usage_meter(view.usage) if view.usage else gr.skip(), wav_bytes(audio) if audio else gr.skip())

        def chat(message: Any, history: list[dict], cid: str | None, voice: bool, temp: float, tokens: float,
                 choice: str, where: str, request: gr.Request):
            text, paths = (message.get("text", ""), list(message.get("files") or [])) if isinstance(message, dict) \
                else (message or "", [])
            text = (text or "").strip()
            history = list(history or [])
            if not text and not paths:
                yield gr.skip(), history, cid, "Type a question first.", gr.skip(), gr.skip()
                return
            key_id = key_id_of(request)
            if cid:
                web.check(cid, key_id)
            audio, images, files = split_attachments(paths)
            view = TurnView(question=text, attachments=tuple(a.name for a in (*images, *files)),
                            resolve_artifact=web.resolve_artifact)
            view.status = "Transcribing…" if audio else "Reading the attachments…" if files else "Thinking…"
            yield None, history + view.messages(), cid, view.status, gr.skip(), gr.skip()
            cancel = web.begin(request.session_hash or "")
            if files:  # ingested and claimed first, so the turn's scope holds them
                where = LIBRARY if where == LIBRARY else CONVERSATION
                if cid is None:  # the files are also the conversation's, at /data in its sandbox
                    cid = web.start(text or files[0].name, key_id)
                try:
                    for event in web.attach(files, key_id, cid, where):
                        view.feed(event)
                        yield None, history + view.messages(), cid, view.status, gr.skip(), gr.skip()
                except AssistantError as e:
                    view.feed(Error(str(e)))
                    view.feed(Done(cid or "", "", "", "error"))
                    yield None, *turn_outputs(view, history, cid)
                    return
            if cid is None and web.tier_policy(key_id):  # the first question is already checked under it
                cid = web.start(text or "Voice question", key_id)
            user_input = UserInput(text, audio=audio, images=images, speak=bool(voice),
                                   model=assistant.models.role(choice))
            events = assistant.turn(cid, user_input, params=web.params(temp, tokens), cancel=cancel,
                                    scope=web.scope(key_id, cid))
            for view in web.run(view, events, cid, key_id):
                yield None, *turn_outputs(view, history, cid)

        def ask(message: str, cid: str | None, request: gr.Request):
            key_id = key_id_of(request)
            if cid:
                web.check(cid, key_id)
            if cid is None and web.tier_policy(key_id):
                cid = web.start(message or "Question", key_id)
            cancel = web.begin(request.session_hash or "")
            view = TurnView(question=message)
            events = assistant.turn(cid, (message or "").strip(), cancel=cancel, scope=web.scope(key_id, cid))
            for view in web.run(view, events, cid, key_id):
                yield view.messages()[-1]["content"] if view.answer or view.finish_reason else "", \
                    view.conversation_id or cid

        def regenerate(cid: str | None, temp: float, tokens: float, request: gr.Request):
            if not cid:
                yield [], cid, "Nothing to regenerate yet.", gr.skip(), None
                return
            web.check(cid, key_id_of(request))
            history = web.history(cid)
            last_user = max((i for i, m in enumerate(history) if m["role"] == "user"), default=-1)
            history = history[:last_user + 1]
            cancel = web.begin(request.session_hash or "")
            view = TurnView(resolve_artifact=web.resolve_artifact)
            events = assistant.regenerate(cid, params=web.params(temp, tokens), cancel=cancel,
                                          scope=web.scope(key_id_of(request), cid))
            for view in web.run(view, events, cid, key_id_of(request)):
                yield turn_outputs(view, history, cid)

        def edit(cid: str | None, temp: float, tokens: float, edit_data: gr.EditData, request: gr.Request):
            if not cid:
                yield web.history(cid), cid, "Nothing to edit yet.", gr.skip(), None
                return
            web.check(cid, key_id_of(request))
            shown = edit_data.index if isinstance(edit_data.index, int) else edit_data.index[0]
            chat_history = web.history(cid)
            # the n-th user message on the page is the n-th stored question of the active branch
            users = [m for m in assistant.conversations.history(cid) if m.role == "user"]
            rendered = web.history(cid)
            n = sum(1 for m in rendered[:shown] if m["role"] == "user")
            if n >= len(users):
                yield chat_history, cid, "That message cannot be edited.", gr.skip(), None
                return
            before = rendered[:[i for i, m in enumerate(rendered) if m["role"] == "user"][n]]
            view = TurnView(question=str(edit_data.value), resolve_artifact=web.resolve_artifact)
            cancel = web.begin(request.session_hash or "")
            events = assistant.edit(cid, users[n].id, str(edit_data.value), params=web.params(temp, tokens),
                                    cancel=cancel, scope=web.scope(key_id_of(request), cid))
            for view in web.run(view, events, cid, key_id_of(request)):
                yield turn_outputs(view, before, cid)

        def stop_answer(request: gr.Request):
            web.stop(request.session_hash or "")

        def new_chat():
            return [], None, "", "", None

        def resume(cid: str, request: gr.Request):
            cid = (cid or "").strip()
            try:
                web.check(cid, key_id_of(request))
            except AssistantError as e:
                raise gr.Error(str(e)) from e
            return web.history(cid), cid

        def open_conversation(cid: str | None, request: gr.Request):
            if not cid:
                return gr.skip(), gr.skip(), gr.skip(), ""
            history, cid = resume(cid, request)
            return history, cid, assistant.conversations.get(cid).title, ""

        def rename_conversation(cid: str | None, title: str, query: str, request: gr.Request):
            if not cid or not title.strip():
                return gr.skip(), gr.skip(), "Open a conversation and type its new title first."
            web.check(cid, key_id_of(request))
            if title.strip() == assistant.conversations.get(cid).title:
                return gr.skip(), gr.skip(), "That is already its title: type the new one in the box first."
            assistant.conversations.rename(cid, title.strip())
            radio, title_value = sidebar(cid, query, request)
            return radio, title_value, "Renamed."

        def delete_conversation(cid: str | None, query: str, request: gr.Request):
            if not cid:
                return gr.skip(), gr.skip(), gr.skip(), gr.skip(), "No conversation is open."
            web.delete(cid, key_id_of(request))
            radio, _ = sidebar(None, query, request)
            return radio, [], None, "", "Deleted."

        def export(cid: str | None, fmt: str, request: gr.Request):
            if not cid:
                return gr.update(visible=False), "Nothing to export yet."
            web.check(cid, key_id_of(request))
            folder = Path(assistant.config.data_dir) / "exports" / secrets.token_hex(6)
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"conversation-{cid[:8]}.{fmt}"
            path.write_text(assistant.conversations.export(cid, fmt), encoding="utf-8")
            return gr.update(value=str(path), visible=True), f"Exported as {fmt.upper()}."

        def switch_branch(cid: str | None, step: int, request: gr.Request):
            message, position, count = web.branch(cid)
            if message is None:
                return gr.skip(), gr.skip(), gr.skip(), gr.skip(), "There are no other versions of this answer."
            web.check(cid, key_id_of(request))
            siblings = assistant.conversations.siblings(message.id)
            target = siblings[(position - 1 + step) % count]
            assistant.conversations.switch(cid, target.id)
            return web.history(cid), *branch_controls(cid), ""

        def previous_branch(cid: str | None, request: gr.Request):
            return switch_branch(cid, -1, request)

        def next_branch(cid: str | None, request: gr.Request):
            return switch_branch(cid, 1, request)

        def export_markdown(cid: str | None, request: gr.Request):
            return export(cid, "md", request)

        def export_json_file(cid: str | None, request: gr.Request):
            return export(cid, "json", request)

        def branch_controls(cid: str | None) -> tuple[str, Any, Any]:
            """'version i/n' and the ◀ ▶ buttons, shown only when an answer has other versions."""
            _, position, count = web.branch(cid)
            shown = gr.update(visible=count > 1)
            return (f"version {position}/{count}" if count > 1 else ""), shown, shown

        def current(cid: str | None):
            return cid or ""

        # -- wiring -----------------------------------------------------------------------------
        settings = [speak, temperature, max_tokens, model, attach_to]
        shown = [chatbot, conversation, status, usage, player]
        refresh_sidebar = dict(fn=sidebar, inputs=[conversation, search], outputs=[past, title_box], api_name=False,
                               queue=False)
        branch_outputs = [branch_label, older, newer]
        refresh_branch = dict(fn=branch_controls, inputs=[conversation], outputs=branch_outputs, api_name=False,
                              queue=False)
        refresh_library = dict(fn=library_text, inputs=[conversation], outputs=[library, doomed], api_name=False)
        submitted = box.submit(chat, [box, chatbot, conversation, *settings], [box, *shown], api_name="chat",
                               concurrency_limit=4)
        submitted.then(**refresh_sidebar).then(**refresh_branch) \
            .then(**refresh_library)
        stop.click(stop_answer, None, None, api_name="stop", queue=False)
        again.click(regenerate, [conversation, temperature, max_tokens], [chatbot, conversation, status, usage, player],
                    api_name="regenerate").then(**refresh_branch)
        chatbot.edit(edit, [conversation, temperature, max_tokens], [chatbot, conversation, status, usage, player],
                     api_name=False).then(**refresh_branch)
        older.click(previous_branch, [conversation], [chatbot, *branch_outputs, status], api_name=False)
        newer.click(next_branch, [conversation], [chatbot, *branch_outputs, status], api_name=False)
        new.click(new_chat, None, [chatbot, conversation, status, title_box, exported], api_name="new_chat") \
            .then(**refresh_sidebar).then(**refresh_library).then(**refresh_branch)
        search.change(**refresh_sidebar)
        speak.change(lambda on: gr.update(visible=on), speak, player, api_name=False, queue=False)
        past.input(open_conversation, [past], [chatbot, conversation, title_box, status],
                   api_name=False).then(**refresh_branch) \
            .then(**refresh_library)
        rename.click(rename_conversation, [conversation, title_box, search], [past, title_box, status],
                     api_name=False)
        delete.click(delete_conversation, [conversation, search], [past, chatbot, conversation, title_box, status],
                     api_name=False).then(**refresh_library).then(**refresh_branch)
        remove_doc.click(remove_document, [doomed, conversation], [library, doomed, status], api_name=False)
        export_md.click(export_markdown, [conversation], [exported, status], api_name=False)
        export_json.click(export_json_file, [conversation], [exported, status], api_name=False)
        app.load(**refresh_sidebar).then(**refresh_library)

        api_in = gr.Textbox(visible=False)
        api_out = gr.Textbox(visible=False)
        api_button = gr.Button(visible=False)
        api_button.click(ask, [api_in, conversation], [api_out, conversation], api_name="ask")
        api_cid = gr.Textbox(visible=False)
        resume_button = gr.Button(visible=False)
        resume_button.click(resume, [api_cid], [chatbot, conversation], api_name="resume")
        current_button = gr.Button(visible=False)
        current_button.click(current, [conversation], [api_cid], api_name="conversation")
    return app


def mount_web_chat(app: Any, assistant: Any, gateway: Any, *, path: str = "/") -> Any:
    """Mount the web chat on the server's FastAPI `app`. With API keys configured (server.api_keys or keys
    in the store), the page asks for a key first (/login); the key's id is the Gradio user, so every
    handler sees only what that key owns, as the REST API does (Authorization: Bearer works too)."""
    import gradio as gr
    from fastapi import Form, Request
    from fastapi.responses import HTMLResponse, RedirectResponse

    sessions: dict[str, str] = {}  # login cookie -> the key it was opened with (checked again on every request)

    def user_of(request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        if not header.strip():
            key = sessions.get(request.cookies.get(COOKIE, ""), "")
            header = f"Bearer {key}" if key else ""
        principal = gateway.auth.authenticate(header)
        if principal is None:
            return None
        return principal.key_id or LOCAL_USER

    @app.get("/login", include_in_schema=False)
    def login_page(error: str = "") -> HTMLResponse:
        return HTMLResponse(login_html(error), status_code=401 if error else 200)

    @app.post("/login", include_in_schema=False)
    def login(key: str = Form("")) -> Any:
        if gateway.auth.authenticate(f"Bearer {key.strip()}") is None or not key.strip():
            return HTMLResponse(login_html("That key is not valid (unknown, mistyped or revoked)."), status_code=401)
        token = secrets.token_urlsafe(24)
        sessions[token] = key.strip()
        response = RedirectResponse(path, status_code=303)
        response.set_cookie(COOKIE, token, httponly=True, samesite="lax", path="/")
        return response

    @app.get("/logout", include_in_schema=False)
    def logout(request: Request) -> Any:
        sessions.pop(request.cookies.get(COOKIE, ""), None)
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(COOKIE, path="/")
        return response

    app.add_middleware(LoginRedirect, user_of=user_of, page=path)
    blocks = build_app(assistant)
    blocks.queue(default_concurrency_limit=4)
    data_dir = Path(assistant.config.data_dir).resolve()
    return gr.mount_gradio_app(app, blocks, path=path, footer_links=["api"], ssr_mode=False, css=CSS, head=HEAD,
                               auth_dependency=user_of, allowed_paths=[str(data_dir / "artifacts"),
                                                                       str(data_dir / "exports")])


class LoginRedirect:
    """ASGI middleware: a browser that opens the chat page without a valid login goes to /login."""

    def __init__(self, app: Any, user_of: Any, page: str = "/") -> None:
        self.app, self.user_of, self.page = app, user_of, page

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") == "GET" and scope.get("path") == self.page:
            from fastapi import Request
            from fastapi.responses import RedirectResponse
            from starlette.concurrency import run_in_threadpool

            if await run_in_threadpool(self.user_of, Request(scope)) is None:
                await RedirectResponse("/login", status_code=303)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def login_html(error: str = "") -> str:
    import html

    message = f'<p class="error" role="alert">{html.escape(error)}</p>' if error else ""
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1"><title>Log in · {TITLE}</title>
<style>body{{font-family:system-ui,sans-serif;display:grid;place-items:center;min-height:90vh;margin:0 1em}}
form{{max-width:26em;width:100%;display:grid;gap:.75em}}input,button{{font-size:1em;padding:.6em}}
button{{background:#f97316;color:#fff;border:0;border-radius:.4em}}.error{{color:#b91c1c}}</style></head>
<body><form method="post" action="/login"><h2>{TITLE}</h2>
<label for="key">API key</label><input id="key" name="key" type="password" autocomplete="current-password"
 placeholder="sk-asst-…" required autofocus>{message}<button id="login" type="submit">Log in</button>
<small>Ask the administrator for a key (<code>assistant keys create</code>).</small></form></body></html>"""
