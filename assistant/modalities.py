"""Voice and vision for the turn: the real `PreStage` (speech -> text, image -> description) and the
speech-out stream transformer, built from `[speech]` and `[vision]` in the config.

Every backend loads on first use, so start-up pays nothing and a text-only user never loads Whisper,
Piper or the image encoder. Packaged model names ("tiny.en", "base", "joe", "lite0") resolve to their
prepared, sha256-checked directories in the models dir (assistant/models/media.py, prepared on first
use); anything else is taken as the path of a user's own model. The backends themselves live in
tools/ (speech.py, tts.py, vision.py, audio.py); this module only chooses and wires them.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

from assistant.config import AssistantConfig
from assistant.errors import ConfigError, ModelError
from assistant.seams import Attachment, StreamTransformer


def model_path(name: str, models_dir: Path) -> Path:
    """A packaged speech/vision model's prepared directory, or the user's own path (which must exist)."""
    from assistant.models.media import MEDIA_MODELS, media_model_dir

    if any(name == s.name or name in s.aliases for s in MEDIA_MODELS.values()):
        return media_model_dir(name, models_dir)
    path = Path(name).expanduser()
    if not path.exists():
        known = ", ".join(a for s in MEDIA_MODELS.values() for a in s.aliases)
        raise ModelError(f"Model {name!r} is neither a packaged one ({known}) nor an existing path: "
                         "check the [speech] / [vision] settings.")
    return path


def _needs(extra: str, e: ImportError) -> ConfigError:
    return ConfigError(f"{extra} needs the {e.name} package: run `make setup` or pip install -e '.[media]'.")


class Modalities:
    """PreStage for the orchestrator plus the speech-out factory. Backends may be passed in (tests)."""

    def __init__(self, config: AssistantConfig, *, stt: Any = None, tts: Any = None, describer: Any = None) -> None:
        self.config = config
        self._stt, self._tts, self._describer = stt, tts, describer
        self._lock = threading.Lock()

    # -- backends, built once on first use -----------------------------------------------------
    def _once(self, attr: str, build: Callable[[], Any]) -> Any:
        with self._lock:
            if getattr(self, attr) is None:
                setattr(self, attr, build())
            return getattr(self, attr)

    @property
    def stt(self) -> Any:
        def build() -> Any:
            sp = self.config.speech
            try:
                from tools.speech import create_stt
            except ImportError as e:
                raise _needs("Speech input", e) from e
            return create_stt(sp.stt_backend, model_path(sp.stt_model, self.config.resolved_models_dir),
                              device=sp.device, language=sp.language, num_threads=sp.num_threads,
                              max_seconds=sp.max_seconds)

        return self._stt if self._stt is not None else self._once("_stt", build)

    @property
    def tts(self) -> Any:
        def build() -> Any:
            sp = self.config.speech
            try:
                from tools.tts import create_tts
            except ImportError as e:
                raise _needs("Spoken answers", e) from e
            return create_tts(sp.tts_backend, model_path(sp.voice, self.config.resolved_models_dir), device=sp.device,
                              num_threads=sp.num_threads)

        return self._tts if self._tts is not None else self._once("_tts", build)

    @property
    def describer(self) -> Any:
        def build() -> Any:
            v = self.config.vision
            try:
                from tools.vision import create_describer
            except ImportError as e:
                raise _needs("Image input", e) from e
            return create_describer(v.backend, model_path(v.model, self.config.resolved_models_dir),
                                    ocr=v.ocr, ocr_languages=v.ocr_languages, top_k=v.top_k, max_pixels=v.max_pixels)

        return self._describer if self._describer is not None else self._once("_describer", build)

    # -- PreStage ------------------------------------------------------------------------------
    def transcribe(self, audio: Attachment) -> str:
        return self.stt.transcribe(audio.read(), name=audio.name).text

    def describe(self, image: Attachment) -> str:
        return self.describer.describe(image.read(), name=image.name).compact()

    # -- speech out ----------------------------------------------------------------------------
    def speech_stream(self) -> StreamTransformer:
        """A fresh sentence-to-speech transformer for one answer (the voice is loaded once)."""
        from tools.tts import SpeechStream

        return SpeechStream(self.tts)

    # -- the facade's direct uses (CLI, /v1/audio/*) -------------------------------------------
    def transcript(self, data: bytes, *, name: str = "", language: str | None = None) -> Any:
        """The full transcript (text, language, duration, segments) of an audio file's bytes."""
        return self.stt.transcribe(data, name=name, language=language)

    def speak(self, text: str) -> tuple[Any, int]:
        """(int16 samples, sample rate) of `text` spoken; markdown, code and citation markers are skipped."""
        from tools.tts import speakable

        words = speakable(text)
        if not words.strip():
            raise ConfigError("There is nothing to speak: the text is empty once code and markup are left out.")
        return self.tts.synthesize(words), self.tts.sample_rate

    def describe_image(self, data: bytes, *, name: str = "") -> Any:
        """The full description (labels, embedding, OCR text) of an image's bytes."""
        return self.describer.describe(data, name=name)
