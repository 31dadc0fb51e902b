"""The vector-index seam (`VectorIndex`) and the types and constants its two backends share.

Every point carries a payload; three kinds share one collection:
  chunk  — dense + sparse vectors, text, doc_id, version, page, heading, char offsets, visible flag
  page   — no vectors; the full text of one page (for `Retriever.read`), doc_id, version, visible
  doc    — no vectors; the ledger record of one document (path, committed version, dirty flag, …)

`Where` is the one filter language of the seam: `{"field": value}` (equal), `{"field": [a, b]}`
(any of), `{"field": Not(value)}` (not equal); all conditions must hold. Hybrid search runs
entirely inside Qdrant: a dense prefetch and a sparse (BM25, IDF modifier) prefetch fused by RRF.

Backends: `EdgeIndex` (index.py, Qdrant Edge on local disk, the default) and `QdrantServerIndex`
(index_server.py, a Qdrant server through qdrant-client); `index.open_index` picks the configured one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np

DENSE, SPARSE = "dense", "sparse"  # vector names
KEYWORD_FIELDS = ("kind", "doc_id", "version", "path", "file_name")
INTEGER_FIELDS = ("page", "visible", "dirty")  # flags are 0/1: Edge matches booleans as integers
RRF_K = 60  # RRF constant (score = Σ 1/(k + rank)); the same on every backend
SEARCH_MODES = ("hybrid", "dense", "sparse")


class Not(NamedTuple):
    value: Any


Where = dict[str, Any]
SparseVec = tuple[list[int], list[float]]  # (indices, values)


@dataclass
class IndexPoint:
    id: str  # UUID string
    payload: dict[str, Any]
    dense: np.ndarray | None = None  # (dim,) float32
    sparse: SparseVec | None = None


@dataclass
class ScoredPayload:
    id: str
    score: float
    payload: dict[str, Any]


class VectorIndex(ABC):
    """A collection of points with payloads, dense + sparse vectors, and filterable fields."""

    dim: int

    @abstractmethod
    def upsert(self, points: Sequence[IndexPoint]) -> None: ...

    @abstractmethod
    def delete(self, where: Where) -> None: ...

    @abstractmethod
    def set_payload(self, where: Where, payload: dict[str, Any]) -> None: ...

    @abstractmethod
    def scroll(self, where: Where, *, batch: int = 256) -> Iterator[dict[str, Any]]:
        """Payloads of every point matching `where` (order unspecified)."""

    @abstractmethod
    def count(self, where: Where) -> int: ...

    @abstractmethod
    def query(self, *, dense: np.ndarray | None, sparse: SparseVec | None, limit: int, where: Where,
              mode: str = "hybrid", candidates: int = 50) -> list[ScoredPayload]:
        """Top `limit` points: dense / sparse nearest, or both fused by RRF over `candidates` each."""

    def flush(self) -> None:
        """Make every update durable."""

    def optimize(self) -> bool:
        """Build indexes for search speed (may take minutes on a large collection)."""
        return False

    def close(self) -> None:
        """Release the collection (flushes first)."""

    def __enter__(self) -> "VectorIndex":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_mode(mode: str, dense, sparse) -> None:
    if mode not in SEARCH_MODES:
        raise ValueError(f"search mode {mode!r}: use one of {', '.join(SEARCH_MODES)}")
    if mode in ("hybrid", "dense") and dense is None or mode in ("hybrid", "sparse") and sparse is None:
        raise ValueError(f"search mode {mode!r} needs the {'dense and sparse' if mode == 'hybrid' else mode} query vector")

