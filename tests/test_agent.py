"""The agent loop with a scripted engine: tool calls parsed, validated, run, fed back; repairs; bounds."""

import json

import pytest

from assistant.toolcalls import ToolCallSplitter, loads_lenient, parse_reply
from assistant.events import Notice, TextDelta, ToolCallFinished, ToolCallStarted, TurnStarted, Usage
from assistant.orchestrator import AgentOptions
from tests.agent_fakes import MANUAL, AddTool, FakeRetriever, make_assistant, make_orchestrator
from tools.base import Tool, ToolContext, ToolInputError, validate_arguments
from tools.registry import ToolRegistry

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def _text(events):
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def test_tool_call_result_then_final_answer(tmp_path):
    add = AddTool()
    orch, engine = make_orchestrator(tmp_path, CALL, "The sum is 5.", tools=[add])
    events = list(orch.run_turn(None, "What is 2 + 3? Use the tool."))
    started = next(e for e in events if isinstance(e, ToolCallStarted))
    finished = next(e for e in events if isinstance(e, ToolCallFinished))
    assert (started.name, started.arguments) == ("add", {"a": 2, "b": 3})
    assert finished.ok and finished.summary == "5" and finished.call_id == started.call_id
    assert add.calls == [(2, 3)] and add.num_setups == 1
    assert _text(events) == events[-1].text == "The sum is 5."  # the call's JSON never reaches the user
    # the tool specs went through the chat template seam, and the result came back as a tool message
    assert [t["function"]["name"] for t in engine.tools_seen[0]] == ["add"]
    second = engine.prompts[1]
    assert second[-2]["role"] == "assistant" and second[-2]["tool_calls"][0]["function"]["name"] == "add"
    assert second[-1] == {"role": "tool", "name": "add", "content": "5", "tool_call_id": started.call_id}
    stored = orch.store.get_message(events[-1].message_id)
    assert stored.meta["steps"] == [{"name": "add", "arguments": {"a": 2, "b": 3}, "ok": True, "summary": "5",
                                     "artifacts": []}]
    usage = next(e for e in events if isinstance(e, Usage))
    assert usage.num_steps == 2 and usage.breakdown["total"] == usage.prompt_tokens
    first = orch.router.small.count_tokens(engine.prompts[0])
    assert usage.total_prompt_tokens == first + usage.prompt_tokens > usage.prompt_tokens  # both calls' prompts


def test_fenced_json_call_as_the_small_model_writes_it(tmp_path):
    fenced = '```json\n{\n  "name": "add",\n  "arguments": {\n    "a": 4, "b": 5\n    }\n  }\n}\n```'
    orch, engine = make_orchestrator(tmp_path, fenced, "9.", tools=[AddTool()])
    events = list(orch.run_turn(None, "4+5?"))
    assert any(isinstance(e, ToolCallFinished) and e.summary == "9" for e in events)
    assert events[-1].text == "9." and "```" not in _text(events)


def test_malformed_call_is_repaired_once_with_the_error_as_observation(tmp_path):
    broken = '<tool_call>{"name": "add", "arguments": "a=2 b=3"}</tool_call>'
    orch, engine = make_orchestrator(tmp_path, broken, CALL, "It is 5.", tools=[AddTool()])
    events = list(orch.run_turn(None, "2+3?"))
    repair = engine.prompts[1]
    assert repair[-2] == {"role": "assistant", "content": broken}
    assert repair[-1]["role"] == "tool" and "must be a JSON object" in repair[-1]["content"]
    failed = [e for e in events if isinstance(e, ToolCallFinished) and not e.ok]
    assert len(failed) == 1 and failed[0].name == "invalid_tool_call"
    assert any(isinstance(e, ToolCallFinished) and e.ok and e.summary == "5" for e in events)
    assert events[-1].text == "It is 5." and events[-1].finish_reason == "stop"


def test_an_answer_written_as_a_call_of_no_tool_is_asked_again_without_tools(tmp_path):
    """Seen with the int8 0.5B: 'List five landmarks in Paris' came back as a "call" of a tool named
    Paris with a list for arguments. That is content, not a call attempt: no repair, tools withdrawn."""
    content = '<tool_call>{"name": "Paris", "arguments": ["Eiffel Tower", "Louvre"]}</tool_call>'
    orch, engine = make_orchestrator(tmp_path, content, "1. Eiffel Tower\n2. Louvre", tools=[AddTool()])
    events = list(orch.run_turn(None, "List two landmarks in Paris."))
    assert not any(isinstance(e, ToolCallStarted) for e in events)  # nothing shown as a failed tool step
    assert engine.tools_seen[1] is None and len(engine.prompts) == 2  # asked once more, without tools
    assert all(m.get("role") != "tool" for m in engine.prompts[1])  # the attempt is not fed back as a step
    assert events[-1].text == "1. Eiffel Tower\n2. Louvre"


def test_a_reply_that_writes_out_the_tool_list_is_never_shown_and_is_asked_again_without_tools(tmp_path):
    """Seen with the 1.5B: "Give me a recipe for pancakes." came back as the template's <tools> block."""
    echo = '<tools>\n{"type": "function", "function": {"name": "add", "description": "Add two numbers."}}\n</tools>'
    orch, engine = make_orchestrator(tmp_path, echo, "Mix flour, milk and eggs.", tools=[AddTool()])
    events = list(orch.run_turn(None, "Give me a recipe for pancakes."))
    assert "<tools>" not in _text(events) and "function" not in _text(events)
    assert not any(isinstance(e, ToolCallStarted) for e in events)
    assert engine.tools_seen[1] is None and events[-1].text == "Mix flour, milk and eggs."


def test_a_request_for_code_to_read_is_not_offered_the_code_interpreter(tmp_path):
    """Offered the interpreter, the 1.5B ran "a Python function that checks whether a number is prime" on 29
    and answered "The number 29 is prime.", without the function (12 code requests: 6 answered with code
    offered it, 12 not)."""
    class Python(Tool):
        name, description = "python", "Run code."
        inputs = {"code": {"type": "string", "description": "the code"}}

        def forward(self, code):
            return "True"

    orch, engine = make_orchestrator(tmp_path, "def is_prime(n): ...", "It is 5.", tools=[Python(), AddTool()])
    list(orch.run_turn(None, "Write a Python function that checks whether a number is prime."))
    list(orch.run_turn(None, "What is 2 + 3?"))
    assert [[t["function"]["name"] for t in seen] for seen in engine.tools_seen] == [["add"], ["python", "add"]]


def test_a_question_without_passages_or_anything_to_compute_is_not_offered_the_interpreter(tmp_path):
    """With the python spec in its prompt the 1.5B answered "How many minutes are in a day?" with "24"."""
    class Python(Tool):
        name, description = "python", "Run code."
        inputs = {"code": {"type": "string", "description": "the code"}}

        def forward(self, code):
            return "1"

    orch, engine = make_orchestrator(tmp_path, "1440 minutes.", "391.", "414.", "Seven years [1].",
                                     tools=[Python()], retriever=FakeRetriever(MANUAL))
    list(orch.run_turn(None, "How many minutes are in a day?"))
    cid = list(orch.run_turn(None, "What is 17 times 23?"))[-1].conversation_id
    list(orch.run_turn(cid, "And 18 times it?"))  # a follow-up: judged with the question before it
    list(orch.run_turn(None, "How long is the warranty?"))  # passages: its prompt keeps every tool
    offered = ["python" in [t["function"]["name"] for t in seen or []] for seen in engine.tools_seen]
    assert offered == [False, True, True, True]
    assert "HEPA" not in str(engine.prompts[0]) and "7 years" in str(engine.prompts[3])  # no passages, passages


def test_second_malformed_call_withdraws_tools_and_still_answers(tmp_path):
    bad = '<tool_call>{"name": "adds", "arguments": {}}</tool_call>'  # a misspelt tool: repaired once
    orch, engine = make_orchestrator(tmp_path, bad, bad, "I cannot use tools; 2+3 is 5.", tools=[AddTool()])
    events = list(orch.run_turn(None, "2+3?"))
    assert "no tool named 'adds'; did you mean 'add'?" in engine.prompts[1][-1]["content"]
    assert any(isinstance(e, Notice) and "without tools" in e.message for e in events)
    assert engine.tools_seen[2] is None  # the last call offered no tools
    assert events[-1].text == "I cannot use tools; 2+3 is 5."


def test_a_call_of_a_made_up_tool_is_answered_without_tools_not_repaired(tmp_path):
    """Seen in `make run` with the 0.5B: "Say hello to my grandma in Italian." came back as a call of a tool
    named 'hello grandma'; shown the repair ("There is no tool named ... Available tools: python."), the
    model answered with those words. A name no tool resembles is content: ask again without tools."""
    made_up = '<tool_call>{"name": "hello grandma", "arguments": {"language": "Italian"}}</tool_call>'
    orch, engine = make_orchestrator(tmp_path, made_up, "Ciao nonna!", tools=[AddTool()])
    events = list(orch.run_turn(None, "Say hello to my grandma in Italian."))
    assert not any(isinstance(e, ToolCallStarted) for e in events)
    assert engine.tools_seen[1] is None and len(engine.prompts) == 2
    assert all("no tool named" not in str(m.get("content")) for m in engine.prompts[1])
    assert events[-1].text == "Ciao nonna!"


def test_bad_arguments_are_an_observation_not_a_crash(tmp_path):
    add = AddTool()
    orch, engine = make_orchestrator(
        tmp_path, '<tool_call>{"name": "add", "arguments": {"a": "two", "b": 3}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {"a": -1, "b": 3}}</tool_call>', "Done.", tools=[add])
    events = list(orch.run_turn(None, "add"))
    results = [e for e in events if isinstance(e, ToolCallFinished)]
    assert [r.ok for r in results] == [False, False] and add.calls == []
    assert "must be a integer" in engine.prompts[1][-1]["content"]
    assert "a must not be negative" in engine.prompts[2][-1]["content"]
    assert events[-1].text == "Done."


def test_max_steps_bounds_the_loop(tmp_path):
    orch, engine = make_orchestrator(tmp_path, CALL, CALL, CALL, "Finally 5.", tools=[AddTool()],
                                     options=AgentOptions(max_steps=2))
    events = list(orch.run_turn(None, "loop"))
    assert sum(isinstance(e, ToolCallStarted) for e in events) == 2
    assert len(engine.prompts) == 3 and engine.tools_seen[2] is None
    assert events[-1].text.startswith("<tool_call>")  # without tools a call is just text


def test_text_before_a_call_streams_and_the_call_is_held_back(tmp_path):
    orch, _ = make_orchestrator(tmp_path, ["Let me add. ", "<tool", "_call>", '{"name": "add", ',
                                           '"arguments": {"a": 1, "b": 1}}', "</tool_call>"], "2.", tools=[AddTool()])
    events = list(orch.run_turn(None, "1+1"))
    assert _text(events) == "Let me add. 2."
    assert isinstance(events[0], TurnStarted)
    assert isinstance(events[1], TextDelta) and events[1].text == "Let me add. "


def test_no_tools_means_no_specs_and_plain_streaming(tmp_path):
    orch, engine = make_orchestrator(tmp_path, ['{"a": 1}'])
    events = list(orch.run_turn(None, "json please"))
    assert engine.tools_seen == [None] and events[-1].text == '{"a": 1}'


def test_disabled_tool_is_not_offered_in_that_conversation_only(tmp_path):
    orch, engine = make_orchestrator(tmp_path, "a", "b", tools=[AddTool()])
    cid = list(orch.run_turn(None, "one"))[-1].conversation_id
    orch.tools.disable(cid, "add")
    list(orch.run_turn(cid, "two"))
    assert engine.tools_seen[0] is not None and engine.tools_seen[1] is None
    assert [t.name for t in orch.tools.enabled("other")] == ["add"]
    orch.tools.enable(cid, "add")
    assert [t.name for t in orch.tools.enabled(cid)] == ["add"]


# -- parsing ----------------------------------------------------------------------------------------


def test_parse_reply_formats():
    names = {"add"}
    assert parse_reply(CALL, names).calls[0].arguments == {"a": 2, "b": 3}
    bare = parse_reply('{"name": "add", "arguments": {"a": 1, "b": 2}}', names)
    assert bare.calls[0].name == "add" and bare.text == ""
    two = parse_reply(CALL + "\n" + CALL.replace("2", "7"), names)
    assert [c.arguments["a"] for c in two.calls] == [2, 7]
    code = parse_reply("```python\nprint(1)\n```", names)
    assert not code.wants_tools and code.text.startswith("```python")
    as_string = parse_reply('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>', names)
    assert as_string.calls[0].arguments == {"a": 1, "b": 2}


def test_lenient_json_repairs():
    assert loads_lenient('{"name": "x", "arguments": {"code": "a"}}}')[0]["name"] == "x"  # extra brace
    assert loads_lenient('{"name": "x", "arguments": {"code": "a"}')[0]["arguments"] == {"code": "a"}  # missing
    assert loads_lenient('{"code": "def f():"\n + "  return 1"}')[0] == {"code": "def f():\n  return 1"}
    assert loads_lenient('{"code": "a" + "b"}')[0] == {"code": "ab"}
    obj, error = loads_lenient("{name: x}")
    assert obj is None and "line 1" in error


def test_splitter_releases_text_but_holds_possible_markers():
    s = ToolCallSplitter(["add"])
    assert s.feed("Hello ") == "Hello "
    assert s.feed("``") == ""  # could open ```json
    assert s.feed("`python\n") == "```python\n"
    assert s.feed("x = 1\n```") == "x = 1\n"
    reply, rest = s.finish()
    assert not reply.wants_tools and rest == "```"


# -- the contract -----------------------------------------------------------------------------------


def test_contract_is_checked_when_the_class_is_defined():
    with pytest.raises(TypeError, match="forward"):
        class Mismatch(Tool):
            name = "mismatch"
            description = "d"
            inputs = {"x": {"type": "string", "description": "x"}}

            def forward(self, y):
                return y
    with pytest.raises(TypeError, match="name"):
        class BadName(Tool):
            name = "Bad Name"
            description = "d"
            inputs = {}

            def forward(self):
                return ""
    with pytest.raises(TypeError, match="type"):
        class BadType(Tool):
            name = "bad_type"
            description = "d"
            inputs = {"x": {"type": "str", "description": "x"}}

            def forward(self, x):
                return x


def test_spec_and_validation():
    spec = AddTool().spec()["function"]
    assert spec["name"] == "add" and spec["parameters"]["required"] == ["a", "b"]
    assert validate_arguments("add", AddTool.inputs, {"a": "3", "b": 4}) == {"a": 3, "b": 4}
    with pytest.raises(ToolInputError, match="needs the argument 'b'"):
        validate_arguments("add", AddTool.inputs, {"a": 1})
    with pytest.raises(ToolInputError, match="no argument 'c'"):
        validate_arguments("add", AddTool.inputs, {"a": 1, "b": 2, "c": 3})


def test_registry_rejects_non_tools_and_duplicates():
    registry = ToolRegistry([AddTool()])
    with pytest.raises(ValueError):
        registry.register(AddTool())
    with pytest.raises(TypeError):
        registry.register(object())
    with pytest.raises(KeyError):
        registry.disable("c", "missing")
    result = registry.get("add")({"a": 1, "b": 2}, ToolContext("c"))
    assert result.ok and result.text == "3" and json.loads(result.text) == 3


def test_repeated_call_is_not_rerun_and_the_last_call_asks_for_the_answer(tmp_path):
    add = AddTool()
    orch, engine = make_orchestrator(tmp_path, CALL, CALL, "5.", tools=[add], options=AgentOptions(max_steps=2))
    events = list(orch.run_turn(None, "2+3"))
    finished = [e for e in events if isinstance(e, ToolCallFinished)]
    assert [f.ok for f in finished] == [True, False] and add.calls == [(2, 3)]
    assert [f.skipped for f in finished] == [False, True]  # shown as a repeat, not as a failed run
    assert "already made exactly this call" in engine.prompts[2][-2]["content"]
    assert engine.prompts[2][-1]["role"] == "system" and "plain text" in engine.prompts[2][-1]["content"]
    assert events[-1].text == "5."


def test_python_tool_hint_when_code_only_defines_a_function(tmp_path):
    from sandbox.fake import FakeExecutor
    from tools.code_interpreter import CodeInterpreter
    from tools.python_tool import PythonTool

    tool = PythonTool(CodeInterpreter(executor=FakeExecutor(), artifacts_dir=tmp_path))
    ctx = ToolContext("c1")
    defined = tool({"code": "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)"}, ctx)
    assert defined.ok and "print(fib(...))" in defined.text
    printed = tool({"code": "print(fib(20))"}, ctx)  # state persists within the conversation
    assert printed.ok and printed.summary == "6765" and "Nothing was printed" not in printed.text


def test_empty_reply_after_a_tool_step_asks_once_more_without_tools(tmp_path):
    orch, engine = make_orchestrator(tmp_path, CALL, "", "The sum is 5.", tools=[AddTool()])
    events = list(orch.run_turn(None, "2+3"))
    assert events[-1].text == "The sum is 5." and engine.tools_seen[2] is None


# -- a turn's document scope (tools/retrieval.py ScopedHandle) ------------------------------------------
TWO_KEYS = {"/docs/alice_secret.txt": ["The vault code is 4471."],
            "/docs/bob_notes.txt": ["The garden gate code is green and the vault is elsewhere."]}
BOBS = frozenset({"/docs/bob_notes.txt"})


def test_a_scoped_handle_shows_only_its_documents_to_every_retrieval_path():
    from assistant.citations import SourceLedger
    from tools.retrieval import DocumentPrefetch, RetrieverHandle, read_pages, search_passages
    from tests.agent_fakes import FakeRetriever

    handle = RetrieverHandle(lambda: FakeRetriever(TWO_KEYS))
    bobs = handle.scoped(BOBS)
    assert [d["file_name"] for d in bobs.get().documents()] == ["bob_notes.txt"] and bobs.has_documents()
    assert {p.doc for p in search_passages(bobs, SourceLedger(), "vault code")} == {"bob_notes.txt"}
    assert search_passages(bobs, SourceLedger(), "vault code", document="alice_secret.txt") == []
    assert {p.doc for p in search_passages(handle, SourceLedger(), "vault code")} == {"alice_secret.txt",
                                                                                      "bob_notes.txt"}
    with pytest.raises(ToolInputError) as outside:
        read_pages(bobs, "alice_secret.txt")
    with pytest.raises(ToolInputError) as unknown:
        read_pages(bobs, "nope.txt")
    assert str(outside.value) == str(unknown.value).replace("nope.txt", "alice_secret.txt") == \
        "No document 'alice_secret.txt'. Documents: bob_notes.txt."
    assert [p.text for p in read_pages(bobs, "bob_notes.txt")] == TWO_KEYS["/docs/bob_notes.txt"]
    prefetch = DocumentPrefetch(handle)
    ledger = SourceLedger()
    found = prefetch("What is the vault code in the document?", ledger, scope=BOBS)
    assert found.tool == "search_documents" and {p.doc for p in ledger.passages} == {"bob_notes.txt"}
    ledger = SourceLedger()
    found = prefetch("Summarise the document alice_secret.txt", ledger, scope=BOBS)  # named but not in scope:
    assert found.tool == "read_document" and found.arguments == {"documents": ["alice_secret.txt"]}  # as if nowhere
    assert not found.ok and found.reply.startswith("No document 'alice_secret.txt'. Documents: bob_notes.txt. Upload it ")
    assert found.passages == [] and len(ledger) == 0
    # an empty scope is an empty library: nothing prefetched, no tool offered, the index never opened
    unopened = RetrieverHandle(lambda: pytest.fail("the index was opened for an empty scope"))
    assert DocumentPrefetch(unopened)("What is the vault code?", SourceLedger(), scope=frozenset()) is None
    assert not unopened.scoped(frozenset()).has_documents()


def test_a_scoped_turn_offers_document_tools_only_over_what_it_may_see(tmp_path):
    from tests.agent_fakes import FakeRetriever

    read = '<tool_call>{"name": "read_document", "arguments": {"document": "%s"}}</tool_call>'
    orch, engine = make_orchestrator(tmp_path, "Hello.", read % "alice_secret.txt", "No.", read % "nope.txt", "No.",
                                     "The vault code is 4471 [1].", retriever=FakeRetriever(TWO_KEYS))
    orch.options = AgentOptions(auto_retrieve=False)
    list(orch.run_turn(None, "What is the vault code?", scope=frozenset()))  # an empty library
    assert engine.tools_seen == [None]
    outside = list(orch.run_turn(None, "Read alice_secret.txt", scope=BOBS))
    unknown = list(orch.run_turn(None, "Read nope.txt", scope=BOBS))
    failed = [next(e for e in events if isinstance(e, ToolCallFinished)) for events in (outside, unknown)]
    assert [f.ok for f in failed] == [False, False]
    assert engine.prompts[2][-1]["content"] == engine.prompts[4][-1]["content"].replace("nope.txt", "alice_secret.txt")
    assert "4471" not in json.dumps(engine.prompts[1:5])
    orch.options = AgentOptions()  # the local user (no scope): the whole library, prefetched
    events = list(orch.run_turn(None, "What is the vault code in the document?"))
    assert "The vault code is 4471." in json.dumps(engine.prompts[-1]) and events[-1].text.endswith("[1].")


def test_after_a_repeated_call_the_next_step_answers_without_tools(tmp_path):
    add = AddTool()
    orch, engine = make_orchestrator(tmp_path, CALL, CALL, "5.", tools=[add], options=AgentOptions(max_steps=4))
    events = list(orch.run_turn(None, "2+3"))
    assert [e.skipped for e in events if isinstance(e, ToolCallFinished)] == [False, True]
    assert len(engine.prompts) == 3 and engine.tools_seen[2] is None  # no third chance to loop
    assert events[-1].text == "5."


def test_a_follow_up_over_documents_carries_the_question_it_follows(tmp_path):
    # "And which file does it write that output to?" lost its "it" behind the passages (dev-023)
    from assistant.agent_loop import FOLLOWS

    assistant, engine = make_assistant(tmp_path, "The warranty period is 7 years [1].", "It starts at purchase [1].",
                                       "The filter lasts 6 months [1].", retriever=FakeRetriever(MANUAL))
    first = list(assistant.turn(None, "What is the warranty period of the Zephyr X2?"))[-1]
    assert engine.prompts[0][-1]["content"] == "What is the warranty period of the Zephyr X2?"
    list(assistant.turn(first.conversation_id, "And when does it start?"))
    assert engine.prompts[1][-1]["content"] == FOLLOWS.format(
        earlier="What is the warranty period of the Zephyr X2?", question="And when does it start?")
    assert FOLLOWS.format(earlier="E", question="Q").endswith("\nQ")  # the question's own tokens come last
    list(assistant.turn(first.conversation_id, "How often should the HEPA filter of the purifier be replaced?"))
    assert engine.prompts[2][-1]["content"] == "How often should the HEPA filter of the purifier be replaced?"
    stored = [m.content for m in assistant.conversations.history(first.conversation_id) if m.role == "user"]
    assert stored[1] == "And when does it start?"  # the conversation keeps what the user wrote
