"""Decode steps on CUDA, replayed from captured CUDA graphs.

Why: a decode step of the 1.5B model reads ~3.1 GB of bf16 weights, ~1 ms of an H100's HBM
bandwidth, but launches ~600 kernels; launched one by one from Python (model.py's eager path, with a
per-sequence attention loop besides) the launches, not the memory, set the speed. A CUDA graph
records the step's kernels once and replays them with one launch.

Design (one `DecodeGraphs` per engine, owned by the engine thread):
  * A graph has fixed shapes, so steps are padded: B rows to the next batch bucket (1, 2, 4, 8, 16,
    20, 24, 28, 32, 40, 48, ..., 112, 128, ... up to engine.max_num_seqs) and the context to the next
    length bucket (256, 512, ... up to the context window). One graph per (batch, length) pair, captured on
    first use; all of them draw on one memory pool, and every graph's output stays referenced, so a
    replay never overwrites another graph's live tensors (replays are sequential: one engine thread).
  * Inputs live in static buffers that the graphs read: each row's token, position, new KV slot,
    block table and context length. A step copies them in (two copies from pinned host buffers) and
    replays. Padding rows and padding blocks point at a scratch block that the block manager never
    hands out (KVCache is built with one block more), so padding writes and reads touch no request.
  * Attention gathers each row's context through its block table to the bucket's length and masks the
    rest (model.paged_decode_attention): the cost follows the bucket, which is at most twice the
    longest row, and the graph needs no data-dependent shapes.
  * What is not a plain decode step (prefill chunks, speculative verification, a batch above the
    largest bucket) runs model.py's eager path. Graph and eager decode run the same arithmetic
    (`Transformer.decode_hidden`), so a replay equals running it eagerly (tests/test_engine_cuda.py).
  * Without CUDA (`capture=False`) the same padding and buffers run eagerly: what the CPU tests check.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

LENGTH_BUCKET_MIN = 256


def batch_buckets(max_batch: int) -> list[int]:
    """Padded batch sizes: powers of two up to 16, then steps of a quarter of the power below."""
    sizes = [1, 2, 4, 8, 16]
    while sizes[-1] < max_batch:
        step = 1 << (sizes[-1].bit_length() - 3)  # 20, 24, 28, 32, 40, 48, 56, 64, 80, ...
        sizes.append(sizes[-1] + step)
    return [s for s in sizes if s < max_batch] + [max_batch]


def length_buckets(max_len: int, block_size: int) -> list[int]:
    sizes, n = [], max(LENGTH_BUCKET_MIN, block_size)
    while n < max_len:
        sizes.append(n)
        n *= 2
    return sizes + [-(-max_len // block_size) * block_size]


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph, or None when not captured (CPU)
    run: Callable[[], torch.Tensor]  # the step as PyTorch ops over the static buffers
    logits: torch.Tensor | None = None  # the captured step's output (B, V) fp32


class DecodeGraphs:
    def __init__(self, model: Any, kv: Any, *, scratch_block: int, max_batch: int, max_len: int,
                 capture: bool | None = None) -> None:
        self.model, self.kv = model, kv
        self.block_size = kv.block_size
        self.scratch_block = scratch_block
        self.batches = batch_buckets(max_batch)
        self.lengths = length_buckets(max_len, self.block_size)
        device = kv.k[0].device
        self.capture = device.type == "cuda" if capture is None else capture
        max_blocks = self.lengths[-1] // self.block_size
        b = self.batches[-1]
        # static inputs: tokens, positions, new slots, context lengths | block tables
        self.scalars = torch.zeros(4, b, dtype=torch.long, device=device)
        self.tables = torch.full((b, max_blocks), scratch_block, dtype=torch.long, device=device)
        pin = device.type == "cuda"
        self._host_scalars = torch.zeros(4, b, dtype=torch.long, pin_memory=pin)
        self._host_tables = torch.zeros(b * max_blocks, dtype=torch.long, pin_memory=pin)  # viewed (rows, width)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.replays = 0

    @property
    def max_batch(self) -> int:
        return self.batches[-1]

    def bucket(self, num_rows: int, max_context: int) -> tuple[int, int]:
        return (self.batches[bisect.bisect_left(self.batches, num_rows)],
                self.lengths[bisect.bisect_left(self.lengths, max_context)])

    def run(self, tokens: Sequence[int], positions: Sequence[int],
            block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """One decode step: row r feeds tokens[r] at positions[r] (so its context is positions[r] + 1
        tokens, the last written now) with block table block_tables[r] -> logits (len(tokens), V) fp32."""
        n = len(tokens)
        contexts = [p + 1 for p in positions]
        key = self.bucket(n, max(contexts))
        graph = self._graphs.get(key) or self._build(*key)
        self._load(tokens, positions, contexts, block_tables, *key)
        if graph.graph is None:
            logits = graph.run()
        else:
            graph.graph.replay()
            logits = graph.logits
        self.replays += 1
        return logits[:n]

    def _load(self, tokens, positions, contexts, block_tables, rows: int, length: int) -> None:
        """Fill the static buffers: the step's rows, then padding rows (one position in the scratch
        block) up to `rows`; block tables padded with the scratch block to `length`."""
        bs, scratch, width = self.block_size, self.scratch_block, length // self.block_size
        pad = rows - len(tokens)
        slots = [table[p // bs] * bs + p % bs for p, table in zip(positions, block_tables)]
        host = self._host_scalars[:, :rows]
        host.copy_(torch.tensor([[*tokens, *[0] * pad], [*positions, *[0] * pad],
                                 [*slots, *[scratch * bs] * pad], [*contexts, *[1] * pad]]))
        tables = self._host_tables[:rows * width].view(rows, width)
        tables.copy_(torch.tensor([[*t[:width], *[scratch] * (width - len(t[:width]))] for t in block_tables]
                                  + [[scratch] * width] * pad, dtype=torch.long))
        self.scalars[:, :rows].copy_(host, non_blocking=True)
        self.tables[:rows, :width].copy_(tables, non_blocking=True)

    def _build(self, rows: int, length: int) -> _Graph:
        model, kv, bs = self.model, self.kv, self.block_size
        scalars, tables = self.scalars[:, :rows], self.tables[:rows, :length // bs]

        def step() -> torch.Tensor:
            tokens, positions, new_slots, contexts = scalars
            offsets = torch.arange(bs, device=tables.device)
            gather = (tables[:, :, None] * bs + offsets).view(rows, length)
            span = torch.arange(length, device=tables.device)
            bias = torch.zeros(rows, 1, 1, length, device=tables.device).masked_fill_(
                (span[None, :] >= contexts[:, None]).view(rows, 1, 1, length), float("-inf"))
            x = model.decode_hidden(tokens, positions, new_slots, gather, bias, kv)
            return model.lm_head(x).float()

        graph = _Graph(None, step)
        if self.capture:
            self._load([], [], [], [], rows, length)  # padding only: the warm-up writes the scratch block alone
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: cuBLAS handles and workspaces exist before capture
                step()
            torch.cuda.current_stream().wait_stream(side)
            graph.graph = torch.cuda.CUDAGraph()
            # thread_local: request threads may touch CUDA (a sampled row's generator) while the engine captures
            with torch.cuda.graph(graph.graph, pool=self._pool, capture_error_mode="thread_local"):
                graph.logits = step()
            torch.cuda.synchronize()  # the padding copies above are done before the step's own inputs go in
        self._graphs[(rows, length)] = graph
        return graph

    def stats(self) -> dict[str, int]:
        return {"cuda_graphs": sum(g.graph is not None for g in self._graphs.values()), "graph_replays": self.replays}
