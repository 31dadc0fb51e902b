"""Documents in, cited chunks out: parse → chunk → embed → index (Qdrant), and the Retriever over it.

Stages, one module each: `parse` (files → pages of text), `chunk` (llama-index sentence splitter,
token-sized with overlap, page + heading + char offsets kept), `embed` (dense embedder seam and the
BM25 sparse encoder), `index_base` / `index` / `index_server` (the vector-index seam and its Qdrant
translation; Qdrant Edge embedded on disk, and `open_index`; Qdrant server through qdrant-client),
`pipeline` (idempotent, crash-safe ingestion), `retriever` (`Retriever.search` / `Retriever.read`),
`cli` (`assistant ingest`, `docs`, `eval retrieval`).
"""
