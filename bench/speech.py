"""Voice and vision speed: ASR and TTS real-time factors, time to the first spoken audio, image describe.

    .venv/bin/python bench/speech.py [--quick] [--threads N]

Measured in the same run, on the packaged models (prepared into the models dir on first use):
  asr_rtf_tiny / asr_rtf_base   faster-whisper (CTranslate2 int8) seconds per second of speech, on ~12 s
                                of Piper speech, best of R runs after a warm-up; WER against the script.
                                Baseline: openai-whisper (PyTorch fp32) on the *same* weights, converted
                                from the CTranslate2 files (tools/whisper_convert.py): ratio = its RTF / ours.
  tts_rtf                       Piper seconds of synthesis per second of speech (baseline: real time).
  first_audio_ms                a scripted answer streamed at decode pace (DELTA_S per token) through the
                                sentence-to-speech transformer (tools/tts.SpeechStream, its defaults): from
                                the delta that completes the first sentence to the first AudioChunk. Negative
                                = audio came before that sentence ended (its first clause is spoken early).
                                Baseline: speaking the whole answer once it is complete (time to synthesise
                                it). Also `first_piece_ms`: from a piece's cut to its audio (synthesis latency).
  describe_p50_ms               ImageDescriber (EfficientNet-Lite0 + Tesseract, OCR beside the CNN) on a
                                640x480 picture with text; baseline: encode and OCR one after the other.
Targets: first_audio_ms <= 300, describe_p50_ms <= 150. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from assistant.events import TextDelta  # noqa: E402
from assistant.models.media import media_model_dir  # noqa: E402

SCRIPT = ("The museum opens at nine in the morning and closes at six in the evening. "
          "Tickets cost twelve dollars for adults and five dollars for children. "
          "Guided tours leave from the main hall every hour.")
ANSWER = ("The warranty lasts two years from the date of purchase, and it covers parts and labour. "
          "To make a claim, keep your receipt and call the service line. "
          "Repairs usually take about a week.")
DELTA_S = 0.06  # one token every 60 ms: the 0.5B model's decode pace on this machine


def models_dir() -> Path:
    return Path(os.environ.get("ASSISTANT_MODELS_DIR", Path(__file__).resolve().parents[1] / "data" / "models"))


def wer(reference: str, hypothesis: str) -> float:
    ref, hyp = (re.findall(r"[a-z0-9']+", s.lower()) for s in (reference, hypothesis))
    d = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, d[0] = d[0], i
        for j, h in enumerate(hyp, 1):
            prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (r != h))
    return d[len(hyp)] / max(1, len(ref))


def timed(fn, runs: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(runs):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def bench_tts(tts, runs: int) -> tuple[dict, np.ndarray]:
    tts.synthesize("Warm up.")
    seconds, audio = timed(lambda: tts.synthesize(SCRIPT), runs)
    duration = len(audio) / tts.sample_rate
    return {"tts_s": seconds, "speech_s": duration, "tts_rtf": seconds / duration}, audio


def bench_asr(wav: bytes, duration: float, threads: int, runs: int) -> dict:
    from tools.speech import FasterWhisperSTT, OpenAIWhisperSTT
    from tools.whisper_convert import convert_ct2_to_openai

    out: dict = {}
    for name, key in (("tiny.en", "tiny"), ("base", "base")):
        path = media_model_dir(name, models_dir())
        ours = FasterWhisperSTT(path, device="cpu", num_threads=threads)
        ours.transcribe(wav, name="warm.wav")
        seconds, transcript = timed(lambda: ours.transcribe(wav, name="bench.wav"), runs)
        out[f"asr_rtf_{key}"] = seconds / duration
        out[f"asr_wer_{key}"] = wer(SCRIPT, transcript.text)
        with tempfile.TemporaryDirectory() as tmp:
            try:
                checkpoint = convert_ct2_to_openai(path, Path(tmp) / f"{name}.pt")
                theirs = OpenAIWhisperSTT(checkpoint, device="cpu", num_threads=threads)
                theirs.transcribe(wav, name="warm.wav")
                base_s, base_t = timed(lambda: theirs.transcribe(wav, name="bench.wav"), runs)
                out[f"openai_whisper_rtf_{key}"] = base_s / duration
                out[f"openai_whisper_wer_{key}"] = wer(SCRIPT, base_t.text)
                out[f"asr_speedup_{key}"] = base_s / seconds
            except Exception as e:  # the conversion is model-specific: report, keep the rest of the bench
                out[f"openai_whisper_error_{key}"] = f"{type(e).__name__}: {e}"
    return out


def bench_first_audio(tts, answers: int) -> dict:
    from tools.tts import SpeechStream, speakable

    tokens = re.findall(r"\S+\s*", ANSWER)
    first_end = next(i for i, t in enumerate(tokens) if t.rstrip().endswith("."))
    lags, pieces = [], []
    for _ in range(answers):
        stream = SpeechStream(tts)
        time.sleep(0.5)  # the engine reads the prompt meanwhile; the voice is already loaded
        sentence_end = first_audio = None
        for i, token in enumerate(tokens):
            time.sleep(DELTA_S)
            events = stream.feed(TextDelta(token))
            now = time.monotonic()
            if i == first_end:
                sentence_end = now
            if first_audio is None and len(events) > 1:
                first_audio = now
        stream.finish()
        first_audio = first_audio or stream.timings[0].emitted_at
        lags.append((first_audio - sentence_end) * 1000)
        pieces.append(stream.timings[0].latency_s * 1000)
    whole_s, _ = timed(lambda: tts.synthesize(speakable(ANSWER)), 1)
    return {"first_audio_ms": statistics.median(lags), "first_audio_max_ms": max(lags),
            "first_piece_ms": statistics.median(pieces), "whole_answer_tts_ms": whole_s * 1000}


def picture() -> bytes:
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(0)
    base = (rng.normal(0, 1, (480, 640, 3)).cumsum(0).cumsum(1) % 255).astype(np.uint8)  # a textured scene
    image = Image.fromarray(base)
    draw = ImageDraw.Draw(image)
    draw.rectangle((40, 40, 600, 140), fill="white")
    try:
        font = ImageFont.truetype("DejaVuSans-Bold.ttf", 56)
    except OSError:
        font = ImageFont.load_default(size=56)
    draw.text((60, 55), "OPEN 9 TO 6", fill="black", font=font)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90)
    return out.getvalue()


def bench_describe(runs: int, threads: int) -> dict:
    from tools.vision import EfficientNetEncoder, ImageDescriber, load_image, read_text

    encoder = EfficientNetEncoder(media_model_dir("lite0", models_dir()), device="cpu", num_threads=threads)
    describer = ImageDescriber(encoder)
    data = picture()
    described = describer.describe(data, name="bench.jpg")  # loads the encoder
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        describer.describe(data, name="bench.jpg")
        times.append((time.perf_counter() - t) * 1000)
    sequential = []
    for _ in range(max(3, runs // 3)):
        t = time.perf_counter()
        image = load_image(data)
        encoder.encode(image)
        read_text(image)
        sequential.append((time.perf_counter() - t) * 1000)
    no_ocr = ImageDescriber(encoder, ocr=False)
    plain = []
    for _ in range(runs):
        t = time.perf_counter()
        no_ocr.describe(data)
        plain.append((time.perf_counter() - t) * 1000)
    describer.close()
    no_ocr.close()
    ordered = sorted(times)
    return {"describe_p50_ms": statistics.median(times), "describe_p95_ms": ordered[int(0.95 * (len(ordered) - 1))],
            "describe_no_ocr_p50_ms": statistics.median(plain),
            "describe_sequential_p50_ms": statistics.median(sequential),
            "describe_text_read": described.text, "describe_labels": [label for label, _ in described.labels]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    args = parser.parse_args()
    runs = 2 if args.quick else 3
    from tools.audio import encode_audio
    from tools.tts import PiperTTS

    tts = PiperTTS(media_model_dir("joe", models_dir()), num_threads=args.threads)
    result: dict = {"threads": args.threads}
    tts_figures, speech = bench_tts(tts, runs)
    result.update(tts_figures)
    print(f"TTS      Piper: {tts_figures['speech_s']:.1f} s of speech in {tts_figures['tts_s']:.2f} s: "
          f"RTF {tts_figures['tts_rtf']:.3f} (baseline real time: {1 / tts_figures['tts_rtf']:.1f}x faster)")
    wav = encode_audio(speech, tts.sample_rate, "wav")
    asr = bench_asr(wav, tts_figures["speech_s"], args.threads, runs)
    result.update(asr)
    for key in ("tiny", "base"):
        line = f"ASR {key:<5} faster-whisper RTF {asr[f'asr_rtf_{key}']:.3f}, WER {asr[f'asr_wer_{key}']:.2f}"
        if f"asr_speedup_{key}" in asr:
            line += (f"; openai-whisper, same weights: RTF {asr[f'openai_whisper_rtf_{key}']:.3f}, "
                     f"WER {asr[f'openai_whisper_wer_{key}']:.2f} -> {asr[f'asr_speedup_{key}']:.1f}x faster")
        else:
            line += f"; openai-whisper baseline failed: {asr.get(f'openai_whisper_error_{key}')}"
        print(line)
    first = bench_first_audio(tts, 3 if args.quick else 7)
    result.update(first)
    print(f"Speech   first sentence end -> first audio: median {first['first_audio_ms']:.0f} ms "
          f"(max {first['first_audio_max_ms']:.0f}; target <= 300); a piece's cut -> its audio "
          f"{first['first_piece_ms']:.0f} ms; baseline, speak the whole answer when done: "
          f"{first['whole_answer_tts_ms']:.0f} ms after its end")
    vision = bench_describe(10 if args.quick else 30, args.threads)
    result.update(vision)
    print(f"Describe p50 {vision['describe_p50_ms']:.0f} ms, p95 {vision['describe_p95_ms']:.0f} ms (target p50 <= 150); "
          f"without OCR {vision['describe_no_ocr_p50_ms']:.0f} ms; encode then OCR one after the other "
          f"{vision['describe_sequential_p50_ms']:.0f} ms "
          f"(ratio {vision['describe_p50_ms'] / vision['describe_sequential_p50_ms']:.2f}); "
          f"read {vision['describe_text_read']!r}, labels {vision['describe_labels']}")
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
