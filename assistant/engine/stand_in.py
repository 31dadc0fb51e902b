"""Random-weight stand-ins of the packaged models' shapes, for measuring the engine where the weights
cannot travel (a lent GPU machine takes the working tree, not data/models).

Speed does not depend on weight values, and correctness is checked against HF's forward on the same
random weights, so a stand-in is a Qwen2 model built from the real config (every shape of
Qwen2.5-0.5B / 1.5B) with HF's own random initialisation, plus a word-level tokenizer of the same
vocabulary size built in code ("w0 w1 ..."), which the engine's detokenizer and stop strings accept
like any other. bench/gpu.py and tests/test_engine_cuda.py use them; nothing in the product does.
"""

from __future__ import annotations

from typing import Any

# the Qwen2.5 releases' config.json, shape fields only. The packaged GGUF conversions keep the output matrix
# apart from the embedding (tie_word_embeddings false): a decode step reads the same bytes either way
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    # for tests: the same architecture, small enough to build in a second; weights 5x HF's default scale, so
    # that greedy answers vary (at 0.02 the tied embedding dominates and the model repeats one token)
    "tiny": dict(vocab_size=2048, hidden_size=128, intermediate_size=352, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.1),
}


def word_tokenizer(vocab_size: int) -> Any:
    """A transformers fast tokenizer whose token i is the word "w{i}" (decoding joins words with spaces)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0")


def random_model(shape: str, *, dtype: Any, device: Any, seed: int = 0, name: str | None = None) -> Any:
    """A LoadedModel (engine/loading.py) of `shape` with random weights (HF's init, seeded)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from assistant.engine.loading import LoadedModel

    fields = SHAPES[shape]
    config = Qwen2Config(**fields, eos_token_id=fields["vocab_size"] - 1, bos_token_id=None, pad_token_id=0,
                         architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    return LoadedModel(model=model, tokenizer=word_tokenizer(fields["vocab_size"]), device=torch.device(device),
                       name=name or f"{shape}-random", context_window=min(fields["max_position_embeddings"], 32768))
