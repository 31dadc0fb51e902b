"""Citations: markers verified against what this turn retrieved; made-up ones dropped; sources stored."""
import json

from assistant.citations import SourceLedger, verify_citations
from assistant.events import Done, Sources, TextDelta, ToolCallFinished, ToolCallStarted, TurnStarted
from tests.agent_fakes import MANUAL, FakeRetriever, make_orchestrator


def _ledger():
    ledger = SourceLedger()
    ledger.add("manual.pdf", 3, "Warranty: the Zephyr X2 comes with a warranty period of 7 years.", "c3")
    ledger.add("manual.pdf", 1, "The Zephyr X2 is a compact air purifier.", "c1")
    assert ledger.add("manual.pdf", 3, "same chunk again", "c3").marker == 1  # one chunk, one number
    return ledger


def test_valid_marker_kept_and_hallucinated_one_dropped():
    check = verify_citations("The warranty is 7 years [1]. It was made in 1999 [7].", _ledger())
    assert check.text == "The warranty is 7 years [1]. It was made in 1999."
    assert [(s.marker, s.doc, s.page, s.chunk_id) for s in check.sources] == [(1, "manual.pdf", 3, "c3")]
    assert check.dropped_markers == (7,) and check.inferred_markers == ()


def test_grouped_markers_are_filtered_one_by_one():
    check = verify_citations("The Zephyr X2 has a warranty of 7 years [1, 9] and is a compact air purifier [2][4].",
                             _ledger())
    assert check.text == "The Zephyr X2 has a warranty of 7 years [1] and is a compact air purifier [2]."
    assert [s.marker for s in check.sources] == [1, 2] and check.dropped_markers == (4, 9)


def test_uncited_answer_is_attributed_only_when_it_reuses_a_passage():
    check = verify_citations("The Zephyr X2 comes with a warranty period of 7 years. Enjoy it!", _ledger())
    assert check.text == "The Zephyr X2 comes with a warranty period of 7 years [1]. Enjoy it!"
    assert check.inferred_markers == (1,) and check.sources[0].page == 3
    unrelated = verify_citations("Paris is the capital of France.", _ledger())
    assert unrelated.sources == () and unrelated.text == "Paris is the capital of France."


def test_turn_with_documents_cites_the_right_page_and_stores_sources(tmp_path):
    retriever = FakeRetriever(MANUAL)
    orch, engine = make_orchestrator(tmp_path, "The warranty period is 7 years [2]. See also [5].",
                                     retriever=retriever)
    events = list(orch.run_turn(None, "What is the warranty period of the Zephyr X2?"))
    assert retriever.searches == ["What is the warranty period of the Zephyr X2?"]  # auto-retrieval
    context = engine.prompts[0][-2]
    assert context["role"] == "system" and "[1] zephyr_manual.pdf p. 3: Warranty" in context["content"]
    sources = next(e for e in events if isinstance(e, Sources))
    done = events[-1]
    # passages shown: [1] p. 3 and [2] p. 1 (p. 2 shares no word with the question); [5] was never shown
    assert "[3]" not in context["content"] and "[2] zephyr_manual.pdf p. 1" in context["content"]
    # the model cited [2] (p. 1, which says nothing of a warranty): the evidence is [1] on p. 3
    assert sources.dropped_markers == (5,) and [(s.marker, s.page) for s in sources.sources] == [(1, 3)]
    assert "[5]" not in done.text and "[2]" not in done.text and done.text.startswith("The warranty period is 7 years [1].")
    stored = orch.store.get_message(done.message_id)
    assert stored.meta["dropped_markers"] == [5] and stored.meta["reassigned_markers"] == [[2, 1]]
    assert [s["marker"] for s in stored.meta["sources"]] == [1]
    assert "[5]" not in stored.content
    started = [e for e in events if isinstance(e, ToolCallStarted)]
    assert started[0].name == "search_documents"  # auto-retrieval is shown as a step


def test_answer_citing_page_three_passage(tmp_path):
    retriever = FakeRetriever(MANUAL)
    orch, engine = make_orchestrator(tmp_path, "It is 7 years [1].", retriever=retriever)
    events = list(orch.run_turn(None, "warranty period Zephyr X2"))
    sources = next(e for e in events if isinstance(e, Sources)).sources
    assert [(s.marker, s.doc, s.page) for s in sources] == [(1, "zephyr_manual.pdf", 3)]
    assert "warranty period of 7 years" in sources[0].snippet


def test_marker_from_an_earlier_turn_is_not_accepted(tmp_path):
    retriever = FakeRetriever(MANUAL)
    orch, _ = make_orchestrator(tmp_path, "7 years [1].", "Nothing about that [1].", retriever=retriever)
    cid = list(orch.run_turn(None, "warranty period"))[-1].conversation_id
    events = list(orch.run_turn(cid, "xyzzy plugh"))  # retrieves nothing this turn
    done = events[-1]
    assert done.text == "Nothing about that."
    assert not any(isinstance(e, Sources) and e.sources for e in events)


def test_search_tool_registers_passages_for_citation(tmp_path):
    retriever = FakeRetriever(MANUAL)
    call = '<tool_call>{"name": "search_documents", "arguments": {"query": "HEPA filter"}}</tool_call>'
    orch, engine = make_orchestrator(tmp_path, call, "Every 6 months [1].", retriever=retriever)
    orch.options = type(orch.options)(auto_retrieve=False)
    events = list(orch.run_turn(None, "How often do I change the filter?"))
    finished = next(e for e in events if isinstance(e, ToolCallFinished))
    assert finished.ok and "zephyr_manual.pdf p. 2" in finished.summary
    assert "[1] zephyr_manual.pdf p. 2: Replace the HEPA filter" in engine.prompts[1][-1]["content"]
    sources = next(e for e in events if isinstance(e, Sources)).sources
    assert [(s.page, s.marker) for s in sources] == [(2, 1)]


def test_whole_document_question_reads_pages_instead_of_top_k(tmp_path):
    retriever = FakeRetriever(MANUAL)
    orch, engine = make_orchestrator(tmp_path, "A purifier [1] with a filter [2] and a warranty [3].",
                                     retriever=retriever)
    events = list(orch.run_turn(None, "Summarise the whole file."))
    assert retriever.reads == [("zephyr_manual.pdf", None)] and retriever.searches == []
    context = engine.prompts[0][-2]["content"]
    assert all(f"p. {n}:" in context for n in (1, 2, 3))
    sources = next(e for e in events if isinstance(e, Sources)).sources
    assert [s.page for s in sources] == [1, 2, 3]


def test_read_document_tool_with_unknown_name_is_the_models_error(tmp_path):
    retriever = FakeRetriever(MANUAL)
    call = '<tool_call>{"name": "read_document", "arguments": {"document": "nope.pdf"}}</tool_call>'
    orch, engine = make_orchestrator(tmp_path, call, "Sorry.", retriever=retriever)
    orch.options = type(orch.options)(auto_retrieve=False)
    events = list(orch.run_turn(None, "read nope.pdf"))
    finished = next(e for e in events if isinstance(e, ToolCallFinished))
    assert not finished.ok and "zephyr_manual.pdf" in engine.prompts[1][-1]["content"]
    assert events[-1].text == "Sorry."


def test_no_documents_means_no_retrieval_tools(tmp_path):
    orch, engine = make_orchestrator(tmp_path, "Hi.", retriever=FakeRetriever({}))
    events = list(orch.run_turn(None, "hello"))
    assert engine.tools_seen == [None] and [type(e) for e in events][-1] is Done
    assert not any(isinstance(e, Sources) for e in events) and isinstance(events[1], TextDelta)
    assert isinstance(events[0], TurnStarted)


def test_code_indexing_is_not_a_citation():
    check = verify_citations("Use `a[1]` or x[2] then\n```python\nb[3]\n```\nand fact [9].", _ledger())
    assert check.text == "Use `a[1]` or x[2] then\n```python\nb[3]\n```\nand fact." and check.dropped_markers == (9,)
    assert check.sources == ()  # x[2] is not taken for a marker, so it names no source either


def test_a_late_marker_after_inline_code_cites_its_sentence_by_the_codes_facts():
    from assistant.grounding import facts_held

    ledger = SourceLedger()
    ledger.add("dejagnu.pdf", 14, "-V, --version Prints out the version numbers of DejaGnu, Expect, and Tcl.", "c1")
    ledger.add("dejagnu.pdf", 6, "Expect script filenames conventionally use .exp as a suffix. The main implementation "
               "of the DejaGnu test driver is in the file runtest.exp. New in this release: the version of Tcl.", "c2")
    answer = "The runtest option that prints the version numbers of DejaGnu, Expect and Tcl is `-V`. [2]"
    check = verify_citations(answer, ledger, facts=facts_held)
    assert check.text == answer.replace("`-V`. [2]", "`-V` [1].")  # not a claim of its own, nor page 6's
    assert [s.page for s in check.sources] == [14] and check.reassigned == ((2, 1),)
    assert verify_citations("Call `f(a[1])`, which prints the version numbers of DejaGnu [1].", ledger).text.startswith(
        "Call `f(a[1])`, which")  # brackets in code come back as they were


def test_auto_retrieval_leaves_out_unrelated_hits(tmp_path):
    class Everything(FakeRetriever):
        def search(self, query, k=None, filters=None):  # a dense index always returns something
            return super().search("warranty zephyr filter purifier", k, filters)

    orch, engine = make_orchestrator(tmp_path, "6765.", "It covers 7 years [1].", retriever=Everything(MANUAL))
    events = list(orch.run_turn(None, "Compute the 20th Fibonacci number with Python."))
    assert not any(m["content"].startswith("Passages") for m in engine.prompts[0])
    assert not any(isinstance(e, Sources) and e.sources for e in events)
    finished = next(e for e in events if isinstance(e, ToolCallFinished))
    assert finished.summary == "nothing relevant"
    events = list(orch.run_turn(None, "What does the document say?"))  # names documents: keep the hits
    assert engine.prompts[1][-2]["content"].startswith("Passages")


def test_a_question_off_the_documents_is_not_offered_the_document_tools(tmp_path):
    """With all three tools in its prompt the 0.5B model refused to write a story; a question the prefetch
    finds nothing for gets the code interpreter, not the document tools. One that names the documents
    keeps them."""
    from tools.base import Tool, ToolResult

    class Python(Tool):
        name, description = "python", "Run code."
        inputs = {"code": {"type": "string", "description": "the code"}}

        def forward(self, code):
            return ToolResult("6765")

    orch, engine = make_orchestrator(tmp_path, "Once upon a time.", "It covers 7 years [1].", "A purifier.",
                                     "import csv", tools=[Python()], retriever=Measured(MANUAL, {"warranty": 0.72}))
    names = lambda specs: {s["function"]["name"] for s in specs or []}  # noqa: E731
    list(orch.run_turn(None, "Write a story about the 3 lighthouse keepers."))  # (a number: may compute)
    assert names(engine.tools_seen[0]) == {"python"}
    list(orch.run_turn(None, "How long is the warranty?"))  # close to a page: passages and every tool
    assert names(engine.tools_seen[1]) == {"search_documents", "read_document", "python"}
    list(orch.run_turn(None, "Summarise zephyr_manual.pdf"))  # a file the library holds: every tool
    assert names(engine.tools_seen[2]) == {"search_documents", "read_document", "python"}
    list(orch.run_turn(None, "Write a Python script that reads data.csv"))  # a file name alone is no sign (and
    assert names(engine.tools_seen[3]) == set()  # code to read is not run: agent_loop.py WRITE_CODE)


def test_a_file_that_is_not_there_is_answered_as_missing_without_a_search_or_a_model_call(tmp_path):
    """"Read notes.pdf" with no notes.pdf had been searched, and the 0.5B model answered from another file's
    passages; now the turn says which documents there are, and sends the model nothing."""
    orch, engine = make_orchestrator(tmp_path, "It covers 7 years [1].", retriever=FakeRetriever(MANUAL))
    for question in ("Read notes.pdf", "What does notes.pdf say about the filter?", "Summarise NOTES.PDF please",
                     "Compare zephyr_manual.pdf and notes.pdf"):
        events = list(orch.run_turn(None, question))
        (step,) = [e for e in events if isinstance(e, ToolCallFinished)]
        assert (step.name, step.ok) == ("read_document", False), question
        missing = "'NOTES.PDF'" if "NOTES" in question else "'notes.pdf'"
        assert step.summary == f"No document {missing}. Documents: zephyr_manual.pdf.", question
        done = events[-1]
        assert done.text.startswith(step.summary + " Upload it ") and done.finish_reason == "stop", question
        assert not [e for e in events if isinstance(e, Sources)], question
    assert engine.prompts == []  # no model call, and no passage of another file in any prompt
    list(orch.run_turn(None, "What does zephyr_manual.pdf say about the filter?"))  # a file that is there
    assert len(engine.prompts) == 1 and "HEPA" in json.dumps(engine.prompts[0])


def test_what_documents_do_i_have_is_answered_with_the_list(tmp_path):
    """The 0.5B model answered "What documents do I have?" with "The documents I searched do not say"; the
    library's list is known, so it is said without the model."""
    orch, engine = make_orchestrator(tmp_path, "It covers 7 years [1].", retriever=FakeRetriever(MANUAL))
    for question in ("What documents do I have?", "which files have I uploaded so far", "List my documents.",
                     "Show me all the files", "What's in my library?", "How many documents do I have?"):
        events = list(orch.run_turn(None, question))
        (step,) = [e for e in events if isinstance(e, ToolCallFinished)]
        assert (step.name, step.ok, step.summary) == ("list_documents", True, "1 document"), question
        assert events[-1].text == ('You have 1 document: zephyr_manual.pdf. Ask about it '
                                   '("Summarise zephyr_manual.pdf").'), question
    assert engine.prompts == []
    orch, engine = make_orchestrator(tmp_path / "empty", "Never said.", retriever=FakeRetriever({}))
    assert list(orch.run_turn(None, "What documents do I have?"))[-1].text.startswith(
        "You have no documents yet. Upload one (the web chat's file button, ")
    assert engine.prompts == []


def test_questions_about_files_in_the_documents_are_not_a_request_for_the_list():
    from tools.retrieval import LISTS_DOCUMENTS

    for question in ("Which files does update-mime-database write?", "What files are there in the zstd README?",
                     "Show the documents that mention HEPA", "What documents does DejaGnu need to run a test?"):
        assert not LISTS_DOCUMENTS.search(question), question


def test_the_list_names_pages_and_stops_at_a_dozen():
    from tools.retrieval import listing

    records = [{"file_name": f"r{i}.pdf", "num_pages": i} for i in range(1, 15)]
    text = listing(records)
    assert text.startswith("You have 14 documents: r1.pdf (1 page), r2.pdf (2 pages), ")
    assert "r12.pdf (12 pages), and 2 more. Ask about them, or name one (\"Summarise r1.pdf\")." in text
    assert "r13" not in text


def test_which_file_names_a_question_asks_about():
    from tools.retrieval import unknown_files

    docs = ["libtasn1.pdf", "zstd-README.md"]
    assert unknown_files("Read notes.pdf", docs) == ["notes.pdf"]
    assert unknown_files("What is the warranty in report.docx?", docs) == ["report.docx"]
    assert unknown_files("Does plan.txt mention a deadline?", docs) == ["plan.txt"]
    assert unknown_files("What does README.md say?", docs) == ["README.md"]  # not zstd-README.md
    assert unknown_files("Read LIBTASN1.PDF and notes.pdf", docs) == ["notes.pdf"]
    assert unknown_files("Read libtasn1.pdf", docs) == []
    assert unknown_files("Write a Python script that reads data.csv", docs) == []  # code about a file
    assert unknown_files("Read https://example.com/index.html for me", docs) == []  # a web address
    assert unknown_files("What is the difference between index.html and index.htm?", docs) == []  # no ask
    assert unknown_files("[image 1 (unit.jpg): a photo; text read: X2]\nWhat is it?", docs) == []  # attached


def test_unreadable_index_turns_document_tools_off_with_one_warning(caplog):
    from tools.retrieval import RetrieverHandle

    class Locked(FakeRetriever):
        def documents(self):
            raise RuntimeError("index is locked by another process")

    handle = RetrieverHandle(lambda: Locked(MANUAL))
    with caplog.at_level("WARNING"):
        assert handle.has_documents() is False
        handle.refresh()
        assert handle.has_documents() is False
    assert [r.message for r in caplog.records].count(
        "Document tools are off: the document index cannot be read (index is locked by another process).") == 1


def test_a_claim_no_passage_supports_gets_no_marker():
    check = verify_citations("The Zephyr X2 was designed in Oslo by Nordic engineers [1].", _ledger())
    assert check.text == "The Zephyr X2 was designed in Oslo by Nordic engineers." and check.sources == ()
    assert check.dropped_markers == (1,)


def test_a_claim_cited_to_the_wrong_passage_moves_to_the_one_that_supports_it():
    check = verify_citations("It is a compact air purifier [1]. The warranty period is 7 years [1].", _ledger())
    assert check.text == "It is a compact air purifier [2]. The warranty period is 7 years [1]."
    assert check.reassigned == ((1, 2),) and [s.page for s in check.sources] == [3, 1]
    assert check.sources[0].snippet.startswith("Warranty: the Zephyr X2 comes with a warranty period of 7 years")


def test_only_pages_the_model_is_shown_can_be_cited():
    from tools.base import ToolContext
    from tools.retrieval import MAX_READ_CHARS, ReadDocumentTool, RetrieverHandle

    long_pages = [f"Page {i} text. " + "word " * 600 for i in range(1, 11)]  # ~3 kB each: 2 fit the budget
    tool = ReadDocumentTool(RetrieverHandle(lambda: FakeRetriever({"/d/big.pdf": long_pages})))
    ctx = ToolContext("c")
    result = tool({"document": "big.pdf"}, ctx)
    shown = [p.page for p in result.data]
    assert 1 <= len(shown) < 10 and len(result.text) <= MAX_READ_CHARS + 200
    assert [p.page for p in ctx.sources.passages] == shown  # the cut pages got no marker
    assert f"(pages {list(range(len(shown) + 1, 11))} not shown" in result.text


def test_a_sentence_with_inline_code_gets_an_inferred_marker_but_a_code_block_does_not():
    # 0.5B answers name functions in backticks; before, those sentences were never cited (recall lost)
    answer = "The `Zephyr X2` warranty period is 7 years.\n```\nZephyr X2 warranty period 7 years\n```\nDone."
    check = verify_citations(answer, _ledger())
    assert check.text == ("The `Zephyr X2` warranty period is 7 years [1].\n```\nZephyr X2 warranty period 7 years\n```"
                          "\nDone.")
    assert check.inferred_markers == (1,) and [s.page for s in check.sources] == [3]


def _manual_pages():
    ledger = SourceLedger()
    ledger.add("libidn2.pdf", 6, "The library returns an error code for a domain label that is too long, and the "
               "idn2 functions return error codes for every domain label that fails the checks.", "c6")
    ledger.add("libidn2.pdf", 11, "IDN2_TOO_BIG_LABEL: Label longer than 63 characters.", "c11")
    return ledger


def test_a_claims_facts_decide_its_citation_over_shared_common_words():
    from assistant.grounding import facts_held

    answer = "libidn2 returns IDN2_TOO_BIG_LABEL for a domain label that is too long [1]."
    by_words = verify_citations(answer, _manual_pages())
    assert [s.page for s in by_words.sources] == [6]  # more common words are shared with page 6
    by_facts = verify_citations(answer, _manual_pages(), facts=facts_held)
    assert [s.page for s in by_facts.sources] == [11]  # only page 11 holds IDN2_TOO_BIG_LABEL
    assert by_facts.reassigned == ((1, 2),) and by_facts.text.endswith("too long [2].")
    both = verify_citations("It returns IDN2_TOO_BIG_LABEL [1, 2].", _manual_pages(), facts=facts_held)
    assert both.text == "It returns IDN2_TOO_BIG_LABEL [2]." and [s.page for s in both.sources] == [11]
    inferred = verify_citations("A domain label longer than 63 characters gives IDN2_TOO_BIG_LABEL.",
                                _manual_pages(), facts=facts_held)
    assert inferred.inferred_markers == (2,)


def test_a_claim_whose_facts_no_passage_holds_falls_back_to_words_and_gets_no_marker_without_them():
    from assistant.grounding import facts_held

    check = verify_citations("Paris has 2100000 people [1].", _manual_pages(), facts=facts_held)
    assert check.text == "Paris has 2100000 people." and check.sources == () and check.dropped_markers == (1,)


def test_a_stray_marker_after_a_cited_sentence_is_dropped_not_reattributed():
    check = verify_citations("The warranty period is 7 years [1]. [2]", _ledger())
    assert check.text == "The warranty period is 7 years [1]." and [s.marker for s in check.sources] == [1]
    assert check.dropped_markers == (2,)
    kept = verify_citations("The warranty period is 7 years [1]. It is a compact air purifier [2].", _ledger())
    assert [s.marker for s in kept.sources] == [1, 2]  # a run after words of its own is a claim's


def test_a_marker_after_the_full_stop_cites_its_own_sentence_and_a_repeated_one_goes():
    ledger = SourceLedger()
    ledger.add("spec.pdf", 3, "The globs2 file records the weight of each glob.", "c1")
    ledger.add("spec.pdf", 4, "A glob gets a weight of 50 when its element sets none.", "c2")
    check = verify_citations("The globs2 file records the weight of each glob [1]. [1] A glob gets a weight of 50. [2]",
                             ledger)
    assert check.text == "The globs2 file records the weight of each glob [1]. A glob gets a weight of 50 [2]."
    assert [s.marker for s in check.sources] == [1, 2] and check.inferred_markers == ()


class Measured(FakeRetriever):
    """A fake that also says how close a query comes to any page (the real one: the best dense cosine)."""

    def __init__(self, docs, similarities: dict[str, float]) -> None:
        super().__init__(docs)
        self.similarities, self.measured = similarities, []

    def similarity(self, query):
        self.measured.append(query)
        return next((v for q, v in self.similarities.items() if q in query), 0.1)


def test_a_question_not_about_the_documents_gets_no_passages():
    # "times" is on a page ("three times a year"), so the old rule took it as a document question, and
    # grounding then withdrew "391", the one fact no passage held
    from tools.retrieval import DocumentPrefetch, RetrieverHandle

    docs = {"/docs/zephyr_manual.pdf": [*MANUAL["/docs/zephyr_manual.pdf"],
                                        "Clean the OpenSSL-free Zephyr sensor three times a year.",
                                        "New in this release: a night mode and a quieter fan."]}
    retriever = Measured(docs, {"warranty": 0.72})
    prefetch = DocumentPrefetch(RetrieverHandle(lambda: retriever))
    found = prefetch("What is 17 times 23?", SourceLedger())
    assert found.passages == [] and found.summary == "nothing relevant" and retriever.measured == ["What is 17 times 23?"]
    assert prefetch("Translate 'good morning' into Spanish.", SourceLedger()).passages == []  # quoted, no section
    assert prefetch("How long is the warranty?", SourceLedger()).passages  # close to a page
    # far by similarity, but a passage found holds a term only it names, or the section it quotes
    assert "Zephyr" in prefetch("How often do I clean the Zephyr sensor?", SourceLedger()).passages[0]
    assert prefetch("What is listed under 'New in this release'?", SourceLedger()).passages
    assert prefetch("Which file holds the sensor notes?", SourceLedger()).passages  # names documents
    # ... but not when it asks for code: these "files" are the user's own
    assert not prefetch("Write a bash one-liner that counts the lines in all .txt files.", SourceLedger()).passages
    # a follow-up is judged with the questions before it
    assert prefetch("And how long does it last?", SourceLedger(), ["What is the warranty period?"]).passages
    assert prefetch("And 18 times 23?", SourceLedger(), ["What is 17 times 23?"]).passages == []
    assert DocumentPrefetch(RetrieverHandle(lambda: retriever), min_relevance=0)(
        "What is 17 times 23?", SourceLedger()).passages  # 0: every question is searched


def test_specific_terms_name_one_thing():
    from assistant.citations import specific_terms

    assert specific_terms("What is 17 times 23?") == []
    assert specific_terms("Write a haiku about autumn.") == []
    assert specific_terms("Which minimum OpenSSL version does libtasn1 need?") == ["OpenSSL", "libtasn1"]
    assert specific_terms("Which PRAGMA sets mime.cache, asn1_der_coding and --verbose in 'New in this release'?") == \
        ["New in this release", "PRAGMA", "mime.cache", "asn1_der_coding", "--verbose"]
    assert specific_terms("Is -5 below x2?") == ["x2"]


def test_a_follow_up_gets_one_passage_more():
    # a follow-up is searched with the question before it, so its hits are shared between two topics
    from tools.retrieval import DocumentPrefetch, RetrieverHandle

    pages = [f"The Zephyr X2 filter note {i}: replace the filter and the warranty card." for i in range(8)]
    retriever = Measured({"/docs/zephyr_manual.pdf": pages}, {"filter": 0.7, "warranty": 0.7})
    prefetch = DocumentPrefetch(RetrieverHandle(lambda: retriever), k=3)
    alone = prefetch("When do I replace the filter?", SourceLedger())
    follow = prefetch("And the warranty card?", SourceLedger(), ["When do I replace the filter?"])
    assert len(alone.passages) == 3 and len(follow.passages) == 4
    fresh = prefetch("How long is the warranty card valid?", SourceLedger(), ["When do I replace the filter?"])
    assert len(fresh.passages) == 3  # history alone does not make a question a follow-up


def test_with_no_passages_a_bracketed_list_of_numbers_is_data_and_a_lone_marker_is_still_dropped(tmp_path):
    """"Sort these numbers: 5, 2, 9, 1." was answered "The sorted numbers are [1, 2, 5, 9]." (from the python
    tool), and the stored answer lost the list: it was taken for four made-up markers."""
    check = verify_citations("The sorted numbers are [1, 2, 5, 9]. Paris is big [1].", SourceLedger())
    assert check.text == "The sorted numbers are [1, 2, 5, 9]. Paris is big." and list(check.dropped_markers) == [1]
    orch, _ = make_orchestrator(tmp_path, "The sorted numbers are [1, 2, 5, 9].", retriever=FakeRetriever(MANUAL))
    assert list(orch.run_turn(None, "Sort these numbers: 5, 2, 9, 1."))[-1].text == "The sorted numbers are [1, 2, 5, 9]."
