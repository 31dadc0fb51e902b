"""`assistant chat`: a terminal REPL over the TurnEvent stream.

Interactive on a terminal (prompt, /new, /quit); in a pipe every input line is one turn and only the
answers go to stdout (status lines go to stderr), so `printf 'What is 2+2?\\n' | assistant chat` works.
"""

from __future__ import annotations

import sys
from typing import TextIO

from assistant.config import AssistantConfig
from assistant.events import Done, Error, Notice, TextDelta


def run_repl(config: AssistantConfig, conversation_id: str | None = None, *, orchestrator=None,
             stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout, stderr: TextIO = sys.stderr) -> int:
    if orchestrator is None:
        from assistant.orchestrator import Orchestrator

        print("Loading the model...", file=stderr, flush=True)
        orchestrator = Orchestrator.from_config(config)
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
        for event in orchestrator.run_turn(conversation_id, text):
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
