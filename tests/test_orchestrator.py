"""Orchestrator turn loop with a scripted fake engine and a real in-memory SQLite store."""

import threading
from dataclasses import replace

import pytest

from assistant.config import AssistantConfig
from assistant.engine.base import SamplingParams
from assistant.engine.fake import ScriptedEngine
from assistant.errors import EngineError
from assistant.events import Done, Error, TextDelta, TurnStarted, Usage
from assistant.orchestrator import Orchestrator
from assistant.store import Store


@pytest.fixture
def make(tmp_path):
    def _make(*script, context_window=4096):
        engine = ScriptedEngine(script, context_window=context_window)
        config = AssistantConfig.load(env={}, overrides={"data_dir": str(tmp_path)})
        return Orchestrator(engine, Store("sqlite://"), config), engine
    return _make


def _answer(events):
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def test_turn_streams_and_persists(make):
    orch, engine = make(["The capital ", "is ", "Paris."])
    events = list(orch.run_turn(None, "What is the capital of France?"))
    assert [type(e) for e in events] == [TurnStarted, TextDelta, TextDelta, TextDelta, Usage, Done]
    assert events[0].message_id == events[-1].message_id and events[0].conversation_id == events[-1].conversation_id
    done = events[-1]
    assert _answer(events) == done.text == "The capital is Paris."
    assert done.finish_reason == "stop"
    stored = orch.store.history(done.conversation_id)
    assert [(m.role, m.content, m.status) for m in stored] == [
        ("user", "What is the capital of France?", "complete"),
        ("assistant", "The capital is Paris.", "complete"),
    ]
    assert stored[1].meta["usage"]["completion_tokens"] == 3
    assert engine.prompts[0][0] == {"role": "system", "content": orch.config.system_prompt}


def test_second_turn_sees_history(make):
    orch, engine = make("Paris.", "Rome.")
    cid = list(orch.run_turn(None, "Capital of France?"))[-1].conversation_id
    list(orch.run_turn(cid, "And of Italy?"))
    assert [m["content"] for m in engine.prompts[1][1:]] == ["Capital of France?", "Paris.", "And of Italy?"]


def test_overflow_drops_oldest_whole_turns(make):
    orch, engine = make("a1", "a2", "a3", context_window=250)
    params = SamplingParams(max_tokens=60)
    cid = list(orch.run_turn(None, "x" * 200, params=params))[-1].conversation_id
    list(orch.run_turn(cid, "y" * 200, params=params))
    events = list(orch.run_turn(cid, "z" * 200, params=params))
    sent = [m["content"] for m in engine.prompts[2]]
    assert sent == [orch.config.system_prompt, "y" * 200, "a2", "z" * 200]  # oldest turn dropped whole
    usage = next(e for e in events if isinstance(e, Usage))
    assert usage.dropped_messages == 2 and usage.prompt_tokens <= 250 - 60


def test_too_long_input_is_an_error_event_not_a_crash(make):
    orch, _ = make("never", context_window=100)
    events = list(orch.run_turn(None, "w" * 1000, params=SamplingParams(max_tokens=10)))
    assert isinstance(events[0], TurnStarted)
    assert isinstance(events[1], Error) and "too long" in events[1].message
    assert events[-1].finish_reason == "error"
    user, answer = orch.store.history(events[-1].conversation_id)
    assert user.content == "w" * 1000 and answer.status == "error"  # the user's message is kept


def test_engine_failure_mid_answer_keeps_the_partial_answer(make):
    orch, engine = make()

    def broken(prompt, params, **kw):
        yield from ScriptedEngine([["par", "tial"]]).generate(prompt, params)
        raise EngineError("the engine fell over")

    engine.generate = broken
    events = list(orch.run_turn(None, "hi", params=replace(orch.default_params(), max_tokens=100)))
    assert isinstance(events[-2], Error) and events[-1].finish_reason == "error"
    stored = orch.store.get_message(events[-1].message_id)
    assert (stored.content, stored.status) == ("partial", "error")


def test_client_gone_keeps_partial_answer(make):
    orch, _ = make(["one ", "two ", "three"])
    stream = orch.run_turn(None, "count")
    assert isinstance(next(stream), TurnStarted)
    first = next(stream)
    stream.close()  # the client disconnected
    cid = orch.store.list_conversations()[0].id
    answer = orch.store.history(cid)[-1]
    assert first.text == "one " and (answer.content, answer.status) == ("one ", "partial")


def test_cancel_stops_the_answer(make):
    orch, _ = make(["a", "b", "c"])
    cancel = threading.Event()
    stream = orch.run_turn(None, "go", cancel=cancel)
    assert isinstance(next(stream), TurnStarted)
    assert next(stream).text == "a"
    cancel.set()
    rest = list(stream)
    assert rest[-1].finish_reason == "cancelled" and rest[-1].text == "a"


def test_a_scoped_turn_takes_no_attached_files(make):
    from assistant.seams import Attachment, UserInput

    orch, engine = make("unused")
    events = list(orch.run_turn(None, UserInput("About this file?", files=(Attachment("a.txt", b"x"),)),
                                scope=frozenset()))
    assert isinstance(events[0], Error) and "upload them as documents first" in events[0].message
    assert events[-1].finish_reason == "error" and engine.prompts == [] and orch.store.list_conversations() == []
