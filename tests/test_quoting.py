"""Quote, then answer (assistant/quoting.py): the quote is held back, the answer after it is shown."""

from __future__ import annotations

import pytest

from assistant.events import Done, TextDelta
from assistant.quoting import NO_ANSWER, QUOTE_INSTRUCTION, QuoteFilter
from tests.agent_fakes import MANUAL, FakeRetriever, make_assistant

QUOTED = "Quote: Warranty: the Zephyr X2 comes with a warranty period of 7 years [1].\nAnswer: It is 7 years [1]."


def filtered(text: str, step: int) -> tuple[str, str]:
    f = QuoteFilter()
    out = "".join(f.feed(text[i:i + step]) for i in range(0, len(text), step)) + f.finish()
    return out, f.quote


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_the_quote_is_held_back_and_the_answer_passes(step):
    assert filtered(QUOTED, step) == (
        "It is 7 years [1].", "Warranty: the Zephyr X2 comes with a warranty period of 7 years [1].")
    assert filtered("**Quote:** x is 5 [2]\n\n**Answer:** It is 5 [2].", step) == ("It is 5 [2].", "x is 5 [2]")
    # no quote: the reply passes as written, even one shorter than "Quote:"
    assert filtered("The warranty is 7 years [1].", step) == ("The warranty is 7 years [1].", "")
    assert filtered("Qu", step) == ("Qu", "")
    # a quote and no answer: the quote is the answer; no quote at all is the documents' silence
    assert filtered("Quote: It lasts 7 years [1].", step) == ("It lasts 7 years [1].", "It lasts 7 years [1].")
    assert filtered("Quote: none", step) == (NO_ANSWER, "none")


def test_a_document_answer_shows_only_what_follows_its_quote(tmp_path):
    chunks = [QUOTED[i:i + 3] for i in range(0, len(QUOTED), 3)]
    assistant, engine = make_assistant(tmp_path, chunks, retriever=FakeRetriever(MANUAL),
                                       overrides={"retrieval.quote_first": True})
    events = list(assistant.turn(None, "What is the warranty period of the Zephyr X2?"))
    done = events[-1]
    assert isinstance(done, Done) and done.text == "It is 7 years [1]."
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "It is 7 years [1]."
    assert QUOTE_INSTRUCTION in engine.prompts[0][-2]["content"]  # the passages' message asks for the quote
    # off (the default), the instruction is not there and a "Quote:" reply is shown as written
    plain, engine = make_assistant(tmp_path / "off", QUOTED, retriever=FakeRetriever(MANUAL))
    assert list(plain.turn(None, "What is the warranty period of the Zephyr X2?"))[-1].text.startswith("Quote:")
    assert all(QUOTE_INSTRUCTION not in str(m["content"]) for m in engine.prompts[0])
