"""Which questions the document prefetch treats as being about the documents (tools/retrieval.py
`DocumentPrefetch`, its design note): the 100 general questions here (questions.txt; the first 50 are
the dev half the threshold was read on, the last 50 the test half) should get no passages, and every
question of the RAG eval set (eval/rag, 215) should get some. Each part of a RAG question that is asked as
two (assistant/compound.py) should be judged about the documents too: a part judged off them is answered
without passages, and its answer is not grounded.

Run from the repository root, on a data dir where `assistant eval answers` ingested eval/rag/docs:
    python eval/general/gate.py --data-dir /tmp/evaldata [--min-relevance 0.4]
Prints the questions that went the wrong way; its last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from assistant.citations import SourceLedger  # noqa: E402
from assistant.compound import question_parts  # noqa: E402
from assistant.config import AssistantConfig  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--min-relevance", type=float, default=None, help="default: the configured value")
    args = parser.parse_args()
    from ingest.retriever import Retriever
    from tools.retrieval import DocumentPrefetch, RetrieverHandle

    config = AssistantConfig.load(overrides={"data_dir": str(args.data_dir)})
    if args.min_relevance is not None:
        config = replace(config, retrieval=replace(config.retrieval, min_relevance=args.min_relevance))
    retriever = Retriever.from_config(config)
    prefetch = DocumentPrefetch(RetrieverHandle(lambda: retriever), min_relevance=config.retrieval.min_relevance)

    def searched(question: str, history: list[str]) -> bool:
        found = prefetch(question, SourceLedger(), history)
        return bool(found and found.passages)

    def judged_off(question: str, history: list[str]) -> bool:
        found = prefetch(question, SourceLedger(), history)
        return found is not None and not found.about_documents

    general = (HERE / "questions.txt").read_text(encoding="utf-8").splitlines()
    report: dict[str, object] = {"min_relevance": config.retrieval.min_relevance}
    for half, questions in (("dev", general[:50]), ("test", general[50:])):
        kept = [q for q in questions if searched(q, [])]
        report[f"general_{half}_with_passages"] = len(kept)
        for q in kept:
            print(f"general {half}: passages for {q!r}")
    for split in ("dev", "test"):
        items = [json.loads(line) for line in (ROOT / "eval" / "rag" / f"{split}.jsonl").open(encoding="utf-8")]
        missed = [it["id"] for it in items if not searched(it["question"], it.get("history", []))]
        report[f"rag_{split}_without_passages"] = len(missed)
        report[f"rag_{split}_questions"] = len(items)
        for name in missed:
            print(f"rag {split}: no passages for {name}")
        asked = [(it, question_parts(it["question"])) for it in items]
        off = [(it["id"], part) for it, parts in asked if len(parts) > 1 for i, part in enumerate(parts)
               if judged_off(part, [*it.get("history", []), *parts[:i]])]
        report[f"rag_{split}_parts_off_documents"] = len(off)
        for name, part in off:
            print(f"rag {split}: {name}'s part {part!r} judged off the documents")
    retriever.close()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
