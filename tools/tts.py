"""Text to speech: the voice backends and `SpeechStream`, which speaks an answer while it is written.

  * `TextToSpeech`  the backend contract: `synthesize(text) -> int16 samples` at `sample_rate`, mono;
  * `PiperTTS`      a Piper ONNX voice (the packaged "joe", or a user's .onnx + .onnx.json), loaded
                    on first use with a set number of onnxruntime CPU threads (CUDA when asked/present);
  * `create_tts`    picks a backend by name. "coqui" is refused with the reason: coqui-tts 0.28 imports
                    only with torchaudio and torchcodec builds matching the installed torch, and the
                    package index has only CUDA builds of those for torch 2.11, which do not load beside
                    torch 2.13.0+cpu (libc10_cuda.so / libnvrtc.so.13 missing);
  * `speakable`     the words worth saying: no code, citation markers, markdown symbols or full URLs;
  * `SentenceSplitter`  cuts streamed text into speakable pieces;
  * `SpeechStream`  the stream transformer (assistant/seams.py) that adds AudioChunk events.

NOTE (latency design). The target is <= 300 ms from the end of the first sentence in the token stream
to its first audio. Piper synthesises a whole utterance per call at a real-time factor of about 0.11 on
one CPU thread (~35 ms per spoken word), so a 20-word first sentence alone would take ~600 ms. Hence:
  1. The first sentence is spoken in pieces: it is cut at every clause boundary (, ; : dash) that has
     at least `min_clause_words` words before it, and its first piece is cut after `first_piece_words`
     words at the latest. The first audio then costs one short utterance (~150-200 ms), and often
     plays before the sentence has even ended. Later sentences are spoken whole: by then the audio
     already emitted plays for longer than the next sentence takes to synthesise (RTF << 1).
  2. A sentence is complete when its end is certain: "." needs the next character (so "3.14", "v1.2",
     "e.g.", "Dr. X", "..." followed by lowercase are not ends); "!" and "?" need whitespace after;
     a newline always ends a piece (list items, headings, table rows). Fenced code is never spoken and
     a fence also ends the piece before it.
  3. Three ways to run it (`SpeechOptions`). Synchronous: synthesis inside `feed()`, which stalls the
     text for every piece (~1 s per three-sentence answer). Background: one worker thread per answer
     synthesises the pieces in order, `feed()` returns the audio that is ready without waiting and
     `finish()` waits for the rest; but audio finished between two deltas waits for the next one.
     The default is background with `wait_first`: `feed()` waits for the answer's first piece only
     (one ~0.2 s text stall), later pieces are made while the text streams on. On the 2-vCPU box,
     simulated 15-40 tokens/s: first piece cut -> audio median 200 ms (sync 190, background 225-267);
     the first audio came before the first sentence ended (median), at most 140 ms after it. With the
     packaged Qwen engine decoding on the same CPUs, the first audio came 0.75-0.9 s before the first
     sentence ended in every mode. The worker is started (and the voice loaded) when the stream is made,
     so loading overlaps the engine's prefill.
  4. Every AudioChunk is recorded in `SpeechStream.timings` with the monotonic time its text was cut
     (`ready_at`) and the time its audio left the transformer (`emitted_at`), for benchmarks.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np

from assistant.errors import ConfigError, ModelError, ToolUnavailable
from assistant.events import AudioChunk, TextDelta, TurnEvent
from assistant.seams import StreamTransformer

BACKENDS = ("piper", "coqui")
PIPER_INPUTS = {"input", "input_lengths", "scales"}  # what every Piper voice graph takes
COQUI_UNAVAILABLE = (
    "The coqui TTS backend is not available in this build: coqui-tts 0.28 imports only with torchaudio and "
    "torchcodec built for the installed torch 2.13.0+cpu, and the package index has only CUDA builds of them "
    "(for torch 2.11) that fail to load here. Use a Piper voice instead: speech.tts_backend = \"piper\" with "
    "speech.voice = \"joe\" or the path of a Piper .onnx voice.")


class TextToSpeech(Protocol):
    name: str  # backend name, e.g. "piper"
    sample_rate: int  # Hz of what synthesize returns

    def synthesize(self, text: str) -> np.ndarray:
        """`text` spoken: int16 samples, mono, shape (num_samples,); empty when there is nothing to say."""
        ...


# -- Piper ---------------------------------------------------------------------------------------


def _num_threads(num_threads: int) -> int:
    """0 = one thread per two CPUs (the rest stay with the language model), at least one."""
    if num_threads:
        return num_threads
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    return max(1, cpus // 2)


def _voice_files(model_path: Path, config_path: Path | None) -> tuple[Path, Path]:
    """(voice.onnx, its .json config) for a voice file or a directory holding one."""
    path = Path(model_path).expanduser()
    if path.is_dir():
        found = sorted(path.glob("*.onnx"))
        preferred = path / "voice.onnx"
        if preferred.is_file():
            path = preferred
        elif len(found) == 1:
            path = found[0]
        else:
            what = "no .onnx file" if not found else f"{len(found)} .onnx files ({', '.join(f.name for f in found)})"
            raise ModelError(f"The Piper voice directory {path} holds {what}: point speech.voice at one .onnx file.")
    if not path.is_file():
        raise ModelError(f"The Piper voice {path} does not exist: check speech.voice, or use the packaged \"joe\".")
    config = Path(config_path).expanduser() if config_path is not None else path.with_name(path.name + ".json")
    if not config.is_file():
        raise ModelError(f"The Piper voice {path.name} has no config at {config}: download the .onnx.json "
                         "that belongs to the voice and put it next to the .onnx file.")
    return path, config


# Piper samples noise inside the voice graph on every call (the voices' configs say noise_scale 0.667,
# noise_w 0.8). At those scales one sentence in about seven came out slurred enough for Whisper tiny.en
# to mishear ("The guard and gate" for "The garden gate": 2 of 12 syntheses); at a third of the noise,
# 0 of 15 over three sentences. Spoken answers favour clear over varied.
NOISE_SCALE = 0.333  # phoneme noise
NOISE_W_SCALE = 0.333  # duration noise


class PiperTTS:
    """A Piper voice. Loads on first use (thread-safe); `synthesize` may be called from any thread."""

    name = "piper"

    def __init__(self, model_path: Path, config_path: Path | None = None, *, device: str = "auto",
                 num_threads: int = 0) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
            raise ValueError(f"device={device!r}: use auto, cpu, cuda or cuda:N.")
        if num_threads < 0:
            raise ValueError(f"num_threads={num_threads}: use 0 (one per two CPUs) or a positive count.")
        self.model_path, self.config_path = _voice_files(model_path, config_path)
        self.device = device
        self.num_threads = _num_threads(num_threads)  # onnxruntime intra-op threads on CPU
        self._config: Any = None  # piper.config.PiperConfig
        self._voice: Any = None  # piper.voice.PiperVoice
        self._warm = False  # the voice has run once
        self._lock = threading.Lock()

    @property
    def sample_rate(self) -> int:
        return self._load_config().sample_rate

    def synthesize(self, text: str) -> np.ndarray:
        voice = self._load()
        try:
            from piper.config import SynthesisConfig

            clear = SynthesisConfig(noise_scale=NOISE_SCALE, noise_w_scale=NOISE_W_SCALE)
            chunks = [c.audio_int16_array for c in voice.synthesize(text, syn_config=clear)]  # one per sentence
        except Exception as e:  # espeak-ng or onnxruntime failing on this text
            raise ModelError(f"The Piper voice {self.model_path.name} could not speak {text[:60]!r}: {e}") from e
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int16)  # (num_samples,)

    def load(self) -> None:
        """Load the voice now and run it once (its first run is slower), so that no answer waits for it."""
        voice = self._load()
        if not self._warm:
            list(voice.synthesize("Ready."))
            self._warm = True

    def _load_config(self) -> Any:
        if self._config is None:
            try:
                from piper.config import PiperConfig
            except ImportError as e:
                raise ToolUnavailable("Spoken answers need Piper: pip install -e '.[media]' "
                                      "(or pip install -r requirements/media.txt).") from e
            try:
                self._config = PiperConfig.from_dict(json.loads(self.config_path.read_text(encoding="utf-8")))
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ModelError(f"The Piper voice config {self.config_path} is not valid ({type(e).__name__}: "
                                 f"{e}): download it again with its voice.") from e
        return self._config

    def _providers(self, ort: Any) -> list[Any]:
        if self.device == "cpu":
            return ["CPUExecutionProvider"]
        has_cuda = "CUDAExecutionProvider" in ort.get_available_providers()
        if self.device.startswith("cuda") and not has_cuda:
            raise ToolUnavailable(f"speech.device={self.device!r}, but onnxruntime has no CUDA provider: install "
                                  "onnxruntime-gpu, or set speech.device = \"cpu\".")
        if not has_cuda:
            return ["CPUExecutionProvider"]
        device_id = int(self.device.partition(":")[2] or 0)
        return [("CUDAExecutionProvider", {"device_id": device_id, "cudnn_conv_algo_search": "HEURISTIC"}),
                "CPUExecutionProvider"]

    def _load(self) -> Any:
        if self._voice is not None:
            return self._voice
        with self._lock:
            if self._voice is None:
                config = self._load_config()
                import onnxruntime as ort
                from piper.voice import PiperVoice

                options = ort.SessionOptions()
                options.intra_op_num_threads = self.num_threads
                options.inter_op_num_threads = 1
                providers = self._providers(ort)
                try:
                    session = ort.InferenceSession(str(self.model_path), sess_options=options, providers=providers)
                except Exception as e:  # onnxruntime raises its own types (InvalidProtobuf, Fail, ...)
                    raise ModelError(f"The Piper voice {self.model_path} cannot be loaded ({e}): the file is "
                                     "damaged or not an ONNX model; download the voice again.") from e
                names = {i.name for i in session.get_inputs()}
                if not PIPER_INPUTS <= names:
                    raise ModelError(f"{self.model_path} is an ONNX model but not a Piper voice (its inputs are "
                                     f"{sorted(names)}, a voice takes {sorted(PIPER_INPUTS)}).")
                self._voice = PiperVoice(session=session, config=config)
        return self._voice


def create_tts(backend: str, model_path: Path, **kw: Any) -> TextToSpeech:
    """The text-to-speech backend `backend` ("piper"; "coqui" is refused, see the module docstring)."""
    if backend == "piper":
        return PiperTTS(Path(model_path), **kw)
    if backend == "coqui":
        raise ToolUnavailable(COQUI_UNAVAILABLE)
    raise ConfigError(f"speech.tts_backend={backend!r}: use one of {', '.join(BACKENDS)}.")


# -- what to say ---------------------------------------------------------------------------------

_FENCED = re.compile(r"^[ \t]*(`{3,}|~{3,}).*?(?:^[ \t]*\1[ \t]*$|\Z)", re.M | re.S)
_INLINE_CODE = re.compile(r"(`+)[^`]*?\1|`")
_IMAGE_OR_LINK = re.compile(r"!?\[([^\]\n]*)\]\([^)\s]*(?:\s+\"[^\"]*\")?\)")
_CITATION = re.compile(r"\[\^?\d+(?:\s*[,–-]\s*\d+)*\]")
_URL = re.compile(r"\b(?:https?|ftp)://(?:www\.)?([^/\s:?#)\]>]+)[^\s)\]>]*|\bwww\.([^/\s:?#)\]>]+)[^\s)\]>]*")
_TABLE_RULE = re.compile(r"^[ \t]*\|?[ \t]*:?-{3,}:?[ \t]*(?:\|[ \t]*:?-{3,}:?[ \t]*)*\|?[ \t]*$", re.M)
_HRULE = re.compile(r"^[ \t]*([-*_])(?:[ \t]*\1){2,}[ \t]*$", re.M)
_LINE_MARKUP = re.compile(r"^[ \t]*(?:#{1,6}[ \t]+|>[ \t>]*|[-*+•][ \t]+|\d{1,3}[.)][ \t]+)+", re.M)
_HTML_TAG = re.compile(r"</?[a-zA-Z][^>\n]*>")
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([,.;:!?])")
_REPEATED_COMMAS = re.compile(r"(?:,\s*){2,}")
_LINE_END = re.compile(r"(?<=[\w)\]\"'’”])[ \t]*\n(?=\s*\S)")


def speakable(text: str) -> str:
    """What should be spoken of `text`: fenced and inline code, citation markers ([1], [2, 3]), HTML
    tags and markdown symbols (# * _ > | ~, rules, bullets, list numbers) are left out, a link becomes
    its text and a URL its host; whitespace collapses to single spaces."""
    text = _FENCED.sub("\n", text)
    text = _INLINE_CODE.sub(" ", text)
    text = _IMAGE_OR_LINK.sub(r"\1", text)
    text = _CITATION.sub("", text)
    text = _URL.sub(lambda m: m.group(1) or m.group(2), text)
    text = _TABLE_RULE.sub("", text)
    text = _HRULE.sub("", text)
    text = _LINE_MARKUP.sub("", text)
    text = _HTML_TAG.sub(" ", text)
    text = re.sub(r"^[ \t]*\||\|[ \t]*$", "", text, flags=re.M)  # a table row's outer pipes
    text = re.sub(r"[ \t]*\|[ \t]*", ", ", text)  # its cells read as a list
    text = re.sub(r"[*#~]+|(?<!\w)_+|_+(?!\w)", "", text).replace("_", " ")
    text = _LINE_END.sub(". ", text)  # a heading or list item without a full stop still ends there
    text = " ".join(text.split())
    text = _REPEATED_COMMAS.sub(", ", _SPACE_BEFORE_PUNCT.sub(r"\1", text))
    return text.lstrip(" ,;:.").rstrip()


# -- where to cut --------------------------------------------------------------------------------

_FENCE_OPEN = re.compile(r"^[ \t]*(?:`{3}|~{3})", re.M)
_FENCE_CLOSE = re.compile(r"^[ \t]*(?:`{3,}|~{3,})[ \t]*\n", re.M)
_SENTENCE_END = re.compile(r"[.!?…]+[\"'”’)\]*_]*(?=\s)|\n")
_CLAUSE_END = re.compile(r"[,;:](?=\s)|\s[—–-](?=\s)")
_WORD = re.compile(r"\S+(?=\s)")
_NEVER_END = {"e.g", "i.e", "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "cf", "fig", "approx", "ca"}


def _is_sentence_end(buf: str, start: int, end: int) -> bool | None:
    """Whether the terminal run buf[start:end] ends a sentence (None: not known until more text comes)."""
    run = buf[start:end]
    if run == "\n" or "!" in run or "?" in run:
        return True
    rest = buf[end:].lstrip(" \t")
    if rest.startswith("\n"):
        return True
    if not rest:
        return None  # "." with nothing after it yet: wait for the next character
    if rest[0].islower():
        return False  # "approx. three", "... and then", an unknown abbreviation
    if run.rstrip("\"'”’)]*_") == ".":
        word = re.search(r"[\w.]*$", buf[:start]).group(0)
        if word.lower() in _NEVER_END or (len(word) == 1 and word.isalpha()):
            return False  # "e.g.", "Dr.", initials
        before = buf[:start - len(word)]
        if word.isdigit() and (not before.strip(" \t") or before.rstrip(" \t").endswith("\n")):
            return False  # "1. " opening a numbered list item
    return True


@dataclass
class SentenceSplitter:
    """Cuts streamed text into the pieces to speak, in order (see the NOTE atop this module)."""

    first_piece_words: int = 5  # the answer's first piece ends after this many words at the latest
    min_clause_words: int = 2  # a clause boundary ends a first-sentence piece only after this many words
    max_chars: int = 400  # a run of text with no boundary is cut at a space after this many characters
    buf: str = field(default="", init=False)  # text not cut yet
    in_fence: bool = field(default=False, init=False)  # inside a ``` block: dropped, never spoken
    in_first_sentence: bool = field(default=True, init=False)  # until a sentence with words in it was cut
    num_pieces: int = field(default=0, init=False)  # speakable pieces cut so far

    def push(self, text: str) -> list[str]:
        self.buf += text
        out: list[str] = []
        while (piece := self._next()) is not None:
            if piece.strip():
                out.append(piece)
        return out

    def flush(self) -> list[str]:
        """The rest of the text (end of the answer); an unclosed code block is dropped."""
        rest = "" if self.in_fence else self.buf
        self.buf, self.in_fence = "", False
        return [rest] if rest.strip() else []

    def _cut(self, end: int, *, sentence: bool) -> str:
        piece, self.buf = self.buf[:end], self.buf[end:]
        if speakable(piece):
            self.num_pieces += 1
            self.in_first_sentence = self.in_first_sentence and not sentence
        return piece

    def _next(self) -> str | None:
        """The next complete piece, "" for a dropped part (code), None when more text is needed."""
        if self.in_fence:
            m = _FENCE_CLOSE.search(self.buf)
            if m is None:
                self.buf = self.buf[self.buf.rfind("\n") + 1:]  # keep the partial line: it may close the fence
                return None
            self.buf, self.in_fence = self.buf[m.end():], False
            return ""
        fence = _FENCE_OPEN.search(self.buf)
        limit = fence.start() if fence else len(self.buf)
        end = next((m.end() for m in _SENTENCE_END.finditer(self.buf, 0, limit)
                    if _is_sentence_end(self.buf, m.start(), m.end())), None)
        piece_end = self._first_sentence_cut(end or limit) if self.in_first_sentence else None
        if piece_end is not None:
            return self._cut(piece_end, sentence=False)
        if end is not None:
            return self._cut(end, sentence=True)
        if fence is not None:
            piece = self._cut(limit, sentence=True)
            self.buf, self.in_fence = self.buf.lstrip(" \t")[3:], True
            return piece
        if len(self.buf) > self.max_chars:
            space = self.buf.rfind(" ", 0, self.max_chars)
            return self._cut(space + 1 if space > 0 else self.max_chars, sentence=False)
        return None

    def _first_sentence_cut(self, limit: int) -> int | None:
        """Where the first sentence's next piece ends before `limit`: a clause boundary after enough
        words, or (first piece only) the end of its `first_piece_words`-th word."""
        cuts = [m.end() for m in _CLAUSE_END.finditer(self.buf, 0, limit)
                if len(self.buf[:m.start()].split()) >= self.min_clause_words]
        if self.num_pieces == 0 and self.first_piece_words > 0:
            words = [m.end() for m in _WORD.finditer(self.buf, 0, limit)]
            if len(words) >= self.first_piece_words:
                cuts.append(words[self.first_piece_words - 1])
        return min(cuts) if cuts else None


# -- the stream transformer ----------------------------------------------------------------------


@dataclass(frozen=True)
class SpeechOptions:
    background: bool = True  # synthesise on a worker thread while text streams (False: inside feed())
    wait_first: bool = True  # background: feed() waits for the answer's first piece (its audio is not held
    #                          back until the next delta arrives; the text stalls once, ~0.2 s)
    first_piece_words: int = 5  # the answer's first piece is cut after this many words at the latest
    min_clause_words: int = 2  # words before a clause boundary (, ; : dash) that may end a first-sentence piece
    max_chars: int = 400  # text with no boundary is cut at a space after this many characters

    def __post_init__(self) -> None:
        if self.first_piece_words < 0 or self.min_clause_words < 1 or self.max_chars < 20:
            raise ValueError(f"{self}: first_piece_words >= 0 (0 = no word cut), min_clause_words >= 1 and "
                             "max_chars >= 20 are needed.")


@dataclass(frozen=True)
class ChunkTiming:
    """When one AudioChunk's text was complete in the stream and when its audio left the transformer."""

    text: str  # the words spoken
    ready_at: float  # time.monotonic() when its text was cut from the stream
    emitted_at: float  # time.monotonic() when its AudioChunk was returned by feed() / finish()
    num_samples: int
    sample_rate: int

    @property
    def latency_s(self) -> float:
        return self.emitted_at - self.ready_at

    @property
    def duration_s(self) -> float:
        return self.num_samples / self.sample_rate


@dataclass
class _Pending:
    text: str
    ready_at: float
    audio: Future = field(repr=False)  # -> np.ndarray int16 (num_samples,)


class SpeechStream(StreamTransformer):
    """Speaks the answer: each TextDelta passes through unchanged, followed by AudioChunk events for the
    pieces of text that are complete and synthesised, in text order. Other events pass through."""

    def __init__(self, tts: TextToSpeech, options: SpeechOptions | None = None) -> None:
        self.tts = tts
        self.options = options or SpeechOptions()
        self.splitter = SentenceSplitter(first_piece_words=self.options.first_piece_words,
                                         min_clause_words=self.options.min_clause_words,
                                         max_chars=self.options.max_chars)
        self.timings: list[ChunkTiming] = []  # one per AudioChunk emitted, in order
        self._pending: deque[_Pending] = deque()
        self._worker: ThreadPoolExecutor | None = None
        self._stop_worker: Any = None  # weakref.finalize: shuts the worker down, also for an abandoned answer
        if self.options.background and callable(getattr(tts, "load", None)):
            self._start_worker().submit(tts.load)  # loads the voice while the engine reads the prompt

    def for_turn(self, conversation_id: str) -> "SpeechStream":
        return SpeechStream(self.tts, self.options)

    def feed(self, event: TurnEvent) -> Sequence[TurnEvent]:
        if isinstance(event, TextDelta):
            now = time.monotonic()
            for piece in self.splitter.push(event.text):
                self._submit(piece, now)
            if self.options.wait_first and not self.timings and self._pending:
                self._pending[0].audio.exception()  # waits; a failure is raised by _ready below
        return [event, *self._ready(wait=False)]

    def finish(self) -> Sequence[TurnEvent]:
        now = time.monotonic()
        try:
            for piece in self.splitter.flush():
                self._submit(piece, now)
            return self._ready(wait=True)
        finally:
            if self._stop_worker is not None:
                self._stop_worker()
                self._worker = self._stop_worker = None

    def _submit(self, piece: str, ready_at: float) -> None:
        words = speakable(piece)
        if not re.search(r"\w", words):
            return
        if not self.options.background:
            audio: Future = Future()
            audio.set_result(self.tts.synthesize(words))  # errors propagate from feed()
        else:
            audio = self._start_worker().submit(self.tts.synthesize, words)
        self._pending.append(_Pending(words, ready_at, audio))

    def _start_worker(self) -> ThreadPoolExecutor:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tts")
            self._stop_worker = weakref.finalize(self, self._worker.shutdown, wait=False, cancel_futures=True)
        return self._worker

    def _ready(self, *, wait: bool) -> list[TurnEvent]:
        """AudioChunks of the oldest pending pieces that are done (all of them when `wait`), in order."""
        out: list[TurnEvent] = []
        while self._pending and (wait or self._pending[0].audio.done()):
            pending = self._pending.popleft()
            samples = np.asarray(pending.audio.result(), dtype=np.int16)  # (num_samples,)
            if samples.size:
                rate = self.tts.sample_rate
                out.append(AudioChunk(rate, samples.astype("<i2", copy=False).tobytes()))
                self.timings.append(ChunkTiming(pending.text, pending.ready_at, time.monotonic(), samples.size, rate))
        return out
