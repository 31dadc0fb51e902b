"""`assistant keys create|list|revoke` and `assistant usage`: the gateway's tables from the command line.

Both work on the store named by the config (SQLite in the data dir, or `store.url`), so they act on
a running server's keys and ledger too: a key created here is accepted by every replica at once, a
revoked one is refused at once. Nothing here loads a model. The key itself is printed once, alone on
stdout (so `KEY=$(assistant keys create ...)` works); everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
import time
from typing import Any

from assistant.config import AssistantConfig
from assistant.errors import ConfigError


def register_keys(subparsers: argparse._SubParsersAction, add_common: Any) -> None:
    keys = subparsers.add_parser("keys", help="create, list and revoke API keys")
    sub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    create = sub.add_parser("create", help="create a key (shown once)")
    create.add_argument("--tier", required=True, help="tier from server.tiers (default config: free, paid)")
    create.add_argument("--name", required=True, help="who or what uses the key")
    add_common(create)
    create.set_defaults(func=_cmd_create)
    lst = sub.add_parser("list", help="list keys (ids, names, tiers; never the keys)")
    lst.add_argument("--json", action="store_true", help="one JSON object per line")
    add_common(lst)
    lst.set_defaults(func=_cmd_list)
    revoke = sub.add_parser("revoke", help="revoke a key (its id, or the key itself)")
    revoke.add_argument("key_id", help="the key's id as `keys list` shows it")
    add_common(revoke)
    revoke.set_defaults(func=_cmd_revoke)


def register_usage(subparsers: argparse._SubParsersAction, add_common: Any) -> None:
    usage = subparsers.add_parser("usage", help="tokens and cost per key and model (the usage ledger)")
    usage.add_argument("--key", default=None, help="only this key id")
    usage.add_argument("--since", default=None, help="a date (2026-01-31), a time (2026-01-31T12:00) or an age (7d, 12h, 30m)")
    usage.add_argument("--json", action="store_true", help="print the totals as JSON")
    add_common(usage)
    usage.set_defaults(func=_cmd_usage)


def _open(config: AssistantConfig) -> tuple[Any, Any, Any]:
    from assistant.keys import Keys
    from assistant.store import Store
    from assistant.usage import UsageLedger

    store = Store(config.store_url)
    return store, Keys(store.db, tuple(config.server.tiers)), UsageLedger(store.db)


def _cmd_create(args: argparse.Namespace, config: AssistantConfig) -> int:
    store, keys, _ = _open(config)
    try:
        record, key = keys.create(args.name, args.tier)
    finally:
        store.close()
    print(key)
    print(f"Created key {record.id} ({record.name!r}, tier {record.tier}). This is the only time the key is "
          "shown: store it now. Clients send it as 'Authorization: Bearer <key>'.", file=sys.stderr)
    return 0


def _cmd_list(args: argparse.Namespace, config: AssistantConfig) -> int:
    store, keys, _ = _open(config)
    try:
        records = keys.list()
    finally:
        store.close()
    if args.json:
        for k in records:
            print(json.dumps({**k.__dict__, "active": k.active}))
        return 0
    if not records:
        print("No keys: the server is open on loopback only. Create one with "
              "`assistant keys create --tier free --name NAME`.", file=sys.stderr)
        return 0
    print(f"{'id':<14}{'tier':<10}{'status':<10}{'created':<18}name")
    for k in records:
        created = dt.datetime.fromtimestamp(k.created_at).strftime("%Y-%m-%d %H:%M")
        print(f"{k.id:<14}{k.tier:<10}{'active' if k.active else 'revoked':<10}{created:<18}{k.name}")
    return 0


def _cmd_revoke(args: argparse.Namespace, config: AssistantConfig) -> int:
    store, keys, _ = _open(config)
    try:
        record = keys.revoke(args.key_id)
    finally:
        store.close()
    print(f"Revoked key {record.id} ({record.name!r}); requests with it now get 401.", file=sys.stderr)
    return 0


def parse_since(text: str, now: float | None = None) -> float:
    """'7d' / '12h' / '30m' (an age) or an ISO date/time (local time) -> a unix time."""
    now = time.time() if now is None else now
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([dhm])\s*", text)
    if match:
        return now - float(match.group(1)) * {"d": 86400, "h": 3600, "m": 60}[match.group(2)]
    try:
        return dt.datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise ConfigError(f"--since {text!r}: give a date (2026-01-31), a time (2026-01-31T12:00) or an age "
                          "(7d, 12h, 30m).") from None


def _cmd_usage(args: argparse.Namespace, config: AssistantConfig) -> int:
    since = parse_since(args.since) if args.since else None
    store, keys, ledger = _open(config)
    try:
        names = {k.id: k.name for k in keys.list()}
        totals = ledger.totals(key_id=args.key, since=since, prices=config.server.prices)
    finally:
        store.close()
    if args.json:
        print(json.dumps([{**t.__dict__, "total_tokens": t.total_tokens, "name": names.get(t.key_id, "")}
                          for t in totals]))
        return 0
    if not totals:
        print("No usage recorded" + (f" since {args.since}" if args.since else "") + ".", file=sys.stderr)
        return 0
    print(f"{'key':<14}{'model':<24}{'requests':>9}{'prompt':>10}{'cached':>9}{'completion':>11}{'cost':>11}  statuses")
    for t in totals:
        statuses = " ".join(f"{k}={v}" for k, v in sorted(t.statuses.items()))
        print(f"{t.key_id or '(no key)':<14}{t.model[:23]:<24}{t.requests:>9}{t.prompt_tokens:>10}{t.cached_tokens:>9}"
              f"{t.completion_tokens:>11}{t.cost:>11.4f}  {statuses}")
    print(f"{'total':<38}{sum(t.requests for t in totals):>9}{sum(t.prompt_tokens for t in totals):>10}"
          f"{sum(t.cached_tokens for t in totals):>9}{sum(t.completion_tokens for t in totals):>11}"
          f"{sum(t.cost for t in totals):>11.4f}")
    unpriced = sorted({t.model for t in totals} - set(config.server.prices))
    if unpriced:
        print(f"No price for {', '.join(unpriced)}: cost counted as 0 (set [server.prices.\"MODEL\"]).", file=sys.stderr)
    return 0
