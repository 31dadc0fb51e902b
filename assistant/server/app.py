"""The server app: one FastAPI application with every route group mounted in one place.

`create_app(config, orchestrator)` mounts the OpenAI-compatible API under /v1 and the Gradio web
chat at /; `serve(config)` builds everything and runs it with uvicorn until Ctrl-C.
"""

from __future__ import annotations

from typing import Any

from assistant.config import AssistantConfig

TITLE = "Offline Assistant"


def create_app(config: AssistantConfig, orchestrator: Any) -> Any:
    """One ASGI app: the OpenAI-compatible API under /v1 and the web chat at /."""
    import gradio as gr
    from fastapi import FastAPI

    from assistant.server.openai import create_api
    from ui.gradio_app import build_app

    app = FastAPI(title=TITLE)
    app.include_router(create_api(orchestrator.engine, model_name=config.engine.model, api_keys=config.api_keys))
    blocks = build_app(orchestrator)
    blocks.queue(default_concurrency_limit=4)
    return gr.mount_gradio_app(app, blocks, path="/", footer_links=["api"], ssr_mode=False)


def serve(config: AssistantConfig, *, orchestrator: Any = None) -> None:
    """Load the model, then serve the web chat and the /v1 API until Ctrl-C."""
    import uvicorn

    if orchestrator is None:
        from assistant.orchestrator import Orchestrator

        print(f"Loading model {config.engine.model}...", flush=True)
        orchestrator = Orchestrator.from_config(config)
    app = create_app(config, orchestrator)
    base = f"http://{config.server.host}:{config.server.port}"
    print(f"Web chat on {base}  ·  OpenAI-compatible API on {base}/v1  (Ctrl-C to stop)", flush=True)
    try:
        uvicorn.run(app, host=config.server.host, port=config.server.port, log_level="warning",
                    timeout_graceful_shutdown=3)  # open streams (browser tabs) must not block Ctrl-C
    finally:
        orchestrator.engine.close()
        print("Stopped.", flush=True)
