"""The engine's CUDA path (engine/cuda_graphs.py) on random-weight stand-ins (engine/stand_in.py).

The first tests run anywhere: graphed decode steps without capture (padding rows, the scratch block,
length buckets) against model.py's eager forward on the CPU. The rest need a GPU: CI has none, so
they skip there, even under ASSISTANT_REQUIRE_REAL=1; on a lent GPU machine run them with
ASSISTANT_REQUIRE_CUDA=1, which turns a missing GPU into a failure:

    ASSISTANT_REQUIRE_CUDA=1 python -m pytest tests/test_engine_cuda.py
"""

from __future__ import annotations

import copy
import os
import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from assistant.config import EngineConfig  # noqa: E402
from assistant.engine.base import SamplingParams  # noqa: E402
from assistant.engine.cuda_graphs import DecodeGraphs, batch_buckets, length_buckets  # noqa: E402
from assistant.engine.kv_cache import KVCache  # noqa: E402
from assistant.engine.model import SeqBatch, Transformer  # noqa: E402
from assistant.engine.stand_in import random_model  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if os.environ.get("ASSISTANT_REQUIRE_CUDA") == "1":
    assert HAS_CUDA, "ASSISTANT_REQUIRE_CUDA=1 but torch sees no CUDA device"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (CI has none; run on a lent device)")


def test_buckets_cover_every_size_with_at_most_a_third_of_padding_past_16():
    sizes = batch_buckets(128)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 128
    for n in range(17, 129):
        padded = min(s for s in sizes if s >= n)
        assert padded - n < max(n / 3, 1), (n, padded)
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert length_buckets(1000, 16) == [256, 512, 1008]
    assert length_buckets(300, 16)[-1] >= 300


def prefilled(model, kv, prompts, tables):
    """Prefill each prompt through the eager forward into its blocks."""
    for ids, table in zip(prompts, tables):
        slots = KVCache.slots(kv, table, len(ids))
        model.forward(torch.tensor(ids, device=kv.k[0].device), torch.arange(len(ids), device=kv.k[0].device),
                      [SeqBatch(0, len(ids), len(ids), slots, len(ids))], kv)


def decode_case(device, dtype):
    loaded = random_model("tiny", dtype=dtype, device=device, seed=1)
    model = Transformer.from_hf(loaded.model)
    a, bs, scratch = model.args, 16, 12
    kv = KVCache(a.num_layers, scratch + 1, bs, a.num_kv_heads, a.head_dim, dtype, device)
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 17, 40]
    prompts = [torch.randint(1, a.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    tables = [[3], [0, 7], [1, 2, 5]]  # scattered blocks, each with room for the next token
    with torch.inference_mode():
        prefilled(model, kv, prompts, tables)
    return model, kv, prompts, tables, scratch


def eager_decode(model, kv, prompts, tables, next_tokens):
    device = kv.k[0].device
    seqs = [SeqBatch(i, 1, len(p) + 1, KVCache.slots(kv, t, len(p) + 1), len(p)) for i, (p, t) in
            enumerate(zip(prompts, tables))]
    return model.forward(torch.tensor(next_tokens, device=device), torch.tensor([len(p) for p in prompts],
                         device=device), seqs, kv)


def test_a_padded_decode_step_equals_the_eager_forward_and_writes_only_its_own_slots():
    model, kv, prompts, tables, scratch = decode_case("cpu", torch.float32)
    twin = copy.deepcopy(kv)
    next_tokens = [11, 22, 33]
    with torch.inference_mode():
        expected = eager_decode(model, kv, prompts, tables, next_tokens)
        graphs = DecodeGraphs(model, twin, scratch_block=scratch, max_batch=8, max_len=512, capture=False)
        got = graphs.run(next_tokens, [len(p) for p in prompts], tables)
    assert graphs.bucket(3, 41) == (4, 256)  # one padding row, the shortest length bucket
    assert got.shape == expected.shape == (3, model.args.vocab_size)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
    real = slice(0, scratch * kv.block_size)  # every block but the scratch one: identical KV after the step
    for layer in range(model.args.num_layers):
        torch.testing.assert_close(twin.k[layer][real], kv.k[layer][real], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(twin.v[layer][real], kv.v[layer][real], atol=1e-5, rtol=1e-5)


def test_a_row_past_the_first_length_bucket_reads_its_whole_context():
    loaded = random_model("tiny", dtype=torch.float32, device="cpu", seed=2)
    model = Transformer.from_hf(loaded.model)
    a, bs = model.args, 16
    kv = KVCache(a.num_layers, 40, bs, a.num_kv_heads, a.head_dim, torch.float32, "cpu")
    prompt = torch.randint(1, a.vocab_size, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    table = list(range(20))
    twin = copy.deepcopy(kv)
    with torch.inference_mode():
        prefilled(model, kv, [prompt], [table])
        prefilled(model, twin, [prompt], [table])
        expected = eager_decode(model, kv, [prompt], [table], [7])
        graphs = DecodeGraphs(model, twin, scratch_block=39, max_batch=4, max_len=600, capture=False)
        got = graphs.run([7], [300], [table])
    assert graphs.bucket(1, 301) == (1, 512)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


# -- on a GPU --------------------------------------------------------------------------------------

def cuda_engine(dtype=torch.float32, seed=0, **overrides):
    from assistant.engine.local import LocalEngine

    config = EngineConfig(**{"max_num_seqs": 8, "kv_cache_mb": 64, "speculation": "off", **overrides})
    loaded = random_model("tiny", dtype=dtype, device="cuda", seed=seed)
    return loaded, LocalEngine(loaded, config)


def answer(engine, prompt, n=24):
    ids: list[int] = []
    for delta in engine.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True)):
        ids.extend(delta.token_ids)
    return ids


def prompts(count, length=20, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 2000, (length + 3 * i,), generator=gen).tolist() for i in range(count)]


@gpu
def test_greedy_output_equals_hf_generate_on_the_same_weights():
    loaded, engine = cuda_engine()
    try:
        prompt = prompts(1)[0]
        got = answer(engine, prompt, 32)
        with torch.inference_mode():
            out = loaded.model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=32, do_sample=False,
                                        min_new_tokens=32, pad_token_id=0)
        assert got == out[0, len(prompt):].tolist()
        assert len(set(got)) >= 16  # a real answer, not one token repeated
        assert engine.stats()["graph_replays"] >= 31  # every step after the prefill replayed a graph
    finally:
        engine.close()


@gpu
def test_batched_equals_sequential():
    _, engine = cuda_engine()
    try:
        batch = prompts(6, seed=1)
        alone = [answer(engine, p) for p in batch]
        together: list[list[int]] = [[] for _ in batch]

        def run(i):
            together[i] = answer(engine, batch[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batch))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert together == alone
    finally:
        engine.close()


@gpu
def test_a_prefix_hit_equals_a_cold_start():
    prompt = prompts(1, length=70, seed=2)[0]
    _, cold_engine = cuda_engine(prefix_cache=False)
    try:
        cold = answer(cold_engine, prompt)
    finally:
        cold_engine.close()
    _, engine = cuda_engine()
    try:
        first = answer(engine, prompt)
        hits = engine.stats()["prefix_cache_hits"]
        second = answer(engine, prompt)
        assert engine.stats()["prefix_cache_hits"] - hits >= 64  # the second prompt's first 4 blocks were cached
        assert first == cold and second == cold
    finally:
        engine.close()


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cuda_graph_step_equals_an_eager_step(dtype):
    model, kv, prompts_, tables, scratch = decode_case("cuda", dtype)
    twin = copy.deepcopy(kv)
    positions = [len(p) for p in prompts_]
    with torch.inference_mode():
        eager = DecodeGraphs(model, kv, scratch_block=scratch, max_batch=8, max_len=512, capture=False)
        graphed = DecodeGraphs(model, twin, scratch_block=scratch, max_batch=8, max_len=512)
        assert graphed.capture
        expected = eager.run([11, 22, 33], positions, tables).clone()
        got = graphed.run([11, 22, 33], positions, tables).clone()
    assert torch.equal(got, expected), f"largest difference {(got - expected).abs().max().item()}"
    assert graphed.stats()["cuda_graphs"] == 1


def tiny_sentence_model(path):
    """A random-weight BERT sentence-transformers directory (the packaged MiniLM's architecture, tiny)."""
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertConfig, BertModel, BertTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words += "the a kill process shoot photo run script page table".split()
    (path / "vocab.txt").write_text("\n".join(words) + "\n")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64)).save_pretrained(path / "bert")
    BertTokenizerFast(str(path / "vocab.txt")).save_pretrained(path / "bert")
    bert = models.Transformer(str(path / "bert"))
    SentenceTransformer(modules=[bert, models.Pooling(32)], device="cpu").save(str(path / "st"))
    return path / "st"


@gpu
def test_the_embedder_runs_on_cuda_when_present_and_agrees_with_the_cpu(tmp_path):
    from ingest.embed import SentenceTransformerEmbedder

    model_dir = tiny_sentence_model(tmp_path)
    texts = ["kill the process", "shoot a photo", "run the script page"]
    on_gpu = SentenceTransformerEmbedder(model_dir)  # device "auto"
    on_cpu = SentenceTransformerEmbedder(model_dir, device="cpu")
    assert on_gpu.model.device.type == "cuda"
    import numpy as np

    np.testing.assert_allclose(on_gpu.embed(texts), on_cpu.embed(texts), atol=1e-4)


@gpu
def test_openai_whisper_transcribes_on_cuda_in_float16(tmp_path):
    """A random-weight Whisper (the base model's layout, tiny) through the product's STT backend: it
    loads on CUDA and decodes in float16. faster-whisper's CTranslate2 wheels need CUDA 12's cuBLAS,
    which a lent machine (CUDA 13) lacks and which is too large to carry, so this is the CUDA STT check."""
    whisper = pytest.importorskip("whisper")
    import dataclasses

    import numpy as np

    from tools.speech import OpenAIWhisperSTT

    dims = whisper.model.ModelDimensions(n_mels=80, n_audio_ctx=1500, n_audio_state=64, n_audio_head=2,
                                         n_audio_layer=1, n_vocab=51865, n_text_ctx=448, n_text_state=64,
                                         n_text_head=2, n_text_layer=1)
    torch.manual_seed(0)
    model = whisper.model.Whisper(dims)
    with torch.no_grad():
        for p in model.parameters():  # some are torch.empty (loaded from a checkpoint in real use)
            p.normal_(0, 0.02)
    checkpoint = tmp_path / "tiny-random.pt"
    torch.save({"dims": dataclasses.asdict(dims), "model_state_dict": model.state_dict()}, checkpoint)
    stt = OpenAIWhisperSTT(checkpoint, vad=False, language="en")
    t = np.arange(2 * 16000) / 16000
    transcript = stt.transcribe_samples((0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 3 * t)))
                                        .astype(np.float32))
    model = stt._model
    assert next(model.parameters()).is_cuda
    assert transcript.duration_s == 2.0 and isinstance(transcript.text, str)
