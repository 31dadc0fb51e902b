"""`assistant keys` and `assistant usage` (assistant/gateway_cli.py): stdout and stderr checked apart,
on a real SQLite store in a scratch data dir, through the same registration the CLI uses."""

from __future__ import annotations

import argparse
import json
import tomllib

import pytest

from assistant.commands import add_common
from assistant.config import AssistantConfig
from assistant.gateway_cli import parse_since, register_keys, register_usage
from tests.conftest import REPO_ROOT


def run(capsys, tmp_path, *argv: str, config_text: str = "") -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="assistant")
    sub = parser.add_subparsers(dest="command", required=True)
    register_keys(sub, add_common)
    register_usage(sub, add_common)
    args = parser.parse_args(argv)
    config_file = tmp_path / "config.toml"
    config_file.write_text(config_text)
    config = AssistantConfig.load(config_file, env={}, overrides={"data_dir": str(tmp_path)})
    code = args.func(args, config)
    out, err = capsys.readouterr()
    return code, out, err


def test_the_commands_are_registered_as_entry_points():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    commands = project["entry-points"]["assistant.commands"]
    assert commands["keys"] == "assistant.gateway_cli:register_keys"
    assert commands["usage"] == "assistant.gateway_cli:register_usage"


def test_create_list_revoke(capsys, tmp_path):
    code, out, err = run(capsys, tmp_path, "keys", "create", "--tier", "paid", "--name", "ci bot")
    key = out.strip()
    assert code == 0 and key.startswith("sk-asst-") and "\n" not in key  # alone on stdout
    assert "only time the key is shown" in err and key not in err
    key_id = key[len("sk-asst-"):].split("-")[0]
    code, out, _ = run(capsys, tmp_path, "keys", "list")
    assert key_id in out and "paid" in out and "active" in out and "ci bot" in out and key not in out
    code, _, err = run(capsys, tmp_path, "keys", "revoke", key_id)
    assert code == 0 and "Revoked" in err
    _, out, _ = run(capsys, tmp_path, "keys", "list", "--json")
    assert json.loads(out)["active"] is False


def test_unknown_tier_and_unknown_key_say_what_to_do(capsys, tmp_path):
    from assistant.errors import AssistantError

    with pytest.raises(AssistantError, match="Unknown tier 'gold'.*free, paid"):
        run(capsys, tmp_path, "keys", "create", "--tier", "gold", "--name", "x")
    with pytest.raises(AssistantError, match="keys list"):
        run(capsys, tmp_path, "keys", "revoke", "abcdefabcdef")


def test_usage_totals_and_cost(capsys, tmp_path):
    from assistant.keys import Keys
    from assistant.store import Store
    from assistant.usage import UsageLedger, UsageRecord

    config_text = '[server.prices."qwen2.5-coder-0.5b"]\nprompt = 1.0\ncached = 0.5\ncompletion = 2.0\n'
    store = Store(f"sqlite:///{tmp_path / 'assistant.db'}")
    record, _ = Keys(store.db).create("alice", "free")
    ledger = UsageLedger(store.db)
    ledger.record(UsageRecord(record.id, "qwen2.5-coder-0.5b", 1_000_000, 200_000, 500_000, 12.0, "ok"))
    ledger.record(UsageRecord(record.id, "qwen2.5-coder-0.5b", 10, 0, 3, 5.0, "cancelled"))
    ledger.record(UsageRecord("", "assistant", 7, 0, 7, 5.0, "ok", created_at=1.0))  # long ago
    store.close()
    code, out, err = run(capsys, tmp_path, "usage", "--json", config_text=config_text)
    totals = {t["model"]: t for t in json.loads(out)}
    qwen = totals["qwen2.5-coder-0.5b"]
    assert qwen["requests"] == 2 and qwen["completion_tokens"] == 500_003 and qwen["name"] == "alice"
    assert qwen["statuses"] == {"ok": 1, "cancelled": 1}
    # 800,010 uncached at 1.0 + 200,000 cached at 0.5 + 500,003 completion at 2.0, per million
    assert qwen["cost"] == pytest.approx((800_010 * 1.0 + 200_000 * 0.5 + 500_003 * 2.0) / 1e6)
    _, out, err = run(capsys, tmp_path, "usage", "--since", "1d", "--key", record.id, config_text=config_text)
    assert "qwen2.5-coder-0.5b" in out and "(no key)" not in out  # the old key-less row is filtered out
    assert "1.9000" in out  # 0.80001 + 0.1 + 1.000006 ≈ 1.9000
    _, out, err = run(capsys, tmp_path, "usage")
    assert "No price for assistant, qwen2.5-coder-0.5b" in err


def test_since_accepts_ages_and_dates():
    assert parse_since("7d", now=1_000_000.0) == 1_000_000.0 - 7 * 86400
    assert parse_since("30m", now=1000.0) == 1000.0 - 1800
    assert parse_since("2026-01-31") > 0
    with pytest.raises(Exception, match="7d, 12h, 30m"):
        parse_since("last week")
