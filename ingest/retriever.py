"""Retriever: the read side used by the agent, the UI and `assistant eval retrieval`.

    retriever = Retriever.from_config(config)            # or Retriever(index, embedder)
    hits = retriever.search("what is the warranty period?", k=5, filters={"file_name": "manual.pdf"})
    hits[0].citation                                      # 'manual.pdf p. 12'
    pages = retriever.read(hits[0].doc_id, pages=[12, 13])  # whole pages, for "summarise chapter 2"

Search is hybrid by default: the query's dense embedding and its BM25 sparse vector are sent together
and fused by RRF inside Qdrant; only chunks of committed, fully written documents are visible.

Distinct texts only: a hit whose text repeats one ranked higher is dropped, and the next one fills
its place (the query fetches 2k so that k distinct hits are usually there).

Exact identifiers first. RRF counts ranks only: when a query names an identifier ("XK-4471Q",
"E1234", "max_num_seqs"), BM25 ranks its one chunk first by a wide score margin, but dense search ranks
look-alike codes first and RRF may then put a look-alike on top (seen with the real embedder, decided
by float rounding). Score-based fusion (DBSF) fixes that case but loses natural questions whose BM25
scores are bunched. So fusion stays RRF, and for queries with identifiers the fused list is fetched
`candidates` deep and the chunks that contain one of those identifiers verbatim (case-insensitive,
whole token) move to the front, in fused order. Fusion still happens in Qdrant; this is a stable
sort of at most `candidates` hits. When a query names several identifiers, a chunk weighs the sum of
1/df of those it holds (df: how many candidates hold it), so the rare one counts: in "since which
libtasn1 version is asn1_perror available?" every chunk of the manual holds "libtasn1", and a plain
"holds any" partition left the one chunk with asn1_perror fourth behind the title page. A chunk earns
nothing for an identifier its own document's title (the first two lines) or file name holds ("ASN.1"
and "libtasn1" in the libtasn1 manual, whose title page reads "Libtasn1 / Abstract Syntax Notation One
(ASN.1) library"): that is what the whole document is about, not what is asked for (the title page
itself earns nothing for it either, or it would come first in every search within the manual). A
note of at most TITLE_MIN_CHUNKS chunks has no title: its first lines are what it says. Before this,
any chunk holding "ASN.1" outranked the one that defines asn1_delete_structure, which holds neither,
and "which function deletes a whole ASN.1 structure" was refused. How often a candidate holds an
identifier does not tell the two apart: "ASN.1" and "asn1Decoding" are each in 8-9 of 50 candidates
there. On the eval library's dev questions, the four passages held every expected string for 64 of
74 answerable non-count questions before and 66 after; on the held-out test part, 72 -> 75 of 80.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from ingest.embed import Bm25Encoder, Embedder
from ingest.index_base import VectorIndex
from ingest.pipeline import find_document, list_documents

FILTER_FIELDS = ("doc_id", "path", "file_name", "page")
TABLE_ROW = re.compile(r"^\s*\|.*\|\s*$|\|[^|\n]*\|[^|\n]*\|", re.M)  # a Markdown table row, or a piece of one
RULE = re.compile(r"\|(?:\s*:?-{3,}:?\s*\|)+")  # "| --- | :---: |", under a table's header row
# a token with a letter and a digit (XK-4471Q, E1234, v2.3.1, sha256) or a snake_case name
IDENTIFIER = re.compile(r"(?<![\w.-])(?:(?=[\w.-]*\d)(?=[\w.-]*[^\W\d_])[^\W_][\w.-]*[^\W_]|[^\W\d_]\w*_\w+)(?![\w-])")


TITLE_CHARS, TITLE_LINES = 200, 2  # of a document's first page: its title, what every chunk of it is about
TITLE_MIN_CHUNKS = 3  # a document of at most this many chunks is a note: no title is discounted
CACHED_CHUNK_DOCS = 8  # documents whose chunk lists (for `section`) are kept between calls


def query_identifiers(query: str) -> list[str]:
    """Identifier-like tokens of a query, in order, without a trailing sentence dot."""
    return list(dict.fromkeys(m.group(0).rstrip(".") for m in IDENTIFIER.finditer(query)))


def contains_identifier(text: str, identifiers: list[str]) -> bool:
    return any(re.search(rf"(?<![\w-]){re.escape(ident)}(?![\w-])", text, re.IGNORECASE) for ident in identifiers)


@dataclass(frozen=True)
class Hit:
    chunk_id: str  # stable id of the chunk (cite this)
    doc_id: str  # stable id of the document (hash of its path)
    path: str  # absolute path of the source file at ingestion time
    page: int  # 1-based page number (1 for formats without pages)
    heading: str  # nearest heading above the chunk ("" if none)
    text: str  # the chunk text
    score: float  # RRF score for hybrid search (exact-identifier hits come first, so not always descending),
    # cosine / BM25 score for single-mode search
    start_char: int  # offsets of `text` within the page text
    end_char: int
    header: str = ""  # a table's header row and rule, when `text` holds rows of a table whose header it lacks

    @property
    def file_name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def citation(self) -> str:
        return f"{self.file_name} p. {self.page}"


@dataclass(frozen=True)
class PageText:
    doc_id: str
    path: str
    page: int  # 1-based
    text: str  # the whole page


class Retriever:
    """Ranked chunks with sources from one collection."""

    def __init__(self, index: VectorIndex, embedder: Embedder, *, sparse: Bm25Encoder | None = None,
                 top_k: int = 5, candidates: int = 50) -> None:
        self.index, self.embedder = index, embedder
        self.sparse = sparse or Bm25Encoder()
        self.top_k, self.candidates = top_k, candidates
        # read once per committed version of a document, so that a search naming identifiers, or a count
        # question trying ten sections, does not read them again: doc id -> (version, title), and for the
        # last CACHED_CHUNK_DOCS documents whose sections were read, doc id -> (version, chunks in order)
        self._titles: dict[str, tuple[Any, str]] = {}
        self._chunk_cache: OrderedDict[str, tuple[Any, list[dict]]] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._last_query: tuple[str, Any] | None = None  # the prefetch asks `similarity` and `search` of one query

    @classmethod
    def from_config(cls, config, collection: str | None = None, *, num_threads: int | None = None) -> "Retriever":
        """Open the configured collection (Edge under <data_dir>/qdrant, or retrieval.qdrant_url)."""
        from ingest.embed import load_embedder
        from ingest.index import open_index

        r = config.retrieval
        threads = r.embed_threads if num_threads is None else num_threads  # 0: leave torch's setting alone
        embedder = load_embedder(r.embedder, num_threads=threads, batch_size=r.embed_batch_size, lazy=True)
        return cls(open_index(config, embedder.dim, collection), embedder, top_k=r.top_k, candidates=r.candidates)

    def search(self, query: str, k: int | None = None, filters: dict[str, Any] | None = None, *,
               mode: str = "hybrid") -> list[Hit]:
        """Top-k chunks for `query`. filters: {"doc_id"|"path"|"file_name"|"page": value or list}.
        mode: "hybrid" (default), "dense" or "sparse"."""
        k = k or self.top_k
        where: dict[str, Any] = {"kind": "chunk", "visible": 1}
        for key, value in (filters or {}).items():
            if key not in FILTER_FIELDS:
                raise ValueError(f"unknown filter {key!r}: use {', '.join(FILTER_FIELDS)}")
            where[key] = value
        if not query.strip():
            return []
        dense = self._query_vector(query) if mode in ("hybrid", "dense") else None
        sparse = self.sparse.encode_query(query) if mode in ("hybrid", "sparse") else None
        if sparse is not None and not sparse[0]:
            if mode == "sparse":
                return []
            sparse, mode = None, "dense"  # only stopwords: nothing for BM25 to match
        identifiers = query_identifiers(query) if mode == "hybrid" else []
        found = self.index.query(dense=dense, sparse=sparse, limit=max(k, self.candidates) if identifiers else 2 * k,
                                 where=where, mode=mode, candidates=max(self.candidates, 2 * k))
        # equal scores in chunk-id order: RRF ties are common (ranks 3+5 and 5+3 sum alike) and Qdrant returns
        # them in no fixed order, so passages swapped places between two runs of one question (and [3] became [4])
        hits = sorted((hit_from_payload(p.id, p.score, p.payload) for p in found), key=lambda h: (-h.score, h.chunk_id))
        if identifiers:  # exact identifiers first, the rarest weighing most (module docstring), then the fused order
            titles: dict[str, str] = {}
            held = [[contains_identifier(h.text, [ident]) and not contains_identifier(self._title(h, titles), [ident])
                     for ident in identifiers] for h in hits]
            df = [sum(row[j] for row in held) for j in range(len(identifiers))]
            weight = [sum(1 / df[j] for j, has in enumerate(row) if has) for row in held]
            hits = [h for _, h in sorted(zip(weight, hits), key=lambda pair: -pair[0])]  # stable: fused order within
        return distinct(hits)[:k]

    def similarity(self, query: str, filters: dict[str, Any] | None = None) -> float:
        """The best cosine similarity of `query` to any visible chunk (0.0 for none): whether the library
        has anything to say about it at all (tools/retrieval.py `DocumentPrefetch`)."""
        hits = self.search(query, 1, filters, mode="dense")
        return float(hits[0].score) if hits else 0.0

    def _query_vector(self, query: str) -> Any:
        """`query` embedded, the last one remembered (~10 ms of MiniLM saved when it is searched twice)."""
        with self._cache_lock:
            last = self._last_query
        if last is not None and last[0] == query:
            return last[1]
        vector = self.embedder.embed_query(query)
        with self._cache_lock:
            self._last_query = (query, vector)
        return vector

    def _title(self, hit: Hit, titles: dict[str, str]) -> str:
        """The file name and the first TITLE_LINES lines of `hit`'s document (its record read once per
        search, its first page once per version); none for a note of a few chunks, whose first lines are
        what it says."""
        if hit.doc_id not in titles:  # by doc id: no scan of the library's records (find_document) per search
            record = self._record(hit.doc_id)
            version = record.get("committed")
            cached = self._titles.get(hit.doc_id)
            if cached is None or not version or cached[0] != version:
                first = []
                if version and record.get("num_chunks", 0) > TITLE_MIN_CHUNKS:
                    first = [p["text"] for p in self.index.scroll({"kind": "page", "visible": 1, "doc_id": hit.doc_id,
                                                                   "version": version, "page": [1]})]
                lines = [line for line in (first[0][:TITLE_CHARS] if first else "").splitlines() if line.strip()]
                cached = (version, "\n".join([hit.file_name, *lines[:TITLE_LINES]]) if first else "")
                with self._cache_lock:
                    self._titles[hit.doc_id] = cached
            titles[hit.doc_id] = cached[1]
        return titles[hit.doc_id]

    def _chunks(self, doc_id: str) -> list[dict]:
        """The visible chunks of a document's committed version in chunk order, read once per version
        (the last CACHED_CHUNK_DOCS documents are kept)."""
        version = self._record(doc_id).get("committed")
        with self._cache_lock:
            cached = self._chunk_cache.get(doc_id)
            if cached is not None and version and cached[0] == version:
                self._chunk_cache.move_to_end(doc_id)
                return cached[1]
        where = {"kind": "chunk", "visible": 1, "doc_id": doc_id, **({"version": version} if version else {})}
        chunks = sorted(self.index.scroll(where), key=lambda c: c["chunk_index"])
        if version:
            with self._cache_lock:
                self._chunk_cache[doc_id] = (version, chunks)
                self._chunk_cache.move_to_end(doc_id)
                while len(self._chunk_cache) > CACHED_CHUNK_DOCS:
                    self._chunk_cache.popitem(last=False)
        return chunks

    def _record(self, doc_id: str) -> dict:
        """A document's record (its committed version, its number of chunks), by id."""
        return next(iter(self.index.scroll({"kind": "doc", "doc_id": doc_id})), None) or {}

    def readable(self, hits: list[Hit]) -> list[Hit]:
        """`hits` as a reader should get them: a table cut mid-row given whole rows and its header
        (`whole_rows`), and a hit that a completed one above it already holds left out. One page read
        per page with a table hit; `search` itself stays the raw ranking (and as fast)."""
        pages: dict[tuple[str, int], str] = {}
        out: list[Hit] = []
        for hit in hits:
            if any(h.doc_id == hit.doc_id and h.page == hit.page and h.start_char <= hit.start_char
                   and hit.end_char <= h.end_char for h in out):
                continue
            if TABLE_ROW.search(hit.text):
                key = (hit.doc_id, hit.page)
                if key not in pages:
                    found = self.read(hit.doc_id, [hit.page])
                    pages[key] = found[0].text if found else ""
                hit = whole_rows(hit, pages[key])
            out.append(hit)
        return out

    def read(self, doc: str, pages: list[int] | None = None) -> list[PageText]:
        """Whole pages of a document (all of them when `pages` is None), in page order.
        `doc` is a doc id, a path or a file name."""
        record = find_document(self.index, doc)
        where: dict[str, Any] = {"kind": "page", "visible": 1, "doc_id": record["doc_id"],
                                 "version": record["committed"]}
        if pages:
            where["page"] = [int(p) for p in pages]
        found = sorted(self.index.scroll(where), key=lambda p: p["page"])
        return [PageText(p["doc_id"], p["path"], p["page"], p["text"]) for p in found]

    def section(self, hit: Hit, max_chars: int = 8000) -> list[PageText]:
        """The text of the section `hit` lies in, as page slices in order: the run of the document's
        chunks (in chunk order) that carry the hit's heading and include the hit, from the first one's
        start to the next section's heading (the last one's end when that is not in it), at most
        `max_chars` (the hit's own page slice when the document has no headings there). For
        whole-section questions: "how many options…", "list every…". A section that ran on to its
        chunk's end had read the first four of the ten placeholders the next section lists, and the
        count was four."""
        chunks = self._chunks(hit.doc_id)
        at = next((i for i, c in enumerate(chunks) if c["page"] == hit.page and c["start_char"] == hit.start_char), None)
        after = None  # the chunk after the section's run: the next section, whose heading ends this one
        if at is None or not hit.heading:
            first = last = {"page": hit.page, "start_char": hit.start_char, "end_char": hit.end_char}
        else:
            lo = hi = at
            while lo > 0 and chunks[lo - 1].get("heading", "") == hit.heading:
                lo -= 1
            while hi + 1 < len(chunks) and chunks[hi + 1].get("heading", "") == hit.heading:
                hi += 1
            first, last = chunks[lo], chunks[hi]
            after = chunks[hi + 1] if hi + 1 < len(chunks) else None
            if lo > 0:  # the chunk before the run may hold the heading and the section's first lines
                before = chunks[lo - 1]
                text = next(iter(self.read(hit.doc_id, [before["page"]])), None)
                at_heading = text.text.find(hit.heading, before["start_char"]) if text is not None else -1
                if 0 <= at_heading < before["end_char"]:
                    first = {"page": before["page"], "start_char": at_heading}
        pages = {p.page: p for p in self.read(hit.doc_id, list(range(first["page"], last["page"] + 1)))}
        if after is not None and last["page"] in pages:
            last = {**last, "end_char": _next_heading_at(pages[last["page"]].text, last, after)}
        out: list[PageText] = []
        left = max_chars
        for number in sorted(pages):
            page = pages[number]
            start = first["start_char"] if number == first["page"] else 0
            end = last["end_char"] if number == last["page"] else len(page.text)
            text = page.text[start:end][:left]
            if text.strip():
                out.append(PageText(page.doc_id, page.path, number, text))
                left -= len(text)
            if left <= 0:
                break
        return out

    def ingester(self, *, chunk_tokens: int = 200, overlap_tokens: int = 30, describe_image=None):
        """An `Ingester` writing into this retriever's collection: a process that serves searches
        (the UI) must ingest uploads through it, because an Edge shard has one owner process. It shares
        this retriever's index: close the retriever, not the ingester. `describe_image` (image file ->
        text) makes a picture's page say what it shows, not only the text read in it."""
        from ingest.chunk import Chunker
        from ingest.pipeline import Ingester

        chunker = Chunker(self.embedder.tokenize, chunk_tokens=chunk_tokens, overlap_tokens=overlap_tokens)
        return Ingester(self.index, self.embedder, chunker, sparse=self.sparse, describe_image=describe_image)

    def documents(self) -> list[dict]:
        """Ledger records of every committed document (path, file_name, doc_id, num_pages, …)."""
        return list_documents(self.index)

    def close(self) -> None:
        self.index.close()

    def __enter__(self) -> "Retriever":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def distinct(hits: list[Hit]) -> list[Hit]:
    """The hits without repeats of a text already ranked higher (whitespace and case folded): the same
    file indexed from two paths, or a page header repeated on every page, would otherwise fill the top
    k with copies (an eval library holding each manual twice gave 2-3 different passages out of 5)."""
    seen: set[str] = set()
    out = []
    for hit in hits:
        key = " ".join(hit.text.lower().split())
        if key not in seen:
            seen.add(key)
            out.append(hit)
    return out


def whole_rows(hit: Hit, page: str) -> Hit:
    """`hit` widened to whole table rows, with its table's header row and rule when it lacks them.

    A chunk is cut by tokens, so a table chunk starts and ends mid-row ("437 | 600 MB/s | 2150 MB/s |")
    and, past the first chunk of a table, without the header that names the columns: the 1.5B model
    then read a compression speed as lz4's decompression speed. A row cut at either end is completed
    from the page (the hit stays a verbatim slice of it), and the header and rule ("| name | ratio |"
    over "| --- |") that open the table above the hit go in `header`."""
    if page[hit.start_char:hit.end_char] != hit.text:
        return hit
    start, end = hit.start_char, hit.end_char
    first = page.rfind("\n", 0, start) + 1
    if _is_row(page, first):
        start = first
    last = page.rfind("\n", 0, max(end - 1, 0)) + 1
    if _is_row(page, last):
        end = max(end, len(page) if page.find("\n", last) < 0 else page.find("\n", last))
    header, line = "", start
    while line > 0:  # walk up the table's rows to its first one
        above = page.rfind("\n", 0, line - 1) + 1
        if not _is_row(page, above):
            break
        line = above
    if line < start and _is_row(page, line):
        rows = page[line:start].split("\n")
        if len(rows) > 1 and RULE.fullmatch(rows[1].strip()):
            header = rows[0].strip() + "\n" + rows[1].strip()
    if start == hit.start_char and end == hit.end_char and not header:
        return hit
    return replace(hit, text=page[start:end], start_char=start, end_char=end, header=header)


def _is_row(page: str, at: int) -> bool:
    return page.startswith("|", at) or page[at:at + 8].lstrip(" ").startswith("|")


def hit_from_payload(point_id: str, score: float, p: dict[str, Any]) -> Hit:
    return Hit(chunk_id=point_id, doc_id=p["doc_id"], path=p["path"], page=int(p["page"]), heading=p.get("heading", ""),
               text=p["text"], score=score, start_char=int(p.get("start_char", 0)), end_char=int(p.get("end_char", 0)))


def _next_heading_at(text: str, last: dict, after: dict) -> int:
    """Where the section that `after` (the chunk after a section's last chunk `last`) carries begins on
    `last`'s page: the start of the line inside `last` that holds its heading (after Markdown's "#"
    marks, if any); `last`'s end when no line does."""
    heading = after.get("heading") or ""
    at = text.find(heading, last["start_char"], last["end_char"]) if heading and heading != last.get("heading") else -1
    while at >= 0:
        line = text.rfind("\n", 0, at) + 1
        if line > last["start_char"] and not text[line:at].strip("# \t"):
            return line
        at = text.find(heading, at + 1, last["end_char"])
    return last["end_char"]
