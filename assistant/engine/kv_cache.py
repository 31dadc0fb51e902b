"""Paged KV cache: fixed-size blocks handed to sequences, with prefix caching and LRU eviction.

Hand-written because transformers' caches are per-request tensors (no sharing of a common prefix
between requests, no block accounting the scheduler can plan with).

`KVCache` is the physical storage: per layer one key and one value tensor of shape
(num_blocks * block_size, KVH, hd); a *slot* is one token position in it, and block b owns slots
[b * block_size, (b + 1) * block_size). A sequence's context is the concatenation of its blocks, so
waste is at most one partly filled block per sequence (< block_size tokens).

`BlockManager` does the bookkeeping without touching tensors (unit-testable without a model):
- ref counts: a block may be shared by several sequences that start with the same tokens;
- prefix caching: once a block is full and computed it is registered under a key that chains the
  previous block's content with the block's own tokens — exact, so there are no hash collisions —
  and a new sequence whose prompt starts with the same tokens reuses those blocks. A key is
  (the previous block's content id, this block's tokens): a content id names one whole prefix and is
  never reused, so a key costs one block of tokens to hash and compare, where a key nesting every
  earlier block's key cost the whole prefix each time (Python does not cache a tuple's hash): at 2,000
  tokens of context, 3.4 ms on every step that filled a block;
- blocks whose ref count drops to zero go to a free list in LRU order; cached ones keep their key
  until they are reused for something else (evicted), so a later request may still hit them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import torch

BlockKey = tuple[int, tuple[int, ...]]  # (content id of the prefix before this block (0: none), its tokens)


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: Any, compute_dtype: torch.dtype | None = None) -> None:
        """`dtype`: what the cache stores (bfloat16 halves what attention reads); `read` hands back
        `compute_dtype` (the model's; default: `dtype`)."""
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size = block_size
        self.compute_dtype = compute_dtype or dtype

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots (T,), k/v (T, KVH, hd)."""
        self.k[layer].index_copy_(0, slots, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v[layer].dtype))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots (ctx,) -> k, v (ctx, KVH, hd)."""
        k, v = self.k[layer].index_select(0, slots), self.v[layer].index_select(0, slots)
        return k.to(self.compute_dtype), v.to(self.compute_dtype)

    def slots(self, block_table: Sequence[int], num_tokens: int) -> torch.Tensor:
        """Cache slots of the first `num_tokens` positions of a sequence with this block table."""
        blocks = torch.tensor(block_table, dtype=torch.long)
        offsets = torch.arange(self.block_size, dtype=torch.long)
        return (blocks[:, None] * self.block_size + offsets).flatten()[:num_tokens].to(self.k[0].device)


@dataclass
class PrefixCacheStats:
    num_queries: int = 0  # prompt tokens looked up
    num_hits: int = 0  # of those, served from cached blocks
    num_evictions: int = 0  # cached blocks reused for other content

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_cache: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_count = [0] * num_blocks
        self.key_of: list[BlockKey | None] = [None] * num_blocks  # the key a block is findable under
        self.id_of: list[int | None] = [None] * num_blocks  # the content id of the prefix a block ends
        self.cached: dict[BlockKey, int] = {}
        self._next_id = 1
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU first
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ---------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Take references on the cached blocks that cover a prefix of `token_ids`.

        At least one token is always left uncached, because its logits are needed for sampling.
        """
        if not self.enable_prefix_cache:
            return []
        self.stats.num_queries += len(token_ids)
        hits: list[int] = []
        parent, size = 0, self.block_size
        for b in range((len(token_ids) - 1) // size):
            block = self.cached.get((parent, tuple(token_ids[b * size:(b + 1) * size])))
            if block is None:
                break
            hits.append(block)
            parent = self.id_of[block]
        for block in hits:
            self._ref(block)
        self.stats.num_hits += len(hits) * self.block_size
        return hits

    def register_full_blocks(self, block_table: Sequence[int], token_ids: Sequence[int], num_computed: int,
                             num_registered: int) -> int:
        """Make blocks that became full and computed findable; returns the new count registered. A block
        whose content another block already holds stays unregistered but takes that content's id, so the
        blocks after it chain on."""
        if not self.enable_prefix_cache:
            return num_registered
        num_full = num_computed // self.block_size
        size = self.block_size
        parent = self.id_of[block_table[num_registered - 1]] if num_registered else 0
        for b in range(num_registered, num_full):
            block, key = block_table[b], (parent, tuple(token_ids[b * size:(b + 1) * size]))
            if self.key_of[block] is None and self.id_of[block] is None:
                holder = self.cached.get(key)
                if holder is None:
                    self.cached[key], self.key_of[block] = block, key
                    self.id_of[block], self._next_id = self._next_id, self._next_id + 1
                else:
                    self.id_of[block] = self.id_of[holder]
            parent = self.id_of[block]
        return max(num_full, num_registered)

    # -- allocation -----------------------------------------------------------------------------
    def allocate(self, block_table: list[int], num_tokens: int) -> bool:
        """Grow `block_table` in place to hold `num_tokens`; False (and no change) if memory is short."""
        need = self.blocks_needed(num_tokens) - len(block_table)
        if need <= 0:
            return True
        if need > len(self.free):
            return False
        for _ in range(need):
            block, _ = self.free.popitem(last=False)  # least recently used
            if self.key_of[block] is not None:  # evict its cached content
                del self.cached[self.key_of[block]]
                self.key_of[block] = None
                self.stats.num_evictions += 1
            self.id_of[block] = None
            self.ref_count[block] = 1
            block_table.append(block)
        return True

    def free_blocks(self, block_table: list[int]) -> None:
        """Drop a sequence's references; its blocks become reusable (cached ones stay findable)."""
        for block in reversed(block_table):  # tail blocks are the least likely to be shared: evict first
            self.ref_count[block] -= 1
            assert self.ref_count[block] >= 0, "block freed twice"
            if self.ref_count[block] == 0:
                self.free[block] = None
                if self.key_of[block] is None:
                    self.free.move_to_end(block, last=False)  # nothing worth keeping: reuse first
        block_table.clear()

    def truncate(self, block_table: list[int], num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` positions (rejected speculative tokens).
        Only blocks never registered can be past a sequence's computed length, so none is shared."""
        keep = self.blocks_needed(num_tokens)
        if len(block_table) > keep:
            tail = block_table[keep:]
            assert all(self.key_of[b] is None and self.ref_count[b] == 1 for b in tail), "truncating a cached block"
            del block_table[keep:]
            self.free_blocks(tail)

    def _ref(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self.free[block]
        self.ref_count[block] += 1
