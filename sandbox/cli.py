"""`assistant sandbox ...`: set up the code sandbox, run a snippet in it by hand."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from assistant.config import AssistantConfig


def register(subparsers, add_common) -> None:
    sandbox = subparsers.add_parser("sandbox", help="the Docker sandbox of the code interpreter")
    sub = sandbox.add_subparsers(dest="sandbox_command", required=True, metavar="ACTION")

    setup = sub.add_parser("setup", help="install and start Docker, build the sandbox image (needs root)")
    setup.add_argument("--rebuild", action="store_true", help="build the image again even if it exists")
    setup.add_argument("--runtime", choices=("runc", "runsc"), default=None, help="also register gVisor with runsc")
    add_common(setup)
    setup.set_defaults(func=_cmd_setup)

    run = sub.add_parser("run", help="run Python code in a fresh sandbox and print the result")
    run.add_argument("code", help="Python source; '-' reads it from stdin")
    run.add_argument("--runtime", choices=("runc", "runsc"), default=None, help="container runtime (default: config)")
    add_common(run)
    run.set_defaults(func=_cmd_run)


def _with_runtime(config: AssistantConfig, runtime: str | None) -> AssistantConfig:
    return config if runtime is None else replace(config, sandbox=replace(config.sandbox, runtime=runtime))


def _cmd_setup(args: argparse.Namespace, config: AssistantConfig) -> int:
    from sandbox.setup import setup_sandbox

    setup_sandbox(_with_runtime(config, args.runtime), rebuild=args.rebuild, say=lambda line: print(line, flush=True))
    return 0


def _cmd_run(args: argparse.Namespace, config: AssistantConfig) -> int:
    from sandbox.executor import DockerExecutor

    code = sys.stdin.read() if args.code == "-" else args.code
    with DockerExecutor(_with_runtime(config, args.runtime).sandbox) as executor:
        out = executor.run(code, conversation_id="cli")
    for stream, text in ((sys.stdout, out.stdout), (sys.stderr, out.stderr)):
        stream.write(text if not text or text.endswith("\n") else text + "\n")
    for f in out.files:
        print(f"[artifact] {f.name} ({f.size} bytes)", file=sys.stderr)
    status = "timed out" if out.timed_out else "out of memory" if out.oom else f"exit {out.exit_code}"
    print(f"[{status}, {out.duration_s * 1000:.0f} ms]", file=sys.stderr)
    return 0 if out.exit_code == 0 else 1
