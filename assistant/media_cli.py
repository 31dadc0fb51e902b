"""`assistant transcribe FILE`, `assistant speak TEXT -o out.wav`, `assistant describe IMAGE`.

Each loads only the one model it needs (no chat model, no store), from `[speech]` / `[vision]` in the
config; the flags override the model per call. Results go to stdout (text, or JSON with --json;
`describe` always prints JSON), progress and errors to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from assistant.config import AssistantConfig
from assistant.errors import ConfigError

SPEECH_FORMATS = ("wav", "mp3", "opus", "ogg", "flac")


def register(subparsers: argparse._SubParsersAction, add_common: Any) -> None:
    tr = subparsers.add_parser("transcribe", help="speech to text (wav, mp3, ogg, webm, flac, m4a)")
    tr.add_argument("file", type=Path, help="the recording")
    tr.add_argument("--stt-model", default=None, help="tiny.en (default), base, or a CTranslate2 Whisper dir / .pt")
    tr.add_argument("--language", default=None, help="spoken language code, e.g. en; default: detect")
    tr.add_argument("--json", action="store_true", help="print text, language, duration and segments as JSON")
    add_common(tr)
    tr.set_defaults(func=_cmd_transcribe)

    sp = subparsers.add_parser("speak", help="text to speech, written to a file")
    sp.add_argument("text", help="what to say ('-' reads stdin)")
    sp.add_argument("-o", "--output", type=Path, required=True, help="out.wav / .mp3 / .opus / .ogg / .flac")
    sp.add_argument("--voice", default=None, help="joe (default), a Piper .onnx, or a coqui model dir")
    add_common(sp)
    sp.set_defaults(func=_cmd_speak)

    de = subparsers.add_parser("describe", help="labels and text read in a picture, as JSON")
    de.add_argument("image", type=Path, help="the picture (png, jpg, webp, gif, bmp, tiff)")
    de.add_argument("--no-ocr", action="store_true", help="skip reading text in the picture")
    add_common(de)
    de.set_defaults(func=_cmd_describe)


def _read(path: Path, what: str) -> bytes:
    if not path.is_file():
        raise ConfigError(f"The {what} {path} does not exist: check the path.")
    return path.read_bytes()


def _media(config: AssistantConfig) -> Any:
    from assistant.modalities import Modalities

    return Modalities(config)


def _cmd_transcribe(args: argparse.Namespace, config: AssistantConfig) -> int:
    if args.stt_model:
        config = replace(config, speech=replace(config.speech, stt_model=args.stt_model))
    transcript = _media(config).transcript(_read(args.file, "recording"), name=args.file.name, language=args.language)
    if args.json:
        print(json.dumps(transcript.to_dict(), ensure_ascii=False))
    elif transcript.text:
        print(transcript.text)
    else:
        print(f"No speech was heard in {args.file.name}.", file=sys.stderr)
    return 0


def _cmd_speak(args: argparse.Namespace, config: AssistantConfig) -> int:
    from tools.audio import encode_audio

    fmt = args.output.suffix.lower().lstrip(".")
    if fmt not in SPEECH_FORMATS:
        raise ConfigError(f"Cannot write {args.output.name}: name the file .{', .'.join(SPEECH_FORMATS)}.")
    if args.voice:
        config = replace(config, speech=replace(config.speech, voice=args.voice))
    text = sys.stdin.read() if args.text == "-" else args.text
    samples, rate = _media(config).speak(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_bytes(encode_audio(samples, rate, fmt))
    print(f"{args.output}: {len(samples) / rate:.1f} s of speech", file=sys.stderr)
    return 0


def _cmd_describe(args: argparse.Namespace, config: AssistantConfig) -> int:
    if args.no_ocr:
        config = replace(config, vision=replace(config.vision, ocr=False))
    description = _media(config).describe_image(_read(args.image, "picture"), name=args.image.name)
    print(json.dumps(description.to_dict(), ensure_ascii=False))
    return 0
