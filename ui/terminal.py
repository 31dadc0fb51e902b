"""`assistant chat`: a terminal REPL over the TurnEvent stream.

Interactive on a terminal (prompt, /new, /quit); in a pipe every input line is one turn and only the
answers go to stdout (status lines go to stderr), so `printf 'What is 2+2?\\n' | assistant chat` works.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from assistant.config import AssistantConfig
from assistant.events import Done, Error, Notice, TextDelta


def register(subparsers: Any, add_common: Any) -> None:
    """`assistant chat` (see assistant/commands.py)."""
    chat = subparsers.add_parser("chat", help="chat in the terminal (reads stdin when piped)")
    add_common(chat)
    chat.add_argument("--conversation", default=None, help="continue this conversation id")
    chat.set_defaults(func=lambda args, config: run_repl(config, conversation_id=args.conversation))


def run_repl(config: AssistantConfig, conversation_id: str | None = None, *, assistant: Any = None,
             stdin: TextIO | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Chat until end of input; builds its own Assistant unless one is given (and then closes it)."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    if assistant is None:
        from assistant.app import build_assistant

        print("Loading the model...", file=stderr, flush=True)
        with build_assistant(config) as built:
            return run_repl(config, conversation_id, assistant=built, stdin=stdin, stdout=stdout, stderr=stderr)
    interactive = stdin.isatty()
    failures = 0
    while True:
        if interactive:
            stdout.write("you> ")
            stdout.flush()
        line = stdin.readline()
        if not line:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/exit"):
            break
        if text == "/new":
            conversation_id = None
            print("(new conversation)", file=stderr)
            continue
        if interactive:
            stdout.write("assistant> ")
        for event in assistant.turn(conversation_id, text):
            if isinstance(event, TextDelta):
                stdout.write(event.text)
                stdout.flush()
            elif isinstance(event, (Notice, Error)):
                print(f"\n[{event.type}] {event.message}", file=stderr, flush=True)
                failures += isinstance(event, Error)
            elif isinstance(event, Done):
                conversation_id = event.conversation_id
        stdout.write("\n")
        stdout.flush()
    if conversation_id:
        print(f"(conversation {conversation_id})", file=stderr)
    return 1 if failures else 0
