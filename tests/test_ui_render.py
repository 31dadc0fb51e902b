"""The web chat's pure rendering helpers (ui/render.py), without a browser: events -> Chatbot messages,
sources, tool panels, the usage meter and the ownership filter of the history sidebar."""

from __future__ import annotations

from dataclasses import dataclass

from assistant.events import (Done, SafetyVerdict, Source, Sources, TextDelta, ToolCallFinished, ToolCallStarted,
                              Transcribed, TurnStarted, Usage)
from ui.render import (TurnView, format_sources, history_messages, library_markdown, may_see, usage_meter,
                       visible_conversations)


def test_turn_view_streams_the_answer_with_sources_and_usage():
    view = TurnView(question="Warranty?")
    view.feed(TurnStarted("c1", "u1", "a1"))
    view.feed(TextDelta("Seven "))
    assert view.messages()[-1]["content"] == "Seven "
    view.feed(TextDelta("years [1]."))
    view.feed(Sources((Source(1, "manual.pdf", 3, "The warranty lasts seven years."),)))
    view.feed(Usage(100, 20, 4096))
    view.feed(Done("c1", "a1", "Seven years [1].", "stop"))
    user, answer = view.messages()
    assert user == {"role": "user", "content": "Warranty?"}
    assert answer["content"].startswith("Seven years [1].")
    assert "manual.pdf, p. 3" in answer["content"] and "seven years" in answer["content"]
    assert view.conversation_id == "c1" and view.status == "Done."
    assert "120 of 4,096 context" in usage_meter(view.usage)


def test_a_stopped_answer_is_marked():
    view = TurnView(question="Essay?")
    view.feed(TextDelta("Rome was"))
    view.feed(Done("c1", "a1", "Rome was", "cancelled"))
    assert view.messages()[-1]["content"] == "Rome was _(stopped)_" and view.status == "Stopped."


def test_a_transcript_becomes_the_users_message():
    view = TurnView()
    assert view.user_message() is None
    view.feed(Transcribed("What is the capital of Germany?"))
    assert view.messages()[0] == {"role": "user", "content": "What is the capital of Germany?"}


def test_tool_step_panel_shows_code_output_errors_and_the_plot(tmp_path):
    plot = tmp_path / "plot.png"
    plot.write_bytes(b"\x89PNG")
    view = TurnView(question="plot", resolve_artifact=lambda ref: plot if ref == "abc" else None)
    view.feed(ToolCallStarted("call1", "python", {"code": "print(1)"}))
    panel = view.messages()[1]
    assert panel["metadata"]["status"] == "pending" and "```python\nprint(1)\n```" in panel["content"]
    view.feed(ToolCallFinished("call1", "python", True, "1", ("abc", "missing")))
    panel, image = view.messages()[1:3]
    assert panel["metadata"]["status"] == "done" and "**Output:** 1" in panel["content"]
    assert image["content"]["path"] == str(plot)
    view.feed(ToolCallStarted("call2", "python", {"code": "1/0"}))
    view.feed(ToolCallFinished("call2", "python", False, "Traceback\nZeroDivisionError"))
    failed = view.messages()[3]
    assert "(failed)" in failed["metadata"]["title"] and "ZeroDivisionError" in failed["content"]
    view.feed(ToolCallStarted("call3", "python", {"code": "1/0"}))
    view.feed(ToolCallFinished("call3", "python", False, "same call as before, not run again", skipped=True))
    repeated = view.messages()[4]
    assert "(repeated, not run)" in repeated["metadata"]["title"] and "(failed)" not in repeated["metadata"]["title"]
    assert "**Note:**" in repeated["content"]


def test_safety_notices_say_what_and_why():
    view = TurnView(question="...")
    view.feed(SafetyVerdict("input", False, "prompt_injection", "Blocked: it asks to ignore the rules.", 0.97, 0.8, "minilm"))
    notice = view.messages()[1]
    assert "blocked" in notice["metadata"]["title"] and "prompt injection" in notice["metadata"]["title"]
    assert "ignore the rules" in notice["content"] and "0.97" in notice["content"]
    view.feed(SafetyVerdict("output", True, "pii", "An e-mail address was redacted."))
    assert "redacted" in view.messages()[2]["metadata"]["title"]


def test_sources_are_numbered_with_page_and_short_snippet():
    text = format_sources([{"marker": 2, "doc": "notes.md", "page": None, "snippet": "x " * 200}])
    assert "**[2]** notes.md —" in text and "p." not in text and text.endswith("…”")
    assert format_sources([]) == ""


@dataclass
class Msg:
    role: str
    content: str
    status: str = "complete"
    meta: dict | None = None


def test_history_shows_sources_and_stopped_answers():
    shown = history_messages([Msg("system", "x"), Msg("user", "Q"),
                              Msg("assistant", "A [1].", meta={"sources": [{"marker": 1, "doc": "d.pdf", "page": 2}]}),
                              Msg("user", "Q2"), Msg("assistant", "Half", meta={"finish_reason": "cancelled"})])
    assert [m["role"] for m in shown] == ["user", "assistant", "user", "assistant"]
    assert "d.pdf, p. 2" in shown[1]["content"] and shown[3]["content"].endswith("_(stopped)_")


@dataclass
class Conv:
    id: str
    title: str


def test_ownership_filter_matches_the_gateway_rule():
    owners = {"a": "alice", "b": "bob"}
    convs = [Conv("a", "Alice's trip"), Conv("b", "Bob's plan"), Conv("c", "Local notes")]
    seen = lambda key, q="": [c.id for c in visible_conversations(convs, owners.get, key, q)]  # noqa: E731
    assert seen("alice") == ["a"] and seen("bob") == ["b"] and seen("") == ["c"]
    assert seen("alice", "TRIP") == ["a"] and seen("alice", "plan") == []
    assert may_see(None, "") and not may_see("alice", "") and not may_see(None, "alice")


def test_library_states():
    assert "empty" in library_markdown([])
    assert "not part of this build" in library_markdown([], available=False)
    assert "report.pdf" in library_markdown([{"doc": "report.pdf", "num_chunks": 3}])
    shown = library_markdown([{"file_name": "handbook.md", "shared": True}], conversation=[{"file_name": "trip.txt"}])
    assert shown.index("This conversation") < shown.index("trip.txt") < shown.index("Library") < shown.index("handbook")
    assert "handbook.md · shared, read-only" in shown
    assert "**This conversation**" not in library_markdown([{"file_name": "a.pdf"}])
