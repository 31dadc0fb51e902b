"""Voice and vision speed: ASR and TTS real-time factors, time to the first spoken audio, image describe.

    .venv/bin/python bench/speech.py [--quick] [--threads N]

Measured in the same run, on the packaged models (prepared into the models dir on first use):
  asr_rtf_tiny / asr_rtf_base   faster-whisper (CTranslate2 int8, beam 5, VAD) seconds per second of speech,
                                on ~10 s of Piper speech, best of R runs after a warm-up; WER against the
                                script after Whisper's English normaliser (numbers as digits or words).
                                Baseline: openai-whisper (PyTorch fp32) on the *same* weights, converted
                                from the CTranslate2 files (tools/whisper_convert.py): ratio = its RTF / ours.
  tts_rtf                       Piper seconds of synthesis per second of speech (baseline: real time).
  first_audio_ms                a scripted answer streamed at decode pace (DELTA_S per token) through the
                                sentence-to-speech transformer (tools/tts.SpeechStream, its defaults): from
                                the delta that completes the first sentence to the first AudioChunk. Negative
                                = audio came before that sentence ended (its first clause is spoken early).
                                Baseline: speaking the whole answer once it is complete (time to synthesise
                                it). Also `first_piece_ms`: from a piece's cut to its audio (synthesis latency).
  first_audio_whole_sentence_ms the same with the first sentence spoken whole (no clause cut).
  describe_p50_ms               ImageDescriber (EfficientNet-Lite0 + Tesseract, OCR beside the CNN) on a
                                640x480 photo-like picture with a sign on it (OCR runs and reads it);
                                also a picture without text (OCR skipped) and with OCR off. Baseline:
                                encode, then OCR through the `tesseract` CLI, one after the other.
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
    import torch
    from whisper.normalizers import EnglishTextNormalizer

    from tools.speech import FasterWhisperSTT, OpenAIWhisperSTT, word_error_rate

    normalise = EnglishTextNormalizer()  # the Whisper paper's: "twelve dollars" and "$12" are the same words

    def wer(reference: str, hypothesis: str) -> float:
        return word_error_rate(normalise(reference), normalise(hypothesis))

    torch.set_num_threads(threads)  # openai-whisper runs on torch's pool: the same threads as CTranslate2
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


def bench_first_audio(tts, answers: int, options=None) -> dict:
    from tools.tts import SpeechStream, speakable

    tokens = re.findall(r"\S+\s*", ANSWER)
    first_end = next(i for i, t in enumerate(tokens) if t.rstrip().endswith("."))
    lags, pieces = [], []
    for _ in range(answers):
        stream = SpeechStream(tts, options)
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


def pictures() -> tuple[bytes, bytes]:
    """(a 640x480 photo with a sign on it, the same photo without): gradio's sample cheetah photo when
    gradio is installed (it is, for the web chat), else a generated scene."""
    from PIL import Image, ImageDraw, ImageFont

    try:
        import gradio

        photo = Image.open(Path(gradio.__file__).parent / "media_assets" / "images" / "cheetah1.jpg").convert("RGB")
    except (ImportError, OSError):
        ramp = np.linspace(0, 255, 640, dtype=np.uint8)
        photo = Image.fromarray(np.stack([np.tile(ramp, (480, 1))] * 3, axis=-1))
    photo = photo.resize((640, 480))
    signed = photo.copy()
    draw = ImageDraw.Draw(signed)
    draw.rectangle((40, 40, 600, 140), fill="white")
    try:
        font = ImageFont.truetype("/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf", 56)
    except OSError:
        font = ImageFont.load_default(size=56)
    draw.text((60, 55), "OPEN 9 TO 6", fill="black", font=font)
    out = []
    for image in (signed, photo):
        buf = io.BytesIO()
        image.save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out[0], out[1]


def p50_ms(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def bench_describe(runs: int, threads: int) -> dict:
    from ingest.parse import ocr_png
    from tools.vision import EfficientNetEncoder, ImageDescriber, load_image

    encoder = EfficientNetEncoder(media_model_dir("lite0", models_dir()), device="cpu", num_threads=threads)
    describer, no_ocr = ImageDescriber(encoder), ImageDescriber(encoder, ocr=False)
    signed, photo = pictures()
    described = describer.describe(signed, name="sign.jpg")  # loads the encoder and Tesseract
    plain_photo = describer.describe(photo, name="photo.jpg")

    def sequential_cli() -> None:  # the obvious way: classify, then run the tesseract program
        image = load_image(signed)
        encoder.encode(image)
        png = io.BytesIO()
        image.save(png, "PNG", compress_level=1)
        ocr_png(png.getvalue(), "eng", output="tsv", threads=1)

    figures = {"describe_p50_ms": p50_ms(lambda: describer.describe(signed, name="sign.jpg"), runs),
               "describe_photo_p50_ms": p50_ms(lambda: describer.describe(photo, name="photo.jpg"), runs),
               "describe_no_ocr_p50_ms": p50_ms(lambda: no_ocr.describe(signed, name="sign.jpg"), runs),
               "describe_sequential_cli_p50_ms": p50_ms(sequential_cli, max(3, runs // 3)),
               "describe_text_read": described.text, "describe_ocr": described.ocr,
               "describe_labels": [label for label, _ in described.labels],
               "describe_photo_labels": [label for label, _ in plain_photo.labels]}
    describer.close()
    no_ocr.close()
    return figures


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
    from tools.tts import SpeechOptions

    first = bench_first_audio(tts, 3 if args.quick else 7)
    result.update(first)
    whole = bench_first_audio(tts, 3 if args.quick else 7, SpeechOptions(first_piece_words=0, min_clause_words=1000))
    result["first_audio_whole_sentence_ms"] = whole["first_audio_ms"]
    print(f"Speech   first sentence end -> first audio: median {first['first_audio_ms']:.0f} ms "
          f"(max {first['first_audio_max_ms']:.0f}; target <= 300); a piece's cut -> its audio "
          f"{first['first_piece_ms']:.0f} ms; baseline, speak the whole answer when done: "
          f"{first['whole_answer_tts_ms']:.0f} ms after its end")
    print(f"Speech   the first sentence spoken whole (no early clause): its end -> its audio "
          f"{whole['first_audio_ms']:.0f} ms")
    vision = bench_describe(10 if args.quick else 30, args.threads)
    result.update(vision)
    print(f"Describe photo with a sign (OCR reads it): p50 {vision['describe_p50_ms']:.0f} ms (target <= 150); "
          f"baseline, classify then the tesseract CLI: {vision['describe_sequential_cli_p50_ms']:.0f} ms "
          f"(ratio {vision['describe_p50_ms'] / vision['describe_sequential_cli_p50_ms']:.2f}); "
          f"read {vision['describe_text_read']!r} (ocr {vision['describe_ocr']}), labels {vision['describe_labels']}")
    print(f"Describe photo without text (OCR runs, reads nothing): p50 {vision['describe_photo_p50_ms']:.0f} ms, labels "
          f"{vision['describe_photo_labels']}; OCR off: {vision['describe_no_ocr_p50_ms']:.0f} ms")
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
