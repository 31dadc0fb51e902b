"""Ingestion pipeline on a real Qdrant Edge shard with the fake embedder: idempotency, replace,
duplicates, delete, crash recovery, hybrid vs dense on a rare identifier, Retriever.read."""

from __future__ import annotations

import re

import numpy as np
import pytest

from ingest.chunk import Chunker
from ingest.embed import HashEmbedder
from ingest.errors import DocumentNotFound
from ingest.index import EdgeIndex
from ingest.pipeline import Ingester
from ingest.retriever import Retriever
from tests.test_ingest_parse import marker_pdf


def open_ingester(tmp_path, embedder=None, **kwargs) -> Ingester:
    embedder = embedder or HashEmbedder()
    index = EdgeIndex(tmp_path / "qdrant" / "test", embedder.dim)
    return Ingester(index, embedder, Chunker(embedder.tokenize, chunk_tokens=64, overlap_tokens=8), batch_size=4, **kwargs)


@pytest.fixture
def ingester(tmp_path):
    ing = open_ingester(tmp_path)
    yield ing
    ing.close()


def texts(retriever: Retriever, query: str, k: int = 20) -> list[str]:
    return [h.text for h in retriever.search(query, k=k)]


def test_reingest_unchanged_is_a_noop(tmp_path, ingester):
    pdf = marker_pdf(tmp_path / "a.pdf")
    first = ingester.ingest_file(pdf)
    assert first.status == "added" and first.num_pages == 5 and first.num_chunks > 5
    before = ingester.index.count({})
    second = ingester.ingest_file(pdf)
    assert second.status == "unchanged" and second.doc_id == first.doc_id
    assert ingester.index.count({}) == before
    assert ingester.index.count({"kind": "chunk"}) == first.num_chunks


def test_a_new_parser_reads_an_unchanged_file_again(tmp_path, ingester, monkeypatch):
    # a parser that reads files differently (ingest/parse.py PARSE_VERSION) must not leave the old reading
    note = tmp_path / "note.md"
    note.write_text("# Plan\n\nThe launch code word is ALPHAWOLF.\n")
    assert ingester.ingest_file(note).status == "added"
    assert ingester.ingest_file(note).status == "unchanged"
    monkeypatch.setattr("ingest.pipeline.PARSE_VERSION", 999)
    again = ingester.ingest_file(note)
    assert again.status == "updated" and ingester.index.count({"doc_id": again.doc_id, "kind": "chunk"}) == again.num_chunks
    assert ingester.ingest_file(note).status == "unchanged"


def test_changed_file_replaces_its_chunks(tmp_path, ingester):
    note = tmp_path / "note.md"
    note.write_text("# Plan\n\nThe launch code word is ALPHAWOLF.\n")
    ingester.ingest_file(note)
    note.write_text("# Plan\n\nThe launch code word is BRAVOHAWK.\n")
    result = ingester.ingest_file(note)
    assert result.status == "updated"
    retriever = Retriever(ingester.index, ingester.embedder)
    assert not any("ALPHAWOLF" in t for t in texts(retriever, "ALPHAWOLF code word"))
    assert any("BRAVOHAWK" in t for t in texts(retriever, "BRAVOHAWK code word"))
    assert ingester.index.count({"doc_id": result.doc_id, "kind": "chunk"}) == result.num_chunks
    assert ingester.index.count({"doc_id": result.doc_id, "kind": "page"}) == 1
    assert len(ingester.list_documents()) == 1


def test_equal_content_at_two_paths_is_two_documents(tmp_path, ingester):
    (tmp_path / "x").mkdir()
    a, b = tmp_path / "a.txt", tmp_path / "x" / "a.txt"
    for p in (a, b):
        p.write_text("Shared content about the ZEBRAFISH protocol.")
    ra, rb = ingester.ingest_file(a), ingester.ingest_file(b)
    assert ra.status == rb.status == "added" and ra.doc_id != rb.doc_id
    assert ingester.index.count({"doc_id": ra.doc_id}) > 0 and ingester.index.count({"doc_id": rb.doc_id}) > 0
    hits = Retriever(ingester.index, ingester.embedder).search("ZEBRAFISH protocol", k=5)
    assert len(hits) == 1 and hits[0].path in {str(a.resolve()), str(b.resolve())}  # a search shows one copy of a text
    with pytest.raises(DocumentNotFound, match="names 2 documents"):
        ingester.find_document("a.txt")


def test_delete_removes_document_and_chunks(tmp_path, ingester):
    keep, drop = tmp_path / "keep.md", tmp_path / "drop.md"
    keep.write_text("Keep this PELICAN note.")
    drop.write_text("Drop this PELICAN note.")
    ingester.ingest_file(keep)
    dropped = ingester.ingest_file(drop)
    record = ingester.delete("drop.md")
    assert record["doc_id"] == dropped.doc_id
    assert [d["file_name"] for d in ingester.list_documents()] == ["keep.md"]
    assert ingester.index.count({"doc_id": dropped.doc_id}) == 0
    hits = Retriever(ingester.index, ingester.embedder).search("PELICAN note")
    assert [h.file_name for h in hits] == ["keep.md"]
    with pytest.raises(DocumentNotFound):
        ingester.delete("drop.md")


class Killed(BaseException):
    """Stands in for kill -9: raised mid-ingestion, with the in-process cleanup disabled."""


class DyingEmbedder(HashEmbedder):
    def __init__(self, die_on_call: int) -> None:
        super().__init__()
        self.calls, self.die_on_call = 0, die_on_call

    def embed(self, texts):
        self.calls += 1
        if self.calls == self.die_on_call:
            raise Killed()
        return super().embed(texts)


@pytest.mark.parametrize("existing", [False, True], ids=["new-file", "changed-file"])
def test_interrupted_ingest_leaves_no_half_file_and_rerun_completes(tmp_path, existing):
    pdf = tmp_path / "big.pdf"
    ing = open_ingester(tmp_path)
    if existing:
        marker_pdf(pdf, 2)
        old = ing.ingest_file(pdf)
    ing.close()
    marker_pdf(pdf, 6)  # new content: more pages, several embedding batches

    dying = open_ingester(tmp_path, DyingEmbedder(die_on_call=3))
    dying._repair = lambda record: None  # kill -9: no chance to clean up
    with pytest.raises(Killed):
        dying.ingest_file(pdf)
    retriever = Retriever(dying.index, dying.embedder)
    visible_pages = {h.page for h in retriever.search("Page marker", k=50)}
    assert visible_pages <= ({1, 2} if existing else set())  # only the old committed version is searchable
    assert dying.index.count({"kind": "doc", "dirty": 1}) == 1
    dying.close()

    rerun = open_ingester(tmp_path)
    assert rerun.recovered == 1
    assert rerun.index.count({"kind": "doc", "dirty": 1}) == 0
    if existing:
        assert rerun.index.count({"kind": "chunk"}) == old.num_chunks  # the half-written version is gone
        assert rerun.list_documents()[0]["num_pages"] == 2  # and the ledger still describes the old one
    else:
        assert rerun.index.count({}) == 0
    result = rerun.ingest_file(pdf)
    assert result.status == ("updated" if existing else "added") and result.num_pages == 6
    assert rerun.index.count({"kind": "chunk"}) == result.num_chunks
    assert {h.page for h in Retriever(rerun.index, rerun.embedder).search("Page marker", k=100)} == set(range(1, 7))
    rerun.close()


class IdentifierBlindEmbedder(HashEmbedder):
    """Like a small dense model, it does not "see" rare alphanumeric identifiers (tokens with digits)."""

    def embed(self, texts):
        return super().embed([re.sub(r"\S*\d\S*", " ", t) for t in texts])


class LookAlikeEmbedder(HashEmbedder):
    """A dense model that confuses codes: every query lands exactly on the look-alike's chunk."""

    LOOK_ALIKE = "Fault XK-4417Q: the fan bearing is worn; replace the fan."

    def embed_query(self, text):
        return super().embed([self.LOOK_ALIKE])[0]


def test_exact_identifier_beats_a_dense_look_alike(tmp_path):
    ing = open_ingester(tmp_path, LookAlikeEmbedder())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a-lookalike.txt").write_text(LookAlikeEmbedder.LOOK_ALIKE)
    for i, code in enumerate(["XK-4711Q", "XK-1447Q", "XK-4470Q", "XK-7441Q"]):
        (docs / f"b-other{i}.txt").write_text(f"Fault {code}: the fan bearing is worn on unit {i}; replace the fan.")
    (docs / "c-target.txt").write_text("Fault XK-4471Q: the impeller is blocked by debris; clear it before restarting.")
    for r in ing.ingest(sorted(docs.iterdir())):
        assert r.status == "added"
    retriever = Retriever(ing.index, ing.embedder)
    query = "fault XK-4471Q"
    assert retriever.search(query, k=1, mode="dense")[0].file_name == "a-lookalike.txt"
    assert retriever.search(query, k=1, mode="sparse")[0].file_name == "c-target.txt"
    # plain RRF (what Qdrant returns) puts the look-alike first: dense rank 1 + a shared "fault xk" sparse rank
    fused = ing.index.query(dense=ing.embedder.embed_query(query), sparse=retriever.sparse.encode_query(query),
                            limit=3, where={"kind": "chunk"}, mode="hybrid")
    assert fused[0].payload["path"].endswith("a-lookalike.txt")
    hybrid = retriever.search(query, k=3)
    assert [h.file_name for h in hybrid][:2] == ["c-target.txt", "a-lookalike.txt"]
    # a near-miss spelling is not an exact match: the fused order stands
    near = "fault XK-4471"
    fused_near = ing.index.query(dense=ing.embedder.embed_query(near), sparse=retriever.sparse.encode_query(near),
                                 limit=3, where={"kind": "chunk"}, mode="hybrid")
    assert [h.chunk_id for h in retriever.search(near, k=3)] == [p.id for p in fused_near]


def test_hybrid_finds_rare_identifier_that_dense_misses(tmp_path):
    ing = open_ingester(tmp_path, IdentifierBlindEmbedder())
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(25):
        (docs / f"faq{i:02d}.txt").write_text(f"What does the operator do when the shift {['starts', 'ends', 'pauses'][i % 3]}? "
                                              f"It does what the shift lead says, note {i}.")
    (docs / "codes.txt").write_text("Fault XK-4471Q: the impeller is blocked by debris; clear it before restarting.")
    for r in ing.ingest(sorted(docs.iterdir())):
        assert r.status == "added"
    retriever = Retriever(ing.index, ing.embedder)
    query = "what does XK-4471Q mean"
    dense = [h.file_name for h in retriever.search(query, k=5, mode="dense")]
    hybrid = [h.file_name for h in retriever.search(query, k=5)]
    assert "codes.txt" not in dense
    assert hybrid[0] == "codes.txt"
    assert retriever.search(query, k=1, mode="sparse")[0].file_name == "codes.txt"
    ing.close()


def test_retriever_hits_read_and_filters(tmp_path, ingester):
    pdf = marker_pdf(tmp_path / "m.pdf", 4)
    other = tmp_path / "o.md"
    other.write_text("# Other\n\nPage marker text in another file.")
    ingester.ingest_file(pdf)
    ingester.ingest_file(other)
    retriever = Retriever(ingester.index, ingester.embedder, top_k=3)
    hits = retriever.search("PM3X")  # only page 3 has this token: top in BM25, so top after fusion
    assert len(hits) == 3 and hits[0].page == 3 and hits[0].file_name == "m.pdf"
    assert hits[0].citation == "m.pdf p. 3" and hits[0].heading == "Chapter 3"
    assert hits[0].score >= hits[-1].score and hits[0].chunk_id
    only_md = retriever.search("page marker", k=10, filters={"file_name": "o.md"})
    assert only_md and {h.file_name for h in only_md} == {"o.md"}
    on_pages = retriever.search("page marker", k=10, filters={"doc_id": hits[0].doc_id, "page": [2, 4]})
    assert on_pages and {h.page for h in on_pages} <= {2, 4}
    pages = retriever.read("m.pdf", [4, 2])
    assert [p.page for p in pages] == [2, 4] and "PM4X" in pages[1].text
    full = retriever.read(hits[0].doc_id)
    assert [p.page for p in full] == [1, 2, 3, 4]
    assert full[2].text[hits[0].start_char:hits[0].end_char] == hits[0].text
    assert retriever.search("   ") == []
    with pytest.raises(ValueError, match="unknown filter"):
        retriever.search("x", filters={"color": "red"})
    with pytest.raises(DocumentNotFound):
        retriever.read("missing.pdf")


def test_failed_files_do_not_touch_the_index(tmp_path, ingester):
    bad = tmp_path / "bad.pdf"
    bad.write_bytes(b"not a pdf at all")
    good = tmp_path / "good.txt"
    good.write_text("fine")
    results = list(ingester.ingest([bad, tmp_path / "missing.txt", good]))
    assert [r.status for r in results] == ["failed", "failed", "added"]
    assert "PDF" in results[0].error and "no such file" in results[1].error
    assert [d["file_name"] for d in ingester.list_documents()] == ["good.txt"]


def test_embedder_rows_are_unit_length():
    vectors = HashEmbedder().embed(["a b c", "", "pump"])
    assert vectors.shape == (3, 64) and np.allclose(np.linalg.norm(vectors, axis=1), 1.0)


KILLED_CHILD = r"""
import sys, time
from pathlib import Path
from ingest.chunk import Chunker
from ingest.embed import HashEmbedder
from ingest.index import EdgeIndex
from ingest.pipeline import Ingester

class SlowEmbedder(HashEmbedder):
    def embed(self, texts):
        time.sleep(0.2)
        return super().embed(texts)

embedder = SlowEmbedder()
index = EdgeIndex(Path(sys.argv[1]), embedder.dim)
ingester = Ingester(index, embedder, Chunker(embedder.tokenize, chunk_tokens=64, overlap_tokens=8), batch_size=4)
def progress(what, n):
    if what == "chunks":
        print("upserted", n, flush=True)
ingester.ingest_file(sys.argv[2], progress)
print("finished", flush=True)
"""


def test_kill_9_mid_file_then_rerun_completes(tmp_path):
    import signal
    import subprocess
    import sys

    doc = tmp_path / "long.txt"
    doc.write_text("\n\n".join(f"Paragraph {i} talks about the KESTREL{i} valve and its pressure." for i in range(200)))
    shard = tmp_path / "qdrant" / "test"
    child = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, str(shard), str(doc)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        lines = [child.stdout.readline() for _ in range(3)]  # three batches are in the index
        assert all(line.startswith("upserted") for line in lines), (lines, child.stderr.read() if child.poll() else "")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    ing = open_ingester(tmp_path)  # the dead process's lock is gone; its WAL is replayed
    assert ing.recovered == 1 and ing.index.count({}) == 0  # never committed: nothing of it is left
    result = ing.ingest_file(doc)
    assert result.status == "added"
    hits = Retriever(ing.index, ing.embedder).search("KESTREL150 valve", k=3)
    assert any("KESTREL150" in h.text for h in hits)
    ing.close()
