"""Hidden-state taps (assistant/engine/taps.py): the engine reads a message's mean hidden states at
chosen layers while it prefills the prompt, and they are the states HF's own forward gives.

On a randomly initialised tiny Qwen2 (4 layers) with the real tokenizer, as tests/test_engine_local.py.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from assistant.config import AssistantConfig
from assistant.engine.base import SamplingParams
from assistant.engine.taps import HiddenTap, generate_kwargs, tap_source
from tests.conftest import tiny_qwen

pytestmark = pytest.mark.real

TEXT = "how do I kill a zombie process on linux"
GREEDY = SamplingParams(max_tokens=3, temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, models_dir):
    from assistant.engine.loading import load_model

    path = tiny_qwen(models_dir, tmp_path_factory.mktemp("tiny-qwen-taps"), num_layers=4)
    config = AssistantConfig.load(env={}, overrides={"engine.model": str(path), "engine.num_threads": 1,
                                                     "engine.kv_cache_mb": 8, "engine.block_size": 4,
                                                     "engine.speculation": "off"})
    return config, load_model(config)


def _engine(tiny, quantize: str):
    from assistant.engine.local import LocalEngine

    config, loaded = tiny
    return LocalEngine(loaded, replace(config.engine, quantize=quantize))


def _ids(tokenizer, before: str, text: str, after: str) -> tuple[list[int], tuple[int, int]]:
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    head, body = enc(before), enc(text)
    return head + body + enc(after), (len(head), len(head) + len(body))


def _tapped(engine, ids, layers=(1, 3, 4), text=TEXT) -> tuple[HiddenTap, list[int]]:
    tap = HiddenTap(text, layers)
    out = [t for d in engine.generate(ids, GREEDY, tap=tap) for t in d.token_ids]
    return tap, out


def test_a_tap_gives_hfs_hidden_states_of_the_message(tiny):
    """fp32 engine, a 40-odd-token prompt prefilled in one step: the tap is the mean, over the message's
    own tokens, of HF's hidden_states[k] for each tapped k (the residual stream after k layers); the
    answer is the untapped one."""
    import torch

    engine = _engine(tiny, "none")
    try:
        ids, span = _ids(engine.tokenizer, "<|im_start|>system\nYou are helpful and careful.<|im_end|>\n"
                         "<|im_start|>user\n", TEXT, "<|im_end|>\n<|im_start|>assistant\n")
        tap, tapped_answer = _tapped(engine, ids, layers=(1, 2, 3))
        features = tap.wait(10)
        assert tap.span == span and features is not None and features.shape == (3 * 64,)
        with torch.inference_mode():  # (HF's last entry is after the final norm: the taps read residual states)
            states = tiny[1].model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        want = np.concatenate([states[k][0, span[0]:span[1]].mean(0).numpy() for k in (1, 2, 3)])
        assert np.abs(features - want).max() < 1e-4 * np.abs(want).max()
        plain = [t for d in engine.generate(ids, GREEDY) for t in d.token_ids]
        assert tapped_answer == plain
    finally:
        engine.close()


def test_native_layer_runs_tap_the_same_states_as_the_layer_loop(tiny):
    """int8 with the native kernels: a short prompt's step runs as native layer runs split at the tapped
    layers (csrc/decode_stack.cpp); their taps equal the Python layer loop's, to the bit."""
    from assistant.engine import native

    if native.unavailable_reason() is not None:
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    stacked, looped = _engine(tiny, "int8"), _engine(tiny, "int8")
    try:
        assert stacked.model.stack is not None
        looped.model.stack = None
        ids, _ = _ids(stacked.tokenizer, "user: ", TEXT, " ok")
        assert len(ids) <= 16  # one natively attending step
        taps = [_tapped(e, ids)[0].wait(10) for e in (stacked, looped)]
        assert taps[0] is not None and np.array_equal(taps[0], taps[1])
        assert {(0, 1), (1, 3), (3, 4)} <= set(stacked.model._stacks)  # the runs between layers 1, 3 and 4
    finally:
        stacked.close()
        looped.close()


def test_a_cached_prefix_and_a_busy_batch_change_no_tapped_state(tiny):
    """The same prompt again (its blocks now in the prefix cache) and the prompt prefilled beside a
    decoding request, in chunks: the span is still computed by the request, and the taps agree."""
    engine = _engine(tiny, "none")
    try:
        ids, _ = _ids(engine.tokenizer, "<|im_start|>system\nA fixed system prompt, long enough to fill "
                      "several blocks of four tokens.<|im_end|>\n<|im_start|>user\n", TEXT, "<|im_end|>\n")
        first = _tapped(engine, ids)[0].wait(10)
        cached = _tapped(engine, ids)[0]
        assert cached.wait(10) is not None and engine.stats()["prefix_cache_hits"] > 0
        np.testing.assert_allclose(cached.features, first, rtol=1e-5, atol=1e-6)
        engine.scheduler.prefill_chunk = 4  # chunked while another request decodes
        other = engine.generate(list(range(100, 140)), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
        next(other)
        busy = _tapped(engine, ids)[0]
        list(other)
        assert busy.wait(10) is not None
        np.testing.assert_allclose(busy.features, first, rtol=1e-4, atol=1e-5)
    finally:
        engine.close()


def test_a_tap_is_declined_where_it_cannot_be_filled(tiny):
    """No span (the text is not in the prompt), a cancelled request, and routing to an engine whose
    states are not the reader's: each declines, with a reason, and no wait hangs."""
    engine = _engine(tiny, "none")
    try:
        ids, _ = _ids(engine.tokenizer, "user: ", "something else entirely", " ok")
        tap, answer = _tapped(engine, ids)
        assert tap.settled and tap.wait(0) is None and "not found" in tap.reason and len(answer) == 3
        import threading

        cancel = threading.Event()
        cancel.set()
        tap = HiddenTap(TEXT, (1,))
        list(engine.generate(_ids(engine.tokenizer, "u: ", TEXT, "")[0], GREEDY, cancel=cancel, tap=tap))
        assert tap.wait(5) is None and tap.reason
        with pytest.raises(ValueError, match="no hidden state 9"):
            engine.generate(ids, GREEDY, tap=HiddenTap(TEXT, (9,)))
        other = HiddenTap(TEXT, (1,), source="qwen2.5-coder-0.5b-engine-int8-cpu")
        assert tap_source(engine) != other.source
        assert "tap" not in generate_kwargs(engine, other, {}) and other.settled and other.features is None
        mine = HiddenTap(TEXT, (1,), source=tap_source(engine))
        assert generate_kwargs(engine, mine, {"cancel": None})["tap"] is mine and not mine.settled
    finally:
        engine.close()
