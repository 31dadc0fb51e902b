"""/v1/audio/* and image_url parts, through the official `openai` SDK, with fake voice and vision
backends behind the real Modalities (the real models are exercised in test_media_real.py)."""

from __future__ import annotations

import base64
import io
import wave
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from assistant.errors import AssistantError
from assistant.modalities import Modalities
from tests.conftest import require_module, serve_in_thread
from tests.gateway_fakes import assert_openai_error, bearer, make_app

openai = require_module("openai")
require_module("tools.audio")
require_module("tools.tts")

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n fake").decode()


class FakeSTT:
    def __init__(self):
        self.heard = []

    def transcribe(self, data, *, name="", language=None):
        if data == b"not audio":
            raise AssistantError("q.txt is not an audio file: record again, or send wav/mp3/ogg/webm/flac.")
        self.heard.append((data, name, language))
        seg = SimpleNamespace(start=0.0, end=1.5, text=" Hello there.", avg_logprob=-0.2, no_speech_prob=0.01)
        return SimpleNamespace(text="Hello there.", language="en", duration_s=1.5, segments=(seg,))


class FakeTTS:
    sample_rate = 16000

    def __init__(self):
        self.said = []

    def synthesize(self, text):
        self.said.append(text)
        return np.zeros(1600, dtype=np.int16)


class FakeDescriber:
    def describe(self, data, *, name=""):
        if not data.startswith(b"\x89PNG"):
            raise AssistantError(f"{name} is not a picture: send a PNG, JPEG, WebP or GIF.")
        return SimpleNamespace(compact=lambda: "a drawing, 8x8; likely: toaster (0.70); text read: none")


@pytest.fixture
def served(tmp_path):
    fakes = SimpleNamespace(stt=FakeSTT(), tts=FakeTTS(), describer=FakeDescriber())
    media = lambda config: Modalities(config, stt=fakes.stt, tts=fakes.tts, describer=fakes.describer)  # noqa: E731
    assistant, engine, app = make_app(tmp_path, media=media)
    with serve_in_thread(app, timeout_s=20) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="not-needed-on-loopback", max_retries=0)
        yield SimpleNamespace(assistant=assistant, engine=engine, client=client, url=url, **vars(fakes))


def test_transcriptions_in_every_response_format(served):
    r = served.client.audio.transcriptions.create(model="whisper-1", file=("q.webm", b"webm bytes"), language="en")
    assert r.text == "Hello there." and served.stt.heard == [(b"webm bytes", "q.webm", "en")]
    text = served.client.audio.transcriptions.create(model="whisper-tiny.en", file=("q.wav", b"x"),
                                                     response_format="text")
    assert text.strip() == "Hello there."
    srt = served.client.audio.transcriptions.create(model="whisper-1", file=("q.wav", b"x"), response_format="srt")
    assert srt.strip() == "1\n00:00:00,000 --> 00:00:01,500\nHello there."
    verbose = served.client.audio.transcriptions.create(model="whisper-1", file=("q.wav", b"x"),
                                                        response_format="verbose_json")
    assert verbose.language == "en" and verbose.duration == 1.5 and verbose.segments[0].end == 1.5


def test_a_bad_recording_or_model_is_a_4xx_in_openais_shape(served):
    with pytest.raises(openai.BadRequestError, match="not an audio file"):
        served.client.audio.transcriptions.create(model="whisper-1", file=("q.txt", b"not audio"))
    with pytest.raises(openai.NotFoundError, match="not a speech-to-text model"):
        served.client.audio.transcriptions.create(model="piper-en_US-joe-medium", file=("q.wav", b"x"))
    no_file = httpx.post(f"{served.url}/v1/audio/transcriptions", data={"model": "whisper-1"})
    assert "file" in assert_openai_error(no_file, 400)["message"]


def test_speech_is_encoded_as_asked_and_markup_is_not_spoken(served):
    audio = served.client.audio.speech.create(model="tts-1", voice="alloy", input="**Hello** [1] world.",
                                              response_format="wav")
    with wave.open(io.BytesIO(audio.content)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getnframes()) == (16000, 1, 1600)
    assert served.tts.said == ["Hello world."]
    mp3 = served.client.audio.speech.create(model="tts-1", voice="alloy", input="Hi.", response_format="mp3")
    assert mp3.content[:3] == b"ID3" or mp3.content[0] == 0xFF


def test_speech_refuses_empty_input_unknown_formats_and_models(served):
    with pytest.raises(openai.BadRequestError, match="non-empty"):
        served.client.audio.speech.create(model="tts-1", voice="alloy", input="  ")
    with pytest.raises(openai.BadRequestError, match="response_format"):
        served.client.audio.speech.create(model="tts-1", voice="alloy", input="Hi.", response_format="aiff")
    with pytest.raises(openai.NotFoundError):
        served.client.audio.speech.create(model="whisper-1", voice="alloy", input="Hi.")


def test_a_picture_in_a_raw_chat_reaches_the_model_as_its_description(served):
    served.engine.add("A toaster.")
    r = served.client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]}])
    assert r.choices[0].message.content == "A toaster."
    user = served.engine.prompts[-1][-1]
    assert user["content"] == "[image 1: a drawing, 8x8; likely: toaster (0.70); text read: none]\nWhat is this?"


def test_a_picture_sent_to_the_assistant_model_goes_through_the_turn(served):
    served.engine.add("It looks like a toaster.")
    r = served.client.chat.completions.create(model="assistant", messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]}])
    conversation = r.model_extra["conversation_id"]
    (user, _answer) = served.assistant.conversations.history(conversation)
    assert user.meta["images"] == ["image 1 (image-1): a drawing, 8x8; likely: toaster (0.70); text read: none"]
    assert open(user.meta["image_files"][0], "rb").read().startswith(b"\x89PNG")


def test_bad_pictures_are_400s(served):
    for url, why in ((f"data:image/png;base64,{base64.b64encode(b'GIF89a').decode()}", "not a picture"),
                     ("https://example.com/cat.png", "only data: URLs")):
        with pytest.raises(openai.BadRequestError, match=why):
            served.client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}]}])


def test_audio_endpoints_need_a_key_when_keys_are_configured(tmp_path):
    fakes = lambda config: Modalities(config, stt=FakeSTT(), tts=FakeTTS())  # noqa: E731
    _, _, app = make_app(tmp_path, media=fakes, api_keys="sk-one")
    with serve_in_thread(app, timeout_s=20) as url:
        assert_openai_error(httpx.post(f"{url}/v1/audio/speech", json={"model": "tts-1", "input": "Hi."}), 401)
        ok = httpx.post(f"{url}/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "response_format": "wav"},
                        headers=bearer("sk-one"))
        assert ok.status_code == 200 and ok.headers["content-type"] == "audio/wav"


def _sse(body: str) -> list[tuple[str, dict]]:
    import json

    out = []
    for block in body.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_the_turn_endpoint_takes_a_recording_and_pictures_and_streams_speech(served):
    served.engine.add("It is a toaster. It toasts.")
    body = {"audio": {"name": "q.webm", "data": base64.b64encode(b"webm bytes").decode()},
            "images": [{"name": "t.png", "data": PNG}], "speak": True}
    r = httpx.post(f"{served.url}/api/turns", json=body, timeout=30)
    assert r.status_code == 200, r.text
    events = _sse(r.text)
    kinds = [k for k, _ in events]
    assert kinds[:2] == ["transcribed", "image_described"] and kinds[-1] == "done"
    audio = [d for k, d in events if k == "audio"]
    assert audio and all(len(base64.b64decode(a["pcm16_b64"])) == a["num_bytes"] == 3200 for a in audio)
    assert served.tts.said == ["It is a toaster.", "It toasts."]
    assert served.stt.heard == [(b"webm bytes", "q.webm", None)]


def test_the_turn_endpoint_wants_something_to_answer(served):
    assert httpx.post(f"{served.url}/api/turns", json={"text": "  "}).status_code == 422
    bad = httpx.post(f"{served.url}/api/turns", json={"audio": {"name": "q.wav", "data": "***"}})
    assert bad.status_code == 422 and "base64" in bad.text
