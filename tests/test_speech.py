"""Audio decoding/encoding and speech to text.

Unit tests need no model: round trips through every format with a generated tone, every kind of bad
input, the hallucination filter on hand-made segments, the lazy/locked backend flow with a fake.
Tests marked `real` transcribe speech made by the packaged Piper voice with the packaged Whisper
models (tiny.en, base once), load a small randomly initialised openai-whisper checkpoint, and run
tiny.en converted from CTranslate2 to openai-whisper's layout (the converter's unit test inverts
CTranslate2's own writer on a random model, float16 and int8).
"""

from __future__ import annotations

import io
import re
import struct
import sys
import threading
import wave
import zlib
from dataclasses import asdict

import numpy as np
import pytest

from assistant.errors import AssistantError, ConfigError, ModelError
from tests.conftest import media_model, require_module
from tools import audio as audio_mod
from tools.audio import AUDIO_MIME, AudioError, decode_audio, encode_audio
from tools.speech import (FasterWhisperSTT, OpenAIWhisperSTT, Segment, Transcript, _check_language, _LazyModel,
                          create_stt, filter_segments, is_silent, speech_chunks, word_error_rate)

CODEC_FORMATS = ["mp3", "opus", "ogg", "webm", "flac", "aac", "m4a"]
SENTENCE = "The quick brown fox jumps over the lazy dog. Please remind me to water the plants tomorrow morning."


def tone(seconds: float = 2.0, sample_rate: int = 22050, hz: float = 440.0, amplitude: float = 0.4) -> np.ndarray:
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    return (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def peak_hz(samples: np.ndarray, sample_rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.fft.rfftfreq(len(samples), 1 / sample_rate)[spectrum.argmax()])


def test_word_error_rate():
    assert word_error_rate("Hello, world!", "hello world") == 0
    assert word_error_rate("a b c d", "a x c") == 0.5
    assert word_error_rate("a b", "") == 1.0


# -- encode / decode round trips -------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["wav", *CODEC_FORMATS])
def test_round_trip_keeps_duration_and_pitch(fmt):
    data = encode_audio(tone(2.0, 22050), 22050, fmt)
    samples = decode_audio(data, name=f"tone.{fmt}")
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert abs(len(samples) / 16000 - 2.0) < 0.12  # codecs add a few ms of priming/padding
    assert abs(peak_hz(samples, 16000) - 440) < 5
    assert 0.25 < np.abs(samples).max() <= 1.0
    resampled = decode_audio(data, sample_rate=8000)
    assert abs(len(resampled) - len(samples) / 2) < 200


def test_wav_is_plain_16_bit_mono_at_the_given_rate():
    pcm = (tone(0.5, 24000) * 32767).astype(np.int16)
    with wave.open(io.BytesIO(encode_audio(pcm, 24000, "wav"))) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert np.array_equal(np.frombuffer(w.readframes(w.getnframes()), "<i2"), pcm)


def test_pcm_is_raw_little_endian_int16():
    data = encode_audio(np.array([0.0, 1.0, -1.0, 2.0]), 24000, "pcm")
    assert np.frombuffer(data, "<i2").tolist() == [0, 32767, -32767, 32767]


def test_opus_is_ogg_at_48_khz_and_webm_is_webm():
    import av

    for fmt, container in (("opus", "ogg"), ("webm", "matroska,webm")):
        with av.open(io.BytesIO(encode_audio(tone(1.0, 16000), 16000, fmt))) as c:
            assert c.format.name == container
            assert (c.streams.audio[0].codec_context.name, c.streams.audio[0].rate) == ("opus", 48000)


def test_encode_accepts_column_vectors_and_refuses_bad_input():
    assert encode_audio(tone(0.1).reshape(-1, 1), 22050, "wav")
    with pytest.raises(ValueError, match="one of"):
        encode_audio(tone(0.1), 22050, "wma")
    with pytest.raises(ValueError, match="mono"):
        encode_audio(np.zeros((2, 100), np.float32), 22050, "wav")
    with pytest.raises(ValueError, match="int16 or float"):
        encode_audio(np.zeros(100, np.int32), 22050, "wav")
    assert set(AUDIO_MIME) == {"wav", "pcm", *CODEC_FORMATS}


# -- bad input -------------------------------------------------------------------------------------
def _png() -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    pixels = zlib.compress(b"".join(b"\x00" + b"\xff\x00\x00" * 4 for _ in range(4)))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 4, 4, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", pixels) + chunk(b"IEND", b""))


def _corrupt(data: bytes, seed: int = 1) -> bytes:
    rng, out = np.random.default_rng(seed), bytearray(data)
    for i in rng.integers(len(out) // 4, len(out), 200):
        out[i] = int(rng.integers(0, 256))
    return bytes(out)


WAV = encode_audio(tone(2.0, 16000), 16000, "wav")
BAD_INPUTS = {
    "empty": (b"", "empty"),
    "pdf": (b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\n" * 20, "not an audio file"),
    "text": (b"Please transcribe this, it is only text.\n" * 50, "not an audio file"),
    "random bytes": (bytes(np.random.default_rng(1).integers(0, 256, 4000, dtype=np.uint8)), "not an audio file"),
    "image": (_png(), "no audio track"),
    "header only": (WAV[:44], "no sound"),
    "zero frames": (encode_audio(np.zeros(0, np.float32), 16000, "wav"), "no sound"),
    "truncated wav": (WAV[: len(WAV) // 3], "cut off"),
    "truncated ogg": (encode_audio(tone(), 22050, "ogg")[:3000], "cut off"),
    "truncated mp3": (encode_audio(tone(), 22050, "mp3")[:2000], "cut off"),
    "corrupt flac": (_corrupt(encode_audio(tone(), 22050, "flac")), "damaged"),
    "corrupt mp3": (_corrupt(encode_audio(tone(), 22050, "mp3")), "damaged"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_an_audio_error_that_says_what_is_wrong(case):
    data, words = BAD_INPUTS[case]
    with pytest.raises(AudioError, match=words) as info:
        decode_audio(data, name="question.webm")
    assert "question.webm" in str(info.value) and isinstance(info.value, AssistantError)


def test_too_long_is_refused_from_the_declared_duration_before_decoding(monkeypatch):
    data = encode_audio(np.zeros(16000 * 12, np.int16), 16000, "wav")
    monkeypatch.setattr(audio_mod, "_decode_stream", lambda *a: pytest.fail("decoded a file known to be too long"))
    with pytest.raises(AudioError, match=r"12.0 s long; the limit is 10 s"):
        decode_audio(data, max_seconds=10)


def test_too_long_without_a_declared_duration_stops_decoding_at_the_limit(monkeypatch):
    monkeypatch.setattr(audio_mod, "_declared_seconds", lambda container, stream: 0.0)  # like a browser webm
    data = encode_audio(tone(12.0, 16000), 16000, "webm")
    with pytest.raises(AudioError, match="longer than the limit of 10 s"):
        decode_audio(data, max_seconds=10)
    assert len(decode_audio(data, max_seconds=13)) > 11 * 16000


# -- the hallucination guard -----------------------------------------------------------------------
def test_filter_drops_what_whisper_makes_up_and_keeps_what_it_hears():
    heard = Segment(0.0, 2.0, " Turn on the lights.", no_speech_prob=0.02, avg_logprob=-0.2)
    confident_despite_noise = Segment(2.0, 3.0, " Yes.", no_speech_prob=0.7, avg_logprob=-0.3)
    unsure_on_silence = Segment(3.0, 4.0, " Thank you.", no_speech_prob=0.8, avg_logprob=-1.4)
    loop = Segment(4.0, 9.0, " Thanks for watching!" * 12, no_speech_prob=0.1, avg_logprob=-0.4)
    no_words = Segment(9.0, 10.0, " ♪ ...", no_speech_prob=0.3, avg_logprob=-0.5)
    kept, dropped = filter_segments([heard, confident_despite_noise, unsure_on_silence, loop, no_words])
    assert kept == (heard, confident_despite_noise) and dropped == 3
    assert loop.compression_ratio > 2.4 > heard.compression_ratio


def test_transcript_to_dict():
    segment = Segment(0.0, 1.0, "Hi.", 0.01, -0.1)
    data = Transcript("Hi.", "en", 1.0, (segment,), dropped=1).to_dict()
    assert data == {"text": "Hi.", "language": "en", "duration_s": 1.0, "segments": [asdict(segment)], "dropped": 1}


def test_silence_gate_and_energy_fallback(monkeypatch):
    rng = np.random.default_rng(0)
    noise = (0.01 * rng.standard_normal(48000)).astype(np.float32)
    assert is_silent(np.zeros(48000, np.float32)) and is_silent(np.zeros(0, np.float32))
    assert not is_silent(noise) and not is_silent(tone(1.0, 16000))
    monkeypatch.setitem(sys.modules, "faster_whisper.vad", None)  # no Silero: the energy gate decides
    assert speech_chunks(noise) == []
    bursts = np.concatenate([tone(0.3, 16000), np.zeros(4800, np.float32)] * 4)
    assert speech_chunks(bursts) == [{"start": 0, "end": len(bursts)}]


def test_silero_vad_hears_no_speech_in_noise():
    require_module("faster_whisper")
    assert speech_chunks((0.01 * np.random.default_rng(0).standard_normal(48000)).astype(np.float32)) == []


def test_language_check():
    assert _check_language("", "tiny.en", False, ["en", "de"]) == "en"
    assert _check_language("", "base", True, ["en", "de"]) is None
    assert _check_language(" DE ", "base", True, ["en", "de"]) == "de"
    with pytest.raises(ConfigError, match=r"only English.*\"en\""):
        _check_language("de", "tiny.en", False, ["en", "de"])
    with pytest.raises(ConfigError, match="Unknown speech language 'xx'"):
        _check_language("xx", "base", True, ["en", "de"])


class FakeWhisper(_LazyModel):
    """Counts loads and runs; 'hears' one fixed sentence."""

    def __init__(self, language: str = "") -> None:
        super().__init__()
        self.name, self.language, self.max_seconds, self.vad = "fake:tiny.en", language, 60.0, False
        self.loads, self.runs = 0, 0

    def _load(self):
        self.loads += 1
        return object()

    def _languages(self):
        return False, ["en", "de"]

    def _run(self, samples, language, chunks):
        self.runs += 1
        return Transcript("hello there", language, len(samples) / 16000)


def test_backend_loads_once_across_threads_and_never_runs_on_silence():
    fake = FakeWhisper()
    assert fake.loads == 0  # building it costs nothing
    loud = encode_audio(tone(0.5, 16000), 16000, "wav")
    threads = [threading.Thread(target=fake.transcribe, args=(loud,)) for _ in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert (fake.loads, fake.runs) == (1, 8)
    silent = fake.transcribe(encode_audio(np.zeros(16000, np.int16), 16000, "wav"))
    assert (silent.text, silent.language, silent.duration_s, fake.runs) == ("", "en", 1.0, 8)
    with pytest.raises(ConfigError, match="only English"):
        fake.transcribe(loud, language="de")
    with pytest.raises(AudioError):
        fake.transcribe(b"not audio at all" * 10)


def test_create_stt_errors(tmp_path):
    with pytest.raises(ConfigError, match="Unknown speech backend 'whisper.cpp'.*faster-whisper"):
        create_stt("whisper.cpp", tmp_path)
    with pytest.raises(ModelError, match="no model.bin"):
        create_stt("faster-whisper", tmp_path / "missing")
    with pytest.raises(ConfigError, match="directory.*\\.pt"):
        create_stt("openai-whisper", tmp_path)
    with pytest.raises(ModelError, match="does not exist"):
        create_stt("openai-whisper", tmp_path / "model.pt")
    (tmp_path / "model.bin").write_bytes(b"not a ctranslate2 model")
    with pytest.raises(ModelError, match="no tokenizer.json"):
        create_stt("faster-whisper", tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="device 'tpu'"):
        create_stt("faster-whisper", tmp_path, device="tpu")
    stt = create_stt("faster-whisper", tmp_path, device="cpu")  # lazy: nothing is read yet
    assert isinstance(stt, FasterWhisperSTT) and stt.name == f"faster-whisper:{tmp_path.name}"
    with pytest.raises(ModelError, match="Cannot load the speech model"):
        stt.transcribe(encode_audio(tone(0.5, 16000), 16000, "wav"))


# -- real models -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def speech() -> tuple[np.ndarray, int]:
    """About 5 s of SENTENCE spoken by the packaged Piper voice: (int16 samples, sample rate)."""
    from piper import PiperVoice

    voice = PiperVoice.load(media_model("joe") / "voice.onnx")
    chunks = list(voice.synthesize(SENTENCE))
    return np.concatenate([c.audio_int16_array for c in chunks]), chunks[0].sample_rate


@pytest.fixture(scope="module")
def tiny() -> FasterWhisperSTT:
    return FasterWhisperSTT(media_model("tiny.en"))


@pytest.mark.real
@pytest.mark.parametrize("fmt", ["wav", "webm", "ogg"])
def test_tiny_en_transcribes_speech(tiny, speech, fmt):
    samples, rate = speech
    transcript = tiny.transcribe(encode_audio(samples, rate, fmt), name=f"question.{fmt}")
    assert word_error_rate(SENTENCE, transcript.text) <= 0.2, transcript.text
    assert transcript.language == "en" and abs(transcript.duration_s - len(samples) / rate) < 0.1
    assert transcript.segments and all(s.end <= transcript.duration_s + 0.5 for s in transcript.segments)


@pytest.mark.real
@pytest.mark.parametrize("vad", [True, False])
def test_silence_and_noise_give_an_empty_transcript(tiny, vad):
    rng = np.random.default_rng(0)
    tiny.vad = vad
    try:
        for sound in (np.zeros(48000, np.float32), (0.01 * rng.standard_normal(48000)).astype(np.float32)):
            transcript = tiny.transcribe(encode_audio(sound, 16000, "wav"))
            assert transcript.text == "" and transcript.duration_s == 3.0
    finally:
        tiny.vad = True


@pytest.mark.real
def test_an_english_only_model_refuses_another_language(tiny, speech):
    with pytest.raises(ConfigError, match="only English"):
        tiny.transcribe(encode_audio(*speech, "wav"), language="de")


@pytest.mark.real
def test_base_detects_english_and_transcribes(speech):
    stt = create_stt("faster-whisper", media_model("base"))
    transcript = stt.transcribe(encode_audio(*speech, "mp3"), name="question.mp3")
    assert word_error_rate(SENTENCE, transcript.text) <= 0.2, transcript.text
    assert transcript.language == "en"


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory):
    """A randomly initialised openai-whisper model with a tiny shape (1 layer, 64 wide, 16-token text
    context so that random decoding stops soon), saved as .pt."""
    torch = pytest.importorskip("torch")
    whisper_model = pytest.importorskip("whisper.model")
    dims = whisper_model.ModelDimensions(n_mels=80, n_audio_ctx=1500, n_audio_state=64, n_audio_head=2,
                                         n_audio_layer=1, n_vocab=51864, n_text_ctx=16, n_text_state=64,
                                         n_text_head=2, n_text_layer=1)
    torch.manual_seed(0)
    model = whisper_model.Whisper(dims)
    with torch.no_grad():  # Whisper leaves this one torch.empty (real checkpoints fill it): garbage, even NaN
        model.decoder.positional_embedding.normal_(0.0, 0.02)
    path = tmp_path_factory.mktemp("whisper") / "random-tiny.pt"
    torch.save({"dims": asdict(dims), "model_state_dict": model.state_dict()}, path)
    return path


@pytest.mark.real
def test_openai_whisper_loads_a_checkpoint_and_transcribes(random_checkpoint, speech):
    stt = create_stt("openai-whisper", random_checkpoint, device="cpu")
    assert isinstance(stt, OpenAIWhisperSTT) and stt.name == "openai-whisper:random-tiny.pt"
    pytest.importorskip("torch").manual_seed(0)  # temperature fallback samples: keep runs alike
    transcript = stt.transcribe(encode_audio(*speech, "ogg"), name="question.ogg")
    assert isinstance(transcript, Transcript) and isinstance(transcript.text, str)  # random weights: no words
    assert transcript.language == "en" and abs(transcript.duration_s - len(speech[0]) / speech[1]) < 0.1
    assert all(isinstance(s, Segment) and s.start <= s.end for s in transcript.segments)
    assert stt.transcribe(encode_audio(np.zeros(16000, np.int16), 16000, "wav")).text == ""


@pytest.mark.real
@pytest.mark.parametrize("content", [b"garbage, not a checkpoint" * 100, "no dims"])
def test_a_bad_checkpoint_is_a_model_error(tmp_path, content):
    torch = pytest.importorskip("torch")
    path = tmp_path / "bad.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save({"model_state_dict": {}}, path)
    stt = create_stt("openai-whisper", path, device="cpu")
    with pytest.raises(ModelError, match="Cannot load the Whisper checkpoint"):
        stt.transcribe(encode_audio(tone(1.0, 16000), 16000, "wav"))


# -- CTranslate2 -> openai-whisper conversion ------------------------------------------------------
def _ct2_spec(model):
    """An openai-whisper model as CTranslate2's own Whisper converter lays it out (fused projections)."""
    from ctranslate2.specs import whisper_spec

    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}  # CTranslate2 quantizes in place
    d = model.dims
    spec = whisper_spec.WhisperSpec(d.n_audio_layer, d.n_audio_head, d.n_text_layer, d.n_text_head)

    def put(layer, name, fuse=(), bias=True):
        names = fuse or (name,)
        layer.weight = np.concatenate([sd[f"{n}.weight"] for n in names])
        if bias:
            layer.bias = np.concatenate([sd.get(f"{n}.bias", np.zeros(sd[f"{n}.weight"].shape[0], np.float32))
                                         for n in names])

    def norm(layer, name):
        layer.gamma, layer.beta = sd[f"{name}.weight"], sd[f"{name}.bias"]

    enc, dec = spec.encoder, spec.decoder
    put(enc.conv1, "encoder.conv1"), put(enc.conv2, "encoder.conv2"), norm(enc.layer_norm, "encoder.ln_post")
    enc.position_encodings.encodings = sd["encoder.positional_embedding"]
    dec.embeddings.weight = dec.projection.weight = sd["decoder.token_embedding.weight"]
    dec.position_encodings.encodings = sd["decoder.positional_embedding"]
    norm(dec.layer_norm, "decoder.ln")
    for side, layers in (("encoder", enc.layer), ("decoder", dec.layer)):
        for i, layer in enumerate(layers):
            b = f"{side}.blocks.{i}"
            put(layer.self_attention.linear[0], "", fuse=(f"{b}.attn.query", f"{b}.attn.key", f"{b}.attn.value"))
            put(layer.self_attention.linear[1], f"{b}.attn.out"), norm(layer.self_attention.layer_norm, f"{b}.attn_ln")
            put(layer.ffn.linear_0, f"{b}.mlp.0"), put(layer.ffn.linear_1, f"{b}.mlp.2")
            norm(layer.ffn.layer_norm, f"{b}.mlp_ln")
            if side == "decoder":
                put(layer.attention.linear[0], f"{b}.cross_attn.query")
                put(layer.attention.linear[1], "", fuse=(f"{b}.cross_attn.key", f"{b}.cross_attn.value"))
                put(layer.attention.linear[2], f"{b}.cross_attn.out")
                norm(layer.attention.layer_norm, f"{b}.cross_attn_ln")
    return spec


@pytest.mark.parametrize("quantization", ["float16", "int8"])
def test_ct2_reader_and_converter_invert_ctranslate2s_writer(tmp_path, quantization):
    torch = pytest.importorskip("torch")
    whisper_model = pytest.importorskip("whisper.model")
    pytest.importorskip("ctranslate2")
    from tools.whisper_convert import read_ct2_model, to_openai_checkpoint

    dims = whisper_model.ModelDimensions(n_mels=80, n_audio_ctx=20, n_audio_state=32, n_audio_head=2, n_audio_layer=2,
                                         n_vocab=100, n_text_ctx=16, n_text_state=32, n_text_head=2, n_text_layer=2)
    torch.manual_seed(0)
    model = whisper_model.Whisper(dims)
    with torch.no_grad():
        model.decoder.positional_embedding.normal_(0.0, 0.02)
        for name, p in model.named_parameters():
            if name.endswith("bias") and ".key." not in name:
                p.normal_(0.0, 0.1)  # nonzero biases, so a misplaced one shows
    spec = _ct2_spec(model)
    spec.register_vocabulary([f"token{i}" for i in range(dims.n_vocab)])
    spec.validate()
    spec.optimize(quantization=quantization)
    spec.save(str(tmp_path))  # CTranslate2's own writer: model.bin, config.json, vocabulary.json

    name, variables = read_ct2_model(tmp_path / "model.bin")
    checkpoint = to_openai_checkpoint(variables)
    assert name == "WhisperSpec" and checkpoint["dims"] == asdict(dims)
    restored = whisper_model.Whisper(whisper_model.ModelDimensions(**checkpoint["dims"]))
    restored.load_state_dict(checkpoint["model_state_dict"])  # strict: every tensor present, none extra
    for key, original in model.state_dict().items():
        got = restored.state_dict()[key]
        assert torch.allclose(got, original, atol=float(original.abs().max()) / 60 + 1e-3), key
    mel, tokens = torch.randn(1, 80, 40), torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        expected = model(mel, tokens)  # logits (1, 3, n_vocab)
        assert torch.allclose(restored(mel, tokens), expected, atol=0.02 * float(expected.abs().max()))


def test_reading_a_non_ct2_file_is_a_model_error(tmp_path):
    from tools.whisper_convert import convert_ct2_to_openai

    (tmp_path / "model.bin").write_bytes(b"\x06\x00\x00\x00garbage")
    with pytest.raises(ModelError, match="Cannot read the CTranslate2 model"):
        convert_ct2_to_openai(tmp_path, tmp_path / "out.pt")


@pytest.mark.real
def test_converted_tiny_en_runs_on_openai_whisper(tmp_path, speech):
    pytest.importorskip("whisper")
    from tools.whisper_convert import convert_ct2_to_openai

    checkpoint = convert_ct2_to_openai(media_model("tiny.en"), tmp_path / "tiny.en.pt")
    transcript = create_stt("openai-whisper", checkpoint, device="cpu").transcribe(encode_audio(*speech, "wav"))
    assert word_error_rate(SENTENCE, transcript.text) <= 0.3, transcript.text
