"""`assistant serve`: the Gradio web chat, a thin adapter over Orchestrator.run_turn.

Each browser session (and each `gradio_client.Client`) keeps its conversation id in a `gr.State`, so
a conversation continues across turns and is stored server-side; the Chatbot only renders. API
endpoints (for gradio_client and scripts):
  /chat   (message, history) -> (cleared textbox, history)   streaming, used by the web page
  /ask    (message) -> answer text                            streaming, same conversation state
  /new_chat () -> ()                                          start a new conversation
"""

from __future__ import annotations

from typing import Any, Iterator

from assistant.config import AssistantConfig
from assistant.events import Done, Error, Notice, TextDelta, Usage

TITLE = "Offline Assistant"


def _stream_answer(orchestrator: Any, message: str, conversation_id: str | None) -> Iterator[tuple[str, str | None, str]]:
    """Yield (answer so far, conversation id, status line) while the turn runs."""
    answer, status = "", ""
    for event in orchestrator.run_turn(conversation_id, message):
        if isinstance(event, TextDelta):
            answer += event.text
        elif isinstance(event, (Error, Notice)):
            status = event.message
            if isinstance(event, Error):
                answer += f"\n\n**Error:** {event.message}"
        elif isinstance(event, Usage):
            status = f"{event.prompt_tokens} prompt + {event.completion_tokens} answer tokens of {event.context_window}"
            if event.dropped_messages:
                status += f" ({event.dropped_messages} old messages left out)"
        elif isinstance(event, Done):
            conversation_id = event.conversation_id
        yield answer, conversation_id, status


def build_app(orchestrator: Any) -> Any:
    import gradio as gr

    with gr.Blocks(title=TITLE) as app:
        gr.Markdown(f"## {TITLE}\nRuns fully offline on this machine.")
        conversation = gr.State(None)
        chatbot = gr.Chatbot(label="Chat", height=520)
        with gr.Row():
            box = gr.Textbox(placeholder="Ask anything, then press Enter", show_label=False, scale=8, autofocus=True)
            send = gr.Button("Send", variant="primary", scale=1)
            new = gr.Button("New chat", scale=1)
        status = gr.Markdown("")

        def chat(message: str, history: list[dict], cid: str | None):
            message = (message or "").strip()
            history = list(history or [])
            if not message:
                yield "", history, cid, ""
                return
            history += [{"role": "user", "content": message}, {"role": "assistant", "content": ""}]
            for answer, cid, line in _stream_answer(orchestrator, message, cid):
                history[-1] = {"role": "assistant", "content": answer}
                yield "", history, cid, line

        def ask(message: str, cid: str | None):
            answer = ""
            for answer, cid, _ in _stream_answer(orchestrator, (message or "").strip(), cid):
                yield answer, cid

        def new_chat():
            return [], None, ""

        outputs = [box, chatbot, conversation, status]
        box.submit(chat, [box, chatbot, conversation], outputs, api_name="chat")
        send.click(chat, [box, chatbot, conversation], outputs, api_name=False)
        new.click(new_chat, None, [chatbot, conversation, status], api_name="new_chat")
        api_in = gr.Textbox(visible=False)
        api_out = gr.Textbox(visible=False)
        api_button = gr.Button(visible=False)
        api_button.click(ask, [api_in, conversation], [api_out, conversation], api_name="ask")
    return app


def serve(config: AssistantConfig, *, orchestrator: Any = None) -> None:
    """Load the model, then serve until Ctrl-C."""
    if orchestrator is None:
        from assistant.orchestrator import Orchestrator

        print(f"Loading model {config.engine.model}...", flush=True)
        orchestrator = Orchestrator.from_config(config)
    app = build_app(orchestrator)
    app.queue(default_concurrency_limit=4)
    print(f"Web chat on http://{config.server.host}:{config.server.port}  (Ctrl-C to stop)", flush=True)
    try:
        app.launch(server_name=config.server.host, server_port=config.server.port, share=False,
                   show_error=True, quiet=True, footer_links=["api"], ssr_mode=False)
    except KeyboardInterrupt:
        pass
    finally:
        app.close()
        print("Stopped.", flush=True)
