"""The server app: one FastAPI application; every route group is declared in `create_app`.

    /v1/...          OpenAI-compatible API: chat completions, models, embeddings (assistant/server/openai.py)
    /v1/audio/...    transcriptions and speech, in OpenAI's shapes (assistant/server/audio.py)
    /v1/moderations  the safety layer's scores and verdict, in OpenAI's shape (assistant/server/moderations.py)
    /api/turns ...   the full assistant turn as server-sent TurnEvents (assistant/server/turns.py)
    /api/conversations, /api/documents   the caller's conversations and documents (assistant/server/rest.py)
    /metrics         Prometheus metrics (assistant/server/metrics.py)
    /                the Gradio web chat (ui/gradio_app.py), mounted last

A feature adds its routes here, as one more `include_router`. Each concern of the gateway is one
module: keys (auth.py), rate limits (limits.py, redis_limits.py), admission (admission.py), the
request lifecycle and usage ledger (gateway.py), request ids / trace context / the body limit
(middleware.py), metrics (metrics.py). The server owns no component: `serve(config)` builds the
app's `Assistant` (assistant/app.py) and closes it on the way out.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

from assistant.config import AssistantConfig

TITLE = "Offline Assistant"


def create_app(assistant: Any, *, web_chat: bool = True, gateway: Any = None) -> Any:
    """One ASGI app over an Assistant: the API routes, then the web chat at /."""
    from fastapi import FastAPI, Response

    from assistant.server.gateway import Gateway
    from assistant.server.middleware import GatewayMiddleware
    from assistant.server.openai import create_api
    from assistant.server.rest import create_rest_api
    from assistant.server.turns import TurnRunner, create_turn_routes

    gateway = gateway or Gateway.from_assistant(assistant)
    app = FastAPI(title=TITLE, lifespan=_release_turns)
    app.state.gateway = gateway
    app.add_middleware(GatewayMiddleware, max_body_bytes=gateway.max_body_bytes,
                       max_upload_bytes=gateway.max_upload_bytes, metrics=gateway.metrics)
    app.include_router(create_api(assistant.models.engine(), model_name=assistant.models.default,
                                  assistant=assistant, gateway=gateway))
    turns = TurnRunner(assistant, gateway)  # one set of running turns: any of them cancelled at /api/turns
    app.state.turns = turns
    app.include_router(create_turn_routes(assistant, runner=turns))
    app.include_router(create_rest_api(turns))
    if getattr(assistant, "media", None) is not None:
        from assistant.server.audio import create_audio_api

        app.include_router(create_audio_api(assistant, gateway))
    from assistant.server.moderations import create_moderation_api

    app.include_router(create_moderation_api(assistant, gateway))

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        body, content_type = gateway.metrics.render()
        return Response(body, media_type=content_type)

    if not web_chat:
        return app
    from ui.gradio_app import mount_web_chat

    return mount_web_chat(app, assistant, gateway)  # with keys configured, a login screen first


@asynccontextmanager
async def _release_turns(app: Any) -> AsyncIterator[None]:
    """When the server stops: stop the turn registry's Redis listener (redis_turns.py), so an app
    that is stopped leaves no thread behind retrying a Redis that may be gone too."""
    yield
    if (turns := getattr(app.state, "turns", None)) is not None:
        turns.running.close()


def serve(config: AssistantConfig, *, assistant: Any = None) -> None:
    """Load the model, then serve the web chat and the APIs until Ctrl-C."""
    import uvicorn

    from assistant.app import build_assistant
    from assistant.server.auth import Authenticator, check_bind
    from assistant.server.gateway import Gateway

    if assistant is None:
        print(f"Loading model {config.engine.model}...", flush=True)
        assistant = build_assistant(config)
    gateway = app = None
    previous_sigterm = None
    try:
        check_bind(config.server.host, Authenticator.from_config(config, assistant.keys))
        _preload_large(assistant)  # once the address is known to be usable: nothing loaded for a refused start
        _log_access_to(Path(config.data_dir) / "logs" / "access.jsonl")
        gateway = Gateway.from_assistant(assistant)
        app = create_app(assistant, gateway=gateway)
        base = f"http://{config.server.host}:{config.server.port}"
        print(f"Web chat on {base}  ·  OpenAI-compatible API on {base}/v1  (Ctrl-C to stop)", flush=True)
        previous_sigterm = _exit_on_sigterm()
        uvicorn.run(app, host=config.server.host, port=config.server.port, log_level="warning",
                    timeout_graceful_shutdown=3)  # open streams (browser tabs) must not block Ctrl-C
    finally:
        if (turns := getattr(getattr(app, "state", None), "turns", None)) is not None:
            turns.running.close()  # the app's lifespan did, unless the server never started (a port in use)
        if gateway is not None:
            gateway.close()
        assistant.close()
        if previous_sigterm is not None:  # a caller's own handler (serve run in-process) back as it was
            signal.signal(signal.SIGTERM, previous_sigterm)
        print("Stopped.", flush=True)


def _exit_on_sigterm() -> Any:
    """A service manager's stop (SIGTERM, `docker stop`): uvicorn shuts down gracefully and then raises the signal
    again, whose default action ended the process before `serve` closed the assistant (its store, library and
    engines); as SystemExit it goes through the `finally` like Ctrl-C does. -> the handler it replaced (None off
    the main thread, where signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))


def _preload_large(assistant: Any) -> None:
    """The large model (document and general questions: assistant/routing.py) loads while the server starts
    serving (14-17 s at `make run`'s start on 2 cores, beside the small model's), not on the first question that
    needs it; a document turn meanwhile waits for it, a general question goes to the small model."""
    from assistant.models import known_model_names, resolve_model_name

    large = assistant.config.engine.large_model
    if large in known_model_names():  # "large" (engine.large_model = "auto") by its own name
        large = resolve_model_name(large).name
    start = time.monotonic()

    def done(engine: Any, error: str) -> None:
        if engine is not None:
            print(f"Large model {large} ready for questions ({time.monotonic() - start:.0f} s).", flush=True)
        else:
            print(f"The large model {large} could not be loaded ({error}); every question uses "
                  f"{assistant.config.engine.model}.", flush=True)

    if assistant.models.preload_large(done):
        print(f"Loading the large model {large} in the background (until it is ready, {assistant.config.engine.model} "
              "answers general questions)...", flush=True)


def _log_access_to(path: Path) -> None:
    """One JSON line per request (id, trace, route, status, latency, key id; middleware.py) in the data dir."""
    import logging

    logger = logging.getLogger("assistant.access")
    if any(getattr(h, "baseFilename", None) == str(path.resolve()) for h in logger.handlers):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def register(subparsers: Any, add_common: Any) -> None:
    """`assistant serve` (see assistant/commands.py)."""
    serve_parser = subparsers.add_parser("serve", help="serve the web chat and the APIs on http://HOST:PORT")
    add_common(serve_parser)
    serve_parser.add_argument("--host", default=None, help="interface to bind (default 127.0.0.1)")
    serve_parser.add_argument("--port", type=int, default=None, help="port (default 7860)")
    serve_parser.set_defaults(func=_cmd_serve)


def _cmd_serve(args: Any, config: AssistantConfig) -> int:
    try:
        serve(config)
    finally:
        exit_if_loading()
    return 0


def exit_if_loading() -> None:
    """End the process now, with the exit status it was about to have, if the large model is still loading.

    Why: stopped while the large model loads in the background (assistant/routing.py `preload`), the process
    aborted ("terminate called without an active exception") after "Stopped.". Python 3.11-3.13 end a daemon
    thread that reacquires the GIL during interpreter shutdown with pthread_exit, whose unwinding aborts when it
    crosses a C++ frame (torch's gil_scoped_release, gdb backtrace). By now `serve` has closed the store, the
    library and the engines, so nothing is lost by skipping the shutdown: logs and streams are flushed first."""
    import logging
    import os

    from assistant.routing import LOADER_THREAD

    if not any(t.name == LOADER_THREAD and t.is_alive() for t in threading.enumerate()):
        return
    error = sys.exc_info()[1]
    if error is not None and not isinstance(error, (KeyboardInterrupt, SystemExit)):
        return  # a failure: its traceback matters more than a clean exit
    code = 130 if isinstance(error, KeyboardInterrupt) else 0
    if isinstance(error, SystemExit) and isinstance(error.code, int):
        code = error.code
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
