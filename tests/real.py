"""Helpers for tests on the real packaged models (marked `real`)."""

from __future__ import annotations

from pathlib import Path

from assistant.models import prepared_path, resolve_model_name
from tests.conftest import need


def prepared_default_model(models_dir: Path) -> Path:
    path = prepared_path(resolve_model_name("qwen2.5-coder-0.5b"), models_dir)
    need(path is not None, f"the prepared default model in {models_dir}",
         "run `make test` or `assistant models prepare` (set ASSISTANT_MODELS_DIR to share it)")
    return path
