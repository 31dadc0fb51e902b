"""History: list/rename/delete, regenerate, edit on a new branch (old one reachable), export, the CLI."""

import json

import pytest

from assistant.cli import main
from assistant.conversations import export_markdown
from assistant.errors import StoreError
from assistant.store import Store
from tests.agent_fakes import MANUAL, FakeRetriever, make_orchestrator


def _chat(orch, cid, text):
    return list(orch.run_turn(cid, text))[-1]


def test_edit_creates_a_branch_and_the_old_one_stays_reachable(tmp_path):
    orch, engine = make_orchestrator(tmp_path, "Paris.", "Rome.", "Berlin.")
    cid = _chat(orch, None, "Capital of France?").conversation_id
    done = _chat(orch, cid, "And of Italy?")
    old_path = orch.store.history(cid)
    italy = old_path[2]
    edited = list(orch.edit(cid, italy.id, "And of Germany?"))[-1]
    assert edited.text == "Berlin."
    # the model saw the history up to the edited message, not the old branch
    assert [m["content"] for m in engine.prompts[2][1:]] == ["Capital of France?", "Paris.", "And of Germany?"]
    new_path = orch.store.history(cid)
    assert [m.content for m in new_path] == ["Capital of France?", "Paris.", "And of Germany?", "Berlin."]
    assert new_path[2].meta["edited_from"] == italy.id
    assert [m.content for m in orch.store.siblings(italy.id)] == ["And of Italy?", "And of Germany?"]
    # the old branch is still there, and can be made active again
    assert [m.content for m in orch.store.history(cid, head_id=done.message_id)][-1] == "Rome."
    orch.store.switch_branch(cid, italy.id)
    assert orch.store.history(cid)[-1].content == "Rome."


def test_regenerate_adds_a_sibling_answer(tmp_path):
    orch, engine = make_orchestrator(tmp_path, "Pariss.", "Paris.")
    first = _chat(orch, None, "Capital of France?")
    again = list(orch.regenerate(first.conversation_id))[-1]
    assert again.text == "Paris."
    assert engine.prompts[1] == engine.prompts[0]  # same question, same context
    answers = orch.store.siblings(again.message_id)
    assert [m.content for m in answers] == ["Pariss.", "Paris."]
    assert [m.content for m in orch.store.history(first.conversation_id)] == ["Capital of France?", "Paris."]


def test_edit_rejects_a_non_user_message(tmp_path):
    orch, _ = make_orchestrator(tmp_path, "Paris.")
    done = _chat(orch, None, "Capital of France?")
    with pytest.raises(StoreError, match="not a user message"):
        list(orch.edit(done.conversation_id, done.message_id, "x"))


def test_list_rename_delete(tmp_path):
    orch, _ = make_orchestrator(tmp_path, "a", "b")
    one = _chat(orch, None, "first question").conversation_id
    two = _chat(orch, None, "second question").conversation_id
    assert [c.id for c in orch.store.list_conversations()] == [two, one]
    orch.store.rename_conversation(one, "Renamed")
    assert orch.store.get_conversation(one).title == "Renamed"
    orch.store.delete_conversation(two)
    assert [c.id for c in orch.store.list_conversations()] == [one]
    with pytest.raises(StoreError):
        orch.store.history(two)


def test_export_json_and_markdown_with_sources_and_steps(tmp_path):
    orch, _ = make_orchestrator(tmp_path, "Seven years [1].", retriever=FakeRetriever(MANUAL))
    cid = _chat(orch, None, "warranty period Zephyr?").conversation_id
    data = orch.store.export(cid)
    assert json.loads(json.dumps(data))["messages"][1]["meta"]["sources"][0]["page"] == 3
    md = export_markdown(orch.store, cid)
    assert md.startswith("# warranty period Zephyr?")
    assert "## You\n\nwarranty period Zephyr?" in md and "Seven years [1]." in md
    assert "- [1] zephyr_manual.pdf, p. 3:" in md and "> tool `search_documents`" not in md


def test_conversations_cli(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ASSISTANT_CONFIG", raising=False)
    store = Store(f"sqlite:///{tmp_path / 'assistant.db'}")
    conv = store.create_conversation("Trip plans")
    store.add_message(conv.id, "user", "Where to?")
    store.add_message(conv.id, "assistant", "Rome.")
    d = ["--data-dir", str(tmp_path)]
    assert main(["conversations", "list", *d]) == 0
    out = capsys.readouterr()
    assert conv.id in out.out and "Trip plans" in out.out and "2 msgs" in out.out
    assert main(["conversations", "rename", conv.id, "Holiday", *d]) == 0
    assert "Holiday" in capsys.readouterr().err
    assert main(["conversations", "export", conv.id, "--format", "md", *d]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("# Holiday") and "Rome." in out.out and out.err == ""
    assert main(["conversations", "export", conv.id, "-o", str(tmp_path / "c.json"), *d]) == 0
    assert json.loads((tmp_path / "c.json").read_text())["title"] == "Holiday"
    capsys.readouterr()
    assert main(["conversations", "delete", conv.id, *d]) == 0
    assert main(["conversations", "show", conv.id, *d]) == 2
    err = capsys.readouterr().err
    assert "No conversation" in err and "assistant conversations" in err
