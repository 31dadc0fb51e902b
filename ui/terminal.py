"""`assistant chat`: a terminal REPL over the TurnEvent stream.

Interactive on a terminal (prompt, /new, /quit); in a pipe every input line is one turn and only the
answers go to stdout (status lines go to stderr), so `printf 'What is 2+2?\\n' | assistant chat` works.
`--audio q.wav` sends the recording as the first turn (its transcript is shown as the question);
`--image pic.png` attaches pictures to the first question; `--speak-to DIR` speaks every answer into
DIR/answer-N.wav (the AudioChunk events, written as they arrive).
"""

from __future__ import annotations

import sys
import wave
from pathlib import Path
from typing import Any, TextIO

from assistant.config import AssistantConfig
from assistant.events import AudioChunk, Done, Error, ImageDescribed, Notice, TextDelta, Transcribed
from assistant.seams import Attachment, UserInput


def register(subparsers: Any, add_common: Any) -> None:
    """`assistant chat` (see assistant/commands.py)."""
    chat = subparsers.add_parser("chat", help="chat in the terminal (reads stdin when piped)")
    add_common(chat)
    chat.add_argument("--conversation", default=None, help="continue this conversation id")
    chat.add_argument("--audio", type=Path, default=None, help="ask the first question by voice: an audio file")
    chat.add_argument("--image", type=Path, action="append", default=[], help="attach a picture to the first question")
    chat.add_argument("--speak-to", type=Path, default=None, help="speak every answer into DIR/answer-N.wav")
    chat.set_defaults(func=lambda args, config: run_repl(
        config, conversation_id=args.conversation, audio=args.audio, images=args.image, speak_to=args.speak_to))


def _attachment(path: Path, what: str) -> Attachment:
    from assistant.errors import ConfigError

    if not path.is_file():
        raise ConfigError(f"The {what} {path} does not exist: check the path.")
    return Attachment(path.name, path=path)


def run_repl(config: AssistantConfig, conversation_id: str | None = None, *, assistant: Any = None,
             stdin: TextIO | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None,
             audio: Path | None = None, images: list[Path] | None = None, speak_to: Path | None = None) -> int:
    """Chat until end of input; builds its own Assistant unless one is given (and then closes it)."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    first = UserInput(audio=_attachment(audio, "recording") if audio else None,
                      images=tuple(_attachment(p, "picture") for p in images or ()))
    if assistant is None:
        from assistant.app import build_assistant

        print("Loading the model...", file=stderr, flush=True)
        with build_assistant(config) as built:
            return run_repl(config, conversation_id, assistant=built, stdin=stdin, stdout=stdout, stderr=stderr,
                            audio=audio, images=images, speak_to=speak_to)
    interactive = stdin.isatty()
    if interactive:  # a person types meanwhile (a pipe's answers do not depend on how far the load got)
        _preload_large(assistant, stderr)
    failures, answers = 0, 0
    pending = first if (first.audio or first.images) else None
    while True:
        if pending is not None and pending.audio is not None:
            turn_input = pending  # a spoken question needs no typed line
        else:
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
            turn_input = UserInput(text, images=pending.images if pending else ())
        pending = None
        if speak_to is not None:
            turn_input = UserInput(turn_input.text, turn_input.audio, turn_input.images, speak=True)
            answers += 1
        speech = _SpeechFile(speak_to / f"answer-{answers}.wav") if speak_to is not None else None
        if interactive:
            stdout.write("assistant> ")
        for event in assistant.turn(conversation_id, turn_input):
            if isinstance(event, TextDelta):
                stdout.write(event.text)
                stdout.flush()
            elif isinstance(event, Transcribed):
                print(f"(heard) {event.text}", file=stderr, flush=True)
            elif isinstance(event, ImageDescribed):
                print(f"(image {event.index}) {event.description}", file=stderr, flush=True)
            elif isinstance(event, AudioChunk) and speech is not None:
                speech.write(event)
            elif isinstance(event, (Notice, Error)):
                print(f"\n[{event.type}] {event.message}", file=stderr, flush=True)
                failures += isinstance(event, Error)
            elif isinstance(event, Done):
                conversation_id = event.conversation_id or conversation_id
        stdout.write("\n")
        stdout.flush()
        if speech is not None and speech.close():
            print(f"(spoken answer: {speech.path})", file=stderr)
    if conversation_id:
        print(f"(conversation {conversation_id})", file=stderr)
    return 1 if failures else 0


def _preload_large(assistant: Any, stderr: TextIO) -> None:
    """The large model (document and general questions: assistant/routing.py) loads in the background, as
    `assistant serve` does; until it is ready the small one answers general questions."""
    models = getattr(assistant, "models", None)

    def done(engine: Any, error: str) -> None:
        if engine is None:  # (ready: nothing to say in the middle of a line being typed)
            print(f"\n(the large model could not be loaded: {error}; the small one answers)", file=stderr, flush=True)

    if models is not None and models.preload_large(done):
        print("(loading the large model in the background)", file=stderr, flush=True)


class _SpeechFile:
    """A WAV file written chunk by chunk as the answer is spoken (opened on the first chunk)."""

    def __init__(self, path: Path) -> None:
        self.path, self._wav = path, None

    def write(self, chunk: AudioChunk) -> None:
        if self._wav is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._wav = wave.open(str(self.path), "wb")
            self._wav.setnchannels(1)
            self._wav.setsampwidth(2)
            self._wav.setframerate(chunk.sample_rate)
        self._wav.writeframes(chunk.pcm16)

    def close(self) -> bool:
        if self._wav is None:
            return False
        self._wav.close()
        return True
