"""The Gradio web chat: a thin renderer of the turn's event stream, over the `Assistant` facade
(assistant/app.py). The server (assistant/server/app.py) mounts it at /.

Each browser session (and each `gradio_client.Client`) keeps its conversation id in a `gr.State`, so
a conversation continues across turns and is stored server-side; the Chatbot only renders. API
endpoints (for gradio_client and scripts):
  /chat   (message, history) -> (cleared textbox, history)   streaming, used by the web page
  /ask    (message) -> answer text                            streaming, same conversation state
  /new_chat () -> ()                                          start a new conversation
  /conversation () -> conversation id                         the session's current conversation ("" if none)
  /resume (conversation id) -> history                        continue a stored conversation (after a restart)
  /regenerate () -> history                                   answer the last question again (new branch)
Tool steps and the turn's token accounting show in the status line; verified sources are listed under
the answer they belong to.
"""

from __future__ import annotations

from typing import Any, Iterator

from assistant.config import AssistantConfig
from assistant.errors import AssistantError
from assistant.events import Done, Error, Notice, Sources, TextDelta, ToolCallFinished, ToolCallStarted, Usage

TITLE = "Offline Assistant"


def _stream_answer(assistant: Any, message: str, conversation_id: str | None, *,
                   events: Any = None) -> Iterator[tuple[str, str | None, str]]:
    """Yield (answer so far, conversation id, status line) while the turn runs."""
    answer, status, sources = "", "", ""
    stream = events if events is not None else assistant.turn(conversation_id, message)
    for event in stream:
        if isinstance(event, TextDelta):
            answer += event.text
        elif isinstance(event, (Error, Notice)):
            status = event.message
            if isinstance(event, Error):
                answer += f"\n\n**Error:** {event.message}"
        elif isinstance(event, ToolCallStarted):
            status = f"Running {event.name}..."
        elif isinstance(event, ToolCallFinished):
            status = f"{event.name}: {'ok' if event.ok else 'failed'}, {event.summary}"
        elif isinstance(event, Sources):
            sources = format_sources(event)
        elif isinstance(event, Usage):
            status = f"{event.prompt_tokens} prompt + {event.completion_tokens} answer tokens of {event.context_window}"
            parts = [f"{name.replace('_', ' ')} {event.breakdown[name]}" for name in ("tools", "memory", "history",
                     "retrieved", "tool_steps") if event.breakdown.get(name)]
            if parts:
                status += f" (prompt: {', '.join(parts)})"
            if event.num_steps > 1:
                status += f" in {event.num_steps} steps"
            if event.dropped_messages:
                status += f" ({event.dropped_messages} old messages left out)"
        elif isinstance(event, Done):
            conversation_id = event.conversation_id
            answer = (event.text if event.finish_reason != "error" else answer) + sources  # verified markers only
        yield answer, conversation_id, status


def format_sources(event: Sources) -> str:
    if not event.sources:
        return ""
    lines = [f"- [{s.marker}] {s.doc}" + (f", p. {s.page}" if s.page is not None else "") for s in event.sources]
    return "\n\n**Sources**\n" + "\n".join(lines)


def render_history(conversations: Any, conversation_id: str | None) -> list[dict]:
    """The active branch of a stored conversation as Chatbot messages (sources under each answer)."""
    if not conversation_id:
        return []
    out = []
    for m in conversations.history(conversation_id):
        if m.role not in ("user", "assistant"):
            continue
        content = m.content
        cited = m.meta.get("sources", []) if m.meta else []
        if cited:
            content += "\n\n**Sources**\n" + "\n".join(
                f"- [{c['marker']}] {c['doc']}" + (f", p. {c['page']}" if c.get("page") is not None else "") for c in cited)
        out.append({"role": m.role, "content": content})
    return out


def build_app(assistant: Any) -> Any:
    import gradio as gr

    with gr.Blocks(title=TITLE) as app:
        gr.Markdown(f"## {TITLE}\nRuns fully offline on this machine.")
        conversation = gr.State(None)
        chatbot = gr.Chatbot(label="Chat", height=520)
        with gr.Row():
            box = gr.Textbox(placeholder="Ask anything, then press Enter", show_label=False, scale=8, autofocus=True)
            send = gr.Button("Send", variant="primary", scale=1)
            again = gr.Button("Regenerate", scale=1)
            new = gr.Button("New chat", scale=1)
        status = gr.Markdown("")

        def chat(message: str, history: list[dict], cid: str | None):
            message = (message or "").strip()
            history = list(history or [])
            if not message:
                yield "", history, cid, ""
                return
            history += [{"role": "user", "content": message}, {"role": "assistant", "content": ""}]
            for answer, cid, line in _stream_answer(assistant, message, cid):
                history[-1] = {"role": "assistant", "content": answer}
                yield "", history, cid, line

        def ask(message: str, cid: str | None):
            answer = ""
            for answer, cid, _ in _stream_answer(assistant, (message or "").strip(), cid):
                yield answer, cid

        def new_chat():
            return [], None, ""

        def regenerate(cid: str | None):
            if not cid:
                yield [], cid, "Nothing to regenerate yet."
                return
            history = render_history(assistant.conversations, cid)[:-1] + [{"role": "assistant", "content": ""}]
            for answer, cid, line in _stream_answer(assistant, "", cid, events=assistant.regenerate(cid)):
                history[-1] = {"role": "assistant", "content": answer}
                yield history, cid, line

        def resume(cid: str):
            cid = (cid or "").strip()
            try:
                assistant.conversations.get(cid)
            except AssistantError as e:
                raise gr.Error(str(e)) from e
            return render_history(assistant.conversations, cid), cid

        def current(cid: str | None):
            return cid or ""

        def past_conversations():
            return gr.update(choices=[(f"{c.title or c.id}", c.id) for c in assistant.conversations.list()[:50]])

        outputs = [box, chatbot, conversation, status]
        box.submit(chat, [box, chatbot, conversation], outputs, api_name="chat")
        send.click(chat, [box, chatbot, conversation], outputs, api_name=False)
        new.click(new_chat, None, [chatbot, conversation, status], api_name="new_chat")
        again.click(regenerate, [conversation], [chatbot, conversation, status], api_name="regenerate")
        with gr.Accordion("Past conversations", open=False):
            with gr.Row():
                past = gr.Dropdown(choices=[], label="Conversation", scale=6)
                refresh = gr.Button("Refresh", scale=1)
                open_button = gr.Button("Open", scale=1)
        refresh.click(past_conversations, None, past, api_name=False)
        open_button.click(resume, [past], [chatbot, conversation], api_name=False)
        app.load(past_conversations, None, past, api_name=False)
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
