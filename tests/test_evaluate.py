"""`assistant eval answers`: QA file parsing, scoring with a scripted engine, and the CLI group."""

import argparse
import json
from types import SimpleNamespace

import pytest

from assistant.cli import build_parser
from assistant.evaluate import (
    EvalReport,
    LeakDetector,
    QAResult,
    _documents_to_ingest,
    evaluate_answers,
    format_summary,
    format_table,
    ingest_documents,
    is_refusal,
    named_documents,
    parse_item,
    percentile,
    read_qa_file,
    refusal_phrase,
    register,
    select,
)
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
    old = {"accuracy": 0.5, "citation_page_precision": round(2 / 3, 4), "num_questions": 2, "num_cited": 3,
           "num_failed": 0}
    assert {k: m[k] for k in old} == old  # the old keys keep their meaning; newer metrics come beside them
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


# -- the eval/rag schema --------------------------------------------------------------------------


def _item(**fields):
    return parse_item(1, {"question": "q?", **fields})


def test_new_schema_fields_parse(tmp_path):
    qa = tmp_path / "qa.jsonl"
    qa.write_text("\n".join([
        "# a comment",
        json.dumps({"id": "tasn1-012", "kind": "number", "docs": ["libtasn1.pdf"], "history": [],
                    "question": "Since which version is asn1_perror available?", "must_contain": ["1.6"],
                    "pages": [25]}),
        json.dumps({"id": "zstd-016", "kind": "follow_up", "docs": ["zstd-README.md"], "pages": [1],
                    "history": ["Does zstd have build files for Windows?"],
                    "question": "Which Visual Studio versions?", "must_contain": ["2005", ["2010", "VS2010"]]}),
        json.dumps({"id": "x", "question": "q", "must_contain": [[]]}),  # an empty list of alternatives
        json.dumps({"id": "y", "question": "q", "history": [1]}),
    ]))
    warnings = []
    items = read_qa_file(qa, warn=warnings.append)
    assert len(items) == 2 and len(warnings) == 2
    a, b = items
    assert (a.id, a.kind, a.docs, a.history, a.pages) == ("tasn1-012", "number", ("libtasn1.pdf",), (), (25,))
    assert a.line == 2
    assert a.must_contain == (("1.6",),) and a.answerable
    assert b.history == ("Does zstd have build files for Windows?",)
    assert b.must_contain == (("2005",), ("2010", "VS2010"))
    old = _item(must_contain="7 years", pages=3)  # the old format: a string and an int still work
    assert old.must_contain == (("7 years",),) and old.pages == (3,) and old.kind_key == "-" and old.name == "line 1"
    assert not _item(kind="unanswerable", must_contain=[]).answerable


def test_alternatives_any_one_suffices():
    item = _item(must_contain=["2005", ["3", "three"]])
    assert item.missing("Versions 2005 and THREE others") == []
    assert item.missing("Version 2005 and 3 more") == []
    assert item.missing("Version 2005 only") == ["3|three"]
    assert item.missing("three of them") == ["2005"]


def test_documents_resolve_against_docs_folder(tmp_path):
    items = [_item(docs=["a.pdf", "b.md"]), _item(docs=["a.pdf"])]
    qa = tmp_path / "qa.jsonl"
    assert named_documents(items, qa) == [tmp_path / "a.pdf", tmp_path / "b.md"]  # no docs/: the QA file's folder
    (tmp_path / "docs").mkdir()
    assert named_documents(items, qa) == [tmp_path / "docs" / "a.pdf", tmp_path / "docs" / "b.md"]
    (tmp_path / "docs" / "a.pdf").write_text("x")
    args = SimpleNamespace(ingest=None)
    assert _documents_to_ingest(args, qa, items) == [tmp_path / "docs" / "a.pdf"]  # automatic: those present
    assert _documents_to_ingest(SimpleNamespace(ingest=False), qa, items) == []
    from assistant.errors import ConfigError
    with pytest.raises(ConfigError, match="b.md"):
        _documents_to_ingest(SimpleNamespace(ingest=True), qa, items)
    (tmp_path / "docs" / "b.md").write_text("x")
    assert len(_documents_to_ingest(SimpleNamespace(ingest=True), qa, items)) == 2


def test_ingest_documents_goes_through_the_facade():
    calls = []

    def ingest(paths):
        calls.append(paths)
        for p, status in zip(paths, ["added", "unchanged", "failed"]):
            yield SimpleNamespace(path=p, status=status, error="bad file")

    warnings = []
    assistant = SimpleNamespace(documents=SimpleNamespace(ingest=ingest))
    counts = ingest_documents(assistant, ["a.pdf", "b.md", "c.txt"], warn=warnings.append)
    assert calls == [["a.pdf", "b.md", "c.txt"]]  # one call, every document once
    assert counts == {"added": 1, "unchanged": 1, "failed": 1} and "c.txt" in warnings[0]
    assert ingest_documents(assistant, []) == {} and len(calls) == 1


def test_select_by_kind_and_limit():
    items = [_item(kind=k) for k in ["lookup", "count", "lookup", "table"]]
    assert [i.kind for i in select(items, kinds=["lookup", "table"])] == ["lookup", "lookup", "table"]
    assert [i.kind for i in select(items, kinds=["lookup"], limit=1)] == ["lookup"]
    assert len(select(items, kinds=[""], limit=None)) == 4 and len(select(items, limit=2)) == 2


def test_follow_up_history_is_asked_first_in_the_same_conversation(tmp_path):
    item = _item(id="f1", kind="follow_up", history=["What is the Zephyr X2?"], question="How long is its warranty?",
                 must_contain=["7 years"], pages=[3])
    assistant, engine = make_assistant(tmp_path, "An air purifier [1].", "It is 7 years [1].",
                                       retriever=FakeRetriever(MANUAL))
    report = evaluate_answers(assistant, [item])
    r = report.results[0]
    assert r.correct and r.answer.startswith("It is 7 years") and r.cited_pages == [3]
    assert len(engine.prompts) == 2
    last = engine.prompts[-1]
    assert any(m["role"] == "user" and "What is the Zephyr X2?" in m["content"] for m in last)  # history in the prompt
    assert any("An air purifier" in str(m.get("content")) for m in last)
    users = [m.content for m in assistant.conversations.history(r.conversation_id) if m.role == "user"]
    assert users == ["What is the Zephyr X2?", "How long is its warranty?"]


@pytest.mark.parametrize("answer", [
    "The documents do not mention a remote build cache.",
    "This information is not mentioned in the passages.",
    "The manual doesn't say which OpenSSL version is needed.",
    "There is no information about Docker in the provided documents.",
    "The release date is not specified in the documentation [1].",
    "I couldn't find that in your documents.",
    "I can't find the answer.",
    "I don't know.",
    "The passages provided do not contain the number of connections.",
    "That detail isn't provided in the text.",
    "Sorry, the spec does not state which MIME type Markdown gets.",
    "It is not in the provided documents.",
])
def test_refusals_are_detected(answer):
    assert is_refusal(answer), answer


@pytest.mark.parametrize("answer", [
    "asn1_delete_structure deletes the structure and sets the pointer to NULL [1].",
    "If not specified, the default is 999 [1].",
    "When no value is provided, ninja uses the default build file build.ninja.",
    "SQLite does not provide a separate boolean storage class; booleans are stored as integers 0 and 1 [2].",
    "The -2 return value means the length does not fit in an int.",
    "",
])
def test_normal_answers_are_not_refusals(answer):
    assert refusal_phrase(answer) == "", answer


def test_unanswerable_items_need_a_refusal_and_refusals_on_answerable_ones_are_counted(tmp_path):
    items = [_item(id="u1", kind="unanswerable", question="What colour is the Zephyr X2?"),
             _item(id="u2", kind="unanswerable", question="How heavy is the Zephyr X2?"),
             _item(id="a1", kind="lookup", question="warranty period of the Zephyr X2?", must_contain=["7 years"],
                   pages=[3])]
    assistant, _ = make_assistant(tmp_path, "The documents do not mention its colour.", "It is quite heavy.",
                                  "The warranty period is not mentioned.", retriever=FakeRetriever(MANUAL))
    report = evaluate_answers(assistant, items)
    assert [r.correct for r in report.results] == [True, False, False]
    assert [r.refused for r in report.results] == [True, False, True]
    m = report.metrics()
    assert m["refusal_correctness"] == 0.5 and m["false_refusals"] == 1.0
    assert m["accuracy_by_kind"] == {"unanswerable": 0.5, "lookup": 0.0} and m["accuracy"] == round(1 / 3, 4)
    assert "unanswerable" in format_summary(report) and "u1" in format_table(report)


def test_leaks_of_the_system_prompt_and_the_citation_example_are_flagged(tmp_path):
    assistant, _ = make_assistant(tmp_path)
    texts = assistant.prompt_texts()
    leaks = LeakDetector(texts)
    system = assistant.config.system_prompt  # "You are a helpful, honest assistant running fully offline on ..."
    assert len(system.split()) >= 8
    eight = " ".join(system.split()[2:10]).upper()  # case and punctuation do not hide it
    assert leaks.check(f"Sure! {eight} and here is more.")
    # the prompts hold no copyable example answer any more; one that did would be caught verbatim
    assert not any("for example" in t.lower() for t in texts) and leaks.check("The device weighs 2 kg [1].") == ""
    example = LeakDetector(["Cite the passage you use, for example: The device weighs 2 kg [2]."])
    assert example.check("The device weighs 2 kg [1].") == "the device weighs 2 kg"  # the citation example
    assert leaks.check("The warranty period is 7 years [1].") == ""
    assert leaks.check("You are right, this assistant is helpful.") == ""  # a few prompt words are no leak
    # a run across the {passages} placeholder is not prompt text
    detector = LeakDetector(["one two three four {passages} five six seven eight nine"])
    assert detector.check("one two three four five six seven eight") == ""
    assert LeakDetector(["a b c d e f g h i"]).check("x a b c [2] d e f g h y") == "a b c d e f g h"
    # end to end: the answer that repeats the system prompt is flagged and counted
    assistant, _ = make_assistant(tmp_path, f"I am {system}", "The warranty is 7 years [1].",
                                  retriever=FakeRetriever(MANUAL))
    report = evaluate_answers(assistant, [_item(question="Who are you?"), _item(question="Zephyr X2 warranty?")])
    assert [bool(r.leak) for r in report.results] == [True, False]
    assert report.metrics()["leak_rate"] == 0.5 and "[LEAK]" in format_table(report)


def _result(item, cites, **kw):
    return QAResult(item, cited_docs=[d for d, _ in cites], cited_pages=[p for _, p in cites], **kw)


def test_page_precision_and_recall_arithmetic():
    a = _item(kind="lookup", docs=["m.pdf"], pages=[3, 4], must_contain=["x"])
    b = _item(kind="lookup", docs=["m.pdf", "n.html"], pages=[1, 7], must_contain=["x"])
    c = _item(kind="number", pages=[2], must_contain=["x"])  # names no document: pages alone count
    u = _item(kind="unanswerable")
    results = [
        _result(a, [("m.pdf", 3), ("m.pdf", 9)], correct=True),  # 1 of 2 right
        _result(b, [("other.html", 1), ("/x/n.html", 1)]),  # another document's page 1 is wrong; n.html p1 right
        _result(c, [("z.pdf", 5)]),  # 0 of 1
        _result(a, []),  # cites nothing: recall 0, precision unaffected
        _result(u, [("m.pdf", 1)], refusal="not mentioned", correct=True),  # not scored for pages
        _result(a, [("m.pdf", 3)], error="the turn failed"),  # failed: left out
    ]
    m = EvalReport([results]).metrics()
    assert m["citation_page_precision"] == round(2 / 5, 4) and m["num_cited"] == 5
    assert m["citation_page_recall"] == round(2 / 4, 4)
    assert m["num_questions"] == 5 and m["num_failed"] == 1
    assert m["refusal_correctness"] == 1.0 and m["false_refusals"] == 0.0
    assert results[1].to_dict()["cited"][0] == {"doc": "other.html", "page": 1, "right": False}
    table = format_table(EvalReport([results]))
    assert "3,9 " in table and "1*,1 " in table and "5 " in table and "(* a page of a document" in table


def test_latency_percentiles():
    assert percentile([], 50) is None
    assert percentile([4.0], 95) == 4.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(1, 101)), 95) == pytest.approx(95.05)
    results = [_result(_item(), [], latency_s=s) for s in (1.0, 2.0, 3.0)]
    m = EvalReport([results]).metrics()
    assert m["latency_p50_s"] == 2.0 and m["latency_p95_s"] == 2.9


def test_repeat_runs_in_fresh_conversations_and_reports_agreement(tmp_path):
    items = [_item(id="a", question="Zephyr X2 warranty?", must_contain=["7 years"]),
             _item(id="b", question="HEPA filter?", must_contain=["6 months"])]
    assistant, _ = make_assistant(tmp_path, "7 years.", "Every 6 months.", "7 years.", "Every year.",
                                  retriever=FakeRetriever(MANUAL))
    seen = []
    report = evaluate_answers(assistant, items, repeat=2, on_result=lambda r, done, total: seen.append((done, total)))
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert [r.run for run in report.runs for r in run] == [1, 1, 2, 2]
    assert len({r.conversation_id for run in report.runs for r in run}) == 4
    m = report.metrics()
    assert m["run_to_run_agreement"] == 0.5 and m["accuracy_per_run"] == [1.0, 0.5]
    assert m["accuracy"] == 1.0 and m["num_questions"] == 2  # the headline is the first run
    assert "run_to_run_agreement" not in EvalReport(report.runs[:1]).metrics()


def test_output_lines_carry_what_a_failure_needs(tmp_path):
    item = _item(id="t1", kind="table", question="warranty period of the Zephyr X2?",
                 must_contain=[["7 years", "seven"]], pages=[3], docs=["zephyr_manual.pdf"])
    assistant, _ = make_assistant(tmp_path, "The warranty period of the Zephyr X2 is 40 months [1].", retriever=FakeRetriever(MANUAL))
    line = evaluate_answers(assistant, [item]).results[0].to_dict()
    assert json.loads(json.dumps(line)) == line
    for key in ("id", "kind", "question", "answer", "correct", "cited_pages", "latency_s", "leaked", "missing"):
        assert key in line
    assert line["id"] == "t1" and line["correct"] is False and line["missing"] == ["7 years|seven"]
    assert line["must_contain"] == [["7 years", "seven"]] and line["cited"][0]["doc"] == "zephyr_manual.pdf"


def test_cli_takes_the_new_options():
    args = build_parser().parse_args(["eval", "answers", "qa.jsonl", "--kinds", "lookup,count", "--limit", "5",
                                      "--repeat", "2", "--output", "out.jsonl", "--ingest"])
    assert (args.kinds, args.limit, args.repeat, args.output, args.ingest) == ("lookup,count", 5, 2, "out.jsonl", True)
    assert build_parser().parse_args(["eval", "answers", "qa.jsonl"]).ingest is None
    assert build_parser().parse_args(["eval", "answers", "qa.jsonl", "--no-ingest"]).ingest is False


def test_a_number_must_occur_as_a_whole_number():
    # "There are 6 RFCs: ... rfc5890" was scored right for a must_contain of "5"
    from assistant.evaluate import occurs

    assert not occurs("5", "there are 6 rfcs: rfc5890, rfc5891") and occurs("5", "there are 5 rfcs.")
    assert not occurs("1.6", "since version 1.6.3") and occurs("1.6", "since: 1.6.") and not occurs("25", "125 types")
    assert occurs("-2", "returns -2 when") and occurs("day of week", "the day of week 0-6")
    assert occurs("8878", "documented in [rfc8878] [1].") and not occurs("88", "rfc8878")  # a name's number counts
