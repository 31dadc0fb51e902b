"""`assistant eval answers`: QA file parsing, scoring with a scripted engine, and the CLI group."""

import argparse
import json

from assistant.cli import build_parser
from assistant.evaluate import evaluate_answers, format_table, read_qa_file, register
from tests.agent_fakes import MANUAL, FakeRetriever, make_assistant


def test_scores_accuracy_and_citation_page_precision(tmp_path):
    qa = tmp_path / "qa.jsonl"
    qa.write_text("\n".join([
        json.dumps({"question": "warranty period of the Zephyr X2?", "must_contain": "7 years", "pages": [3],
                    "extra": "ignored"}),
        json.dumps({"question": "How often replace the HEPA filter?", "must_contain": ["6", "months"], "pages": 2}),
        "not json",
        json.dumps({"must_contain": "no question"}),
        "",
    ]))
    warnings = []
    items = read_qa_file(qa, warn=warnings.append)
    assert [i.line for i in items] == [1, 2] and len(warnings) == 2 and "Skipping line 3" in warnings[0]
    # answer 1 right and cites page 3 ([1]) plus page 1 (wrong); answer 2 wrong, cites page 2
    assistant, _ = make_assistant(tmp_path, "It is 7 years [1] for a compact air purifier [2].",
                                  "Replace the filter every year [1].",
                                retriever=FakeRetriever(MANUAL))
    report = evaluate_answers(assistant, items)
    assert [r.correct for r in report.results] == [True, False]
    assert report.results[0].cited_pages == [3, 1] and report.results[1].cited_pages == [2]
    m = report.metrics()
    assert m == {"accuracy": 0.5, "citation_page_precision": round(2 / 3, 4), "num_questions": 2, "num_cited": 3,
                 "num_failed": 0}
    table = format_table(report)
    assert "yes" in table and "3,1" in table


def test_eval_group_is_shared_whichever_module_registers_first():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    args = parser.parse_args(["eval", "answers", "qa.jsonl", "--data-dir", "x"])
    assert args.file == "qa.jsonl" and args.func.__name__ == "cmd_eval_answers"
    assert "eval" in sub.choices
    # alone (no ingest module): `eval` is created
    alone = argparse.ArgumentParser().add_subparsers()
    register(alone, lambda p: None)
    assert "answers" in _sub(alone.choices["eval"]).choices
    assert list(alone.choices) == ["eval"]


def _sub(parser):
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def test_missing_file_is_a_message(tmp_path, capsys):
    from assistant.cli import main

    assert main(["eval", "answers", str(tmp_path / "none.jsonl"), "--data-dir", str(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err
