"""One suite, two backends: identical inserts and queries on Qdrant Edge and on qdrant-client (its
`:memory:` mode standing in for a Qdrant server); each must behave as specified and both must agree."""

from __future__ import annotations

import numpy as np
import pytest

from ingest.chunk import Chunker
from ingest.embed import Bm25Encoder, HashEmbedder
from ingest.index import EdgeIndex
from ingest.index_base import IndexPoint, Not
from ingest.index_server import QdrantServerIndex
from ingest.pipeline import Ingester, point_id
from ingest.retriever import Retriever
from tests.test_ingest_parse import make_pdf

DIM = 16
SENTENCES = [
    "the centrifugal pump needs new seals", "valve pressure drops at night", "replace the impeller blades yearly",
    "error code QX-77 means low voltage", "the manual covers pumps and valves", "night shift checks pressure gauges",
    "seals wear out faster in hot water", "voltage spikes trip the breaker", "impeller debris causes vibration",
    "gauges must be calibrated in spring", "the breaker panel is in room 4", "vibration sensors report hourly",
]
QUERIES = ["pump seals", "pressure at night", "QX-77", "breaker voltage", "impeller vibration", "spring calibration"]


def make_backend(kind: str, tmp_path):
    if kind == "edge":
        return EdgeIndex(tmp_path / "edge", DIM)
    from qdrant_client import QdrantClient

    return QdrantServerIndex(QdrantClient(":memory:"), "suite", DIM)


BACKENDS = ["edge", "qdrant-client"]


def fill(index) -> None:
    rng = np.random.default_rng(7)
    bm25 = Bm25Encoder()
    points = []
    for i, text in enumerate(SENTENCES):
        text += " " + " ".join(f"w{i}n{j}" for j in range(i))  # distinct lengths: no BM25 ties to order arbitrarily
        dense = rng.standard_normal(DIM).astype(np.float32)
        points.append(IndexPoint(point_id("doc", i), {"kind": "chunk", "doc_id": f"d{i % 3}", "page": i % 4 + 1,
                                                      "visible": 1, "text": text, "version": "v1"},
                                 dense=dense / np.linalg.norm(dense), sparse=bm25.encode_documents([text])[0]))
    points.append(IndexPoint(point_id("doc-record"), {"kind": "doc", "doc_id": "d0", "dirty": 0}))
    index.upsert(points)


def run_queries(index) -> dict:
    """Every read the seam offers, as plain data."""
    rng = np.random.default_rng(11)
    bm25 = Bm25Encoder()
    out = {}
    for q in QUERIES:
        dense = rng.standard_normal(DIM).astype(np.float32)
        sparse = bm25.encode_query(q)
        for mode in ("dense", "sparse", "hybrid"):
            for where in ({"kind": "chunk"}, {"kind": "chunk", "doc_id": ["d0", "d1"], "page": Not(2)}):
                hits = index.query(dense=dense, sparse=sparse, limit=5, where=where, mode=mode, candidates=8)
                out[(q, mode, str(where))] = [(h.id, round(h.score, 4), h.payload["text"]) for h in hits]
    out["count"] = (index.count({}), index.count({"kind": "chunk"}), index.count({"doc_id": "d1"}),
                    index.count({"page": [1, 2]}), index.count({"kind": "doc", "dirty": 0}))
    out["scroll"] = sorted(p["text"] for p in index.scroll({"doc_id": "d2", "kind": "chunk"}, batch=2))
    return out


def tie_groups(hits) -> list[frozenset]:
    """Texts grouped by equal score (RRF gives ties, which backends may order differently); the last
    group is left out because the limit may cut a tie at different members."""
    groups: list[tuple[float, set]] = []
    for _id, score, text in hits:
        if groups and abs(groups[-1][0] - score) < 1e-4:
            groups[-1][1].add(text)
        else:
            groups.append((score, {text}))
    return [frozenset(texts) for _score, texts in groups[:-1]]


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path):
    index = make_backend(request.param, tmp_path)
    yield index
    index.close()


def test_backend_contract(backend):
    fill(backend)
    assert backend.count({}) == len(SENTENCES) + 1
    bm25 = Bm25Encoder()
    hits = backend.query(dense=None, sparse=bm25.encode_query("QX-77 error"), limit=3, where={"kind": "chunk"},
                         mode="sparse")
    assert hits[0].payload["text"].startswith("error code QX-77")
    # a point without vectors (a ledger record) is never a search result
    assert all(h.payload["kind"] == "chunk" for h in backend.query(
        dense=np.ones(DIM, np.float32), sparse=None, limit=50, where={}, mode="dense"))
    backend.set_payload({"doc_id": "d1"}, {"visible": 0})
    assert backend.count({"visible": 1}) == len(SENTENCES) - 4
    backend.delete({"doc_id": "d1", "page": Not(2)})
    assert backend.count({"doc_id": "d1"}) == 1  # only the d1 chunk on page 2 is left
    with pytest.raises(ValueError):
        backend.delete({})
    with pytest.raises(ValueError, match="needs"):
        backend.query(dense=None, sparse=None, limit=1, where={}, mode="hybrid")


def test_both_backends_return_identical_results(tmp_path):
    results = {}
    for kind in BACKENDS:
        index = make_backend(kind, tmp_path)
        fill(index)
        results[kind] = run_queries(index)
        index.close()
    edge, client = results["edge"], results["qdrant-client"]
    assert edge.keys() == client.keys()
    for key in edge:
        if isinstance(key, tuple):
            assert [h[1] for h in edge[key]] == pytest.approx([h[1] for h in client[key]], abs=2e-3), key
            assert tie_groups(edge[key]) == tie_groups(client[key]), key
        else:
            assert edge[key] == client[key], key
    assert any(edge[k] for k in edge if isinstance(k, tuple) and k[1] == "hybrid")


def test_pipeline_and_retriever_agree_across_backends(tmp_path):
    make_pdf(tmp_path / "m.pdf", [(f"Chapter {i + 1}", ". ".join(SENTENCES[3 * i:3 * i + 3]) + f". Marker PM{i + 1}X.")
                                  for i in range(4)])
    (tmp_path / "n.md").write_text("# Notes\n\nThe breaker for PM2X lives in room 4.\n")
    embedder = HashEmbedder(DIM)
    answers = {}
    for kind in BACKENDS:
        index = make_backend(kind, tmp_path / kind)
        ingester = Ingester(index, embedder, Chunker(embedder.tokenize, chunk_tokens=64, overlap_tokens=8))
        assert [r.status for r in ingester.ingest([tmp_path / "m.pdf", tmp_path / "n.md"])] == ["added", "added"]
        assert ingester.ingest_file(tmp_path / "n.md").status == "unchanged"
        retriever = Retriever(index, embedder)
        searches = [[(h.chunk_id, round(h.score, 4), (h.file_name, h.page, h.text)) for h in retriever.search(q, k=20)]
                    for q in ("PM2X breaker room", "marker PM4X", "pump seals", "voltage at night")]
        answers[kind] = {"search": searches, "read": [(p.page, p.text) for p in retriever.read("m.pdf", [3])],
                         "docs": [d["doc_id"] for d in retriever.documents()]}
        index.close()
    edge, client = answers["edge"], answers["qdrant-client"]
    assert edge["read"] == client["read"] and edge["docs"] == client["docs"]
    for e, c in zip(edge["search"], client["search"]):
        # k covers every chunk, so both return all of them; near-tied BM25 scores may swap neighbours,
        # which moves RRF scores by less than 1e-3
        assert len(e) == len(c) >= 5 and {h[0] for h in e} == {h[0] for h in c}
        assert e[0][0] == c[0][0]
        assert [h[1] for h in e] == pytest.approx([h[1] for h in c], abs=2e-3)
    assert edge["search"][0][0][2][0] == "n.md" and edge["search"][1][0][2][1] == 4


def test_search_returns_distinct_texts_and_weighs_the_rarer_identifier(tmp_path):
    # The same manual indexed from two paths filled the top k with copies (2-3 different passages out of 5);
    # and with two identifiers in a query, "holds any" let the one every chunk holds (the library's name)
    # outrank the chunk with the function asked about.
    chapters = [(f"Chapter {i}", f"The libfoo library, part {i}: " + ". ".join(SENTENCES[3 * (i % 4):3 * (i % 4) + 3]))
                for i in range(8)]
    chapters[6] = ("Errors", "void foo_perror (int error) prints a description of an error. Since: 1.6.")
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        make_pdf(tmp_path / folder / "libfoo.pdf", chapters)
    embedder = HashEmbedder(DIM)
    index = EdgeIndex(tmp_path / "edge", DIM)
    ingester = Ingester(index, embedder, Chunker(embedder.tokenize, chunk_tokens=64, overlap_tokens=8))
    assert [r.status for r in ingester.ingest([tmp_path / "a" / "libfoo.pdf", tmp_path / "b" / "libfoo.pdf"])] == \
        ["added", "added"]
    retriever = Retriever(index, embedder)
    hits = retriever.search("pump seals and valve pressure", k=5)
    texts = [" ".join(h.text.split()) for h in hits]
    assert len(hits) == 5 and len(set(texts)) == 5
    assert len({h.doc_id for h in retriever.search("pump seals", k=50)}) == 2  # both copies are still indexed
    first = retriever.search("Since which libfoo version is foo_perror available?", k=3)[0]
    assert "foo_perror" in first.text and first.page == 7
    index.close()


def test_tied_scores_come_back_in_one_order_whatever_order_the_index_gives():
    # Qdrant returns RRF ties (ranks 3+5 and 5+3 sum alike) in no fixed order: two runs of one question
    # numbered the same two passages [3] and [4] the other way round, and the answers differed.
    from ingest.index_base import ScoredPayload

    class TieIndex:
        def __init__(self) -> None:
            self.calls = 0

        def query(self, **_: object) -> list:
            self.calls += 1
            tied = [ScoredPayload(f"id-{c}", 0.03, {"doc_id": "d", "path": "/a.txt", "page": 1, "text": f"text {c}"})
                    for c in "abc"]
            top = ScoredPayload("id-z", 0.05, {"doc_id": "d", "path": "/a.txt", "page": 1, "text": "text z"})
            return [top, *(tied if self.calls % 2 else tied[::-1])]

    retriever = Retriever(TieIndex(), HashEmbedder(DIM))
    orders = {tuple(h.chunk_id for h in retriever.search("what text", k=4)) for _ in range(4)}
    assert orders == {("id-z", "id-a", "id-b", "id-c")}


def test_an_identifier_of_the_documents_own_title_moves_nothing():
    # "ASN.1" is what the whole libtasn1 manual is about (its title page says so): any chunk holding it
    # outranked the one defining asn1_delete_structure, which holds neither it nor "libtasn1", and
    # "which function deletes a whole ASN.1 structure" was refused (dev tasn1-002).
    from ingest.index_base import ScoredPayload

    doc = {"kind": "doc", "doc_id": "d", "path": "/m/libtasn1.pdf", "file_name": "libtasn1.pdf", "committed": "v1",
           "num_chunks": 14}
    title = {"kind": "page", "doc_id": "d", "path": "/m/libtasn1.pdf", "page": 1, "version": "v1",
             "text": "Libtasn1\nAbstract Syntax Notation One (ASN.1) library for the GNU system"}

    class FixedIndex:
        def query(self, **_: object) -> list:
            def chunk(cid: str, score: float, page: int, text: str) -> ScoredPayload:
                return ScoredPayload(cid, score, {"doc_id": "d", "path": doc["path"], "page": page, "text": text})
            target = chunk("id-target", 0.05, 12, "asn1 delete structure: deletes the whole structure, sets it to NULL.")
            topical = [chunk(f"id-{i:02d}", 0.04 - i / 1000, i + 2, f"ASN.1 definitions in libtasn1, part {i}.")
                       for i in range(12)]
            rare = chunk("id-rare", 0.01, 30, "Only here: the asn1_perror function prints an error.")
            return [target, *topical, rare]

        def scroll(self, where: dict, **_: object) -> list:
            return [doc] if where.get("kind") == "doc" else [title] if where.get("page") == [1] else []

    retriever = Retriever(FixedIndex(), HashEmbedder(DIM))
    assert retriever.search("Which libtasn1 function deletes a whole ASN.1 structure?", k=3)[0].chunk_id == "id-target"
    # an identifier the title does not hold still comes first, whatever its fused rank
    hits = retriever.search("Since which libtasn1 version is asn1_perror available?", k=3)
    assert [h.chunk_id for h in hits] == ["id-rare", "id-target", "id-00"]


def test_a_documents_chunks_are_read_once_per_version(tmp_path):
    # a count question tries the sections of up to ten hits: each read had scrolled all of the
    # document's chunks again; a re-ingested document must still be read anew
    embedder = HashEmbedder(DIM)
    index = EdgeIndex(tmp_path / "edge", DIM)
    ingester = Ingester(index, embedder, Chunker(embedder.tokenize, chunk_tokens=32, overlap_tokens=4))
    doc = tmp_path / "notes.md"
    doc.write_text("# Pumps\n\n" + ". ".join(SENTENCES[:6]) + ".\n\n# Valves\n\n" + ". ".join(SENTENCES[6:]) + ".\n")
    assert [r.status for r in ingester.ingest([doc])] == ["added"]
    retriever = Retriever(index, embedder)
    scrolls: list[dict] = []
    scroll = index.scroll
    index.scroll = lambda where, **kw: scrolls.append(where) or scroll(where, **kw)  # type: ignore[method-assign]
    hit = next(h for h in retriever.search("breaker panel room", k=5) if h.heading == "Valves")
    first = "".join(p.text for p in retriever.section(hit))
    assert "breaker panel is in room 4" in first and "centrifugal pump" not in first
    assert "".join(p.text for p in retriever.section(hit)) == first
    assert sum(w.get("kind") == "chunk" for w in scrolls) == 1

    doc.write_text(doc.read_text().replace("room 4", "room 9"))
    assert [r.status for r in ingester.ingest([doc])] == ["updated"]
    hit = next(h for h in retriever.search("breaker panel room", k=5) if h.heading == "Valves")
    again = "".join(p.text for p in retriever.section(hit))
    assert "breaker panel is in room 9" in again and "room 4" not in again
    assert sum(w.get("kind") == "chunk" for w in scrolls) == 2
    index.close()


def test_similarity_is_the_best_cosine_and_the_query_is_embedded_once(tmp_path):
    # the prefetch asks how close a question comes to the library before it searches: one embedding
    embedder = HashEmbedder(DIM)
    index = EdgeIndex(tmp_path / "edge", DIM)
    ingester = Ingester(index, embedder, Chunker(embedder.tokenize, chunk_tokens=32, overlap_tokens=4))
    doc = tmp_path / "notes.md"
    doc.write_text("# Pumps\n\n" + ". ".join(SENTENCES[:6]) + ".\n")
    assert [r.status for r in ingester.ingest([doc])] == ["added"]
    retriever = Retriever(index, embedder)
    embedded: list[str] = []
    embed_query = embedder.embed_query
    embedder.embed_query = lambda text: embedded.append(text) or embed_query(text)  # type: ignore[method-assign]
    chunk = retriever.search("centrifugal pump", k=1)[0].text
    assert retriever.similarity(chunk) > 0.95  # a chunk's own text (embedded at ingest with its heading)
    assert retriever.similarity("zebra quartz violin") < 0.5
    assert retriever.similarity("zebra quartz violin", {"doc_id": ["no-such-doc"]}) == 0.0
    assert embedded == ["centrifugal pump", chunk, "zebra quartz violin"]  # each query embedded once
    index.close()


def test_a_section_ends_where_the_next_sections_heading_starts(tmp_path):
    # the chunk that ends a section also holds the next heading and the first items of its list: read to
    # its end, "Running" had counted four of the ten placeholders that "Environment" lists
    embedder = HashEmbedder(DIM)
    index = EdgeIndex(tmp_path / "edge", DIM)
    ingester = Ingester(index, embedder, Chunker(embedder.tokenize, chunk_tokens=48, overlap_tokens=4))
    doc = tmp_path / "manual.md"
    placeholders = "\n".join(f"- %{c}: the number of {w} edges." for c, w in zip("stprufoce", (
        "started", "total", "percent", "running", "remaining", "finished", "overall", "current", "elapsed")))
    doc.write_text("# Running\n\n" + ". ".join(SENTENCES[:3]) + ".\n\n# Environment\n\nSeveral placeholders are "
                   f"available:\n\n{placeholders}\n\n# Tools\n\n" + ". ".join(SENTENCES[3:6]) + ".\n")
    assert [r.status for r in ingester.ingest([doc])] == ["added"]
    retriever = Retriever(index, embedder)
    chunks = retriever._chunks(next(iter(retriever.documents()))["doc_id"])
    running = [c for c in chunks if c["heading"] == "Running"]
    assert "# Environment" in running[-1]["text"]  # the case: the next heading inside the section's last chunk
    hit = next(h for h in retriever.search(SENTENCES[0], k=8) if h.heading == "Running")
    text = "".join(p.text for p in retriever.section(hit))
    assert text.startswith("# Running") and SENTENCES[2] in text and "Environment" not in text
    hit = next(h for h in retriever.search("placeholders elapsed edges", k=8) if h.heading == "Environment")
    text = "".join(p.text for p in retriever.section(hit))
    assert "%s: the number of started" in text and "%e: the number of elapsed" in text and "# Tools" not in text
    index.close()
