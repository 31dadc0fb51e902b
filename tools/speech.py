"""Speech to text: an audio file's bytes -> a `Transcript`, behind the small `SpeechToText` seam.

Two real backends, chosen by `create_stt(backend, model_path, ...)`:
  * `FasterWhisperSTT`  faster-whisper on a CTranslate2 Whisper directory (the packaged tiny.en/base):
                        int8 on CPU, float16 on CUDA, Silero VAD in front of the decoder;
  * `OpenAIWhisperSTT`  the `openai-whisper` package on a user's `.pt` checkpoint.
Both load on first use under a lock, so building one costs nothing and threads can share it (the lock
also runs one transcription at a time: a CPU box has no cores to spare for two).

Design note: Whisper was trained on captioned video, so on silence and noise it writes captions that
were never spoken ("Thank you.", "Thanks for watching!"). The guard has three layers and never
invents: (1) nothing quieter than `SILENCE_DBFS` reaches a model; (2) Silero VAD (shipped with
faster-whisper) must hear speech before a model runs, and then only those stretches are decoded
(faster-whisper's vad_filter; openai-whisper gets the rest zeroed); without Silero, an energy gate
refuses steady noise; (3) `filter_segments` drops what the decoder itself doubts: no-speech
probability over 0.6 with average log-probability under -1.0 (Whisper's own rule), a compression
ratio over 2.4 (a repetition loop) or no letters at all. What is dropped is counted in
`Transcript.dropped`; silence gives text "".
"""

from __future__ import annotations

import os
import re
import threading
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Protocol

import numpy as np

from assistant.errors import ConfigError, ModelError
from tools.audio import decode_audio

__all__ = ["FasterWhisperSTT", "OpenAIWhisperSTT", "Segment", "SpeechToText", "Transcript", "create_stt",
           "filter_segments", "is_silent", "keep_segment", "speech_chunks", "word_error_rate"]

SAMPLE_RATE = 16000  # what every Whisper model hears
NO_SPEECH_PROB = 0.6  # a segment the model thinks is not speech ...
MIN_AVG_LOGPROB = -1.0  # ... and decoded with little confidence is dropped
MAX_COMPRESSION_RATIO = 2.4  # text that gzip squeezes more than this is a repetition loop
SILENCE_DBFS = -60.0  # audio whose loudest 30 ms frame is quieter than this holds no speech
NOISE_SPREAD_DB = 6.0  # energy gate without VAD: frames this close in loudness are steady noise
FRAME = 480  # 30 ms at 16 kHz
DEVICES = ("auto", "cpu", "cuda")
REQUIRED_FILES = ("model.bin", "tokenizer.json")  # of a CTranslate2 Whisper directory


@dataclass(frozen=True)
class Segment:
    """One stretch of decoded speech (times in seconds from the start of the recording)."""

    start: float
    end: float
    text: str
    no_speech_prob: float  # the model's probability that this window holds no speech
    avg_logprob: float  # mean log-probability of the decoded tokens

    @property
    def compression_ratio(self) -> float:
        raw = self.text.encode("utf-8")
        return len(raw) / len(zlib.compress(raw)) if raw else 0.0


@dataclass(frozen=True)
class Transcript:
    text: str  # what was said, "" when nothing was
    language: str  # language code the model used or detected, e.g. "en"
    duration_s: float  # length of the decoded recording
    segments: tuple[Segment, ...] = ()  # the kept segments, in order
    dropped: int = 0  # segments discarded as non-speech or hallucination

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"segments": [asdict(s) for s in self.segments]}


class SpeechToText(Protocol):
    name: str  # backend and model, for logs and the UI

    def transcribe(self, data: bytes, *, name: str = "", language: str | None = None) -> Transcript:
        """The words spoken in an audio file's bytes (any container decode_audio accepts).
        language: a code like "en"; None = the configured one (or detection)."""
        ...


# -- the hallucination guard -----------------------------------------------------------------------
def keep_segment(segment: Segment) -> bool:
    """False for what Whisper writes over silence and noise rather than hears."""
    if not re.search(r"\w", segment.text):
        return False
    if segment.no_speech_prob > NO_SPEECH_PROB and segment.avg_logprob < MIN_AVG_LOGPROB:
        return False
    return segment.compression_ratio <= MAX_COMPRESSION_RATIO


def filter_segments(segments: Iterable[Segment]) -> tuple[tuple[Segment, ...], int]:
    """(kept segments, number dropped)."""
    segments = list(segments)
    kept = tuple(s for s in segments if keep_segment(s))
    return kept, len(segments) - len(kept)


def is_silent(samples: np.ndarray) -> bool:
    """True when even the loudest 30 ms frame is quieter than SILENCE_DBFS."""
    return frame_dbfs(samples).max(initial=-np.inf) < SILENCE_DBFS


def frame_dbfs(samples: np.ndarray) -> np.ndarray:
    """Loudness of each 30 ms frame in dB relative to full scale: shape (num_frames,)."""
    num_frames = max(1, len(samples) // FRAME)
    frames = np.resize(samples, num_frames * FRAME).reshape(num_frames, FRAME) if len(samples) else np.zeros((1, FRAME))
    rms = np.sqrt(np.mean(np.square(frames, dtype=np.float64), axis=1))
    return 20 * np.log10(np.maximum(rms, 1e-10))


def _transcript(segments: Iterable[Segment], language: str, duration_s: float) -> Transcript:
    kept, dropped = filter_segments(segments)
    text = " ".join(s.text.strip() for s in kept).strip()
    return Transcript(text, language, round(duration_s, 3), kept, dropped)


# -- shared plumbing -------------------------------------------------------------------------------
def _check_device(device: str) -> str:
    if device not in DEVICES:
        raise ConfigError(f"Speech device {device!r} is not one of {', '.join(DEVICES)}: fix [speech] device.")
    return device


def _check_language(language: str, model: str, multilingual: bool, known: Iterable[str]) -> str | None:
    """A language code the model can take, None for detection; ConfigError saying what to set instead."""
    language = (language or "").strip().lower()
    if not language:
        return None if multilingual else "en"
    if not multilingual and language != "en":
        raise ConfigError(f"The speech model {model} understands only English, but language {language!r} was asked "
                          "for: set [speech] language to \"en\" (or \"\"), or use a multilingual model such as base.")
    if language not in set(known):
        raise ConfigError(f"Unknown speech language {language!r}: "
                          "use a code such as en, de, fr, es (or \"\" to detect).")
    return language


class _LazyModel:
    """Decode, load once under a lock, gate silence; subclasses implement `_load`, `_languages`, `_run`."""

    name: str
    language: str  # configured language code; "" = detect (English-only models: "en")
    max_seconds: float
    vad: bool

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._model: Any = None

    def transcribe(self, data: bytes, *, name: str = "", language: str | None = None) -> Transcript:
        samples = decode_audio(data, name=name, sample_rate=SAMPLE_RATE, max_seconds=self.max_seconds)
        return self.transcribe_samples(samples, language=language)

    def transcribe_samples(self, samples: np.ndarray, *, language: str | None = None) -> Transcript:
        """The same from float32 mono 16 kHz samples, shape (N,)."""
        duration_s = round(len(samples) / SAMPLE_RATE, 3)
        with self._lock:
            if self._model is None:
                self._model = self._load()
            multilingual, known = self._languages()
            code = _check_language(self.language if language is None else language,
                                   self.name.split(":", 1)[-1], multilingual, known)
            if is_silent(samples):
                return Transcript("", code or "", duration_s)
            chunks = speech_chunks(samples) if self.vad else [{"start": 0, "end": len(samples)}]
            if not chunks:
                return Transcript("", code or "", duration_s)
            return self._run(samples, code, chunks)

    def _load(self) -> Any:
        raise NotImplementedError

    def _languages(self) -> tuple[bool, Iterable[str]]:
        """(whether the loaded model is multilingual, the language codes it knows)."""
        raise NotImplementedError

    def _run(self, samples: np.ndarray, language: str | None, chunks: list[dict[str, int]]) -> Transcript:
        raise NotImplementedError


def speech_chunks(samples: np.ndarray) -> list[dict[str, int]]:
    """Where speech is: [{"start": sample, "end": sample}, ...], [] for none.

    Silero VAD (shipped in faster-whisper) when installed; otherwise an energy gate that finds no
    speech in a recording whose frames are all within NOISE_SPREAD_DB of each other (steady noise)."""
    try:
        from faster_whisper.vad import VadOptions, get_speech_timestamps
    except ImportError:
        db = frame_dbfs(samples)
        steady = np.percentile(db, 95) - np.percentile(db, 10) < NOISE_SPREAD_DB
        return [] if steady else [{"start": 0, "end": len(samples)}]
    return get_speech_timestamps(samples, VadOptions(), sampling_rate=SAMPLE_RATE)


# -- faster-whisper --------------------------------------------------------------------------------
class FasterWhisperSTT(_LazyModel):
    """faster-whisper on a CTranslate2 Whisper directory (model.bin, config.json, tokenizer.json)."""

    def __init__(self, model_dir: Path, *, device: str = "auto", language: str = "", num_threads: int = 0,
                 max_seconds: float = 600.0, vad: bool = True, beam_size: int = 5) -> None:
        super().__init__()
        self.model_dir = Path(model_dir)
        missing = [f for f in REQUIRED_FILES if not (self.model_dir / f).is_file()]
        if missing:  # without tokenizer.json faster-whisper would fetch one from the hub
            raise ModelError(f"{self.model_dir} is not a CTranslate2 Whisper model (no {' or '.join(missing)}): "
                             "set [speech] stt_model to tiny.en, base or such a directory.")
        self.device, self.language, self.vad = _check_device(device), language, vad
        self.num_threads = num_threads or max(1, (os.cpu_count() or 2) // 2)
        self.max_seconds, self.beam_size = max_seconds, beam_size
        self.name = f"faster-whisper:{self.model_dir.name}"

    def _load(self) -> Any:
        try:
            import ctranslate2
            from faster_whisper import WhisperModel
        except ImportError as e:
            raise ConfigError(f"Speech input needs the {e.name} package: pip install -e '.[media]'.") from e
        device = self.device
        if device == "auto":
            device = "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
        compute_type = "float16" if device == "cuda" else "int8"
        try:
            return WhisperModel(str(self.model_dir), device=device, compute_type=compute_type,
                                cpu_threads=self.num_threads, local_files_only=True)
        except (RuntimeError, ValueError, OSError) as e:
            raise ModelError(f"Cannot load the speech model in {self.model_dir} on {device} ({e}): run "
                             "`assistant models prepare` again or check [speech] stt_model and device.") from e

    def _languages(self) -> tuple[bool, Iterable[str]]:
        return self._model.model.is_multilingual, self._model.supported_languages

    def _run(self, samples: np.ndarray, language: str | None, chunks: list[dict[str, int]]) -> Transcript:
        raw, info = self._model.transcribe(
            samples, language=language, beam_size=self.beam_size, vad_filter=self.vad,
            condition_on_previous_text=False,  # one bad window must not seed the next
            no_speech_threshold=NO_SPEECH_PROB, log_prob_threshold=MIN_AVG_LOGPROB,
            compression_ratio_threshold=MAX_COMPRESSION_RATIO)
        segments = [Segment(s.start, s.end, s.text, s.no_speech_prob, s.avg_logprob) for s in raw]  # runs here
        return _transcript(segments, info.language, len(samples) / SAMPLE_RATE)


# -- openai-whisper --------------------------------------------------------------------------------
class OpenAIWhisperSTT(_LazyModel):
    """The openai-whisper package on a `.pt` checkpoint ({"dims": ..., "model_state_dict": ...})."""

    def __init__(self, checkpoint: Path, *, device: str = "auto", language: str = "", num_threads: int = 0,
                 max_seconds: float = 600.0, vad: bool = True) -> None:
        super().__init__()
        self.checkpoint = Path(checkpoint).expanduser().resolve()
        if not self.checkpoint.is_file():
            raise ModelError(f"Whisper checkpoint {self.checkpoint} does not exist: "
                             "set [speech] stt_model to a .pt file.")
        self.device, self.language, self.vad = _check_device(device), language, vad
        self.num_threads = num_threads  # unused: torch's thread pool is process-wide (the chat engine's)
        self.max_seconds = max_seconds
        self.name = f"openai-whisper:{self.checkpoint.name}"

    def _load(self) -> Any:
        try:
            import torch
            import whisper
        except ImportError as e:
            raise ConfigError(f"The openai-whisper backend needs the {e.name} package: "
                              "pip install --no-deps openai-whisper (see requirements/media.txt).") from e
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:  # an absolute path: a bare name like "base" would make load_model download
            model = whisper.load_model(str(self.checkpoint), device=device)
        except Exception as e:  # torch.load / load_state_dict raise many types for a bad file
            raise ModelError(f"Cannot load the Whisper checkpoint {self.checkpoint} ({type(e).__name__}: "
                             f"{str(e)[:200]}): it must be an openai-whisper .pt file with 'dims' and "
                             "'model_state_dict'.") from e
        model.eval()
        return model

    def _languages(self) -> tuple[bool, Iterable[str]]:
        from whisper.tokenizer import LANGUAGES

        return self._model.is_multilingual, LANGUAGES

    def _run(self, samples: np.ndarray, language: str | None, chunks: list[dict[str, int]]) -> Transcript:
        import whisper

        speech = np.zeros_like(samples)  # only what the VAD heard as speech, at its original time
        for chunk in chunks:
            speech[chunk["start"]:chunk["end"]] = samples[chunk["start"]:chunk["end"]]
        model = self._model
        result = whisper.transcribe(
            model, speech, language=language, fp16=next(model.parameters()).is_cuda, verbose=None,
            condition_on_previous_text=False, no_speech_threshold=NO_SPEECH_PROB,
            logprob_threshold=MIN_AVG_LOGPROB, compression_ratio_threshold=MAX_COMPRESSION_RATIO)
        segments = [Segment(float(s["start"]), float(s["end"]), s["text"], float(s["no_speech_prob"]),
                            float(s["avg_logprob"])) for s in result["segments"]]
        return _transcript(segments, result.get("language") or language or "", len(samples) / SAMPLE_RATE)


# -- choosing one ----------------------------------------------------------------------------------
BACKENDS = {"faster-whisper": FasterWhisperSTT, "openai-whisper": OpenAIWhisperSTT}


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Word-level edit distance / reference length, after lowercasing and dropping punctuation."""
    ref, hyp = (re.sub(r"[^\w\s']", " ", s.lower()).split() for s in (reference, hypothesis))
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1] / max(1, len(ref))


def create_stt(backend: str, model_path: Path, **kw: Any) -> SpeechToText:
    """A speech-to-text backend by name: "faster-whisper" (a CTranslate2 dir) or "openai-whisper" (a .pt).
    kw: device, language, num_threads, max_seconds, vad (see the classes)."""
    if backend not in BACKENDS:
        raise ConfigError(f"Unknown speech backend {backend!r}: "
                          f"set [speech] stt_backend to one of {', '.join(BACKENDS)}.")
    model_path = Path(model_path)
    if backend == "openai-whisper" and model_path.is_dir():
        raise ConfigError(f"{model_path} is a directory, but the openai-whisper backend loads a .pt checkpoint file: "
                          "set [speech] stt_model to the .pt file, or stt_backend to faster-whisper.")
    return BACKENDS[backend](model_path, **kw)
