"""The store on a real PostgreSQL server, through exactly the code path SQLite uses.

The test starts its own throwaway server (the `pg_url` fixture, tests/services.py: initdb + pg_ctl in a
temp dir, Unix socket only), so it needs the server binaries (`apt-get install postgresql`, which
`make test` does as root) but no running service.
"""

from __future__ import annotations

import pytest

from assistant.store import Store

pytestmark = pytest.mark.real


def test_conversation_round_trip_and_branches(pg_url):
    store = Store(pg_url)
    c = store.create_conversation("pg")
    store.add_message(c.id, "user", "q1")
    a1 = store.add_message(c.id, "assistant", "", status="partial")
    store.update_message(a1.id, content="a1", status="complete", meta={"usage": {"prompt_tokens": 5}})
    store.add_message(c.id, "user", "q2")
    store.add_message(c.id, "user", "q2 edited", parent_id=a1.id)
    assert [m.content for m in store.history(c.id)] == ["q1", "a1", "q2 edited"]
    assert store.get_message(a1.id).meta == {"usage": {"prompt_tokens": 5}}
    store.close()
    reopened = Store(pg_url)  # committed: a new connection pool sees everything
    assert [m.content for m in reopened.history(c.id)] == ["q1", "a1", "q2 edited"]
    reopened.delete_conversation(c.id)
    assert reopened.list_conversations() == []
    reopened.close()
