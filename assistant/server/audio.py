"""OpenAI's audio endpoints, so the official SDK works unchanged:

  POST /v1/audio/transcriptions  multipart (file, model, language, response_format: json | text |
                                 verbose_json | srt | vtt) -> {"text": ...}
  POST /v1/audio/speech          JSON (model, input, voice, response_format: mp3 | opus | flac | wav |
                                 pcm) -> the audio bytes

Model ids: the packaged ones ("whisper-tiny.en", "whisper-base", "piper-en_US-joe-medium", or their
short names) and OpenAI's ("whisper-1", "tts-1", "tts-1-hd", "gpt-4o-mini-tts", ...) for the configured
default. There is one packaged voice, so every OpenAI voice name speaks with it. Requests pass the same
gateway as chat (key, tier's model list, rate limits, a running slot, the ledger); the work runs in the
threadpool, never on the event loop. A bad recording or empty input is a 400 whose message says why.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from assistant.errors import AssistantError, ConfigError, ModelError
from assistant.server.auth import UNAUTHORIZED
from assistant.server.completions import error_response as _error
from assistant.server.gateway import Gateway, Refusal

OPENAI_STT = ("whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe")
OPENAI_TTS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
TRANSCRIPT_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
SPEECH_FORMATS = ("mp3", "opus", "flac", "wav", "pcm")
MAX_SPEECH_CHARS = 4096  # OpenAI's limit on `input`


def _timestamp(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def subtitles(transcript: Any, fmt: str) -> str:
    """SRT or WebVTT cues from the transcript's segments."""
    sep = "," if fmt == "srt" else "."
    cues = []
    for i, seg in enumerate(transcript.segments, start=1):
        span = f"{_timestamp(seg.start, sep)} --> {_timestamp(seg.end, sep)}"
        cues.append((f"{i}\n" if fmt == "srt" else "") + f"{span}\n{seg.text.strip()}\n")
    return ("WEBVTT\n\n" if fmt == "vtt" else "") + "\n".join(cues)


def create_audio_api(assistant: Any, gateway: Gateway) -> APIRouter:
    router = APIRouter(prefix="/v1/audio")
    config = assistant.config
    media_by_model: dict[str, Any] = {}

    def media_for(kind: str, requested: str) -> tuple[Any, str] | None:
        """(Modalities serving `requested`, its canonical id) or None for an unknown model."""
        from assistant.models.media import MEDIA_MODELS

        default = config.speech.stt_model if kind == "speech-to-text" else config.speech.voice
        openai_ids = OPENAI_STT if kind == "speech-to-text" else OPENAI_TTS
        def packaged(name: str) -> Any:
            return next((s for s in MEDIA_MODELS.values() if s.kind == kind and name in (s.name, *s.aliases)), None)

        if requested in openai_ids or not requested or requested == default:
            return assistant.media, (packaged(default).name if packaged(default) else default)
        spec = packaged(requested)
        if spec is None:
            return None
        if packaged(default) is spec:
            return assistant.media, spec.name
        field = "stt_model" if kind == "speech-to-text" else "voice"
        if spec.name not in media_by_model:
            from assistant.modalities import Modalities

            media_by_model[spec.name] = Modalities(replace(config, speech=replace(config.speech, **{field: spec.name})))
        return media_by_model[spec.name], spec.name

    async def admitted(request: Request, model: str, estimate: int) -> Any:
        principal = gateway.principal(request)
        if principal is None:
            return _error(401, UNAUTHORIZED, code="invalid_api_key")
        if not principal.may_use(model):
            return _error(404, f"The model `{model}` does not exist or you do not have access to it.", "model",
                          code="model_not_found")
        ticket = await gateway.admit(request, principal, model, estimate)
        if isinstance(ticket, Refusal):
            return _error(ticket.status, ticket.message, None, ticket.type, ticket.headers, ticket.code)
        return ticket

    @router.post("/transcriptions")
    async def transcriptions(request: Request) -> Any:
        try:
            form = await request.form()
        except Exception as e:  # not multipart, or a broken body
            return _error(400, f"Send the recording as multipart/form-data with a `file` field ({e}).", "file")
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            return _error(400, "The `file` field with the recording is missing.", "file")
        fmt = str(form.get("response_format") or "json")
        if fmt not in TRANSCRIPT_FORMATS:
            return _error(400, f"response_format={fmt!r}: use one of {', '.join(TRANSCRIPT_FORMATS)}.", "response_format")
        found = media_for("speech-to-text", str(form.get("model") or ""))
        if found is None:
            return _error(404, f"The model `{form.get('model')}` is not a speech-to-text model here: use whisper-1, "
                          "whisper-tiny.en or whisper-base.", "model", code="model_not_found")
        media, model = found
        data = await upload.read()
        ticket = await admitted(request, model, 0)
        if isinstance(ticket, JSONResponse):
            return ticket
        language = str(form.get("language") or "") or None
        try:
            transcript = await run_in_threadpool(media.transcript, data, name=upload.filename or "", language=language)
        except ConfigError as e:  # a language the model does not know is the request's; anything else is ours
            await run_in_threadpool(ticket.finish, "invalid" if language else "error")
            return _error(400, str(e), "language") if language else _error(500, str(e), type_="server_error")
        except ModelError as e:
            await run_in_threadpool(ticket.finish, "error")
            return _error(500, str(e), type_="server_error")
        except AssistantError as e:  # the recording's fault: empty, not audio, too long
            await run_in_threadpool(ticket.finish, "invalid")
            return _error(400, str(e), "file")
        except BaseException:
            await run_in_threadpool(ticket.finish, "error")
            raise
        await run_in_threadpool(ticket.finish, "ok", 0, 0, len(transcript.text.split()))
        if fmt == "text":
            return PlainTextResponse(transcript.text + "\n", headers=ticket.headers)
        if fmt in ("srt", "vtt"):
            return PlainTextResponse(subtitles(transcript, fmt), headers=ticket.headers)
        body: dict[str, Any] = {"text": transcript.text}
        if fmt == "verbose_json":
            body.update(task="transcribe", language=transcript.language, duration=transcript.duration_s,
                        segments=[{"id": i, "start": s.start, "end": s.end, "text": s.text,
                                   "avg_logprob": s.avg_logprob, "no_speech_prob": s.no_speech_prob}
                                  for i, s in enumerate(transcript.segments)])
        return JSONResponse(body, headers=ticket.headers)

    @router.post("/speech")
    async def speech(request: Request) -> Any:
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return _error(400, f"The body is not valid JSON: {e}.")
        if not isinstance(body, dict):
            return _error(400, "The body must be a JSON object with `model`, `input` and `voice`.")
        text = body.get("input")
        if not isinstance(text, str) or not text.strip():
            return _error(400, "`input` must be a non-empty string: the text to speak.", "input")
        if len(text) > MAX_SPEECH_CHARS:
            return _error(400, f"`input` is {len(text)} characters; the limit is {MAX_SPEECH_CHARS}.", "input")
        fmt = body.get("response_format") or "mp3"
        if fmt not in SPEECH_FORMATS:
            return _error(400, f"response_format={fmt!r}: use one of {', '.join(SPEECH_FORMATS)}.", "response_format")
        if body.get("speed", 1.0) != 1.0:
            return _error(400, "`speed` other than 1.0 is not supported by the local voices: leave it out.", "speed")
        requested = str(body.get("model") or "")
        found = media_for("text-to-speech", requested)
        if found is None:
            return _error(404, f"The model `{requested}` is not a text-to-speech model here: use tts-1 or "
                          "piper-en_US-joe-medium.", "model", code="model_not_found")
        media, model = found
        ticket = await admitted(request, model, len(text) // 4)
        if isinstance(ticket, JSONResponse):
            return ticket
        try:
            audio = await run_in_threadpool(_speak, media, text, fmt)
        except ModelError as e:
            await run_in_threadpool(ticket.finish, "error")
            return _error(500, str(e), type_="server_error")
        except ConfigError as e:  # nothing left to speak once code and markup are left out
            await run_in_threadpool(ticket.finish, "invalid")
            return _error(400, str(e), "input")
        except BaseException:
            await run_in_threadpool(ticket.finish, "error")
            raise
        await run_in_threadpool(ticket.finish, "ok", len(text) // 4, 0, 0)
        from tools.audio import AUDIO_MIME

        return Response(audio, media_type=AUDIO_MIME.get(fmt, "application/octet-stream"), headers=ticket.headers)

    return router


def _speak(media: Any, text: str, fmt: str) -> bytes:
    from tools.audio import encode_audio

    samples, rate = media.speak(text)
    return encode_audio(samples, rate, fmt)
