"""CTranslate2 Whisper (model.bin) -> an openai-whisper checkpoint (.pt), so the openai-whisper backend
can run the packaged tiny.en/base weights without any download.

`read_ct2_model(path)` reads CTranslate2's binary format, the inverse of
`ctranslate2.specs.model_spec.ModelSpec._serialize` (binary version 6):

    u32 version | str spec name | u32 revision | u32 num_variables
    num_variables x (str name | u8 ndim | ndim x u32 dim | u8 dtype id | u32 num_bytes | raw data)
    u32 num_aliases | num_aliases x (str alias | str variable name)

where str is u16 length (including a trailing NUL), the UTF-8 bytes and the NUL; integers are little
endian; dtype ids follow `_dtype_to_type_id` (float32, int8, int16, int32, float16, bfloat16).
Quantized weights sit beside a `<name>_scale` variable (int8: one float32 scale per output row, the
weight was multiplied by it; int16: one scalar) and are divided back here.

Design note: the layers match one to one except that CTranslate2 fuses projections. Self-attention's
`linear_0` is [query; key; value] stacked on the output axis, cross-attention's `linear_1` is
[key; value]; both are split in three or two equal parts. The key projection has no bias in Whisper,
so its slice of a fused bias (zeros) is dropped. The output projection is tied to the token embedding
in both layouts. Everything is converted to float32 (openai-whisper casts to fp16 itself on CUDA).
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any

import numpy as np

from assistant.errors import ModelError

__all__ = ["convert_ct2_to_openai", "read_ct2_model", "to_openai_checkpoint"]

SUPPORTED_VERSIONS = (6,)  # what ctranslate2 4.x writes (the only layout checked against its writer)
DTYPES = (np.float32, np.int8, np.int16, np.int32, np.float16, "bfloat16")  # by CTranslate2 type id
ENCODER_LAYER = {  # CTranslate2 name inside encoder/layer_N -> openai-whisper name inside encoder.blocks.N
    "self_attention/layer_norm": "attn_ln", "self_attention/linear_1": "attn.out",
    "ffn/layer_norm": "mlp_ln", "ffn/linear_0": "mlp.0", "ffn/linear_1": "mlp.2",
}
DECODER_LAYER = ENCODER_LAYER | {
    "attention/layer_norm": "cross_attn_ln", "attention/linear_0": "cross_attn.query",
    "attention/linear_2": "cross_attn.out",
}
FUSED = {  # fused projection -> the openai-whisper modules it splits into, in order
    "self_attention/linear_0": ("attn.query", "attn.key", "attn.value"),
    "attention/linear_1": ("cross_attn.key", "cross_attn.value"),
}
PARAM = {"weight": "weight", "bias": "bias", "gamma": "weight", "beta": "bias"}


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        size = self.take("H")
        text = self.data[self.pos:self.pos + size - 1].decode("utf-8")
        self.pos += size
        return text

    def raw(self, size: int) -> bytes:
        if self.pos + size > len(self.data):
            raise ValueError("the file ends inside a variable")
        chunk = self.data[self.pos:self.pos + size]
        self.pos += size
        return chunk


def read_ct2_model(path: Path) -> tuple[str, dict[str, np.ndarray]]:
    """(spec name, variables by name), quantized weights divided back to float32, aliases resolved."""
    try:
        reader = _Reader(Path(path).read_bytes())
        version = reader.take("I")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"binary version {version}; this reader knows {SUPPORTED_VERSIONS} "
                             "(re-convert with ctranslate2 4)")
        spec, _revision, num_variables = reader.string(), reader.take("I"), reader.take("I")
        variables = {}
        for _ in range(num_variables):
            name, ndim = reader.string(), reader.take("B")
            shape = tuple(reader.take("I") for _ in range(ndim))
            dtype, num_bytes = DTYPES[reader.take("B")], reader.take("I")
            variables[name] = _array(reader.raw(num_bytes), dtype, shape)
        variables = _dequantize(variables)
        for _ in range(reader.take("I")):
            alias, target = reader.string(), reader.string()
            if target in variables:  # a scale's alias has nothing left to point at
                variables[alias] = variables[target]
    except (OSError, ValueError, IndexError, KeyError, struct.error, UnicodeDecodeError) as e:
        raise ModelError(f"Cannot read the CTranslate2 model {path} ({e}): prepare it again or check the path.") from e
    return spec, variables


def _array(raw: bytes, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    if dtype == "bfloat16":  # numpy has no bfloat16: it is the top half of a float32
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return np.frombuffer(raw, dtype).reshape(shape)


def _dequantize(variables: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The variables without their `_scale`s, each quantized one divided by its scale (float32)."""
    out = {}
    for name, value in variables.items():
        if name.endswith("_scale"):
            continue
        scale = variables.get(name + "_scale")
        if name + "_zero" in variables:
            raise ValueError(f"{name} uses AWQ/GPTQ zero points, which this converter does not read")
        if scale is not None and value.dtype in (np.int8, np.int16):
            rows = value.reshape(value.shape[0], -1).astype(np.float32)
            value = (rows / (scale.reshape(-1, 1) if scale.ndim else scale)).reshape(value.shape)
        out[name] = value
    return out


def to_openai_checkpoint(variables: dict[str, np.ndarray]) -> dict[str, Any]:
    """{"dims": ModelDimensions as a dict, "model_state_dict": openai-whisper tensor names -> float32 tensors}."""
    import torch

    num_layers = {side: len({n.split("/")[1] for n in variables if re.match(rf"{side}/layer_\d+/", n)})
                  for side in ("encoder", "decoder")}
    embedding = variables["decoder/embeddings/weight"]  # (n_vocab, n_text_state)
    conv1 = variables["encoder/conv1/weight"]  # (n_audio_state, n_mels, 3)
    dims = {
        "n_mels": conv1.shape[1], "n_audio_ctx": variables["encoder/position_encodings/encodings"].shape[0],
        "n_audio_state": conv1.shape[0], "n_audio_head": int(variables["encoder/num_heads"]),
        "n_audio_layer": num_layers["encoder"], "n_vocab": embedding.shape[0],
        "n_text_ctx": variables["decoder/position_encodings/encodings"].shape[0], "n_text_state": embedding.shape[1],
        "n_text_head": int(variables["decoder/num_heads"]), "n_text_layer": num_layers["decoder"],
    }
    state: dict[str, np.ndarray] = {
        "encoder.positional_embedding": variables["encoder/position_encodings/encodings"],
        "decoder.positional_embedding": variables["decoder/position_encodings/encodings"],
        "decoder.token_embedding.weight": embedding,
    }
    for ct2, ours in (("encoder/conv1", "encoder.conv1"), ("encoder/conv2", "encoder.conv2"),
                      ("encoder/layer_norm", "encoder.ln_post"), ("decoder/layer_norm", "decoder.ln")):
        state |= _params(variables, ct2, ours)
    for side, table in (("encoder", ENCODER_LAYER), ("decoder", DECODER_LAYER)):
        for i in range(num_layers[side]):
            prefix = f"{side}/layer_{i}"
            for ct2, ours in table.items():
                state |= _params(variables, f"{prefix}/{ct2}", f"{side}.blocks.{i}.{ours}")
            for ct2, parts in FUSED.items():
                if f"{prefix}/{ct2}/weight" in variables:
                    state |= _split(variables, f"{prefix}/{ct2}", [f"{side}.blocks.{i}.{p}" for p in parts])
    tensors = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in state.items()}  # writable copies
    return {"dims": dims, "model_state_dict": tensors}


def _params(variables: dict[str, np.ndarray], ct2: str, ours: str) -> dict[str, np.ndarray]:
    return {f"{ours}.{PARAM[p]}": variables[f"{ct2}/{p}"] for p in PARAM if f"{ct2}/{p}" in variables}


def _split(variables: dict[str, np.ndarray], ct2: str, parts: list[str]) -> dict[str, np.ndarray]:
    out = {}
    weights = np.split(variables[f"{ct2}/weight"], len(parts))  # (n_state, n_state) each
    biases = np.split(variables[f"{ct2}/bias"], len(parts))  # (n_state,) each
    for part, weight, bias in zip(parts, weights, biases):
        out[f"{part}.weight"] = weight
        if not part.endswith(".key"):  # Whisper's key projections have no bias (CTranslate2 stored zeros)
            out[f"{part}.bias"] = bias
    return out


def convert_ct2_to_openai(ct2_dir: Path, out_pt: Path) -> Path:
    """Write `out_pt`, an openai-whisper checkpoint of the CTranslate2 Whisper model in `ct2_dir`."""
    import torch

    spec, variables = read_ct2_model(Path(ct2_dir) / "model.bin")
    if spec != "WhisperSpec":
        raise ModelError(f"{ct2_dir} holds a CTranslate2 {spec}, not a Whisper model: nothing to convert.")
    try:
        checkpoint = to_openai_checkpoint(variables)
    except KeyError as e:
        raise ModelError(f"{ct2_dir}/model.bin lacks the Whisper variable {e}: is it a complete model?") from e
    out_pt = Path(out_pt)
    out_pt.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, out_pt)
    return out_pt
