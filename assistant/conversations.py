"""Conversation history: export (JSON, Markdown) and the `assistant conversations ...` subcommands.

    assistant conversations list                      id, updated, messages, title
    assistant conversations show ID                   the active branch, with sources and tool steps
    assistant conversations rename ID "New title"
    assistant conversations delete ID
    assistant conversations export ID [--format json|md] [-o FILE]
    assistant conversations branches ID               every message with alternatives (edits, regenerations)
    assistant conversations switch ID MESSAGE_ID      make the branch through MESSAGE_ID active
    assistant conversations regenerate ID             answer the last question again (loads the model)
    assistant conversations edit ID MESSAGE_ID "text" edit a question on a new branch and answer it
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

from assistant.store import Store


def export_json(store: Store, conversation_id: str) -> str:
    return json.dumps(store.export(conversation_id), indent=2, ensure_ascii=False)


def export_markdown(store: Store, conversation_id: str) -> str:
    """The active branch as Markdown: each turn, its tool steps, and the sources it cites."""
    conv = store.get_conversation(conversation_id)
    lines = [f"# {conv.title or 'Conversation'}", "",
             f"*{conv.id} · started {_when(conv.created_at)} · updated {_when(conv.updated_at)}*", ""]
    for m in store.history(conversation_id):
        if m.role == "user":
            lines += ["## You", "", m.content, ""]
        elif m.role == "assistant":
            lines += ["## Assistant", ""]
            for step in m.meta.get("steps", []):
                mark = "ok" if step.get("ok") else "failed"
                lines.append(f"> tool `{step.get('name')}` ({mark}): {step.get('summary', '')}")
            if m.meta.get("steps"):
                lines.append("")
            lines += [m.content + (" *(incomplete)*" if m.status != "complete" else ""), ""]
            sources = m.meta.get("sources", [])
            if sources:
                lines.append("Sources:")
                for s in sources:
                    page = f", p. {s['page']}" if s.get("page") is not None else ""
                    lines.append(f"- [{s['marker']}] {s['doc']}{page}: \"{s['snippet']}\"")
                lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _when(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp, dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# -- CLI ------------------------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction, add_common) -> None:
    conv = subparsers.add_parser("conversations", help="list, show, rename, delete, export, branch conversations")
    sub = conv.add_subparsers(dest="conversations_command", required=True, metavar="ACTION")

    def add(name: str, help: str, func, *args: tuple[str, str]) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, help=help)
        for arg, arg_help in args:
            parser.add_argument(arg, help=arg_help)
        add_common(parser)
        parser.set_defaults(func=func)
        return parser

    add("list", "list conversations, newest first", _cmd_list)
    add("show", "print the active branch", _cmd_show, ("id", "conversation id"))
    add("rename", "give a conversation a new title", _cmd_rename, ("id", "conversation id"), ("title", "new title"))
    add("delete", "delete a conversation and all its messages", _cmd_delete, ("id", "conversation id"))
    export = add("export", "export the active branch as JSON or Markdown", _cmd_export, ("id", "conversation id"))
    export.add_argument("--format", choices=("json", "md"), default="json", help="json (default) or md")
    export.add_argument("-o", "--output", default=None, help="write to this file instead of stdout")
    add("branches", "list the messages that have alternatives", _cmd_branches, ("id", "conversation id"))
    add("switch", "make the branch through a message active", _cmd_switch, ("id", "conversation id"),
        ("message_id", "a message on the branch to show"))
    add("regenerate", "answer the last question again (new branch)", _cmd_regenerate, ("id", "conversation id"))
    add("edit", "edit a question on a new branch and answer it", _cmd_edit, ("id", "conversation id"),
        ("message_id", "the user message to edit"), ("text", "the new question"))


def _store(config) -> Store:
    return Store(config.store_url)


def _cmd_list(args, config) -> int:
    store = _store(config)
    rows = store.list_conversations()
    if not rows:
        print("No conversations yet: start one with `assistant chat`.", file=sys.stderr)
    for c in rows:
        num = len(store.history(c.id))
        print(f"{c.id}  {_when(c.updated_at)}  {num:>3} msgs  {c.title}")
    return 0


def _cmd_show(args, config) -> int:
    print(export_markdown(_store(config), args.id), end="")
    return 0


def _cmd_rename(args, config) -> int:
    _store(config).rename_conversation(args.id, args.title)
    print(f"Renamed {args.id} to {args.title!r}.", file=sys.stderr)
    return 0


def _cmd_delete(args, config) -> int:
    _store(config).delete_conversation(args.id)
    print(f"Deleted {args.id}.", file=sys.stderr)
    return 0


def _cmd_export(args, config) -> int:
    store = _store(config)
    text = export_markdown(store, args.id) if args.format == "md" else export_json(store, args.id) + "\n"
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"Wrote {args.output}.", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _cmd_branches(args, config) -> int:
    store = _store(config)
    active = {m.id for m in store.history(args.id)}
    seen: set[str] = set()
    for m in store.history(args.id):
        siblings = store.siblings(m.id)
        if len(siblings) < 2 or m.parent_id in seen:
            continue
        seen.add(m.parent_id or "")
        print(f"{len(siblings)} versions of the {m.role} message after {m.parent_id or 'the start'}:")
        for s in siblings:
            mark = "*" if s.id in active else " "
            print(f" {mark} {s.id}  {' '.join(s.content.split())[:70]}")
    return 0


def _cmd_switch(args, config) -> int:
    head = _store(config).switch_branch(args.id, args.message_id)
    print(f"Active branch now ends at {head.id}.", file=sys.stderr)
    return 0


def _print_turn(events: Any) -> int:
    from assistant.events import Done, Error, TextDelta

    failed = 0
    for event in events:
        if isinstance(event, TextDelta):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, Error):
            print(f"\nError: {event.message}", file=sys.stderr)
            failed = 1
        elif isinstance(event, Done):
            print()
    return failed


def _cmd_regenerate(args, config) -> int:
    from assistant.app import build_assistant

    with build_assistant(config) as assistant:
        return _print_turn(assistant.regenerate(args.id))


def _cmd_edit(args, config) -> int:
    from assistant.app import build_assistant

    with build_assistant(config) as assistant:
        return _print_turn(assistant.edit(args.id, args.message_id, args.text))
