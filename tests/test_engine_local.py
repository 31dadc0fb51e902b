"""LocalEngine plumbing on a randomly initialised tiny Qwen2 (real tokenizer + chat template).

Loads the model through the "local HF directory" path, exactly like a user's own checkpoint would.
"""

import shutil
import threading

import pytest

from assistant.config import AssistantConfig
from assistant.engine.base import SamplingParams
from tests.real import prepared_default_model

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    import os
    from pathlib import Path

    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from assistant.engine.local import LocalEngine

    from tests.conftest import REPO_ROOT

    models_dir = Path(os.environ.get("ASSISTANT_MODELS_DIR", REPO_ROOT / "data" / "models"))
    source = prepared_default_model(models_dir)
    tiny = tmp_path_factory.mktemp("tiny-qwen")
    tokenizer = AutoTokenizer.from_pretrained(source)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         eos_token_id=151645, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(tiny)
    tokenizer.save_pretrained(tiny)
    for name in ("generation_config.json",):
        shutil.copy(source / name, tiny / name)
    cfg = AssistantConfig.load(env={}, overrides={"engine.model": str(tiny), "engine.num_threads": 1})
    return LocalEngine.from_config(cfg)


MESSAGES = [{"role": "user", "content": "Say something."}]


def _run(engine, params, **kw):
    deltas = list(engine.generate(MESSAGES, params, **kw))
    return "".join(d.text for d in deltas), deltas


def test_stream_matches_full_decode_and_greedy_is_deterministic(engine):
    text, deltas = _run(engine, SamplingParams(max_tokens=24))
    ids = [t for d in deltas for t in d.token_ids]
    assert text == engine.tokenizer.decode([t for t in ids if t not in engine.eos_ids], skip_special_tokens=True)
    assert _run(engine, SamplingParams(max_tokens=24))[0] == text
    assert deltas[-1].finish_reason in ("stop", "length")
    assert deltas[-1].num_prompt_tokens == engine.count_tokens(MESSAGES)


def test_max_tokens_gives_length(engine):
    _, deltas = _run(engine, SamplingParams(max_tokens=5))
    eos = any(t in engine.eos_ids for d in deltas for t in d.token_ids)
    assert eos or (deltas[-1].finish_reason == "length" and deltas[-1].num_generated_tokens == 5)


def test_stop_string_cuts_the_answer(engine):
    text, _ = _run(engine, SamplingParams(max_tokens=40))
    if len(text) < 12:
        pytest.skip("random model stopped too early to pick a stop string")
    stop = text[6:9]
    cut, deltas = _run(engine, SamplingParams(max_tokens=40, stop=(stop,)))
    assert cut == text[: text.find(stop)] and deltas[-1].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(engine):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=7)
    assert _run(engine, params)[0] == _run(engine, params)[0]


def test_cancel_and_close_free_the_engine(engine):
    cancel = threading.Event()
    stream = engine.generate(MESSAGES, SamplingParams(max_tokens=200), cancel=cancel)
    next(stream)
    cancel.set()
    last = list(stream)[-1]
    assert last.finish_reason == "cancelled"
    abandoned = engine.generate(MESSAGES, SamplingParams(max_tokens=200))
    next(abandoned)
    abandoned.close()  # client gone: the lock must be released
    result = []
    worker = threading.Thread(target=lambda: result.append(_run(engine, SamplingParams(max_tokens=3))))
    worker.start()
    worker.join(timeout=60)
    assert result, "engine still locked after the stream was closed"


def test_prompt_longer_than_window_is_refused(engine):
    from assistant.errors import EngineError

    with pytest.raises(EngineError, match="context window"):
        list(engine.generate([{"role": "user", "content": "word " * 600}], SamplingParams(max_tokens=4)))
