"""Pipeline: idempotent, crash-safe ingestion of files into one collection (parse → chunk → embed → upsert).

NOTE on the ledger. A document is identified by its resolved path (`doc_id` = hash of the path), and
its content by `version` (sha256 of the bytes and the parser's `PARSE_VERSION`, so that a parser that
reads files differently re-reads the documents it had read before). The ledger is kept *in the index itself*: one `doc`
point per document, holding the `committed` version and a `dirty` flag, so it can never disagree with
the points it describes, on Edge or on a server. Ingesting one file is, in order:

  1. parse + chunk (no writes yet: a file that fails to parse leaves the index untouched)
  2. doc record ← dirty, still naming the old committed version (or none)
  3. upsert page + chunk points of the new version, `visible=false` (searches filter on visible)
  4. flip the new version's points to `visible=true`
  5. doc record ← committed = new version, still dirty
  6. delete the doc's points of any other version
  7. doc record ← clean

Crash anywhere (Ctrl-C, kill -9) and the doc record stays dirty. `recover()`, run when an `Ingester`
opens, keeps exactly the committed version of each dirty doc (or drops the doc if nothing was ever
committed) and cleans the record; the rerun then sees the file as new or changed and completes it.
So a reader never sees half a file, an unchanged file is a no-op (same path, same version), a changed
file replaces its old chunks, and equal content at two paths is two documents. Flags (`visible`,
`dirty`) are stored as 0/1 integers: Qdrant Edge matches booleans as integers.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from ingest.chunk import Chunk, Chunker
from ingest.embed import Bm25Encoder, Embedder
from ingest.errors import DocumentNotFound, IngestError
from ingest.index_base import IndexPoint, Not, VectorIndex
from ingest.parse import PARSE_VERSION, DescribeImage, is_supported, parse_file

POINT_NAMESPACE = uuid.UUID("6b1d3a58-3f0e-4bb6-9a57-2f4f3c1e9d10")
OPTIMIZE_MIN_POINTS = 20_000  # below this a plain (brute-force) Edge segment answers in a few ms anyway

Progress = Callable[[str, int], None]  # ("pages" parsed | "chunks" embedded | "pages_done" embedded, how many more)


@dataclass
class FileResult:
    path: Path
    status: str  # "added", "updated", "unchanged" or "failed"
    doc_id: str = ""
    num_pages: int = 0
    num_chunks: int = 0
    error: str = ""  # why it failed (status "failed")
    warnings: list[str] = field(default_factory=list)  # pages skipped inside an otherwise good file


def chunk_texts(index: Any, doc_id: str) -> list[str]:
    """The visible chunks' texts of one document, in order (what a search hit's passage holds)."""
    chunks = index.scroll({"kind": "chunk", "visible": 1, "doc_id": doc_id})
    return [c["text"] for c in sorted(chunks, key=lambda c: c["chunk_index"])]


def screen_result(index: Any, result: "FileResult", screen: Callable[[list[str]], int] | None) -> None:
    """Run `screen` (the safety layer's ingest-time screening, passed in by the caller: this package never
    imports it) over a newly written document's chunks; the result warns when some look like instructions."""
    if screen is None or result.status not in ("added", "updated") or not result.doc_id:
        return
    texts = chunk_texts(index, result.doc_id)
    flagged = screen(texts)
    if flagged:
        result.warnings.append(f"{flagged} of {len(texts)} passages look like instructions to the model; "
                               "they will reach it fenced as untrusted data.")


def doc_id_for(path: Path) -> str:
    return hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]


def point_id(*parts: object) -> str:
    return str(uuid.uuid5(POINT_NAMESPACE, ":".join(str(p) for p in parts)))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def expand_paths(paths: Iterable[str | Path], recursive: bool = False) -> list[Path]:
    """Files named explicitly are kept whatever their type (so an unknown type is reported); folders
    contribute their supported, non-hidden files (sub-folders only with `recursive`)."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            found = path.rglob("*") if recursive else path.glob("*")
            out.extend(sorted(p for p in found if p.is_file() and is_supported(p)
                              and not any(part.startswith(".") for part in p.relative_to(path).parts)))
        else:
            out.append(path)
    seen, unique = set(), []
    for p in out:
        if (key := str(p.resolve())) not in seen:
            seen.add(key)
            unique.append(p)
    return unique


class Ingester:
    """Writes documents into one collection; see the module NOTE for the crash-safety protocol."""

    def __init__(self, index: VectorIndex, embedder: Embedder, chunker: Chunker, *, sparse: Bm25Encoder | None = None,
                 batch_size: int = 32, ocr_languages: str = "eng", recover: bool = True,
                 describe_image: DescribeImage | None = None) -> None:
        if index.dim != embedder.dim:
            raise ValueError(f"index holds {index.dim}-d vectors but the embedder makes {embedder.dim}-d ones")
        self.index, self.embedder, self.chunker = index, embedder, chunker
        self.sparse = sparse or Bm25Encoder()
        self.batch_size, self.ocr_languages = batch_size, ocr_languages
        self.describe_image = describe_image  # image file -> description + text read (see ingest.parse.parse_image)
        self.recovered = self.recover() if recover else 0

    @classmethod
    def from_config(cls, config, collection: str | None = None, *, num_threads: int | None = None,
                    describe_image: DescribeImage | None = None) -> "Ingester":
        from ingest.embed import load_embedder
        from ingest.index import open_index

        r = config.retrieval
        threads = r.embed_threads if num_threads is None else num_threads  # 0: leave torch's setting alone
        embedder = load_embedder(r.embedder, num_threads=threads, batch_size=r.embed_batch_size, lazy=True)
        chunker = Chunker(embedder.tokenize, chunk_tokens=r.chunk_tokens, overlap_tokens=r.chunk_overlap)
        index = open_index(config, embedder.dim, collection)
        return cls(index, embedder, chunker, batch_size=r.embed_batch_size, ocr_languages=r.ocr_languages,
                   describe_image=describe_image)

    # -- ledger ---------------------------------------------------------------------------------
    def record(self, doc_id: str) -> dict | None:
        found = list(self.index.scroll({"kind": "doc", "doc_id": doc_id}))
        return found[0] if found else None

    def _write_record(self, record: dict) -> None:
        self.index.upsert([IndexPoint(point_id(record["doc_id"], "doc"), record)])

    def recover(self) -> int:
        """Finish or undo every half-done document (dirty record); returns how many were repaired."""
        dirty = list(self.index.scroll({"kind": "doc", "dirty": 1}))
        for record in dirty:
            self._repair(record)
        if dirty:
            self.index.flush()
        return len(dirty)

    def _repair(self, record: dict) -> None:
        doc_id, committed = record["doc_id"], record.get("committed") or ""
        if not committed:
            self.index.delete({"doc_id": doc_id})  # never committed: drop points and record
            return
        self.index.delete({"doc_id": doc_id, "kind": ["chunk", "page"], "version": Not(committed)})
        self.index.set_payload({"doc_id": doc_id, "version": committed, "kind": ["chunk", "page"]}, {"visible": 1})
        self._write_record({**record, "dirty": 0})

    def list_documents(self) -> list[dict]:
        return list_documents(self.index)

    def find_document(self, doc: str) -> dict:
        return find_document(self.index, doc)

    def delete(self, doc: str) -> dict:
        record = find_document(self.index, doc)
        self._write_record({**record, "dirty": 1, "committed": ""})  # a crash now still ends in "deleted"
        self.index.delete({"doc_id": record["doc_id"]})
        self.index.flush()
        return record

    # -- ingestion ------------------------------------------------------------------------------
    def ingest(self, paths: Iterable[Path], on_progress: Progress | None = None) -> Iterator[FileResult]:
        """One FileResult per path; a failing file is reported and the rest go on."""
        for path in paths:
            yield self.ingest_file(path, on_progress)

    def ingest_file(self, path: str | Path, on_progress: Progress | None = None) -> FileResult:
        path = Path(path)
        progress = on_progress or (lambda _what, _n: None)
        try:
            abspath = path.expanduser().resolve()
            if not abspath.is_file():
                raise IngestError("no such file" if not abspath.exists() else "not a regular file")
            doc_id, version = doc_id_for(abspath), f"{file_sha256(abspath)}.p{PARSE_VERSION}"
            old = self.record(doc_id)
            if old and old.get("committed") == version and not old.get("dirty"):
                return FileResult(path, "unchanged", doc_id, old.get("num_pages", 0), old.get("num_chunks", 0))
            parsed = parse_file(abspath, ocr_languages=self.ocr_languages, describe_image=self.describe_image)
            progress("pages", len(parsed.pages))
            chunks = self.chunker.split(parsed)
            if not chunks:
                raise IngestError("no text found to index")
        except IngestError as e:
            return FileResult(path, "failed", error=str(e))
        except OSError as e:
            return FileResult(path, "failed", error=f"cannot read file: {e.strerror or e}")
        except Exception as e:  # noqa: BLE001 - a parser bug on one odd file must not stop the batch
            return FileResult(path, "failed", error=f"could not be read ({type(e).__name__}: {e})")
        record = {
            "kind": "doc", "doc_id": doc_id, "path": str(abspath), "file_name": abspath.name,
            "format": parsed.format, "committed": (old or {}).get("committed", ""), "dirty": 1,
            "num_pages": len(parsed.pages), "num_chunks": len(chunks), "size": abspath.stat().st_size,
            "ingested_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "warnings": parsed.warnings,
        }
        try:
            self._write_record({**old, "dirty": 1} if old else record)  # the old version's facts until committed
            self._write_points(record, version, parsed.pages, chunks, progress)
            where_new = {"doc_id": doc_id, "version": version, "kind": ["chunk", "page"]}
            self.index.set_payload(where_new, {"visible": 1})
            self._write_record({**record, "committed": version})
            self.index.delete({"doc_id": doc_id, "kind": ["chunk", "page"], "version": Not(version)})
            self._write_record({**record, "committed": version, "dirty": 0})
            self.index.flush()
        except BaseException:
            try:  # best effort right away; recover() on the next start does it otherwise
                self._repair(self.record(doc_id) or record)
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
            raise
        status = "updated" if old and old.get("committed") else "added"
        return FileResult(path, status, doc_id, len(parsed.pages), len(chunks), warnings=parsed.warnings)

    def _write_points(self, record: dict, version: str, pages, chunks: list[Chunk], progress: Progress) -> None:
        doc_id = record["doc_id"]
        base = {"doc_id": doc_id, "version": version, "visible": 0, "path": record["path"],
                "file_name": record["file_name"]}
        self.index.upsert([IndexPoint(point_id(doc_id, version, "page", p.number),
                                      {**base, "kind": "page", "page": p.number, "text": p.text, "ocr": p.ocr})
                           for p in pages])
        ordinal = {p.number: i for i, p in enumerate(pages)}
        pages_done = 0
        for start in range(0, len(chunks), self.batch_size):
            batch = chunks[start:start + self.batch_size]
            texts = [embedding_text(c) for c in batch]
            dense = self.embedder.embed(texts)  # (B, dim)
            sparse = self.sparse.encode_documents(texts)
            self.index.upsert([
                IndexPoint(point_id(doc_id, version, "chunk", c.index),
                           {**base, "kind": "chunk", "chunk_index": c.index, "page": c.page, "heading": c.heading,
                            "text": c.text, "start_char": c.start_char, "end_char": c.end_char},
                           dense=dense[i], sparse=sparse[i])
                for i, c in enumerate(batch)])
            progress("chunks", len(batch))
            done = len(pages) if start + len(batch) == len(chunks) else ordinal[batch[-1].page]
            if done > pages_done:
                progress("pages_done", done - pages_done)
                pages_done = done

    def should_optimize(self) -> bool:
        """Large enough for HNSW/sparse indexes to matter (Edge builds them only when asked)."""
        return self.index.count({"kind": "chunk"}) >= OPTIMIZE_MIN_POINTS

    def optimize(self) -> bool:
        """Build indexes; minutes on a large shard. Searches and upserts keep working meanwhile, so
        a long-lived process can run this in a background thread."""
        return self.index.optimize()

    def close(self) -> None:
        self.index.close()


def list_documents(index: VectorIndex) -> list[dict]:
    """Ledger records of every committed document, by path."""
    return sorted((r for r in index.scroll({"kind": "doc"}) if r.get("committed")), key=lambda r: r["path"])


def find_document(index: VectorIndex, doc: str) -> dict:
    """A committed document by doc id, path, or file name (which must then be unique)."""
    docs = list_documents(index)
    resolved = str(Path(doc).expanduser().resolve()) if doc else ""
    for r in docs:
        if doc in (r["doc_id"], r["path"]) or r["path"] == resolved:
            return r
    named = [r for r in docs if r["file_name"] == doc]
    if len(named) == 1:
        return named[0]
    if named:
        raise DocumentNotFound(f"{doc!r} names {len(named)} documents: give the doc id or the full path "
                               f"({', '.join(r['doc_id'] for r in named)})")
    raise DocumentNotFound(f"no document {doc!r} in this collection: see `assistant docs list`")


def embedding_text(chunk: Chunk) -> str:
    """What gets embedded: the heading gives a chunk its context unless the chunk starts with it."""
    if chunk.heading and not chunk.text.lstrip().startswith(chunk.heading[:40]):
        return f"{chunk.heading}\n{chunk.text}"
    return chunk.text
