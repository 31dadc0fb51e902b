"""The answer check (assistant/answer_check.py): the large model re-reads the passages a document
answer cites; a "no", confirmed by a second reading of every passage of the turn, withdraws the answer
for a refusal; anything else keeps it."""

from dataclasses import replace

from assistant.agent_loop import AgentOptions
from assistant.answer_check import WITHDRAWN, cited_passages
from assistant.citations import Passage
from assistant.engine.fake import ScriptedEngine
from assistant.events import Notice, Sources
from assistant.routing import Router, RoutingPolicy
from tests.agent_fakes import MANUAL, FakeRetriever, make_orchestrator


class Large(ScriptedEngine):
    name = "large"


# a second passage the question's search also finds, which the answer does not cite
CLAIMS = "Warranty claims for the Zephyr X2 need the receipt and the serial number."


def _turn(tmp_path, large_script, *, small_script=(), large=True, manual=MANUAL, **options):
    small, big = ScriptedEngine(list(small_script)), Large(list(large_script))
    orch, _ = make_orchestrator(tmp_path, engine=small, retriever=FakeRetriever(manual))
    orch.router = Router(small, big if large else None, RoutingPolicy())
    orch.options = replace(orch.options, **options)
    events = list(orch.run_turn(None, "How long is the warranty period?"))
    return orch, events, small, big


def test_two_noes_withdraw_the_answer_for_a_refusal_that_names_the_passages(tmp_path):
    manual = {doc: [*lines, CLAIMS] for doc, lines in MANUAL.items()}
    orch, events, _, big = _turn(tmp_path, ["The warranty is 7 years [1].", "no", "No"], manual=manual)
    done = events[-1]
    assert done.text.startswith("The documents I searched do not say.") and "zephyr_manual.pdf" in done.text
    assert any(isinstance(e, Notice) and e.message == WITHDRAWN for e in events)
    assert not any(isinstance(e, Sources) and e.sources for e in events)  # nothing cited is left to show
    stored = orch.store.get_message(done.message_id)
    assert stored.content == done.text and stored.meta["answer_check"] == "no/No" and stored.meta["sources"] == []
    assert stored.meta["withdrawn_answer"] == "The warranty is 7 years [1]."
    check, second = big.prompts[1][-1]["content"], big.prompts[2][-1]["content"]
    assert "Question: How long is the warranty period?" in check and "Question: How long" in second
    assert "warranty period of 7 years" in check  # the passage the answer cited ...
    assert "receipt" not in check and "receipt" in second  # ... then every passage of the turn
    assert "Does the passage contain" in check and "Do the passages contain" in second


def test_a_no_that_the_second_reading_over_every_passage_does_not_confirm_keeps_the_answer(tmp_path):
    orch, events, _, big = _turn(tmp_path, ["The warranty is 7 years [1].", "no", "yes"])
    assert events[-1].text == "The warranty is 7 years [1]." and len(big.prompts) == 3
    assert not any(isinstance(e, Notice) and e.message == WITHDRAWN for e in events)
    assert [s.marker for e in events if isinstance(e, Sources) for s in e.sources] == [1]
    assert orch.store.get_message(events[-1].message_id).meta["answer_check"] == "no/yes"


def test_a_yes_keeps_the_answer_and_its_sources(tmp_path):
    orch, events, _, big = _turn(tmp_path, ["The warranty is 7 years [1].", "Yes"])
    assert events[-1].text == "The warranty is 7 years [1]."
    assert not any(isinstance(e, Notice) and e.message == WITHDRAWN for e in events)
    assert [s.marker for e in events if isinstance(e, Sources) for s in e.sources] == [1]
    assert orch.store.get_message(events[-1].message_id).meta["answer_check"] == "Yes"
    assert len(big.prompts) == 2


def test_the_check_failing_keeps_the_answer(tmp_path):
    _, events, _, big = _turn(tmp_path, ["The warranty is 7 years [1]."])  # no reply left: EngineError
    assert events[-1].text == "The warranty is 7 years [1]." and len(big.prompts) == 2


def test_answers_of_the_small_model_and_a_switched_off_check_are_not_checked(tmp_path):
    _, events, small, _ = _turn(tmp_path, [], small_script=["The warranty is 7 years [1]."], large=False)
    assert events[-1].text == "The warranty is 7 years [1]." and len(small.prompts) == 1
    _, events, _, big = _turn(tmp_path / "off", ["The warranty is 7 years [1]."], check_answers=False)
    assert events[-1].text == "The warranty is 7 years [1]." and len(big.prompts) == 1


def test_cited_passages_are_the_cited_ones_or_the_first():
    passages = [Passage(i, "m.pdf", i, f"text {i}", f"c{i}") for i in (1, 2, 3)]
    assert [p.marker for p in cited_passages([3, 1, 3], passages)] == [1, 3]
    assert [p.marker for p in cited_passages([], passages)] == [1]
    assert cited_passages([9], []) == []


def test_a_follow_up_is_not_checked_the_check_reads_the_question_alone(tmp_path):
    orch, events, _, big = _turn(tmp_path, ["The warranty is 7 years [1].", "yes", "From the date of purchase [1].",
                                            "Rooms up to 40 square metres [1].", "yes"])
    cid = events[-1].conversation_id
    follow = list(orch.run_turn(cid, "And from when does it count?"))
    assert follow[-1].text == "From the date of purchase [1]." and len(big.prompts) == 3  # no check after the follow-up
    other = list(orch.run_turn(cid, "How big a room does the Zephyr X2 purifier handle?"))  # a question of its own
    assert other[-1].text == "Rooms up to 40 square metres [1]." and len(big.prompts) == 5
    assert "Does the passage contain the answer" in big.prompts[4][-1]["content"]


def test_a_streaming_v1_client_is_told_the_answer_was_withdrawn_and_gets_what_stands(tmp_path):
    """/v1 streaming clients read only content deltas: the withdrawn answer is already theirs, so the
    withdrawal and the refusal come after it as content."""
    import json
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from assistant.engine.base import SamplingParams
    from assistant.events import Done, TextDelta
    from assistant.server.assistant_model import assistant_completion

    refusal = "The documents I searched do not say. The closest passages I found are in m.pdf p. 2."

    class Withdrawing:
        conversations = SimpleNamespace(start=lambda history, title="": "c1")

        def turn(self, cid, user_input, **kw):
            yield TextDelta("The default level is 1 [1].")
            yield Notice(WITHDRAWN, replaces_answer=refusal)
            yield Done(cid, "m1", refusal, "stop")

    app = FastAPI()
    app.post("/v1")(lambda: assistant_completion(Withdrawing(), [{"role": "user", "content": "Default level?"}],
                                                 SamplingParams(), True))
    body = TestClient(app).post("/v1").text
    content = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                      for line in body.splitlines() if line.startswith("data: {") and '"choices"' in line)
    assert content == f"The default level is 1 [1].\n\n{WITHDRAWN}\n{refusal}"
