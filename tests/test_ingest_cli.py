"""`assistant ingest`, `docs list|delete`, `eval retrieval`: stdout and stderr checked separately."""

from __future__ import annotations

import argparse
import json

import pytest

from assistant.cli import main
from ingest.cli import add_eval_command, eval_subparsers, register, retrieval_metrics
from tests.test_ingest_parse import marker_pdf


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("ASSISTANT_RETRIEVAL_EMBEDDER", "hash-64")  # the fake embedder: no model needed
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    marker_pdf(docs / "manual.pdf", 4)
    (docs / "notes.md").write_text("# Notes\n\nThe spare key is under the OSPREY mat.\n")
    (docs / "sub" / "deep.txt").write_text("Deep file about the HERON project.")
    (docs / "ignored.xyz").write_text("not picked up from a folder")
    (docs / "broken.pdf").write_bytes(b"%PDF-1.4 garbage")
    return tmp_path


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_ingest_reports_each_failure_and_exits_nonzero(corpus, capsys):
    data = str(corpus / "data")
    code, out, err = run(capsys, "ingest", str(corpus / "docs"), str(corpus / "docs" / "ignored.xyz"), "--data-dir", data)
    assert code == 1
    assert "Skipping" in err and "broken.pdf: not a readable PDF" in err
    assert "ignored.xyz: unsupported file type '.xyz'" in err
    assert "Skipping" not in out
    assert "4 file(s)" in out and "2 added" in out and "2 failed" in out and "pages" in out and "chunks" in out
    assert "deep.txt" not in out + err  # no --recursive: the sub-folder is not read

    code, out, err = run(capsys, "ingest", str(corpus / "docs" / "notes.md"), str(corpus / "docs"), "--recursive",
                         "--data-dir", data, "--collection", "default")
    assert code == 1 and err.count("Skipping") == 1  # broken.pdf again; notes.md and manual.pdf unchanged
    assert "1 added" in out and "2 unchanged" in out


def test_docs_list_and_delete(corpus, capsys):
    data = str(corpus / "data")
    ok = [str(corpus / "docs" / n) for n in ("manual.pdf", "notes.md")]
    assert run(capsys, "ingest", *ok, "--data-dir", data)[0] == 0
    code, out, err = run(capsys, "docs", "list", "--data-dir", data)
    assert code == 0 and err == ""
    assert "manual.pdf" in out and "notes.md" in out and "2 document(s)" in out
    code, out, _ = run(capsys, "docs", "list", "--json", "--data-dir", data)
    rows = [json.loads(line) for line in out.splitlines()]
    assert {r["file_name"] for r in rows} == {"manual.pdf", "notes.md"} and rows[0]["num_pages"] >= 1

    code, out, err = run(capsys, "docs", "delete", "notes.md", "--data-dir", data)
    assert code == 0 and "Deleted" in out and err == ""
    code, out, err = run(capsys, "docs", "delete", "notes.md", "--data-dir", data)
    assert code == 2 and out == "" and "no document 'notes.md'" in err and "assistant docs list" in err
    code, out, _ = run(capsys, "docs", "list", "--data-dir", data, "--collection", "empty")
    assert code == 0 and "No documents" in out


def test_eval_retrieval_prints_one_json_line(corpus, capsys):
    data = str(corpus / "data")
    assert run(capsys, "ingest", str(corpus / "docs" / "manual.pdf"), str(corpus / "docs" / "notes.md"),
               "--data-dir", data, "--collection", "scratch")[0] == 0
    qa = corpus / "qa.jsonl"
    qa.write_text("\n".join(json.dumps(row) for row in [
        {"question": "where is the OSPREY mat key", "doc": "notes.md", "pages": [1], "answer": "ignored"},
        {"question": "PM3X", "doc": "manual.pdf", "pages": [3]},
        {"question": "PE2X", "doc": "docs/manual.pdf", "pages": [2]},
        {"question": "something absent ZZZQQQ", "doc": "nowhere.pdf", "pages": [1]},
    ]) + "\n")
    code, out, err = run(capsys, "eval", "retrieval", str(qa), "--data-dir", data, "--collection", "scratch", "--k", "5")
    assert code == 0 and err == ""
    lines = out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["num_questions"] == 4
    assert result["recall_at_1"] == 0.75 and result["recall_at_5"] == 0.75 and result["mrr"] == 0.75

    qa.write_text('{"question": "no doc field"}\n')
    code, out, err = run(capsys, "eval", "retrieval", str(qa), "--data-dir", data)
    assert code == 2 and out == "" and "qa.jsonl:1" in err


def test_metrics_arithmetic():
    assert retrieval_metrics([1, 2, None, 5]) == {"recall_at_1": 0.25, "recall_at_5": 0.75, "mrr": 0.425,
                                                  "num_questions": 4}


def test_eval_group_is_shared_with_a_sibling_command():
    def common(p):
        p.add_argument("--data-dir")

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    register(sub, common)
    eval_sub = eval_subparsers(sub, common)  # what a later `eval answers` module does
    eval_sub.add_parser("answers").set_defaults(func="answers")
    assert parser.parse_args(["eval", "answers"]).func == "answers"
    assert parser.parse_args(["eval", "retrieval", "qa.jsonl"]).k == 10

    other = argparse.ArgumentParser()
    other_sub = other.add_subparsers(dest="command")
    existing = other_sub.add_parser("eval").add_subparsers(dest="what")  # the sibling registered first
    existing.add_parser("answers")
    add_eval_command(eval_subparsers(other_sub, common), common)
    assert other.parse_args(["eval", "retrieval", "q.jsonl", "--k", "3"]).k == 3


def test_bad_retrieval_settings_say_how_to_fix_them(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("ASSISTANT_RETRIEVAL_CHUNK_OVERLAP", "500")
    code, out, err = run(capsys, "docs", "list", "--data-dir", str(tmp_path))
    assert code == 2 and out == "" and "retrieval.chunk_overlap=500" in err and "below chunk_tokens" in err


def test_a_shard_held_by_another_process_is_a_clear_error(corpus, capsys):
    from ingest.index import EdgeIndex

    data = corpus / "data"
    holder = EdgeIndex(data / "qdrant" / "default", 64)  # e.g. `assistant serve` holding the collection
    try:
        code, out, err = run(capsys, "docs", "list", "--data-dir", str(data))
    finally:
        holder.close()
    assert code == 2 and out == ""
    assert "in use by another process" in err


@pytest.mark.parametrize("cores,idle,threads", [(2, 0.3, 1), (2, 1.8, 2), (8, 7.5, 4), (1, 1.0, 1)])
def test_auto_threads_use_the_idle_cores(monkeypatch, cores, idle, threads):
    import ingest.embed as embed

    monkeypatch.setattr(embed.os, "cpu_count", lambda: cores)
    monkeypatch.setattr(embed, "_idle_cores", lambda n: idle)
    assert embed.auto_threads() == threads
