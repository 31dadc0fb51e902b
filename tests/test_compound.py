"""Compound questions: split at a comma before a question word, each part searched and answered in
turn with the earlier parts as its conversation, shown as one answer with one set of sources."""

from assistant.compound import question_parts
from assistant.events import Done, Sources, ToolCallStarted
from tests.agent_fakes import MANUAL, FakeRetriever, make_orchestrator
from tools.retrieval import retrieval_query


def test_parts_keep_the_lead_sentence_and_the_opening_clause():
    assert question_parts("Which file records the weight of each glob, and what weight does a glob get?") == [
        "Which file records the weight of each glob?", "What weight does a glob get?"]
    assert question_parts("If I store dates as Julian day numbers, which storage class holds them, and which "
                          "function produces that number?") == [
        "If I store dates as Julian day numbers, which storage class holds them?",
        "If I store dates as Julian day numbers, which function produces that number?"]
    assert question_parts("The manual shows a fallback. Which code triggers it, what does it mean, and which flag "
                          "is used?") == ["The manual shows a fallback. Which code triggers it?",
                                          "The manual shows a fallback. What does it mean?",
                                          "The manual shows a fallback. Which flag is used?"]
    # a part that asks from its first words is a part, not an opening clause
    assert question_parts("With which function, and what does it return?") == ["With which function?",
                                                                                 "What does it return?"]
    assert question_parts("When was zstd 1.5 released, and who wrote it?") == ["When was zstd 1.5 released?",
                                                                                "Who wrote it?"]


def test_one_question_stays_one():
    for text in ("Under which licences are libtasn1 and libidn2 distributed?",  # "and" joins names
                 "What is the default SQLITE_MAX_COLUMN and how far can it be raised?",  # no comma: not split
                 "After runtest --tool gdb, what are the log files called?",  # an opening clause, one question
                 "Summarise the manual, and list its chapters.",  # not a question
                 "Which flag is it, and why? And which version?",  # two question marks: the user split it already
                 "Which one, and what?"):  # a part of one word is not a question
        assert question_parts(text) == [text], text


def test_a_short_part_is_searched_with_the_part_before_it():
    assert retrieval_query("Since which version?", ["Does strftime() support %V?"]) == \
        "Does strftime() support %V? Since which version?"
    assert retrieval_query("Which flag allows padding?", ["What does asn1_get_length_der do?"]) == \
        "Which flag allows padding?"


def test_each_part_is_searched_and_answered_in_turn_and_shown_as_one_answer(tmp_path):
    retriever = FakeRetriever(MANUAL)
    orch, engine = make_orchestrator(tmp_path, "The HEPA filter is replaced every 6 months [1].",
                                     "The warranty period is 7 years [2].", retriever=retriever)
    events = list(orch.run_turn(None, "How often is the HEPA filter replaced, and what is the warranty period?"))
    assert retriever.searches == ["How often is the HEPA filter replaced?", "What is the warranty period?"]
    assert [e.name for e in events if isinstance(e, ToolCallStarted)] == ["search_documents", "search_documents"]
    # the second call sees the first part and its answer as the conversation, and its own passages
    second = engine.prompts[1]
    assert [m["content"] for m in second if m["role"] in ("user", "assistant")] == [
        "How often is the HEPA filter replaced?", "The HEPA filter is replaced every 6 months [1].",
        "What is the warranty period?"]
    assert "Warranty: the Zephyr X2" in second[-2]["content"] and "HEPA" not in second[-2]["content"]
    done = events[-1]
    assert isinstance(done, Done)
    assert done.text == "The HEPA filter is replaced every 6 months [1]. The warranty period is 7 years [2]."
    sources = next(e for e in events if isinstance(e, Sources)).sources
    assert [(s.marker, s.page) for s in sources] == [(1, 2), (2, 3)]  # one ledger: the markers do not collide
    stored = orch.store.get_message(done.message_id)
    assert stored.content == done.text and stored.meta["usage"]["num_steps"] == 2
    # the user's own question is what is stored, not its parts
    assert [m.content for m in orch.store.history(done.conversation_id) if m.role == "user"] == [
        "How often is the HEPA filter replaced, and what is the warranty period?"]


def test_without_documents_a_compound_question_is_one_call(tmp_path):
    orch, engine = make_orchestrator(tmp_path, "Both: 6 months, and 7 years.")
    events = list(orch.run_turn(None, "How often is the HEPA filter replaced, and what is the warranty period?"))
    assert len(engine.prompts) == 1 and events[-1].text == "Both: 6 months, and 7 years."


def test_a_part_off_the_documents_is_not_refused_for_facts_no_passage_holds(tmp_path):
    # "21" is in no passage: grounding refused the whole answer for it when the part was judged off the
    # documents ("What is the shed key's location, and what is 3 times 7?" at `make run`)
    from tests.test_citations import Measured

    retriever = Measured(MANUAL, {"HEPA": 0.7})
    orch, engine = make_orchestrator(tmp_path, "The HEPA filter is replaced every 6 months [1].", "3 times 7 is 21.",
                                     retriever=retriever)
    events = list(orch.run_turn(None, "How often is the HEPA filter replaced, and what is 3 times 7?"))
    assert retriever.searches == ["How often is the HEPA filter replaced?"]  # the second part is judged off them
    done = events[-1]
    assert done.text == "The HEPA filter is replaced every 6 months [1]. 3 times 7 is 21."
    meta = orch.store.get_message(done.message_id).meta
    assert meta["unsupported_facts"] == [] and not meta["grounding_refusal"]
    # the checks of a document answer (the answer check, an unstated count or default) read only the part
    # asked of the documents
    from assistant.agent_loop import TurnState, on_documents
    from assistant.citations import SourceLedger

    turn = TurnState("c", SourceLedger())
    question = "How often is the HEPA filter replaced, and what is 3 times 7?"
    assert on_documents(question, turn) == question
    turn.off_documents.append(("What is 3 times 7?", "3 times 7 is 21."))
    assert on_documents(question, turn) == "How often is the HEPA filter replaced?"


def test_a_made_up_fact_in_a_part_about_the_documents_is_still_dropped(tmp_path):
    from tests.test_citations import Measured

    retriever = Measured(MANUAL, {"HEPA": 0.7, "warranty": 0.7})
    orch, engine = make_orchestrator(tmp_path, "The HEPA filter is replaced every 6 months [1].",
                                     "The warranty period is 12 years [2].", retriever=retriever)
    done = list(orch.run_turn(None, "How often is the HEPA filter replaced, and what is the warranty period?"))[-1]
    assert done.text == "The HEPA filter is replaced every 6 months [1]."
    assert orch.store.get_message(done.message_id).meta["unsupported_facts"] == ["12"]
