"""A lean decoder-only transformer (Llama / Qwen2 / Mistral family) for the batched engine.

Why not run transformers' own forward: the scheduler packs a *ragged* batch (several sequences, each
with its own number of new tokens and its own paged KV blocks) into one flat tensor of tokens, so
that every linear layer runs once per step over all of them; per-sequence work is only attention.
transformers' forward wants padded (B, T) batches plus masks and its per-call overhead dominated small
models here (MACHINE.md: 95 ms vs a 31 ms bandwidth floor for SmolLM2). The weights come from the HF
model (any local dir or GGUF that transformers loads), so loading stays the library's job.

Shapes: T = tokens in this step (all sequences), D = hidden, H/KVH = query/kv heads, hd = head dim.

Every linear layer (fp32/bf16, or int8 with `quantize="int8"`) is int8.py's `Linear`: that module says how
weights and activations are quantized, which kernel runs which rows and why, and how greedy rows read the
lm_head through its screened 4-bit copy. The layer ops between the linears (RMSNorm, RoPE with the KV
write, paged attention, SwiGLU; every layer of a natively attending step in one call) run through
native.py's kernels where they can (fp32 on CPU), else through the PyTorch ops below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from assistant.config import INT8_LINEARS
from assistant.engine.int8 import Linear, RowSplit
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


LINEARS = INT8_LINEARS  # a layer's linears, in the order csrc/decode_stack.cpp takes them
RESIDUAL = ("down",)  # int8: the linears that refine generated rows (int8.py says why these)
OUTLIERS = 16  # int8: ... by keeping so many channels exact (0: by the residual pass; int8.py has the quality)


def argmax(logits: torch.Tensor) -> list[int]:
    """logits.argmax(-1).tolist() for (n, V) logits, CPU fp32 rows in one native pass (csrc/lm_head.cpp
    `argmax_rows`: torch's CPU argmax spent ~170 us on a row of Qwen2.5's 151,936 logits, 1 ms of an 8-row
    step; the native pass ~30 us)."""
    if logits.dim() == 2 and logits.dtype == torch.float32 and logits.device.type == "cpu" and (ops := int8_kernels()):
        return ops.argmax_rows(logits).tolist()
    return logits.argmax(-1).tolist()


# Native attention up to this many new tokens of a sequence (with the layer stack), SDPA beyond: the native
# linear's MAX_ROWS, so that a step of up to that many rows runs whole in one native call (`step_rows`).
ATTEND_MAX_QUERIES = 32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda:  # one fused kernel (fp32 accumulation), where the ops below would launch five
        return F.rms_norm(x, weight.shape, weight, eps)
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
    kv_slots: torch.Tensor | None  # (context_len,) cache slot of every context position, oldest first (None: a
    # graphed decode step, which reads block tables instead: local.py, cuda_graphs.py)
    prompt_len: int = 0  # positions below this are prompt tokens (prefill kernel for int8)
    num_logits: int = 1  # logits rows wanted: at its last `num_logits` new tokens (1 + drafts when verifying)
    tap: Any = None  # a taps.HiddenTap reading some of this step's rows, which are `tap_rows` [a, b) of its new tokens
    tap_rows: tuple[int, int] = (0, 0)


class Transformer:
    def __init__(self, args: ModelArgs, state: dict[str, torch.Tensor], *, quantize: str | None, dtype: torch.dtype,
                 device: Any, residual: Sequence[str] = RESIDUAL, outliers: int = OUTLIERS) -> None:
        self.args, self.dtype, self.device, self.quantize = args, dtype, device, quantize
        self.residual, self.outliers = tuple(residual), outliers
        if not set(self.residual) <= set(LINEARS):
            raise ValueError(f"int8 residual pass on {sorted(set(self.residual) - set(LINEARS))}: not linears of a "
                             f"layer ({', '.join(LINEARS)})")
        linear = lambda name, w, b: Linear(w, b, quantize, dtype, residual=name in self.residual,  # noqa: E731
                                           outliers=outliers)
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
            qkv_w = [get(p + f"self_attn.{n}_proj.weight") for n in "qkv"]  # fused by Linear, uncopied
            biases = [opt(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
            qkv_b = torch.cat(biases) if all(b is not None for b in biases) else None
            gate_up = [get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]
            self.layers.append({
                "attn_norm": get(p + "input_layernorm.weight").to(dtype),
                "qkv": linear("qkv", qkv_w, qkv_b),
                "o": linear("o", get(p + "self_attn.o_proj.weight"), opt(p + "self_attn.o_proj.bias")),
                "mlp_norm": get(p + "post_attention_layernorm.weight").to(dtype),
                "gate_up": linear("gate_up", gate_up, None),
                "down": linear("down", get(p + "mlp.down_proj.weight"), None),
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
        self._stacks: dict[tuple[int, int], Any] = {}  # runs of layers (a hidden-state tap reads between them)
        if self.ops is not None and all(layer[n].native is not None for layer in self.layers for n in LINEARS):
            self.stack = self._layer_stack(0, args.num_layers)

    @property
    def step_rows(self) -> int | None:
        """The most new tokens a step computes in the native layer stack (None: no stack, any size runs alike).
        Past it a step leaves the stack for SDPA and torch._int_mm, which cost ~2x as much per prompt token
        here: a 1,036-token prompt prefilled 1.64 s in one 512-token chunk, 0.83 s in 32-token steps (Qwen2.5-0.5B,
        2 cores), so prefill on this path goes in steps of this size (local.py). Not so on the AVX2 build (native.py):
        its 32-row steps emulate 32 zmm registers with 16 ymm ones, and its `int_mm` runs big chunks at a fraction of
        the cost, so prompts go in the scheduler's chunks there (a 1,754-token prompt, 0.5B, 2 Zen 3 cores: time to
        the first token 25-28 s in 32-token steps, 13.7-14.2 s in chunks). The price: a chunk's attention is SDPA's, so
        a prompt read partly from the prefix cache may differ in the last bits from the same prompt computed cold
        (native attention for the chunks instead kept them equal, but took the time to 23.5-24 s: `attend` is built
        for a step's few queries)."""
        if self.stack is None or hasattr(self.ops, "int_mm"):
            return None
        return min(ATTEND_MAX_QUERIES, self.ops.MAX_ROWS)

    def _layer_stack(self, first: int, end: int) -> Any:
        """Layers [first, end) as one native call (the tensors are shared, not copied)."""
        if (first, end) not in self._stacks:
            def tensors(lin: Linear) -> list[torch.Tensor]:
                return [lin.vnni, lin.scale, lin.weight, torch.empty(0) if lin.bias is None else lin.bias]

            self._stacks[first, end] = self.ops.DecodeStack([[layer["attn_norm"], layer["mlp_norm"],
                                                              *(t for n in LINEARS for t in tensors(layer[n]))]
                                                             for layer in self.layers[first:end]],
                                                            [n in self.residual for n in LINEARS], self.outliers)
        return self._stacks[first, end]

    @classmethod
    def from_hf(cls, hf_model: Any, *, quantize: str | None = None, residual: Sequence[str] = RESIDUAL,
                outliers: int = OUTLIERS) -> "Transformer":
        args = ModelArgs.from_hf_config(hf_model.config)
        param = next(hf_model.parameters())
        return cls(args, dict(hf_model.state_dict()), quantize=quantize, dtype=param.dtype, device=param.device,
                   residual=residual, outliers=outliers)

    def decode_bytes(self) -> int:
        """Weight bytes one greedy decode step reads: every linear, the lm_head through its 4-bit screen
        where there is one (the candidates' rows and one embedding row are noise). What bounds a decode
        step on a CPU, so also what a draft model costs beside its target (draft.py)."""
        layers = [layer[n] for layer in self.layers for n in LINEARS]
        head = self.lm_head.screen[0] if self.lm_head.screen is not None else self.lm_head.weight
        return sum(t.numel() * t.element_size() for t in [head] + [lin.weight for lin in layers])

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, seqs: Sequence[SeqBatch],
                kv: Any, greedy: Sequence[bool] | None = None) -> torch.Tensor:
        """tokens, positions (T,) -> logits (L, V) at the last `num_logits` new tokens of each sequence,
        in batch order (L = B when every sequence wants one row, as outside speculation).

        `greedy[b]`: sequence b only needs its argmax, so its rows may come from the screened head
        (`Linear.greedy_logits`: the same argmax, -inf for tokens that cannot win).
        """
        x = self.last_hidden(tokens, positions, seqs, kv)
        if greedy is not None:
            mask = [g for g, s in zip(greedy, seqs) for _ in range(s.num_logits)]
            return self.lm_head.greedy_logits(x, torch.tensor(mask, dtype=torch.bool)).float()
        return self.lm_head(x).float()  # (L, V)

    def last_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, seqs: Sequence[SeqBatch],
                    kv: Any) -> torch.Tensor:
        """The normalized hidden state (L, D) at the last `num_logits` new tokens of each sequence (the
        lm_head's input).

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
            cos = (self.cos[positions].unsqueeze(1) * self.head_scale).to(self.dtype)  # (T, H + KVH, hd)
            sin = (self.sin[positions].unsqueeze(1) * self.head_scale).to(self.dtype)
        h = self.embed[tokens]  # (T, D)
        taps = [s for s in seqs if s.tap is not None]
        stacked = self.stack is not None and native_attention
        if stacked:  # the loop below, in native calls: one, or one per run of layers between tapped ones
            cuts = sorted({n for s in taps for n in s.tap.layers if 0 < n < a.num_layers})
            for first, end in zip([0, *cuts], [*cuts, a.num_layers]):
                h = self._layer_stack(first, end).run(
                    h, cos, sin, new_slots, kv.k[first:end], kv.v[first:end], *attend_args, rows.refine,
                    rows.num_refined, a.rms_eps, a.num_heads, a.num_kv_heads, a.head_dim ** -0.5)
                _read_taps(taps, end, h)
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
                out = attention(q, *kv.read(i, seqs[0].kv_slots), rowwise=seqs[0].num_logits > 1)
            else:
                out = torch.empty_like(q)
                for j, s in enumerate(seqs):
                    span = slice(s.start, s.start + s.num_new)
                    if ops is not None and seq_attend[j] is not None:
                        out[span] = ops.attend(q[span], kv.k[i], kv.v[i], *seq_attend[j])
                    else:
                        k, v = kv.read(i, s.kv_slots)  # (ctx, KVH, hd) each
                        out[span] = attention(q[span], k, v, rowwise=s.num_logits > 1)
            h = h + layer["o"](out.reshape(-1, q_size), rows)
            gate_up = layer["gate_up"](norm(h, layer["mlp_norm"]), rows)
            if ops is not None:
                act = ops.swiglu(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
            h = h + layer["down"](act, rows)
            _read_taps(taps, i + 1, h)
        last = torch.tensor([i for s in seqs for i in range(s.start + s.num_new - s.num_logits, s.start + s.num_new)],
                            device=h.device)
        return norm(h[last], self.norm)

    def decode_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, new_slots: torch.Tensor,
                      gather: torch.Tensor, bias: torch.Tensor, kv: Any) -> torch.Tensor:
        """One decode step of B sequences, one new token each, in PyTorch ops of fixed shapes (what
        cuda_graphs.py captures): tokens, positions, new_slots (B,); gather (B, L) the cache slot of
        each row's context positions, padded to L; bias (B, 1, 1, L) 0 where a position is in the row's
        context, -inf past it. Writes the new keys/values, returns the normalized hidden state (B, D)."""
        a = self.args
        q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        cos = (self.cos[positions].unsqueeze(1) * self.head_scale).to(self.dtype)  # (B, H + KVH, hd): queries
        sin = (self.sin[positions].unsqueeze(1) * self.head_scale).to(self.dtype)  # pre-scaled; in bf16 as HF's
        h = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            qkv = layer["qkv"](rms_norm(h, layer["attn_norm"], a.rms_eps))
            qk = apply_rope(qkv[:, :q_size + kv_size].view(-1, a.num_heads + a.num_kv_heads, a.head_dim), cos, sin)
            kv.write(i, new_slots, qk[:, a.num_heads:], qkv[:, q_size + kv_size:].view(-1, a.num_kv_heads, a.head_dim))
            out = paged_decode_attention(qk[:, :a.num_heads], kv.k[i], kv.v[i], gather, bias)
            h = h + layer["o"](out.reshape(-1, q_size))
            gate, up = layer["gate_up"](rms_norm(h, layer["mlp_norm"], a.rms_eps)).chunk(2, dim=-1)
            h = h + layer["down"](F.silu(gate) * up)
        return rms_norm(h, self.norm, a.rms_eps)


def _read_taps(taps: Sequence[SeqBatch], layer: int, h: torch.Tensor) -> None:
    """Hand each tap reading `layer` (the output of that many layers) the sum of its rows of h."""
    for s in taps:
        if layer in s.tap.layers:
            a, b = s.tap_rows
            s.tap.add(s.tap.layers.index(layer), h[s.start + a:s.start + b].sum(0))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rowwise: bool = False) -> torch.Tensor:
    """q (n, H, hd) are the last n positions of a context whose k, v are (ctx, KVH, hd) -> (n, H, hd).
    q arrives already multiplied by the softmax scale (hd ** -0.5).

    Decode (n == 1) uses grouped matmuls directly: on CPU, SDPA with GQA falls back to its math path
    and copies K/V per query group (measured 5x slower for one query token). `rowwise` (speculative
    verification: a few generated tokens whose argmax must be plain decoding's) runs each query as
    its own decode step, so its numbers are those decoding it alone would give.
    """
    n, ctx, heads, kv_heads = q.size(0), k.size(0), q.size(1), k.size(1)
    if rowwise and n > 1:
        return torch.cat([attention(q[j:j + 1], k[:ctx - n + j + 1], v[:ctx - n + j + 1]) for j in range(n)])
    if n == 1:
        qg = q.reshape(kv_heads, heads // kv_heads, q.size(-1))  # (KVH, G, hd)
        scores = torch.matmul(qg, k.permute(1, 2, 0))  # (KVH, G, ctx)
        return torch.matmul(scores.softmax(-1), v.transpose(0, 1)).view(1, heads, -1)  # (1, H, hd)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (heads, len, hd)
    # causal, aligned bottom-right: query j sees keys 0 .. ctx - n + j
    mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(diagonal=ctx - n)
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True, scale=1.0).transpose(0, 1)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, gather: torch.Tensor,
                           bias: torch.Tensor) -> torch.Tensor:
    """q (B, H, hd), one query per row, already scaled; k_cache/v_cache (slots, KVH, hd); gather (B, L)
    slots of each row's context; bias (B, 1, 1, L) masks the padding -> (B, H, hd).

    Every row reads L positions whatever its own length (fixed shapes, so a CUDA graph can replay it):
    cuda_graphs.py keeps L to the smallest bucket that holds the longest row of the step. Scores and
    softmax in fp32, as HF's kernels accumulate."""
    b, heads, hd = q.shape
    kv_heads = k_cache.size(1)
    k = k_cache[gather].to(q.dtype).permute(0, 2, 3, 1)  # (B, KVH, hd, L)
    v = v_cache[gather].to(q.dtype).transpose(1, 2)  # (B, KVH, L, hd)
    scores = torch.matmul(q.view(b, kv_heads, heads // kv_heads, hd), k).float() + bias  # (B, KVH, G, L)
    return torch.matmul(scores.softmax(-1).to(q.dtype), v).view(b, heads, hd)
