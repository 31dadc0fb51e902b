"""Brevity (assistant/brevity.py): a document answer stops after two sentences, while it streams."""

from __future__ import annotations

import pytest

from assistant.agent_loop import AgentOptions
from assistant.brevity import SentenceCap
from assistant.events import Done, TextDelta
from tests.agent_fakes import MANUAL, FakeRetriever, make_assistant


def capped(text: str, step: int, limit: int = 2) -> tuple[str, bool]:
    cap, out = SentenceCap(limit), ""
    for i in range(0, len(text), step):
        out += cap.feed(text[i:i + step])
        if cap.done:
            break
    return out + cap.finish(), cap.done


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_the_third_sentence_is_not_shown_and_markers_stay_with_their_sentence(step):
    drift = "The function is asn1_delete_structure [2]. It sets the pointer to NULL [2]. It takes a pointer [3]."
    assert capped(drift, step) == ("The function is asn1_delete_structure [2]. It sets the pointer to NULL [2].", True)
    after_stop = "A is x [1]. B is e.g. y. [2] The third one [3]."  # "e.g. y" ends no sentence
    assert capped(after_stop, step) == ("A is x [1]. B is e.g. y. [2]", True)
    lines = "One [1].\nTwo [2].\nThree [3]."
    assert capped(lines, step) == ("One [1].\nTwo [2].", True)
    assert capped("Only one [1].", step) == ("Only one [1].", False)
    assert capped("One [1]. Two [2]. [3]", step) == ("One [1]. Two [2]. [3]", False)  # a late marker is no sentence


@pytest.mark.parametrize("step", [1, 2, 5])
def test_lists_tables_and_code_are_not_cut(step):
    for text in ["The options are:\n- a [1]\n- b [1]\n- c [1]", "One [1]. Two:\n- a\n- b\n- c",
                 "One. Two.\n1. first\n2. second", "Speeds:\n| a | 1 |\n| b | 2 |\nThird. Fourth.",
                 "Run this:\n```\nls -l\n```\nThen that. And more. And more."]:
        assert capped(text, step) == (text, False)


def test_no_cap_when_none_is_asked_for():
    text = "One. Two. Three. Four."
    assert capped(text, 1, limit=0) == (text, False)


def test_a_document_answer_stops_generating_after_two_sentences(tmp_path):
    answer = ["The warranty period", " is 7 years [1].", " The warranty runs from the", " date of purchase [1].",
              " The Zephyr", " X2 is compact [1].", " Replace the filter", " every 6 months [1]."]
    assistant, engine = make_assistant(tmp_path, answer, retriever=FakeRetriever(MANUAL))
    events = list(assistant.turn(None, "What is the warranty period of the Zephyr X2?"))
    done = events[-1]
    assert isinstance(done, Done)
    assert done.text == "The warranty period is 7 years [1]. The warranty runs from the date of purchase [1]."
    shown = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert "compact" not in shown  # never shown, then taken back
    stored = assistant.conversations.history(done.conversation_id)[-1]
    assert stored.meta["finish_reason"] == "stop" and stored.meta["usage"]["completion_tokens"] == 5

    # without passages in the prompt (no documents), or with the cap off, the answer is left whole
    chat, _ = make_assistant(tmp_path / "chat", answer)
    assert "compact" in list(chat.turn(None, "Tell me about purifiers."))[-1].text
    off, _ = make_assistant(tmp_path / "off", answer, retriever=FakeRetriever(MANUAL),
                            options=AgentOptions(answer_sentences=0))
    assert "compact" in list(off.turn(None, "What is the warranty period of the Zephyr X2?"))[-1].text
    # a summary of whole files is not a lookup: it is left whole
    summary = ["The Zephyr X2 is a compact air purifier [1].", " Replace the HEPA filter every 6 months [1].",
               " The warranty period is 7 years [1].", " Clean the pre-filter monthly [1]."]
    whole, _ = make_assistant(tmp_path / "summary", summary, retriever=FakeRetriever(MANUAL))
    assert "pre-filter monthly" in list(whole.turn(None, "Summarise zephyr_manual.pdf"))[-1].text


def test_a_loop_is_seen_once_one_unit_repeats_over_the_span():
    from assistant.brevity import REPEAT_SPAN, repeating

    story = "The keeper climbed the stairs at dusk and lit the lamp. "
    loop = "and it was covered in a thick layer of sandstone, gravel, and limestone, "
    assert not repeating(story + loop * 3)  # 219 characters: not yet
    text = story + loop * 4
    assert len(loop) * 4 >= REPEAT_SPAN and repeating(text)
    assert repeating(text + loop[:17])  # wherever in the unit the stream stands
    # what is not a loop: a few identical code lines, a table of equal rows, a short answer said twice
    assert not repeating("```python\n" + "print('hi')\n" * 4 + "```\n" + story * 2)
    assert not repeating(story + "| 0 | 0 | 0 |\n" * 5)
    assert not repeating(story * 2 + "asn1_print_structure prints everything [1]. " * 2)
    assert repeating(story + "." * 300)  # one character over and over is a loop too (its 10-character units repeat)


def test_a_looping_answer_is_stopped_with_a_notice(tmp_path):
    from assistant.agent_loop import LOOPING
    from assistant.events import Done, Notice
    from tests.agent_fakes import make_orchestrator

    loop = "and it was covered in a thick layer of sandstone, gravel, and limestone, "
    orch, engine = make_orchestrator(tmp_path, "Once upon a time the keeper lit the lamp, " + loop * 40)
    events = list(orch.run_turn(None, "Write a long story about a lighthouse keeper."))
    notices = [e.message for e in events if isinstance(e, Notice)]
    done = [e for e in events if isinstance(e, Done)][-1]
    assert LOOPING in notices
    answer = orch.store.history(done.conversation_id)[-1].content
    assert answer.count(loop.strip()) <= 5 and "lit the lamp" in answer  # stopped early, what came before kept


def test_a_looping_answer_shows_its_last_words_before_the_notice(tmp_path):
    """A transformer that holds text (the output guard holds the unfinished sentence) releases it before the
    notice, not after: the notice is the last thing the user reads."""
    from assistant.agent_loop import LOOPING
    from assistant.events import Notice, TextDelta
    from tests.agent_fakes import make_assistant
    from tests.test_seams import HoldAll

    loop = "and it was covered in a thick layer of sandstone, gravel, and limestone, "
    assistant, _ = make_assistant(tmp_path, "Once upon a time the keeper lit the lamp, " + loop * 40,
                                  transformers=[HoldAll()])
    events = list(assistant.turn(None, "Write a long story about a lighthouse keeper."))
    at = next(i for i, e in enumerate(events) if isinstance(e, Notice) and e.message == LOOPING)
    shown = "".join(e.text for e in events[:at] if isinstance(e, TextDelta))
    assert "lit the lamp" in shown and loop.strip() in shown
    assert not any(isinstance(e, TextDelta) and e.text for e in events[at:])
