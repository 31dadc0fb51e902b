"""The vector-index seam (`VectorIndex`) with the types and constants its two backends share, and the
translation of its filters and points into Qdrant's structures that both use.

Every point carries a payload; three kinds share one collection:
  chunk  — dense + sparse vectors, text, doc_id, version, page, heading, char offsets, visible flag
  page   — no vectors; the full text of one page (for `Retriever.read`), doc_id, version, visible
  doc    — no vectors; the ledger record of one document (path, committed version, dirty flag, …)

`Where` is the one filter language of the seam: `{"field": value}` (equal), `{"field": [a, b]}`
(any of), `{"field": Not(value)}` (not equal); all conditions must hold. Hybrid search runs
entirely inside Qdrant: a dense prefetch and a sparse (BM25, IDF modifier) prefetch fused by RRF.

Backends: `EdgeIndex` (index.py, Qdrant Edge on local disk, the default) and `QdrantServerIndex`
(index_server.py, a Qdrant server through qdrant-client); `index.open_index` picks the configured one.
Qdrant Edge (`qdrant_edge`) and qdrant-client (`qdrant_client.models`) name their filter, match,
sparse-vector and point classes' arguments alike, so `qdrant_filter` and `qdrant_points` build either
from the module they are given.
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


# -- Qdrant structures (`models`: the qdrant_edge module, or qdrant_client.models) -------------------
def qdrant_filter(models: Any, where: Where):
    """`where` as a Qdrant Filter; None when it has no conditions."""
    must, must_not = [], []
    for key, value in where.items():
        target = must_not if isinstance(value, Not) else must
        value = value.value if isinstance(value, Not) else value
        if isinstance(value, (list, tuple, set)):
            match = models.MatchAny(any=list(value))
        else:
            match = models.MatchValue(value=value)
        target.append(models.FieldCondition(key=key, match=match))
    if not must and not must_not:
        return None
    return models.Filter(must=must or None, must_not=must_not or None)


def dense_vector(dense: np.ndarray) -> list[float]:
    return [float(x) for x in dense]


def sparse_vector(models: Any, sparse: SparseVec):
    return models.SparseVector(indices=list(sparse[0]), values=[float(x) for x in sparse[1]])


def qdrant_points(models: Any, point_type: Any, points: Sequence[IndexPoint]) -> list[Any]:
    """IndexPoints as `point_type` (qdrant_edge.Point, or qdrant_client's PointStruct) with named vectors."""
    structs = []
    for p in points:
        vector: dict[str, Any] = {}
        if p.dense is not None:
            vector[DENSE] = dense_vector(p.dense)
        if p.sparse is not None:
            vector[SPARSE] = sparse_vector(models, p.sparse)
        structs.append(point_type(id=p.id, vector=vector, payload=p.payload))
    return structs
