"""Index: the default backend of the vector-index seam (index_base.py), Qdrant Edge on local disk, and
`open_index`, which opens the configured backend (this one, or index_server.py's Qdrant server).

`EdgeIndex` keeps one Qdrant Edge shard per collection under `<data_dir>/qdrant/<collection>/`. A
shard is opened by one process at a time; a second opener gets `VectorIndexError` saying so.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator, Sequence

from ingest.errors import VectorIndexError
from ingest.index_base import (DENSE, INTEGER_FIELDS, KEYWORD_FIELDS, RRF_K, SPARSE, IndexPoint, ScoredPayload,
                               VectorIndex, Where, check_mode, dense_vector, qdrant_filter, qdrant_points,
                               sparse_vector)


def check_collection_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name or ""):
        raise VectorIndexError(f"collection name {name!r} is not valid: use letters, digits, '_', '-', '.' (max 64)")
    return name


class EdgeIndex(VectorIndex):
    """Qdrant Edge (qdrant-edge-py): Qdrant's engine in-process, one shard directory per collection."""

    def __init__(self, path: str | Path, dim: int, *, search_threads: int = 1) -> None:
        try:
            import qdrant_edge as qe
        except ImportError as e:
            raise VectorIndexError("qdrant-edge-py is not installed: pip install qdrant-edge-py==0.9.0") from e
        self._qe, self.dim, self.path = qe, dim, Path(path)
        config = qe.EdgeConfig(
            vectors={DENSE: qe.EdgeVectorParams(size=dim, distance=qe.Distance.Cosine)},
            sparse_vectors={SPARSE: qe.EdgeSparseVectorParams(modifier=qe.Modifier.Idf)},
            max_search_threads=search_threads,
        )
        exists = self.path.is_dir() and any(self.path.iterdir())
        try:
            self._shard = qe.EdgeShard.load(str(self.path), config) if exists else qe.EdgeShard.create(str(self.path), config)
        except Exception as e:  # qdrant_edge raises plain exceptions with the Rust message
            text = str(e)
            if "WouldBlock" in text or "lock" in text.lower():
                raise VectorIndexError(f"the index at {self.path} is in use by another process (e.g. `assistant serve`): "
                                       "stop it or use another --data-dir/--collection") from e
            raise VectorIndexError(f"cannot open the index at {self.path} ({text}); if it was built with another "
                                   "embedder, use another --collection or delete the folder") from e
        if not exists:
            for name in KEYWORD_FIELDS:
                self._shard.update(qe.UpdateOperation.create_field_index(name, qe.PayloadSchemaType.Keyword))
            for name in INTEGER_FIELDS:
                self._shard.update(qe.UpdateOperation.create_field_index(name, qe.PayloadSchemaType.Integer))

    # -- filters --------------------------------------------------------------------------------
    def _filter(self, where: Where):
        return qdrant_filter(self._qe, where)

    # -- updates --------------------------------------------------------------------------------
    def upsert(self, points: Sequence[IndexPoint]) -> None:
        qe = self._qe
        batch = qdrant_points(qe, qe.Point, points)
        if batch:
            self._shard.update(qe.UpdateOperation.upsert_points(batch))

    def delete(self, where: Where) -> None:
        flt = self._filter(where)
        if flt is None:
            raise ValueError("refusing to delete with an empty filter")
        self._shard.update(self._qe.UpdateOperation.delete_points_by_filter(flt))

    def set_payload(self, where: Where, payload: dict[str, Any]) -> None:
        self._shard.update(self._qe.UpdateOperation.set_payload_by_filter(self._filter(where), payload))

    # -- reads ----------------------------------------------------------------------------------
    def scroll(self, where: Where, *, batch: int = 256) -> Iterator[dict[str, Any]]:
        offset = None
        flt = self._filter(where)
        while True:
            records, offset = self._shard.scroll(self._qe.ScrollRequest(
                offset=offset, limit=batch, filter=flt, with_payload=True, with_vector=False))
            for r in records:
                yield dict(r.payload or {})
            if offset is None:
                return

    def count(self, where: Where) -> int:
        return int(self._shard.count(self._qe.CountRequest(exact=True, filter=self._filter(where))))

    def query(self, *, dense, sparse, limit, where, mode="hybrid", candidates=50) -> list[ScoredPayload]:
        qe = self._qe
        check_mode(mode, dense, sparse)
        flt = self._filter(where)
        dense_q = qe.Query.Nearest(dense_vector(dense), using=DENSE) if dense is not None else None
        sparse_q = qe.Query.Nearest(sparse_vector(qe, sparse), using=SPARSE) if sparse is not None else None
        if mode == "hybrid":
            request = qe.QueryRequest(
                limit=limit, with_payload=True, with_vector=False, filter=flt, query=qe.Fusion.Rrf(k=RRF_K),
                prefetches=[qe.Prefetch(limit=candidates, query=dense_q, filter=flt),
                            qe.Prefetch(limit=candidates, query=sparse_q, filter=flt)])
        else:
            request = qe.QueryRequest(limit=limit, with_payload=True, with_vector=False, filter=flt,
                                      query=dense_q if mode == "dense" else sparse_q)
        return [ScoredPayload(str(p.id), float(p.score), dict(p.payload or {})) for p in self._shard.query(request)]

    def flush(self) -> None:
        self._shard.flush()

    def optimize(self) -> bool:
        return bool(self._shard.optimize())

    def close(self) -> None:
        shard, self._shard = getattr(self, "_shard", None), None
        if shard is not None:
            shard.flush()
            shard.close()


def open_index(config, dim: int, collection: str | None = None) -> VectorIndex:
    """The index for an AssistantConfig: a Qdrant server when retrieval.qdrant_url is set, else Edge."""
    retrieval = config.retrieval
    name = check_collection_name(collection or retrieval.collection)
    if retrieval.qdrant_url:
        from ingest.index_server import QdrantServerIndex

        return QdrantServerIndex.from_url(retrieval.qdrant_url, name, dim)
    return EdgeIndex(Path(config.data_dir) / "qdrant" / name, dim, search_threads=retrieval.search_threads)
