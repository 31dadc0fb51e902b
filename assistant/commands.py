"""How subsystems add `assistant` subcommands: the one plain mechanism, and the helpers they share.

A subsystem (ingest/, sandbox/, the server, the terminal chat, ...) exposes
`register(subparsers, add_common)` and names it in pyproject.toml under the entry-point group
`assistant.commands`; `assistant.cli` loads every entry of the group, so the CLI imports no front end
or subsystem by name. Each parser sets `func(args, config) -> int`. This module imports nothing but
argparse, so any package may use it.
"""

from __future__ import annotations

import argparse

ENTRY_POINT_GROUP = "assistant.commands"
EVAL_HELP = "evaluate retrieval and answers on your own QA files"


def add_common(parser: argparse.ArgumentParser) -> None:
    """Options every subcommand takes."""
    parser.add_argument("--data-dir", default=None, help="data directory (default ./data or $ASSISTANT_DATA_DIR)")
    parser.add_argument("--config", default=None, help="TOML config file (default $ASSISTANT_CONFIG)")
    parser.add_argument("--model", default=None, help="chat model name or path (overrides engine.model)")


def command_group(subparsers: argparse._SubParsersAction, name: str, help: str) -> argparse._SubParsersAction:
    """The sub-parsers of `assistant NAME`, creating the group if no subsystem has yet, so that
    several subsystems can add actions to one group (e.g. `eval retrieval` and `eval answers`)."""
    parser = subparsers.choices.get(name)
    if parser is None:
        parser = subparsers.add_parser(name, help=help)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return parser.add_subparsers(dest=f"{name}_command", required=True, metavar="WHAT")
