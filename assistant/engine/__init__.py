"""LLM engines behind one seam (see base.py). Heavy backends are imported only when created."""

from __future__ import annotations

from assistant.config import AssistantConfig
from assistant.engine.base import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    Engine,
    Message,
    SamplingParams,
    TokenDelta,
)

__all__ = ["Engine", "Message", "SamplingParams", "TokenDelta", "FINISH_STOP", "FINISH_LENGTH",
           "FINISH_CANCELLED", "create_engine"]


def create_engine(config: AssistantConfig) -> Engine:
    """The configured engine: a remote OpenAI-compatible server if `engine.remote_url`, else in-process."""
    if config.engine.remote_url:
        from assistant.engine.remote import RemoteEngine

        return RemoteEngine.from_config(config)
    import logging

    from assistant.engine.hf_loop import HFLoopEngine
    from assistant.engine.loading import load_draft_model, load_model
    from assistant.engine.local import LocalEngine
    from assistant.engine.model import unsupported_reason

    loaded = load_model(config)
    reason = unsupported_reason(loaded.model.config)
    if reason:
        logging.getLogger(__name__).warning("Serving one request at a time with transformers: %s.", reason)
        return HFLoopEngine(loaded)
    return LocalEngine(loaded, config.engine, load_draft_model(config))
