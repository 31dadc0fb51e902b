"""Context budget: layout (stable parts first), what gives way on overflow, and the token accounting."""

import pytest

from assistant.context import CUT_TOOL_OUTPUT, PromptParts, fit_prompt
from assistant.engine.base import SamplingParams
from assistant.engine.fake import ScriptedEngine
from assistant.errors import EngineError
from assistant.events import Usage
from assistant.orchestrator import AgentOptions
from tests.agent_fakes import MANUAL, AddTool, FakeRetriever, make_orchestrator

SYSTEM = {"role": "system", "content": "sys"}
count = ScriptedEngine().count_tokens  # 4 + len/4 per message


def _turns(n, size=200):
    out = []
    for i in range(n):
        out += [{"role": "user", "content": f"q{i}" + "x" * size}, {"role": "assistant", "content": f"a{i}"}]
    return out


def test_layout_puts_stable_parts_first():
    parts = PromptParts(SYSTEM, {"role": "user", "content": "now"}, _turns(1, 4), memory="m", context=["[1] d p. 1: t"],
                        steps=[{"role": "tool", "name": "add", "content": "5"}])
    plan = fit_prompt(parts, count_tokens=count, context_window=4096, reserve=100)
    roles = [(m["role"], m["content"][:12]) for m in plan.messages]
    assert roles == [("system", "sys"), ("system", "Summary of t"), ("user", "q0xxxx"), ("assistant", "a0"),
                     ("system", "Passages fro"), ("user", "now"), ("tool", "5")]
    b = plan.breakdown
    assert b["total"] == plan.prompt_tokens and b["reserved_answer"] == 100 and b["free"] == 4096 - 100 - b["total"]
    assert b["history"] > 0 and b["retrieved"] > 0 and b["memory"] > 0 and b["tool_steps"] > 0


def test_drop_policy_without_summariser_drops_oldest_whole_turns():
    parts = PromptParts(SYSTEM, {"role": "user", "content": "now"}, _turns(4))
    plan = fit_prompt(parts, count_tokens=count, context_window=140, reserve=50)
    assert plan.num_dropped == 6 and plan.num_summarised == 0 and plan.memory == ""
    assert [m["content"][:2] for m in plan.messages] == ["sy", "q3", "a3", "no"]


def test_summariser_folds_dropped_turns_into_memory():
    seen = []

    def summarize(memory, messages, max_tokens):
        seen.append((memory, [m["content"][:2] for m in messages]))
        assert max_tokens == 60  # a quarter of the 240-token budget
        return "user asked q0 and q1"

    parts = PromptParts(SYSTEM, {"role": "user", "content": "now"}, _turns(4), memory="older")
    plan = fit_prompt(parts, count_tokens=count, context_window=290, reserve=50, summarize=summarize)
    assert seen == [("older", ["q0", "a0", "q1", "a1"])]  # room for a 60-token summary was enough
    assert plan.memory == "user asked q0 and q1" and plan.num_summarised == 4
    assert plan.messages[1]["content"].endswith("user asked q0 and q1")
    assert [m["content"][:2] for m in plan.messages[2:]] == ["q2", "a2", "q3", "a3", "no"]
    assert plan.prompt_tokens <= 290 - 50


def test_then_retrieved_passages_then_earlier_tool_outputs_give_way():
    steps = [{"role": "tool", "name": "t", "content": "r" * 400}, {"role": "tool", "name": "t", "content": "s" * 40}]
    parts = PromptParts(SYSTEM, {"role": "user", "content": "now"}, _turns(1), context=["p" * 200, "q" * 200],
                        steps=steps)
    plan = fit_prompt(parts, count_tokens=count, context_window=150, reserve=40)
    assert plan.num_dropped == 2 and plan.num_context_dropped == 2 and plan.num_steps_cut == 1
    assert plan.messages[-2]["content"] == CUT_TOOL_OUTPUT and plan.messages[-1]["content"] == "s" * 40
    assert steps[0]["content"] == "r" * 400  # the caller's messages are not modified


def test_what_never_gives_way_fails_with_a_fix():
    parts = PromptParts(SYSTEM, {"role": "user", "content": "w" * 2000})
    with pytest.raises(EngineError, match="too long.*Shorten"):
        fit_prompt(parts, count_tokens=count, context_window=300, reserve=50)


def test_orchestrator_summarises_once_and_reuses_the_memory(tmp_path):
    orch, engine = make_orchestrator(tmp_path, "a1", "a2", "SUMMARY: x and y", "a3", "a4", context_window=660,
                                     options=AgentOptions(summarize_overflow=True))
    params = SamplingParams(max_tokens=20)
    cid = list(orch.run_turn(None, "x" * 800, params=params))[-1].conversation_id
    list(orch.run_turn(cid, "y" * 800, params=params))
    events = list(orch.run_turn(cid, "z" * 800, params=params))  # overflow: the first turn is summarised
    summary_prompt = engine.prompts[2]
    assert "Summarise" in summary_prompt[-1]["content"] and "x" * 50 in summary_prompt[-1]["content"]
    sent = engine.prompts[3]
    assert sent[1] == {"role": "system", "content": "Summary of the earlier conversation:\nSUMMARY: x and y"}
    assert [m["content"][:3] for m in sent[2:]] == ["yyy", "a2", "zzz"]
    stored = orch.store.get_message(events[-1].message_id)
    assert stored.meta["memory"]["summary"] == "SUMMARY: x and y"
    usage = next(e for e in events if isinstance(e, Usage))
    assert usage.dropped_messages == 2 and usage.breakdown["memory"] > 0
    # next turn: the stored memory stands in for the first turn without asking the model again
    list(orch.run_turn(cid, "w", params=params))
    assert engine.prompts[4][1]["content"].endswith("SUMMARY: x and y")
    assert [m["content"][:3] for m in engine.prompts[4][2:]] == ["yyy", "a2", "zzz", "a3", "w"]


def test_consecutive_turns_share_the_prompt_prefix(tmp_path):
    orch, engine = make_orchestrator(tmp_path, "Paris.", "Rome.", tools=[AddTool()], retriever=FakeRetriever(MANUAL))
    cid = list(orch.run_turn(None, "Capital of France?"))[-1].conversation_id
    list(orch.run_turn(cid, "And of Italy?"))
    first, second = engine.prompts
    assert second[: len(first) - 2] == first[:-2]  # system (+ tool specs), history...; not this turn's passages
    assert engine.tools_seen[0] == engine.tools_seen[1]


def test_usage_event_reports_the_breakdown(tmp_path):
    orch, _ = make_orchestrator(tmp_path, "Seven years [1].", retriever=FakeRetriever(MANUAL))
    events = list(orch.run_turn(None, "warranty period?"))
    usage = next(e for e in events if isinstance(e, Usage))
    assert usage.breakdown["retrieved"] > 0 and usage.breakdown["reserved_answer"] == orch.config.engine.max_new_tokens
    assert usage.to_dict()["breakdown"]["total"] == usage.prompt_tokens


def test_the_assistant_model_bills_every_calls_prompt():
    """A turn with a tool step sends two prompts; /v1's "assistant" model bills both (it billed the last
    one only, and its cached tokens, counted over both calls, could exceed its prompt tokens)."""
    from assistant.server.assistant_model import TurnTally

    tally = TurnTally(None)
    tally.see(Usage(prompt_tokens=260, completion_tokens=40, context_window=4096, cached_tokens=330, num_steps=2,
                    total_prompt_tokens=480))
    assert (tally.prompt, tally.cached, tally.completion) == (480, 330, 40)
