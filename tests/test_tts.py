"""Text to speech (tools/tts.py): where streamed text is cut, what is spoken, the SpeechStream
transformer with a fake voice (order, flush, per-turn state, its place in a scripted turn), and the
packaged Piper voice end to end (`real`)."""

from __future__ import annotations

import gc
import importlib.util
import json
import threading
import time

import numpy as np
import pytest

from assistant.errors import ConfigError, ModelError, ToolUnavailable
from assistant.events import AudioChunk, Done, Notice, TextDelta
from tests.agent_fakes import make_assistant
from tests.conftest import media_model, need
from tools.tts import PiperTTS, SentenceSplitter, SpeechOptions, SpeechStream, create_tts, speakable


class FakeTTS:
    """A tone per call whose length follows the text; its value is the call's number (1, 2, ...)."""

    name = "fake"
    sample_rate = 16000

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.texts: list[str] = []
        self.num_loads = 0

    def load(self) -> None:
        self.num_loads += 1

    def synthesize(self, text: str) -> np.ndarray:
        self.texts.append(text)
        time.sleep(self.delay_s)
        return np.full(100 * len(text), len(self.texts), dtype=np.int16)


def tokens(text: str) -> list[str]:
    """Roughly what a BPE tokenizer streams: words with their leading space, punctuation, newlines."""
    import re

    return re.findall(r" ?\w+| ?[^\w\s]|\s", text)


def split(text: str, **kw) -> list[str]:
    splitter = SentenceSplitter(**kw)
    pieces = [p for t in tokens(text) for p in splitter.push(t)]
    return [p.strip() for p in pieces + splitter.flush()]


def audio(events) -> list[AudioChunk]:
    return [e for e in events if isinstance(e, AudioChunk)]


WHOLE = dict(first_piece_words=0, min_clause_words=1000)  # no first-sentence pieces: sentences only


# -- where to cut ---------------------------------------------------------------------------------

def test_sentences_survive_abbreviations_decimals_versions_and_ellipses():
    text = ("It has e.g. the Louvre, which opened in 1793. Pi is 3.14 and v1.2 is out... really. "
            "Dr. Smith agreed. Wait... What? Yes! Done.")
    assert split(text, **WHOLE) == ["It has e.g. the Louvre, which opened in 1793.",
                                    "Pi is 3.14 and v1.2 is out... really.", "Dr. Smith agreed.", "Wait...",
                                    "What?", "Yes!", "Done."]


def test_newlines_end_list_items_and_code_fences_are_never_spoken():
    text = "Steps:\n1. Install it\n2. Run it\n\n```python\nprint('x. Y')\n```\nThat is all. Bye"
    assert split(text, **WHOLE) == ["Steps:", "1. Install it", "2. Run it", "That is all.", "Bye"]


def test_an_unclosed_fence_is_dropped_at_the_end():
    assert split("Here:\n```\nrm -rf. Oops\n", **WHOLE) == ["Here:"]


def test_a_sentence_end_waits_for_the_next_character():
    splitter = SentenceSplitter(**WHOLE)
    assert splitter.push("Pi is 3.") == []  # 3.14 or the end of a sentence: not known yet
    assert splitter.push("14 and so on.") == []
    assert splitter.push(" Next") == ["Pi is 3.14 and so on."]


def test_the_first_sentence_is_cut_into_pieces_later_ones_are_whole():
    text = "The capital of France is Paris, a city on the Seine. It has many museums, parks, and cafes."
    pieces = split(text, first_piece_words=5, min_clause_words=2)
    assert pieces[0] == "The capital of France is"  # at most five words before the first audio
    assert pieces[1:] == ["Paris, a city on the Seine.", "It has many museums, parks, and cafes."]
    assert split("Yes, that works. Fine, thanks.", first_piece_words=5) == ["Yes, that works.", "Fine, thanks."]
    assert split("Well, yes, that works.", first_piece_words=5, min_clause_words=1) == ["Well,", "yes,", "that works."]


def test_text_without_boundaries_is_cut_at_a_space():
    pieces = split("word " * 200, max_chars=100, **WHOLE)
    assert len(pieces) > 5 and all(len(p) <= 100 and not p.endswith("wor") for p in pieces)


# -- what is spoken -------------------------------------------------------------------------------

@pytest.mark.parametrize("text, spoken", [
    ("The warranty is 7 years [1].", "The warranty is 7 years."),
    ("Both agree [2, 3] on it.", "Both agree on it."),
    ("Run `pip install x` first.", "Run first."),
    ("Intro\n```python\nprint(1)\n```\nafter", "Intro. after"),
    ("## Setup\n**Bold** and _italic_ text", "Setup. Bold and italic text"),
    ("> quoted\n- one\n* two\n3. three", "quoted. one. two. three"),
    ("| a | b |\n|---|:---:|\n| 1 | 2 |", "a, b. 1, 2"),
    ("See https://www.example.com/docs?page=2 for more.", "See example.com for more."),
    ("Read [the manual](http://x.org/m.pdf).", "Read the manual."),
    ("  lots   of\n\n  space  ", "lots of. space"),
    ("```\nonly code\n```", ""),
    ("---", ""),
])
def test_speakable(text, spoken):
    assert speakable(text) == spoken


# -- the stream transformer -----------------------------------------------------------------------

ANSWER = "The capital of France is Paris, a city on the Seine. It is large. Its museums are famous"


def _run(stream, text=ANSWER):
    events = []
    for t in tokens(text):
        out = list(stream.feed(TextDelta(t)))
        assert out[0] == TextDelta(t)  # the text passes through unchanged, first
        events += out
    return events, list(stream.finish())


@pytest.mark.parametrize("options", [SpeechOptions(), SpeechOptions(wait_first=False),
                                     SpeechOptions(background=False)], ids=["default", "background", "sync"])
def test_stream_speaks_every_piece_in_order_and_finish_flushes(options):
    tts = FakeTTS(delay_s=0.002)
    stream = SpeechStream(tts, options)
    events, tail = _run(stream)
    chunks = audio(events + tail)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == ANSWER
    assert tts.texts == ["The capital of France is", "Paris, a city on the Seine.", "It is large.",
                         "Its museums are famous"]
    assert [np.frombuffer(c.pcm16, "<i2")[0] for c in chunks] == [1, 2, 3, 4]  # the order they were cut
    assert all(c.sample_rate == 16000 and len(c.pcm16) == 2 * 100 * len(t) for c, t in zip(chunks, tts.texts))
    assert audio(tail) and "museums" in stream.timings[-1].text  # the unfinished sentence came from finish()
    assert [t.text for t in stream.timings] == tts.texts
    assert all(t.emitted_at >= t.ready_at and t.duration_s > 0 for t in stream.timings)


def test_first_audio_comes_with_the_delta_that_completes_the_first_piece():
    stream = SpeechStream(FakeTTS())
    events, _ = _run(stream)
    first = next(i for i, e in enumerate(events) if isinstance(e, AudioChunk))
    assert "".join(e.text for e in events[:first] if isinstance(e, TextDelta)) == "The capital of France is Paris"


def test_other_events_pass_through_and_code_is_not_synthesised():
    tts = FakeTTS()
    stream = SpeechStream(tts, SpeechOptions(background=False))
    assert list(stream.feed(Notice("hello"))) == [Notice("hello")]
    _run(stream, "Use this:\n```\nx = 1. Y = 2.\n```\n")
    assert tts.texts == ["Use this:"]


def test_for_turn_gives_independent_streams_sharing_the_voice():
    tts = FakeTTS()
    root = SpeechStream(tts, SpeechOptions(background=False))
    a, b = root.for_turn("c1"), root.for_turn("c2")
    assert a is not b and a.tts is b.tts is tts and a.options == root.options
    a.feed(TextDelta("Half a sent"))
    b.feed(TextDelta("Other turn. More"))
    a.feed(TextDelta("ence here. Next"))
    assert [t.text for t in a.timings] == ["Half a sentence here."]
    assert [t.text for t in b.timings] == ["Other turn."]


def test_the_voice_is_loaded_when_the_stream_is_made():
    tts = FakeTTS()
    stream = SpeechStream(tts)
    deadline = time.monotonic() + 5
    while not tts.num_loads and time.monotonic() < deadline:
        time.sleep(0.005)
    assert tts.num_loads == 1 and not tts.texts
    stream.finish()


class BrokenTTS(FakeTTS):
    def synthesize(self, text: str) -> np.ndarray:
        raise ModelError("the voice broke")


@pytest.mark.parametrize("background", [True, False])
def test_a_failing_voice_raises_its_error_from_the_stream(background):
    stream = SpeechStream(BrokenTTS(), SpeechOptions(background=background, wait_first=False))
    with pytest.raises(ModelError, match="broke"):
        stream.feed(TextDelta("One sentence. Two"))
        stream.finish()


def test_an_abandoned_stream_stops_its_worker():
    def workers():
        return [t for t in threading.enumerate() if t.name.startswith("tts")]

    before = len(workers())
    stream = SpeechStream(FakeTTS(delay_s=0.01), SpeechOptions(wait_first=False))
    stream.feed(TextDelta("One sentence here. And another "))
    del stream
    gc.collect()
    deadline = time.monotonic() + 5
    while len(workers()) > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(workers()) <= before


def test_a_turn_speaks_before_the_engine_has_finished(tmp_path):
    script = tokens("The capital of France is Paris, on the Seine. It has about two million people. "
                    "Many visit it every year.")
    assistant, _ = make_assistant(tmp_path, script, transformers=[SpeechStream(FakeTTS())])
    with assistant:
        events = list(assistant.turn(None, "Tell me about Paris."))
    deltas = [i for i, e in enumerate(events) if isinstance(e, TextDelta)]
    chunks = [i for i, e in enumerate(events) if isinstance(e, AudioChunk)]
    assert chunks and chunks[0] < deltas[-1]  # audio before the engine's last token
    done = events[-1]
    assert isinstance(done, Done) and done.text == "".join(script)  # audio is not part of the stored answer
    assert len(chunks) == 4  # first sentence in two pieces, then two whole sentences


# -- backends -------------------------------------------------------------------------------------

def test_create_tts_names_the_backends(tmp_path):
    with pytest.raises(ToolUnavailable, match="piper"):
        create_tts("coqui", tmp_path)
    with pytest.raises(ConfigError, match="piper, coqui"):
        create_tts("festival", tmp_path)


def test_piper_refuses_missing_voices_with_the_fix(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        PiperTTS(tmp_path / "nope.onnx")
    with pytest.raises(ModelError, match="no .onnx file"):
        PiperTTS(tmp_path)
    (tmp_path / "voice.onnx").write_bytes(b"x")
    with pytest.raises(ModelError, match="no config"):
        PiperTTS(tmp_path)
    with pytest.raises(ValueError, match="device"):
        PiperTTS(tmp_path / "voice.onnx", device="tpu")


@pytest.mark.real
def test_piper_refuses_a_garbled_voice(tmp_path):
    need(importlib.util.find_spec("piper") is not None, "the piper-tts package", "pip install -e '.[media]'")
    (tmp_path / "voice.onnx").write_bytes(b"not an onnx model")
    (tmp_path / "voice.onnx.json").write_text("{broken", encoding="utf-8")
    with pytest.raises(ModelError, match="config"):
        PiperTTS(tmp_path).sample_rate
    config = json.loads((media_model("joe") / "voice.onnx.json").read_text(encoding="utf-8"))
    (tmp_path / "voice.onnx.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ModelError, match="damaged"):
        PiperTTS(tmp_path).synthesize("Hello.")


@pytest.fixture(scope="module")
def piper():
    need(importlib.util.find_spec("piper") is not None, "the piper-tts package", "pip install -e '.[media]'")
    tts = PiperTTS(media_model("joe"), num_threads=1)
    tts.load()
    return tts


@pytest.mark.real
def test_piper_speaks_a_sentence(piper):
    assert piper.sample_rate == 22050
    assert piper._voice.session.get_session_options().intra_op_num_threads == 1
    samples = piper.synthesize("The warranty lasts seven years.")
    assert samples.dtype == np.int16 and samples.ndim == 1
    seconds = samples.size / piper.sample_rate
    assert 1.0 < seconds < 5.0 and np.abs(samples).max() > 3000  # about 2 s of speech, not silence


@pytest.mark.real
def test_piper_stream_speaks_before_the_last_delta(piper):
    stream = SpeechStream(piper)
    text = ("Replace the HEPA filter every six months, and clean the pre-filter monthly. "
            "The warranty lasts seven years. Keep the receipt.")
    events = []
    for t in tokens(text):
        events += stream.feed(TextDelta(t))
        time.sleep(0.02)  # a fast engine: 50 tokens per second
    events += stream.finish()
    deltas = [i for i, e in enumerate(events) if isinstance(e, TextDelta)]
    chunks = audio(events)
    assert chunks and events.index(chunks[0]) < deltas[-1]
    assert all(c.sample_rate == 22050 and len(c.pcm16) % 2 == 0 for c in chunks)
    assert stream.timings[0].text == "Replace the HEPA filter every"
    assert sum(t.duration_s for t in stream.timings) > 4.0
