"""Audio in and out: any recording's bytes -> float32 mono samples, and samples -> a file's bytes.

Both directions go through PyAV (FFmpeg's libraries, bundled in its wheel), so no ffmpeg binary is
needed. `decode_audio` takes what users send (wav, mp3, ogg/vorbis, ogg/opus, webm/opus from a
browser's MediaRecorder, flac, m4a) and `encode_audio` writes what speech front ends return (the
formats of OpenAI's /v1/audio/speech plus ogg/vorbis and webm/opus).

Design note: decoding is the one place where untrusted bytes meet a C library, so it is defensive in
three ways. (1) Every FFmpeg failure becomes an `AudioError` whose message says what is wrong with
the file and what to do; no av traceback reaches a user. (2) Length is bounded twice: the container's
declared duration is checked before any sample is decoded, and decoding stops as soon as the decoded
audio passes `max_seconds` (browser webm recordings declare no duration, and a declared one may lie).
(3) A file that declares a duration but decodes to much less is refused as cut off, rather than
transcribed as half a question.
"""

from __future__ import annotations

import io
import wave
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Iterator

import numpy as np

from assistant.errors import AssistantError, ToolUnavailable

__all__ = ["AUDIO_MIME", "AudioError", "decode_audio", "encode_audio"]

MIN_TRUNCATED_GAP_S = 1.0  # a file decoding to this much less than it declares ...
MIN_DECODED_FRACTION = 0.8  # ... and to less than this fraction of it, is refused as cut off


class AudioError(AssistantError):
    """An audio file cannot be used; the message says why and what the user can do."""


@dataclass(frozen=True)
class _Writer:
    container: str  # FFmpeg muxer name
    codec: str  # FFmpeg encoder name
    layout: str = "mono"  # channel layout the encoder is given
    rate: int = 0  # fixed sample rate the codec needs; 0 = keep the input's (if the codec supports it)
    options: tuple[tuple[str, str], ...] = ()  # encoder options


WRITERS: dict[str, _Writer] = {
    "mp3": _Writer("mp3", "libmp3lame"),
    "opus": _Writer("ogg", "libopus", rate=48000),  # Ogg Opus, what OpenAI's speech endpoint returns
    "ogg": _Writer("ogg", "vorbis", layout="stereo", options=(("strict", "experimental"),)),  # FFmpeg's own
    "webm": _Writer("webm", "libopus", rate=48000),  # Vorbis encoder is experimental and stereo-only
    "flac": _Writer("flac", "flac"),
    "aac": _Writer("adts", "aac"),
    "m4a": _Writer("ipod", "aac"),
}
AUDIO_MIME: dict[str, str] = {
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg; codecs=opus",
    "ogg": "audio/ogg",
    "webm": "audio/webm",
    "flac": "audio/flac",
    "aac": "audio/aac",
    "m4a": "audio/mp4",
    "pcm": "audio/pcm",
}


def _av() -> Any:
    try:
        import av
    except ImportError as e:
        raise ToolUnavailable("Audio needs PyAV: run `make setup` or pip install -e '.[media]'.") from e
    return av


# -- decoding ----------------------------------------------------------------------------------
def decode_audio(data: bytes, *, name: str = "", sample_rate: int = 16000, max_seconds: float = 600.0) -> np.ndarray:
    """The first audio track of a file's bytes as float32 mono in [-1, 1] at `sample_rate`: shape (N,).

    Raises AudioError for empty, non-audio, corrupt, cut-off, zero-length or too long input.
    """
    av = _av()

    what = f"{name!r}" if name else "The recording"
    if not data:
        raise AudioError(f"{what} is empty (0 bytes): record or upload it again.")
    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except EOFError as e:  # the demuxer ran off the end while reading headers or looking for the length
        raise AudioError(f"{what} is cut off or damaged (it ends too early to be read); "
                         "upload the complete file again.") from e
    except (av.FFmpegError, ValueError, OSError) as e:
        raise AudioError(f"{what} is not an audio file that can be read ({_reason(e)}); "
                         "send wav, mp3, ogg, opus, webm, flac or m4a.") from e
    with container:
        if not container.streams.audio:
            raise AudioError(f"{what} has no audio track; send a sound recording (wav, mp3, ogg, webm, flac, m4a).")
        stream = container.streams.audio[0]
        declared = _declared_seconds(container, stream)
        if declared > max_seconds:
            raise AudioError(f"{what} is {declared:.1f} s long; the limit is {max_seconds:g} s: "
                             "send a shorter recording or split it.")
        samples = _decode_stream(container, stream, what, sample_rate, max_seconds)
    decoded = len(samples) / sample_rate
    if not len(samples):
        raise AudioError(f"{what} contains no sound (0 s of audio): record it again.")
    if _riff_is_cut(data):  # FFmpeg trims a wav's declared length to the bytes present, so look ourselves
        raise AudioError(f"{what} seems cut off: its header announces more audio than the file holds; "
                         "upload the complete file again.")
    if declared and declared - decoded > MIN_TRUNCATED_GAP_S and decoded < MIN_DECODED_FRACTION * declared:
        raise AudioError(f"{what} seems cut off: it declares {declared:.1f} s but only {decoded:.1f} s could be "
                         "decoded; upload the complete file again.")
    return samples


def _decode_stream(container: Any, stream: Any, what: str, sample_rate: int, max_seconds: float) -> np.ndarray:
    av = _av()

    resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)
    chunks: list[np.ndarray] = []
    num_samples, max_samples = 0, int(max_seconds * sample_rate)
    try:
        for frame in _frames_then_flush(container, stream):
            for out in resampler.resample(frame):
                chunk = out.to_ndarray().reshape(-1)  # (1, n) packed mono -> (n,)
                chunks.append(chunk)
                num_samples += len(chunk)
            if num_samples > max_samples:
                raise AudioError(f"{what} is longer than the limit of {max_seconds:g} s: "
                                 "send a shorter recording or split it.")
    except (av.FFmpegError, ValueError, OSError, EOFError) as e:
        raise AudioError(f"{what} is damaged and cannot be decoded ({_reason(e)}); "
                         "record or export it again.") from e
    if not chunks:
        return np.zeros(0, dtype=np.float32)
    samples = np.concatenate(chunks).astype(np.float32, copy=False)
    return np.clip(np.nan_to_num(samples, nan=0.0, posinf=1.0, neginf=-1.0), -1.0, 1.0)


def _frames_then_flush(container: Any, stream: Any) -> Iterator[Any]:
    """Decoded frames of `stream`, then None (which tells the resampler to flush)."""
    yield from container.decode(stream)
    yield None


def _declared_seconds(container: Any, stream: Any) -> float:
    """What the container says the audio lasts, without decoding; 0.0 when it does not say."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000  # AV_TIME_BASE
    return 0.0


def _riff_is_cut(data: bytes) -> bool:
    """A RIFF/WAVE file much shorter than the size its header announces (streamed wavs that write
    0 or 0xFFFFFFFF there are left alone)."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return False
    announced = int.from_bytes(data[4:8], "little") + 8
    return 0 < announced - 8 < 0xFFFFFF00 and len(data) < MIN_DECODED_FRACTION * announced


def _reason(e: Exception) -> str:
    text = getattr(e, "strerror", None) or str(e) or type(e).__name__
    return text.split(":")[0].strip() if "Errno" in text else text.strip()


# -- encoding ----------------------------------------------------------------------------------
def encode_audio(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """Mono samples (int16, or float in [-1, 1]; shape (N,)) as the bytes of a `fmt` file.

    fmt: "wav", "mp3", "opus" (Ogg Opus), "ogg" (Ogg Vorbis), "webm" (WebM Opus), "flac", "aac" (ADTS),
    "m4a" or "pcm" (raw signed 16-bit little-endian, no header). Resampled where the codec needs it.
    """
    if fmt not in AUDIO_MIME:
        raise ValueError(f"unknown audio format {fmt!r}; use one of {', '.join(AUDIO_MIME)}")
    if sample_rate <= 0:
        raise ValueError(f"sample_rate must be positive, got {sample_rate}")
    pcm = _to_int16(samples)
    if fmt == "pcm":
        return pcm.astype("<i2").tobytes()
    if fmt == "wav":
        buf = io.BytesIO()
        with wave.open(buf, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(sample_rate)
            w.writeframes(pcm.astype("<i2").tobytes())
        return buf.getvalue()
    return _encode_with_av(pcm, sample_rate, WRITERS[fmt])


def _to_int16(samples: np.ndarray) -> np.ndarray:
    samples = np.asarray(samples)
    if samples.ndim == 2 and 1 in samples.shape:
        samples = samples.reshape(-1)
    if samples.ndim != 1:
        raise ValueError(f"encode_audio takes mono samples of shape (N,), got shape {samples.shape}")
    if samples.dtype == np.int16:
        return samples
    if not np.issubdtype(samples.dtype, np.floating):
        raise ValueError(f"encode_audio takes int16 or float samples, got {samples.dtype}")
    clean = np.clip(np.nan_to_num(samples.astype(np.float32), nan=0.0), -1.0, 1.0)
    return np.round(clean * 32767.0).astype(np.int16)


def _encode_with_av(pcm: np.ndarray, sample_rate: int, writer: _Writer) -> bytes:
    av = _av()

    rate = writer.rate or _supported_rate(writer.codec, sample_rate)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=writer.container) as container:
        stream = container.add_stream(writer.codec, rate=rate, layout=writer.layout)
        stream.codec_context.options = dict(writer.options)
        resampler = av.AudioResampler(format=stream.codec_context.format, layout=writer.layout, rate=rate)
        if len(pcm):
            frame = av.AudioFrame.from_ndarray(pcm[None, :], format="s16", layout="mono")  # (1, N) packed
            frame.sample_rate, frame.pts, frame.time_base = sample_rate, 0, Fraction(1, sample_rate)
            for resampled in [*resampler.resample(frame), *resampler.resample(None)]:
                container.mux(stream.encode(resampled))
        container.mux(stream.encode(None))
    return buf.getvalue()


def _supported_rate(codec: str, rate: int) -> int:
    """`rate` if the encoder takes it, else the nearest higher rate it takes (else its highest)."""
    rates = _av().codec.Codec(codec, "w").audio_rates
    if not rates or rate in rates:
        return rate
    higher = [r for r in rates if r >= rate]
    return min(higher) if higher else max(rates)
