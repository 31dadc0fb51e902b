"""CLI: `assistant ingest`, `assistant docs list|delete`, `assistant eval retrieval`.

Registered by assistant/cli.py through `register(subparsers, add_common)`. Progress bars and
"Skipping X: reason" lines go to stderr, results and summaries to stdout. `eval` is a group: this
module creates it (or reuses one another module created) and adds `retrieval`; a sibling such as
`eval answers` can join through `eval_subparsers(subparsers, add_common)`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from assistant.commands import EVAL_HELP, command_group
from assistant.errors import AssistantError


def register(subparsers, add_common) -> None:
    ingest = subparsers.add_parser("ingest", help="add files and folders to the document index",
                                   description="Parse, chunk, embed and index documents (PDF, Markdown, text, "
                                               "HTML, DOCX, images via OCR). Unchanged files are skipped.")
    ingest.add_argument("paths", nargs="+", metavar="PATH", help="files and folders")
    ingest.add_argument("--recursive", "-r", action="store_true", help="descend into sub-folders")
    _add_collection(ingest)
    add_common(ingest)
    ingest.set_defaults(func=cmd_ingest)

    docs = subparsers.add_parser("docs", help="list or delete indexed documents")
    docs_sub = docs.add_subparsers(dest="docs_command", required=True, metavar="ACTION")
    lst = docs_sub.add_parser("list", help="list indexed documents")
    lst.add_argument("--json", action="store_true", help="one JSON object per line")
    _add_collection(lst)
    add_common(lst)
    lst.set_defaults(func=cmd_docs_list)
    delete = docs_sub.add_parser("delete", help="remove a document and its chunks")
    delete.add_argument("doc", metavar="DOC", help="doc id, path, or file name (if unique)")
    _add_collection(delete)
    add_common(delete)
    delete.set_defaults(func=cmd_docs_delete)

    add_eval_command(eval_subparsers(subparsers, add_common), add_common)


def eval_subparsers(subparsers, add_common=None) -> argparse._SubParsersAction:
    """The `eval` group's sub-parsers, creating `assistant eval` if no module has yet."""
    return command_group(subparsers, "eval", EVAL_HELP)


def add_eval_command(eval_sub, add_common) -> None:
    """Add `eval retrieval` to an `eval` group."""
    retrieval = eval_sub.add_parser("retrieval", help="recall@k and MRR over a JSONL file of questions",
                                    description='Each line: {"question": ..., "doc": FILE NAME, "pages": [1-based, ...]}; '
                                                "other fields are ignored. Prints one JSON line.")
    retrieval.add_argument("file", metavar="FILE.jsonl")
    retrieval.add_argument("--k", type=int, default=10, help="results per question for MRR (default 10, at least 5)")
    retrieval.add_argument("--mode", choices=("hybrid", "dense", "sparse"), default="hybrid", help="search mode")
    _add_collection(retrieval)
    add_common(retrieval)
    retrieval.set_defaults(func=cmd_eval_retrieval)


def _add_collection(parser) -> None:
    parser.add_argument("--collection", default=None, help="collection name (default: retrieval.collection)")


# -- handlers -----------------------------------------------------------------------------------


def cmd_ingest(args, config, *, screen=None) -> int:
    """`screen(texts) -> flagged`: the safety layer's ingest-time screening of a new document's chunks
    (the CLI entry passes it; this package never imports the core's safety)."""
    from tqdm import tqdm

    from ingest.pipeline import Ingester, expand_paths, screen_result

    paths = expand_paths(args.paths, recursive=args.recursive)
    if not paths:
        print("Nothing to ingest: no supported files under the given paths.", file=sys.stderr)
        return 1
    started = time.perf_counter()
    ingester = Ingester.from_config(config, args.collection, num_threads=_cli_threads(config))
    if ingester.recovered:
        print(f"Recovered {ingester.recovered} document(s) left half-indexed by an interrupted run.", file=sys.stderr)
    counts = {"added": 0, "updated": 0, "unchanged": 0, "failed": 0}
    num_pages = num_chunks = 0
    expected = {p: estimate_pages(p) for p in paths}  # cheap page counts, so the ETA covers big PDFs
    bar = tqdm(total=sum(expected.values()), unit="page", desc="Ingesting", file=sys.stderr, disable=None,
               dynamic_ncols=True)
    advanced = 0  # pages of the current file already counted on the bar

    def on_progress(what: str, n: int) -> None:
        nonlocal num_pages, num_chunks, advanced
        if what == "pages":
            num_pages += n
        elif what == "chunks":
            num_chunks += n
        elif what == "pages_done" and advanced < expected[path]:
            step = min(n, expected[path] - advanced)
            advanced += step
            bar.update(step)
        bar.set_postfix(files=f"{done_files}/{len(paths)}", chunks=num_chunks, refresh=False)

    done_files = 0
    try:
        for path in paths:
            bar.set_description(f"Ingesting {path.name[:30]}")
            advanced = 0
            result = ingester.ingest_file(path, on_progress)
            if screen is not None and result.status in ("added", "updated"):
                bar.set_description(f"Screening {path.name[:30]}")
                screen_result(ingester.index, result, screen)
            counts[result.status] += 1
            if result.status == "failed":
                bar.write(f"Skipping {path}: {result.error}", file=sys.stderr)
            for warning in result.warnings:
                bar.write(f"Warning {path}: {warning}", file=sys.stderr)
            bar.update(expected[path] - advanced)  # unchanged / failed files, blank pages dropped
            done_files += 1
            bar.set_postfix(files=f"{done_files}/{len(paths)}", chunks=num_chunks)
        bar.close()
        if counts["added"] + counts["updated"] and ingester.should_optimize():
            print("Optimizing the index for search speed (a few minutes on a large collection; "
                  "interrupting is safe)...", file=sys.stderr)
            ingester.optimize()
    finally:
        bar.close()
        ingester.close()
    seconds = time.perf_counter() - started
    print(f"Ingested {len(paths)} file(s) in {seconds:.1f} s: {counts['added']} added, {counts['updated']} updated, "
          f"{counts['unchanged']} unchanged, {counts['failed']} failed; {num_pages} pages, {num_chunks} chunks "
          f"into collection {args.collection or config.retrieval.collection!r}.")
    return 1 if counts["failed"] else 0


def estimate_pages(path: Path) -> int:
    """A PDF's page count (opening it reads only the page tree), else 1."""
    if path.suffix.lower() != ".pdf":
        return 1
    try:
        import pymupdf

        with pymupdf.open(path) as pdf:
            return max(1, pdf.page_count)
    except Exception:  # noqa: BLE001 - a broken file is reported when it is ingested
        return 1


def cmd_docs_list(args, config) -> int:
    from ingest.pipeline import list_documents

    collection = args.collection or config.retrieval.collection
    if not config.retrieval.qdrant_url and not (Path(config.data_dir) / "qdrant" / collection).exists():
        docs = []  # listing must not create the collection
    else:
        index = _open_index_for_listing(config, collection)
        try:
            docs = list_documents(index)
        finally:
            index.close()
    if args.json:
        for d in docs:
            print(json.dumps({k: d.get(k) for k in ("doc_id", "path", "file_name", "format", "num_pages",
                                                    "num_chunks", "ingested_at")}))
        return 0
    if not docs:
        print("No documents. Add some with: assistant ingest PATH...")
        return 0
    print(f"{'doc id':<17} {'pages':>5} {'chunks':>6}  {'format':<8} path")
    for d in docs:
        print(f"{d['doc_id']:<17} {d['num_pages']:>5} {d['num_chunks']:>6}  {d['format']:<8} {d['path']}")
    print(f"{len(docs)} document(s)")
    return 0


def cmd_docs_delete(args, config) -> int:
    from ingest.pipeline import Ingester

    ingester = Ingester.from_config(config, args.collection)
    try:
        record = ingester.delete(args.doc)
    finally:
        ingester.close()
    print(f"Deleted {record['path']} ({record['doc_id']}, {record['num_chunks']} chunks).")
    return 0


def cmd_eval_retrieval(args, config) -> int:
    from ingest.retriever import Retriever

    questions = read_qa_file(Path(args.file))
    k = max(5, args.k)
    retriever = Retriever.from_config(config, args.collection, num_threads=_cli_threads(config))
    try:
        ranks = [first_relevant_rank(retriever.search(q["question"], k=k, mode=args.mode), q["doc"], q["pages"])
                 for q in questions]
    finally:
        retriever.close()
    print(json.dumps(retrieval_metrics(ranks) | {"k": k, "mode": args.mode}))
    return 0


class QAFileError(AssistantError):
    """The QA file of `eval retrieval` is malformed."""


def read_qa_file(path: Path) -> list[dict]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise QAFileError(f"cannot read {path}: {e.strerror or e}") from e
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            question, doc = str(row["question"]), Path(str(row["doc"])).name
            pages = [int(p) for p in row.get("pages") or []]
        except (ValueError, KeyError, TypeError) as e:
            raise QAFileError(f"{path}:{number}: expected {{\"question\": str, \"doc\": file name, \"pages\": [int]}} ({e})") from e
        out.append({"question": question, "doc": doc, "pages": pages})
    if not out:
        raise QAFileError(f"{path} has no questions")
    return out


def first_relevant_rank(hits, doc: str, pages: list[int]) -> int | None:
    """1-based rank of the first hit from `doc` on one of `pages` (any page when `pages` is empty)."""
    for rank, hit in enumerate(hits, 1):
        if hit.file_name == doc and (not pages or hit.page in pages):
            return rank
    return None


def retrieval_metrics(ranks: list[int | None]) -> dict:
    n = len(ranks)
    return {
        "recall_at_1": round(sum(1 for r in ranks if r == 1) / n, 4),
        "recall_at_5": round(sum(1 for r in ranks if r is not None and r <= 5) / n, 4),
        "mrr": round(sum(1.0 / r for r in ranks if r) / n, 4),
        "num_questions": n,
    }


def _cli_threads(config) -> int:
    """In a CLI process the embedder is torch's only user: size its thread pool deliberately
    (applied when the model loads, so commands that embed nothing never import torch)."""
    from ingest.embed import auto_threads

    return config.retrieval.embed_threads or auto_threads()


def _open_index_for_listing(config, collection):
    """Listing needs no embedder: open the index with the embedder's known size, without loading it."""
    from ingest.embed import PACKAGED_DIMS, load_embedder
    from ingest.index import open_index

    name = config.retrieval.embedder
    dim = PACKAGED_DIMS.get(name) or load_embedder(name, num_threads=config.retrieval.embed_threads).dim
    return open_index(config, dim, collection)
