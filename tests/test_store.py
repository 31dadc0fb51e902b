"""Store: committed messages, branch-aware history, export; SQLite file and in-memory alike."""

import pytest

from assistant.errors import StoreError
from assistant.store import Store


@pytest.fixture(params=["memory", "file"])
def store(request, tmp_path):
    url = "sqlite://" if request.param == "memory" else f"sqlite:///{tmp_path / 'a.db'}"
    s = Store(url)
    yield s
    s.close()


def test_history_follows_the_active_branch(store):
    c = store.create_conversation("t")
    u1 = store.add_message(c.id, "user", "q1")
    store.add_message(c.id, "assistant", "a1")
    store.add_message(c.id, "user", "q2")
    assert [m.content for m in store.history(c.id)] == ["q1", "a1", "q2"]
    # edit q2: a sibling under a1 becomes the head; the old branch stays reachable by id
    a1 = store.history(c.id)[1]
    old_head = store.get_conversation(c.id).head_id
    store.add_message(c.id, "user", "q2 edited", parent_id=a1.id)
    assert [m.content for m in store.history(c.id)] == ["q1", "a1", "q2 edited"]
    assert [m.content for m in store.history(c.id, old_head)] == ["q1", "a1", "q2"]
    assert store.history(c.id)[0].id == u1.id


def test_update_rename_delete_list(store):
    c = store.create_conversation("first")
    m = store.add_message(c.id, "assistant", "", status="partial")
    store.update_message(m.id, content="done", status="complete", meta={"usage": {"prompt_tokens": 3}})
    got = store.get_message(m.id)
    assert (got.content, got.status, got.meta["usage"]["prompt_tokens"]) == ("done", "complete", 3)
    store.rename_conversation(c.id, "renamed")
    assert [x.title for x in store.list_conversations()] == ["renamed"]
    assert store.export(c.id)["messages"][0]["content"] == "done"
    store.delete_conversation(c.id)
    assert store.list_conversations() == []
    with pytest.raises(StoreError, match="No conversation"):
        store.history(c.id)


def test_data_survives_reopening(tmp_path):
    url = f"sqlite:///{tmp_path / 'b.db'}"
    s = Store(url)
    c = s.create_conversation("keep")
    s.add_message(c.id, "user", "hello")
    s.close()
    assert [m.content for m in Store(url).history(c.id)] == ["hello"]


def test_bad_url_is_a_store_error():
    with pytest.raises(StoreError, match="Cannot open the store"):
        Store("nosuchdialect://x")


def test_a_sqlite_store_in_a_new_data_dir_makes_its_folder(tmp_path):
    from assistant.store import Store

    path = tmp_path / "new" / "data" / "assistant.db"
    store = Store(f"sqlite:///{path}")
    store.create_conversation("hello")
    assert path.is_file() and [c.title for c in store.list_conversations()] == ["hello"]


def test_an_in_memory_store_keeps_one_threads_transaction_whole_while_another_reads():
    """Seen in CI: an in-memory store is one shared SQLite connection; a reader ending its read rolled
    back a writer's transaction half way (the message insert undone, the head update kept)."""
    import threading
    import time as clock

    from sqlalchemy import text

    store = Store("sqlite://")
    cid = store.create_conversation(title="race").id
    inserted, done = threading.Event(), threading.Event()

    def writer():
        with store.db.begin() as c:
            c.execute(text("UPDATE conversations SET title = 'written' WHERE id = :id"), {"id": cid})
            inserted.set()
            clock.sleep(0.3)  # the reader runs now, unless it must wait for this transaction
        done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    inserted.wait(5)
    with store.db.connect() as c:  # a read that ends (and rolls back) while the writer is mid-transaction
        c.execute(text("SELECT 1")).all()
    thread.join(5)
    assert done.is_set() and store.get_conversation(cid).title == "written"


def test_an_in_memory_store_serves_another_thread_after_two_threads_took_turns():
    """Seen in CI as a 300 s hang: while one thread held the in-memory store's connection, a second one
    waiting for it had already re-pointed the shared pool record at itself, so its own checkin was
    skipped as a 'double checkin' and the connection was never given back to any third thread."""
    import threading

    from sqlalchemy import text

    store = Store("sqlite://")
    cid = store.create_conversation(title="turns").id
    holding, waiting = threading.Event(), threading.Event()

    def holder():
        with store.db.connect() as c:
            c.execute(text("SELECT 1")).all()
            holding.set()
            waiting.wait(5)

    first = threading.Thread(target=holder)
    first.start()
    holding.wait(5)
    second = threading.Thread(target=lambda: store.get_conversation(cid))
    second.start()
    second.join(0.3)  # it waits for the holder
    waiting.set()
    first.join(5)
    second.join(5)
    seen: list[str] = []
    third = threading.Thread(target=lambda: seen.append(store.get_conversation(cid).title))
    third.start()
    third.join(10)
    assert seen == ["turns"], "a third thread could not get the store's connection"
