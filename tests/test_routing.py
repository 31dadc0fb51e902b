"""Model routing with two scripted engines: simple turns small, long/tool-heavy turns large, fallback."""

from assistant.engine.fake import ScriptedEngine
from assistant.errors import EngineBusy, ModelError
from assistant.events import Notice, ToolCallFinished
from assistant.routing import LARGE, SMALL, Router, RoutingPolicy
from tests.agent_fakes import MANUAL, AddTool, FakeRetriever, make_orchestrator


class Large(ScriptedEngine):
    name = "large"


def _orch(tmp_path, small_script, large, **kw):
    small = ScriptedEngine(small_script)
    orch, _ = make_orchestrator(tmp_path, engine=small, **kw)
    # plain questions on the small model, as a large engine that is slow to answer them would have it: these
    # tests are about length, documents, tools and fallback (test_questions_go_large_writing_stays_small)
    orch.router = Router(small, large, RoutingPolicy(long_prompt_tokens=300, large_for_questions=False))
    return orch, small


def test_policy():
    router = Router(ScriptedEngine(), Large(), RoutingPolicy(long_prompt_tokens=100))
    question = router.choose(prompt_tokens=10, has_documents=False, after_tool_step=False)
    assert (question.role, question.reason) == (LARGE, "question")
    writing = router.choose(prompt_tokens=10, has_documents=False, after_tool_step=False, writing=True)
    assert (writing.role, writing.reason) == (SMALL, "writing request")
    assert router.choose(prompt_tokens=10, has_documents=True, after_tool_step=False, writing=True).role == LARGE
    assert router.choose(prompt_tokens=10, has_documents=False, after_tool_step=False, prefer=SMALL).role == SMALL
    router.policy = RoutingPolicy(long_prompt_tokens=100, large_for_questions=False)
    assert router.choose(prompt_tokens=10, has_documents=False, after_tool_step=False).role == SMALL
    assert router.choose(prompt_tokens=100, has_documents=False, after_tool_step=False).role == LARGE
    assert router.choose(prompt_tokens=10, has_documents=True, after_tool_step=False).role == LARGE
    assert router.choose(prompt_tokens=10, has_documents=False, after_tool_step=True).role == LARGE
    alone = Router(ScriptedEngine())
    assert alone.choose(prompt_tokens=10**6, has_documents=True, after_tool_step=True).role == SMALL


def test_simple_turn_small_long_turn_large(tmp_path):
    large = Large(["long answer"])
    orch, small = _orch(tmp_path, ["short answer"], large)
    assert list(orch.run_turn(None, "hi"))[-1].text == "short answer"
    done = list(orch.run_turn(None, "z" * 2000))[-1]
    assert done.text == "long answer" and len(large.prompts) == 1 and len(small.prompts) == 1
    stored = orch.store.get_message(done.message_id)
    assert (stored.meta["model"], stored.meta["route"]) == ("large", "large")


def test_questions_go_large_writing_stays_small(tmp_path):
    """The 0.5B model answered 29 of 70 general-knowledge questions right, the 1.5B 55; the 1.5B refused 4 of
    16 writing requests, the 0.5B none (assistant/routing.py)."""
    small, large = ScriptedEngine(["Waves fold in."]), Large(["Paris."])
    orch, _ = make_orchestrator(tmp_path, engine=small)
    orch.router = Router(small, large)
    assert list(orch.run_turn(None, "What is the capital of France?"))[-1].text == "Paris."
    assert list(orch.run_turn(None, "Write a short poem about the sea."))[-1].text == "Waves fold in."
    assert len(large.prompts) == len(small.prompts) == 1


def test_which_requests_are_for_a_piece_of_writing():
    from assistant.routing import WRITING

    for text in ("Write a long story about a lighthouse keeper.", "Tell me a joke about cats.", "Compose a haiku "
                 "about autumn leaves.", "Draft an email to my landlord asking to fix the heating.", "Could you write "
                 "song lyrics about a road trip?", "Write a two-line birthday message for my sister."):
        assert WRITING.search(text), text
    for text in ("Write a Python function that checks whether a number is prime.", "Tell me a fun fact about "
                 "octopuses.", "What is a haiku?", "Give me a recipe for pancakes.", "Write a SQL query that counts rows."):
        assert not WRITING.search(text), text


def test_tool_heavy_turn_goes_large_after_the_first_step(tmp_path):
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    large = Large(["It is 3."])
    orch, small = _orch(tmp_path, [call], large, tools=[AddTool()])
    events = list(orch.run_turn(None, "1+2"))
    assert any(isinstance(e, ToolCallFinished) for e in events)
    assert events[-1].text == "It is 3." and len(small.prompts) == 1 and len(large.prompts) == 1
    assert large.prompts[0][-1]["role"] == "tool" and large.tools_seen[0] == small.tools_seen[0]


def test_documents_go_large(tmp_path):
    large = Large(["Seven years [1]."])
    orch, small = _orch(tmp_path, [], large, retriever=FakeRetriever(MANUAL))
    assert list(orch.run_turn(None, "warranty period?"))[-1].text == "Seven years [1]."
    # the answer, then the large model's check of it against the passage it cites (assistant/answer_check.py)
    assert small.prompts == [] and len(large.prompts) == 2
    assert "Does the passage contain the answer" in large.prompts[1][-1]["content"]


def test_busy_large_model_falls_back_to_small_with_a_notice(tmp_path):
    class Busy(Large):
        def generate(self, *a, **kw):
            raise EngineBusy("queue full")
            yield  # pragma: no cover

    orch, small = _orch(tmp_path, ["small answer"], Busy())
    events = list(orch.run_turn(None, "z" * 2000))
    notice = next(e for e in events if isinstance(e, Notice))
    assert "large model is not available" in notice.message and "queue full" in notice.message
    assert events[-1].text == "small answer" and events[-1].finish_reason == "stop"


def test_unloadable_large_model_is_not_retried_at_once(tmp_path):
    attempts = []

    def factory():
        attempts.append(1)
        raise ModelError("qwen2.5-coder-1.5b is not prepared: run `assistant models prepare large`")

    orch, small = _orch(tmp_path, ["one", "two"], factory)
    for _ in range(2):
        events = list(orch.run_turn(None, "z" * 2000))
        assert any(isinstance(e, Notice) and "models prepare large" in e.message for e in events)
    assert attempts == [1] and [e.text for e in events[-1:]] == ["two"]


def test_prompts_fit_the_smaller_window_once_the_large_engine_is_loaded():
    small, large = ScriptedEngine(context_window=32768), Large(context_window=8192)
    router = Router(small, lambda: large)
    assert router.context_window == 32768  # the large one is not loaded yet
    router.large()
    assert router.context_window == 8192


def test_a_turn_can_name_its_model(tmp_path):
    from assistant.seams import UserInput

    router = Router(ScriptedEngine(), Large(), RoutingPolicy(long_prompt_tokens=100))
    assert router.choose(prompt_tokens=10, has_documents=False, after_tool_step=False, prefer=LARGE).role == LARGE
    assert router.choose(prompt_tokens=10**6, has_documents=True, after_tool_step=True, prefer=SMALL).role == SMALL
    assert Router(ScriptedEngine()).choose(prompt_tokens=1, has_documents=False, after_tool_step=False,
                                           prefer=LARGE).role == SMALL  # nothing large to choose
    large = Large(["large answer"])
    orch, small = _orch(tmp_path, ["small answer"], large)
    done = list(orch.run_turn(None, UserInput("hi", model=LARGE)))[-1]
    assert done.text == "large answer" and len(small.prompts) == 0
    assert orch.store.get_message(done.message_id).meta["route"] == LARGE
    done = list(orch.run_turn(None, UserInput("z" * 2000, model=SMALL)))[-1]  # long, yet the user chose small
    assert done.text == "small answer" and len(large.prompts) == 1


def test_the_facade_maps_a_chosen_model_id_to_a_role():
    from assistant.app import Models
    from assistant.config import AssistantConfig

    config = AssistantConfig.load(env={}, overrides={"engine.large_model": "large"})
    models = Models(config, Router(ScriptedEngine(), Large()))
    assert models.role("large") == LARGE and models.role(config.engine.model) == SMALL
    assert models.role("auto") == "" and models.role(None) == ""
    alone = Models(AssistantConfig.load(env={}), Router(ScriptedEngine()))
    assert alone.role("large") == ""


def test_auto_large_model_is_the_packaged_one_only_when_it_is_prepared(tmp_path):
    import json

    from assistant.app import with_large_model
    from assistant.config import AssistantConfig
    from assistant.models import FORMAT_VERSION, PREPARED_MARKER, resolve_model_name

    config = AssistantConfig.load(env={}, overrides={"data_dir": str(tmp_path), "models_dir": str(tmp_path / "m")})
    assert config.engine.large_model == "auto"
    assert with_large_model(config).engine.large_model == ""  # nothing prepared: every turn on the small model
    spec = resolve_model_name("large")
    folder = tmp_path / "m" / spec.name
    folder.mkdir(parents=True)
    (folder / PREPARED_MARKER).write_text(json.dumps({"sha256": spec.sha256, "format": FORMAT_VERSION}))
    assert with_large_model(config).engine.large_model == "large"
    off = AssistantConfig.load(env={"ASSISTANT_ENGINE_LARGE_MODEL": ""}, overrides={"models_dir": str(tmp_path / "m")})
    assert with_large_model(off).engine.large_model == ""  # "" turns routing off
    same = AssistantConfig.load(env={}, overrides={"models_dir": str(tmp_path / "m"), "engine.model": "large"})
    assert with_large_model(same).engine.large_model == ""  # the large model is already the only one
    remote = AssistantConfig.load(env={}, overrides={"models_dir": str(tmp_path / "m"),
                                                     "engine.remote_url": "http://127.0.0.1:9/v1"})
    assert with_large_model(remote).engine.large_model == ""
    from assistant.app import build_assistant
    from assistant.store import Store

    fake = ScriptedEngine(["the fake's answer"])
    with build_assistant(config, engine=fake, store=Store("sqlite://"), tools=[]) as assistant:
        assert assistant.models.role("large") == ""  # a passed engine is not routed around to the prepared 1.5B
        assert list(assistant.orchestrator.run_turn(None, "x" * 2000))[-1].text == "the fake's answer"


class Closable(Large):
    closed = 0

    def close(self) -> None:
        self.closed += 1


def test_preload_loads_the_large_engine_once_and_a_call_meanwhile_waits_for_it():
    import threading

    loading, release, built = threading.Event(), threading.Event(), []

    def factory():
        loading.set()
        release.wait(10)
        built.append(Closable())
        return built[-1]

    router, ready = Router(ScriptedEngine(), factory), []
    thread = router.preload(lambda engine, error: ready.append((engine, error)))
    assert thread is not None and loading.wait(10)
    # a plain question does not wait for it (a document answer does)
    while_loading = router.choose(prompt_tokens=10, has_documents=False, after_tool_step=False)
    assert (while_loading.role, while_loading.reason) == (SMALL, "question, while the large model loads")
    assert router.choose(prompt_tokens=10, has_documents=True, after_tool_step=False).role == LARGE
    got = []
    caller = threading.Thread(target=lambda: got.append(router.large()))
    caller.start()
    caller.join(0.2)
    assert caller.is_alive() and not got  # the turn waits for the loading engine, it does not load a second
    release.set()
    thread.join(10)
    caller.join(10)
    assert len(built) == 1 and got == [built[0]] and ready == [(built[0], "")]
    assert router.preload() is None  # loaded: nothing to do
    assert router.choose(prompt_tokens=10, has_documents=False, after_tool_step=False).role == LARGE


def test_preload_reports_a_model_that_cannot_load_and_a_router_closed_meanwhile_closes_it():
    import threading

    def broken():
        raise ModelError("qwen2.5-coder-1.5b is not prepared: run `assistant models prepare large`")

    reports, router = [], Router(ScriptedEngine(), broken)
    router.preload(lambda engine, error: reports.append((engine, error))).join(10)
    assert reports == [(None, "qwen2.5-coder-1.5b is not prepared: run `assistant models prepare large`")]
    question = router.choose(prompt_tokens=10, has_documents=False, after_tool_step=False)  # no notice each time
    assert (question.role, question.reason) == (SMALL, "question, the large model is unavailable")
    assert Router(ScriptedEngine()).preload() is None  # no large model configured

    release, engine = threading.Event(), Closable()
    router = Router(ScriptedEngine(), lambda: release.wait(10) and engine)
    thread = router.preload(lambda *_: reports.append("done"))
    router.close()  # the server stopped while the model loaded
    release.set()
    thread.join(10)
    assert engine.closed >= 1 and reports[-1] != "done"
