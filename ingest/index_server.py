"""Index backend for a Qdrant server or cluster through qdrant-client (the scale-out path).

Same seam, same payloads, same filter and point translation (index_base.py), same hybrid query as
`EdgeIndex` (dense + sparse-with-IDF prefetches fused by RRF with the same constant), so results agree
across backends; tests run one shared suite on both, with `QdrantClient(":memory:")` standing in for
the server.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from ingest.errors import VectorIndexError
from ingest.index_base import (DENSE, INTEGER_FIELDS, KEYWORD_FIELDS, RRF_K, SPARSE, IndexPoint, ScoredPayload,
                               VectorIndex, Where, check_mode, dense_vector, qdrant_filter, qdrant_points,
                               sparse_vector)


class QdrantServerIndex(VectorIndex):
    """One collection on a Qdrant server (or qdrant-client's local mode when given such a client)."""

    def __init__(self, client, collection: str, dim: int) -> None:
        from qdrant_client import models

        self._client, self._m, self.collection, self.dim = client, models, collection, dim
        try:
            exists = client.collection_exists(collection)
            if not exists:
                client.create_collection(
                    collection,
                    vectors_config={DENSE: models.VectorParams(size=dim, distance=models.Distance.COSINE)},
                    sparse_vectors_config={SPARSE: models.SparseVectorParams(modifier=models.Modifier.IDF)},
                )
                schema = [(KEYWORD_FIELDS, models.PayloadSchemaType.KEYWORD),
                          (INTEGER_FIELDS, models.PayloadSchemaType.INTEGER)]
                if not _is_local(client):  # local mode has no payload indexes (and warns about them)
                    for names, kind in schema:
                        for name in names:
                            client.create_payload_index(collection, name, field_schema=kind)
            else:
                info = client.get_collection(collection)
                size = info.config.params.vectors[DENSE].size
                if size != dim:
                    raise VectorIndexError(f"collection {collection!r} holds {size}-d vectors but the embedder makes "
                                           f"{dim}-d ones: use another --collection or the embedder it was built with")
        except VectorIndexError:
            raise
        except Exception as e:
            raise VectorIndexError(f"Qdrant collection {collection!r} is not usable: {e}") from e

    @classmethod
    def from_url(cls, url: str, collection: str, dim: int) -> "QdrantServerIndex":
        try:
            from qdrant_client import QdrantClient
        except ImportError as e:
            raise VectorIndexError("qdrant-client is not installed: pip install qdrant-client==1.20.0") from e
        client = QdrantClient(location=url) if url == ":memory:" else QdrantClient(url=url, timeout=30)
        return cls(client, collection, dim)

    def _filter(self, where: Where):
        return qdrant_filter(self._m, where)

    def upsert(self, points: Sequence[IndexPoint]) -> None:
        structs = qdrant_points(self._m, self._m.PointStruct, points)
        if structs:
            self._client.upsert(self.collection, structs, wait=True)

    def delete(self, where: Where) -> None:
        flt = self._filter(where)
        if flt is None:
            raise ValueError("refusing to delete with an empty filter")
        self._client.delete(self.collection, points_selector=self._m.FilterSelector(filter=flt), wait=True)

    def set_payload(self, where: Where, payload: dict[str, Any]) -> None:
        self._client.set_payload(self.collection, payload=payload, points=self._m.FilterSelector(filter=self._filter(where)),
                                 wait=True)

    def scroll(self, where: Where, *, batch: int = 256) -> Iterator[dict[str, Any]]:
        offset, flt = None, self._filter(where)
        while True:
            records, offset = self._client.scroll(self.collection, scroll_filter=flt, limit=batch, offset=offset,
                                                  with_payload=True, with_vectors=False)
            for r in records:
                yield dict(r.payload or {})
            if offset is None:
                return

    def count(self, where: Where) -> int:
        return int(self._client.count(self.collection, count_filter=self._filter(where), exact=True).count)

    def query(self, *, dense, sparse, limit, where, mode="hybrid", candidates=50) -> list[ScoredPayload]:
        m = self._m
        check_mode(mode, dense, sparse)
        flt = self._filter(where)
        dense_q = dense_vector(dense) if dense is not None else None
        sparse_q = sparse_vector(m, sparse) if sparse is not None else None
        if mode == "hybrid":
            result = self._client.query_points(
                self.collection, limit=limit, query_filter=flt, with_payload=True,
                prefetch=[m.Prefetch(query=dense_q, using=DENSE, limit=candidates, filter=flt),
                          m.Prefetch(query=sparse_q, using=SPARSE, limit=candidates, filter=flt)],
                query=m.RrfQuery(rrf=m.Rrf(k=RRF_K)))
        else:
            result = self._client.query_points(
                self.collection, limit=limit, query_filter=flt, with_payload=True,
                query=dense_q if mode == "dense" else sparse_q, using=DENSE if mode == "dense" else SPARSE)
        return [ScoredPayload(str(p.id), float(p.score), dict(p.payload or {})) for p in result.points]

    def close(self) -> None:
        client, self._client = getattr(self, "_client", None), None
        if client is not None:
            client.close()


def _is_local(client) -> bool:
    from qdrant_client.local.qdrant_local import QdrantLocal

    return isinstance(getattr(client, "_client", None), QdrantLocal)
