"""A lean decoder-only transformer (Llama / Qwen2 / Mistral family) for the batched engine.

Why not run transformers' own forward: the scheduler packs a *ragged* batch (several sequences, each
with its own number of new tokens and its own paged KV blocks) into one flat tensor of tokens, so
that every linear layer runs once per step over all of them; per-sequence work is only attention.
transformers' forward wants padded (B, T) batches plus masks and its per-call overhead dominated small
models here (MACHINE.md: 95 ms vs a 31 ms bandwidth floor for SmolLM2). The weights come from the HF
model (any local dir or GGUF that transformers loads), so loading stays the library's job.

Shapes: T = tokens in this step (all sequences), D = hidden, H/KVH = query/kv heads, hd = head dim.

int8 (`quantize="int8"`): per-output-channel symmetric int8 weights and dynamic per-row symmetric
int8 activations, so every output is an exact int32 dot product, converted to float and scaled by
the weight's channel scale, then by the row's scale.
Generated tokens get a second pass: their quantization residual (x - scale * q, at most half a
step) is quantized at 1/254 of the step and goes into the same GEMM as an extra row, so the
activations keep ~15 bits while the weights are read once. Measured against fp32 on the bench's 8
prompts, 48 tokens each, teacher-forced through decode steps (next-token top-1 agreement, greedy
answers identical): one pass 0.954 (1/8); with the residual pass 0.980-0.989 (4-5/8); bf16
activations with `_weight_int8pack_mm` 0.974 (4/8); the pass on qkv/o/down only 0.977. (Single
answers are no measure: `assistant chat` answers "What is 2+2?" with 4 or 6 depending on rounding
details, and fp32 itself only repeats the question.) Prompt tokens keep one pass: prefill is
compute-bound, and only a prompt's last token is sampled (its lm_head row gets the pass).
Kernels, all computing exactly that arithmetic, so a row's output never depends on which one ran:
  * native.py (default where the CPU has AVX-512 VNNI and g++ is present): up to MAX_ROWS (16) GEMM
    rows (decode steps, small chunks) go through one fused call (row quantization, residual rows, a
    VNNI GEMV that streams each weight byte once for up to 8 rows and re-reads it from L2 for the next
    8, epilogue); more rows through the same kernel-side quantization and epilogue around
    `torch._int_mm` (oneDNN), which is 2-2.5x faster at 16+ rows. Decode step, Qwen2.5-0.5B, 2
    threads, same run: 47 ms against 68-90 ms through the PyTorch ops below (native.py says where
    that time went). A decode step that also takes prompt tokens of another request (chunked
    prefill) grows ~linearly to 14 of them: 1.6x a decode step with 8, 2.0x with 10 (at 8 GEMM rows
    the kernel used to hand over to `_int_mm`: 2.2x with 7, 2.6x with 10), which is what the
    prefill-chunk tuner in local.py assumes when it sizes chunks for its inter-token target.
  * without it, up to FBGEMM_MAX_ROWS rows: fbgemm's prepacked int8 GEMM
    (`quantized::linear_with_input_q_dq_qweight_dq_output_fp32`) with rows quantized here and handed
    over as integral floats (scale 1, zero point 128), which its own quantization leaves exact
    (fbgemm's dynamic-quant linear would quantize the whole batch with one scale, making a request's
    output depend on its batch). `fbgemm_matches_int_mm` checks bit-identity with `_int_mm` once per
    process, int16 saturation included; where it fails, generated rows use `_weight_int8pack_mm`
    and prompt rows `_int_mm`: the kernel is then chosen per token (prompt or generated), never by
    batch size.
In every case the int8 weights are held twice (the GEMV layout and `_int_mm`'s); decode reads one.

Greedy rows (temperature 0, the default) need only the argmax of the lm_head, which is a quarter of a
decode step's bytes (136 of 494 MB for Qwen2.5-0.5B). With the native kernels the head also keeps a
4-bit copy of its weights' high nibbles (+68 MB); `Linear.greedy_logits` streams that, keeps every
token that could still win (a margin of SCREEN_Z standard deviations of the dropped low nibbles'
contribution) and computes those candidates exactly, bit for bit the full head's logits
(csrc/lm_head.cpp has the design note). On the bench's rows: median 2 candidates, the largest
normalized error seen 5.4 of the 8 allowed, the argmax the full head's on every row; the head costs
~6 ms instead of ~11. Sampled rows use the full head.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from assistant.engine.native import int8_kernels

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    dim: int  # hidden size D
    num_layers: int
    num_heads: int  # H
    num_kv_heads: int  # KVH (grouped-query attention when < H)
    head_dim: int  # hd
    rms_eps: float
    rope_theta: float
    max_position: int

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "ModelArgs":
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        heads = cfg.num_attention_heads
        return cls(
            vocab_size=cfg.vocab_size, dim=cfg.hidden_size, num_layers=cfg.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", heads) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_eps=cfg.rms_norm_eps, rope_theta=float(theta), max_position=cfg.max_position_embeddings,
        )


def unsupported_reason(hf_config: Any) -> str | None:
    """Why the lean model cannot run this checkpoint (then the engine falls back to HF's forward)."""
    arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        return f"architecture {arch} is not one of {', '.join(SUPPORTED_ARCHITECTURES)}"
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        return f"rope scaling {rope.get('rope_type')} is not implemented"
    if getattr(hf_config, "use_sliding_window", False) or getattr(hf_config, "hidden_act", "silu") != "silu":
        return "sliding-window attention / non-SiLU activations are not implemented"
    return None


LINEARS = ("qkv", "o", "gate_up", "down")  # a layer's linears, in the order csrc/decode_stack.cpp takes them
ATTEND_MAX_QUERIES = 16  # native attention up to this many new tokens of a sequence (with the layer stack), SDPA beyond
FBGEMM_MAX_ROWS = 8  # steps with more rows than this use torch._int_mm (see the module docstring)
SCREEN_Z = 8.0  # candidate margin of the screened greedy head, in standard deviations (csrc/lm_head.cpp)


class Linear:
    """y = x @ W.T + b, with W kept as fp32/bf16 or as per-channel int8 + scales."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quantize: str | None, dtype: torch.dtype):
        self.bias = None if bias is None else bias.to(dtype)
        self.int8 = quantize == "int8"
        self.packed = self.native = self.screen = None
        self.screened_rows = self.screened_candidates = 0  # statistics of `greedy_logits`
        if self.int8:
            w = weight.float()
            self.scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # (N,) fp32
            self.weight = torch.round(w / self.scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()  # (N, K)
            on_cpu = self.weight.device.type == "cpu"
            if on_cpu and dtype == torch.float32 and (ext := int8_kernels()) is not None:
                self.native = ext  # the fused kernel (native.py); the int8 weights above serve prefill
                self.vnni, self.comp = ext.pack(self.weight)
                self.bias = None if bias is None else self.bias.contiguous()  # the kernel reads it raw
            elif on_cpu and fbgemm_matches_int_mm():
                self.packed = fbgemm_pack(self.weight, self.scale)
        else:
            self.weight = weight.to(dtype).contiguous()

    def __call__(self, x: torch.Tensor, rows: "RowSplit | None" = None) -> torch.Tensor:  # (T, K) -> (T, N)
        if not self.int8:
            return F.linear(x, self.weight, self.bias)
        if self.native is not None:
            return self._native(x, rows)
        if self.packed is not None:  # generated tokens (and every lm_head row) get the residual pass
            y = self._int8(x, slice(None) if rows is None or rows.prompt is None else rows.decode)
        elif rows is None or rows.prompt is None:
            y = self._weight_only(x)
        elif rows.decode is None:
            y = self._int8(x, None)
        else:
            y = x.new_empty(x.size(0), self.weight.size(0))
            y[rows.prompt] = self._int8(x[rows.prompt], None)
            y[rows.decode] = self._weight_only(x[rows.decode])
        return y if self.bias is None else y + self.bias

    def _int8(self, x: torch.Tensor, refine: "torch.Tensor | slice | None") -> torch.Tensor:
        """Per-row int8 activations; the rows in `refine` (all of them: slice(None)) also get their
        quantization residual, at 1/254 of the row's step, as extra rows of the same GEMM (module
        docstring). Every op costs microseconds on a decode step's few rows: fewest ops wins."""
        n = x.size(0)
        x_scale = x.float().abs().amax(dim=1, keepdim=True).clamp_min_(1e-8).div_(127.0)  # (n, 1)
        u = torch.div(x, x_scale)  # in [-127, 127]
        if refine is None:
            xq = u.round_()
        elif isinstance(refine, slice):  # a pure decode step: every row, no gathers
            xq = torch.empty(2 * n, x.size(1), dtype=u.dtype, device=u.device)
            torch.round(u, out=xq[:n])
            torch.sub(u, xq[:n], out=xq[n:]).mul_(254.0).round_()
        else:
            head = torch.round(u)
            xq = torch.cat([head, (u[refine] - head[refine]).mul_(254.0).round_()])
        if self.packed is not None and xq.size(0) <= FBGEMM_MAX_ROWS:
            acc = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(xq, 1.0, 128, self.packed)
        else:
            acc = torch._int_mm(xq.to(torch.int8), self.weight.t()).float().mul_(self.scale)
        # acc = float(int32 dot) * channel scale, as fbgemm computes it; the residual rows count 1/254
        if refine is None:
            y = acc
        elif isinstance(refine, slice):
            y = torch.add(acc[:n], acc[n:], alpha=1 / 254.0)
        else:
            y = acc[:n].index_add_(0, refine, acc[n:], alpha=1 / 254.0)
        return y.mul_(x_scale).to(x.dtype)  # then each row's own scale

    def _native(self, x: torch.Tensor, rows: "RowSplit | None") -> torch.Tensor:
        """The fused kernel for up to its MAX_ROWS GEMM rows, else torch._int_mm between the kernel's own
        quantization and epilogue: the same arithmetic, so the same row either way."""
        refine, refined = (rows.refine, rows.num_refined) if rows is not None else (all_rows(x.size(0)), x.size(0))
        if x.size(0) + refined <= self.native.MAX_ROWS:
            return self.native.linear(x, self.vnni, self.comp, self.scale, self.bias, refine)
        xq, x_scale = self.native.quantize(x, refine)
        return self.native.finish(torch._int_mm(xq, self.weight.t()), self.scale, x_scale, refine, self.bias)

    def prepare_greedy(self) -> None:
        """Pack the 4-bit screening copy for `greedy_logits` (native int8 only; +half the int8 bytes)."""
        if self.native is not None:
            packed, hcomp, mean, sd = self.native.head_pack(self.weight)
            self.screen = (packed, hcomp, mean, (sd * self.scale).contiguous())

    def greedy_logits(self, x: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
        """Logits whose argmax is the full layer's for the rows in `greedy` (bool (n,)), reading half the
        bytes: exact values for the screened candidates, -inf for the rest (csrc/lm_head.cpp); other
        rows get the full layer. Used for the lm_head of greedy decode rows."""
        if self.screen is None or not bool(greedy.any()):
            return self(x)
        packed, hcomp, mean, margin = self.screen
        every = bool(greedy.all())
        logits, counts = self.native.head_greedy(x if every else x[greedy], packed, hcomp, mean, margin, self.weight,
                                                 self.comp, self.scale, self.bias, SCREEN_Z)
        self.screened_rows += counts.numel()
        self.screened_candidates += int(counts.sum())
        if every:
            return logits
        out = x.new_empty(x.size(0), self.weight.size(0))
        out[greedy], out[~greedy] = logits, self(x[~greedy])
        return out

    def _weight_only(self, x: torch.Tensor) -> torch.Tensor:  # the fallback decode kernel without fbgemm
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scale.to(torch.bfloat16)).to(x.dtype)


def fbgemm_pack(weight: torch.Tensor, scale: torch.Tensor) -> Any:
    """Prepack int8 (N, K) weights with per-channel scales for fbgemm."""
    import warnings

    previous = torch.backends.quantized.engine
    try:
        torch.backends.quantized.engine = "fbgemm"
        with warnings.catch_warnings():  # per-channel qint8 tensors are flagged as deprecated API
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch._make_per_channel_quantized_tensor(
                weight, scale.double(), torch.zeros(weight.size(0), dtype=torch.long), 0)
            return torch.ops.quantized.linear_prepack(qweight, None)
    finally:
        torch.backends.quantized.engine = previous


@functools.cache
def fbgemm_matches_int_mm() -> bool:
    """Whether fbgemm is present and gives rows bit-identical to the `_int_mm` path on this CPU,
    including the worst case for int16 saturation (all-positive activations times +127 weights)."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (48, 1024), generator=gen, dtype=torch.int8)
    weight[0] = 127
    scale = torch.rand(48, generator=gen) / 100 + 1e-4
    probe = Linear.__new__(Linear)
    probe.bias, probe.int8, probe.weight, probe.scale = None, True, weight, scale
    try:
        probe.packed = fbgemm_pack(weight, scale)
    except Exception:  # noqa: BLE001 - an fbgemm that cannot pack here is an fbgemm we do not use
        return False
    x = torch.randn(3, 1024, generator=gen) * 5
    x[0] = x[0].abs()
    small = probe._int8(x, slice(None))  # 6 rows: fbgemm
    probe.packed = None
    return torch.equal(small, probe._int8(x, slice(None)))  # _int_mm


@dataclass(frozen=True)
class RowSplit:
    """Which rows of a step are prompt tokens; None where a group is empty."""

    prompt: torch.Tensor | None  # (P,) row indices
    decode: torch.Tensor | None  # (T - P,) row indices
    refine: torch.Tensor  # (T,) bool: the rows that get the residual pass (generated tokens)
    num_refined: int

    @classmethod
    def from_mask(cls, is_prompt: torch.Tensor) -> "RowSplit":
        prompt = is_prompt.nonzero().squeeze(1)
        decode = (~is_prompt).nonzero().squeeze(1)
        return cls(prompt if prompt.numel() else None, decode if decode.numel() else None, ~is_prompt, decode.numel())


@functools.lru_cache(maxsize=64)
def all_rows(n: int) -> torch.Tensor:
    """A refine mask selecting every row (lm_head rows; calls without a RowSplit)."""
    return torch.ones(n, dtype=torch.bool)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight  # F.rms_norm: 2x slower on CPU


def rope_tables(args: ModelArgs, max_len: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (L, hd) in HF's rotate_half layout, with the sign of rotate_half folded into sin:
    rotate_half(x) * sin == roll(x, hd/2) * signed_sin."""
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float32) / args.head_dim))
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)  # (L, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (L, hd)
    sign = torch.cat([-torch.ones(args.head_dim // 2), torch.ones(args.head_dim // 2)])
    return emb.cos().to(device), (emb.sin() * sign).to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x (T, nh, hd); cos/signed_sin broadcastable to it."""
    return torch.addcmul(x * cos, torch.roll(x, x.size(-1) // 2, dims=-1), signed_sin)


@dataclass
class SeqBatch:
    """One sequence's slice of a ragged step."""

    start: int  # offset of its new tokens in the flat token tensor
    num_new: int  # new tokens this step (a prefill chunk, or 1 when decoding)
    context_len: int  # tokens in its KV after this step (cached + new)
    kv_slots: torch.Tensor  # (context_len,) cache slot of every context position, oldest first
    prompt_len: int = 0  # positions below this are prompt tokens (prefill kernel for int8)


class Transformer:
    def __init__(self, args: ModelArgs, state: dict[str, torch.Tensor], *, quantize: str | None, dtype: torch.dtype,
                 device: Any) -> None:
        self.args, self.dtype, self.device, self.quantize = args, dtype, device, quantize
        get = lambda name: state[name].to(device)  # noqa: E731
        opt = lambda name: state[name].to(device) if name in state else None  # noqa: E731
        self.embed = get("model.embed_tokens.weight").to(dtype)  # (V, D)
        head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
        self.lm_head = Linear(head.to(device), None, quantize, dtype)
        self.lm_head.prepare_greedy()
        self.norm = get("model.norm.weight").to(dtype)
        self.layers = []
        for i in range(args.num_layers):
            p = f"model.layers.{i}."
            qkv_w = torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            biases = [opt(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
            qkv_b = torch.cat(biases) if all(b is not None for b in biases) else None
            gate_up = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
            self.layers.append({
                "attn_norm": get(p + "input_layernorm.weight").to(dtype),
                "qkv": Linear(qkv_w, qkv_b, quantize, dtype),
                "o": Linear(get(p + "self_attn.o_proj.weight"), opt(p + "self_attn.o_proj.bias"), quantize, dtype),
                "mlp_norm": get(p + "post_attention_layernorm.weight").to(dtype),
                "gate_up": Linear(gate_up, None, quantize, dtype),
                "down": Linear(get(p + "mlp.down_proj.weight"), None, quantize, dtype),
            })
        self.cos, self.sin = rope_tables(args, min(args.max_position, 32768), device)
        scales = [args.head_dim ** -0.5] * args.num_heads + [1.0] * args.num_kv_heads
        self.head_scale = torch.tensor(scales, device=device).view(-1, 1)  # (H + KVH, 1): pre-scaled queries
        # fused layer ops (native.py): RMSNorm, RoPE + KV write, paged causal attention; fp32 on CPU
        native_ok = (torch.device(device).type == "cpu" and dtype == torch.float32 and args.head_dim % 16 == 0
                     and args.head_dim <= 256)
        self.ops = int8_kernels() if native_ok else None
        # steps where every sequence attends natively run all layers in one call (csrc/decode_stack.cpp)
        self.stack = None
        if self.ops is not None and all(layer[n].native is not None for layer in self.layers for n in LINEARS):
            def tensors(lin: Linear) -> list[torch.Tensor]:
                return [lin.vnni, lin.comp, lin.scale, lin.weight, torch.empty(0) if lin.bias is None else lin.bias]

            self.stack = self.ops.DecodeStack([[layer["attn_norm"], layer["mlp_norm"],
                                                *(t for n in LINEARS for t in tensors(layer[n]))] for layer in self.layers])

    @classmethod
    def from_hf(cls, hf_model: Any, *, quantize: str | None = None) -> "Transformer":
        args = ModelArgs.from_hf_config(hf_model.config)
        param = next(hf_model.parameters())
        return cls(args, dict(hf_model.state_dict()), quantize=quantize, dtype=param.dtype, device=param.device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, seqs: Sequence[SeqBatch],
                kv: Any, greedy: Sequence[bool] | None = None) -> torch.Tensor:
        """tokens, positions (T,) -> logits (B, V) at the last new token of each sequence.

        `greedy[b]`: sequence b only needs its argmax, so its row may come from the screened head
        (`Linear.greedy_logits`: the same argmax, -inf for tokens that cannot win).
        """
        x = self.last_hidden(tokens, positions, seqs, kv)
        if greedy is not None:
            return self.lm_head.greedy_logits(x, torch.tensor(list(greedy), dtype=torch.bool)).float()
        return self.lm_head(x).float()  # (B, V)

    def last_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, seqs: Sequence[SeqBatch],
                    kv: Any) -> torch.Tensor:
        """The normalized hidden state (B, D) at the last new token of each sequence (the lm_head's input).

        Writes this step's keys/values into `kv` (slots = the last `num_new` of each seq's kv_slots).
        A sequence with at most ATTEND_MAX_QUERIES new tokens attends through the native `attend` whether
        or not others prefill in the same step, so a decoding sequence's numbers never depend on the batch.
        """
        a = self.args
        new_slots = torch.cat([s.kv_slots[s.context_len - s.num_new:] for s in seqs])  # (T,)
        rows = RowSplit.from_mask(positions < torch.cat([torch.full((s.num_new,), s.prompt_len) for s in seqs]).to(
            positions.device)) if self.quantize else None
        ops = self.ops
        if ops is not None:
            norm = lambda x, w: ops.rms_norm(x, w, a.rms_eps)  # noqa: E731
            cos, sin = self.cos[positions], self.sin[positions]  # (T, hd)
            native_attention = all(s.num_new <= ATTEND_MAX_QUERIES for s in seqs)
            if native_attention:  # one attend call per layer for every sequence (decode, small chunks)
                attend_args = (torch.cat([s.kv_slots for s in seqs]),
                               torch.tensor([0] + [s.context_len for s in seqs]).cumsum(0),
                               torch.tensor([0] + [s.num_new for s in seqs]).cumsum(0))
            else:  # a long prefill chunk in the step: per sequence, native where it is short
                seq_attend = [(s.kv_slots, torch.tensor([0, s.context_len]), torch.tensor([0, s.num_new]))
                              if s.num_new <= ATTEND_MAX_QUERIES else None for s in seqs]
        else:
            norm = lambda x, w: rms_norm(x, w, a.rms_eps)  # noqa: E731
            # queries and keys are rotated together; the queries' softmax scale rides on their tables
            cos = self.cos[positions].unsqueeze(1) * self.head_scale  # (T, H + KVH, hd)
            sin = self.sin[positions].unsqueeze(1) * self.head_scale
        h = self.embed[tokens]  # (T, D)
        stacked = self.stack is not None and native_attention
        if stacked:  # the loop below, in one native call
            h = self.stack.run(h, cos, sin, new_slots, kv.k, kv.v, *attend_args, rows.refine, rows.num_refined,
                               a.rms_eps, a.num_heads, a.num_kv_heads, a.head_dim ** -0.5)
        q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        for i, layer in enumerate(() if stacked else self.layers):
            qkv = layer["qkv"](norm(h, layer["attn_norm"]), rows)
            if ops is not None:
                q = ops.rope_store(qkv, cos, sin, a.num_heads, a.num_kv_heads, a.head_dim ** -0.5, kv.k[i], kv.v[i],
                                   new_slots)  # (T, H, hd), scaled; k and v are in the cache
            else:
                qk = apply_rope(qkv[:, :q_size + kv_size].view(-1, a.num_heads + a.num_kv_heads, a.head_dim), cos, sin)
                q, k = qk[:, :a.num_heads], qk[:, a.num_heads:]  # (T, H, hd), (T, KVH, hd)
                kv.write(i, new_slots, k, qkv[:, q_size + kv_size:].view(-1, a.num_kv_heads, a.head_dim))
            if ops is not None and native_attention:
                out = ops.attend(q, kv.k[i], kv.v[i], *attend_args)
            elif len(seqs) == 1 and ops is None:
                out = attention(q, *kv.read(i, seqs[0].kv_slots))
            else:
                out = torch.empty_like(q)
                for j, s in enumerate(seqs):
                    span = slice(s.start, s.start + s.num_new)
                    if ops is not None and seq_attend[j] is not None:
                        out[span] = ops.attend(q[span], kv.k[i], kv.v[i], *seq_attend[j])
                    else:
                        out[span] = attention(q[span], *kv.read(i, s.kv_slots))  # (ctx, KVH, hd) each
            h = h + layer["o"](out.reshape(-1, q_size), rows)
            gate_up = layer["gate_up"](norm(h, layer["mlp_norm"]), rows)
            if ops is not None:
                act = ops.swiglu(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
            h = h + layer["down"](act, rows)
        last = torch.tensor([s.start + s.num_new - 1 for s in seqs], device=h.device)
        return norm(h[last], self.norm)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q (n, H, hd) are the last n positions of a context whose k, v are (ctx, KVH, hd) -> (n, H, hd).
    q arrives already multiplied by the softmax scale (hd ** -0.5).

    Decode (n == 1) uses grouped matmuls directly: on CPU, SDPA with GQA falls back to its math path
    and copies K/V per query group (measured 5x slower for one query token).
    """
    n, ctx, heads, kv_heads = q.size(0), k.size(0), q.size(1), k.size(1)
    if n == 1:
        qg = q.reshape(kv_heads, heads // kv_heads, q.size(-1))  # (KVH, G, hd)
        scores = torch.matmul(qg, k.permute(1, 2, 0))  # (KVH, G, ctx)
        return torch.matmul(scores.softmax(-1), v.transpose(0, 1)).view(1, heads, -1)  # (1, H, hd)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (heads, len, hd)
    # causal, aligned bottom-right: query j sees keys 0 .. ctx - n + j
    mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(diagonal=ctx - n)
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True, scale=1.0).transpose(0, 1)
