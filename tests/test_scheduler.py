"""Scheduler and block manager on synthetic requests, without any model (vLLM style)."""

import pytest

from assistant.engine.base import SamplingParams
from assistant.engine.kv_cache import BlockManager
from assistant.engine.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig

BS = 4  # block size


def make(num_blocks=64, **kw):
    return Scheduler(SchedulerConfig(**kw), BlockManager(num_blocks, BS))


def req(tokens, max_tokens=16):
    return Request(list(tokens), SamplingParams(max_tokens=max_tokens), max_len=10_000)


def step(s, sample_token=7):
    """One engine step with a fake model: every request that caught up samples `sample_token`."""
    out = s.schedule()
    for r, n in out.scheduled:
        if s.after_step(r, n):
            r.output_ids.append(sample_token)
    return out


def test_prefill_then_decode_one_token_per_step():
    s = make(max_batched_tokens=100)
    r = req([1] * 10)
    s.add(r)
    out = step(s)
    assert [(x.request_id, n) for x, n in out.scheduled] == [(r.request_id, 10)]
    assert len(r.block_table) == 3 and r.output_ids == [7]
    out = step(s)
    assert [n for _, n in out.scheduled] == [1]
    assert r.num_computed_tokens == 11 and len(r.output_ids) == 2


def test_new_request_joins_running_batch_and_prefill_is_chunked_while_decoding():
    s = make(max_batched_tokens=100, max_prefill_chunk=8)
    a = req([1] * 6)
    s.add(a)
    step(s)  # a is now decoding
    b = req([2] * 30)
    s.add(b)
    chunks = []
    for _ in range(4):
        out = step(s)
        assert out.scheduled[0] == (a, 1)  # the running stream is never stalled
        chunks.append(dict((x.request_id, n) for x, n in out.scheduled).get(b.request_id))
    assert chunks == [8, 8, 8, 6]
    assert b.output_ids == [7]


def test_token_budget_and_max_num_seqs():
    s = make(max_batched_tokens=12, max_num_seqs=2)
    rs = [req([i] * 8) for i in range(3)]
    for r in rs:
        s.add(r)
    out = s.schedule()
    assert out.num_batched_tokens <= 12
    assert len(s.running) <= 2 and rs[2] in s.waiting


def test_prefix_cache_hit_skips_computation_and_counts_stats():
    s = make(max_batched_tokens=100)
    shared = list(range(100, 112))  # 3 full blocks
    a = req(shared + [1, 2])
    s.add(a)
    step(s)
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    b = req(shared + [3, 4, 5])
    s.add(b)
    out = s.schedule()
    assert b.num_cached_tokens == 12 and out.scheduled == [(b, 3)]
    assert s.blocks.stats.num_hits == 12


def test_whole_prompt_cached_still_computes_last_token():
    s = make(max_batched_tokens=100)
    prompt = list(range(8))  # exactly 2 blocks
    a = req(prompt)
    s.add(a)
    step(s)
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    b = req(prompt)
    s.add(b)
    out = s.schedule()
    assert out.scheduled[0][1] >= 1 and b.num_cached_tokens == 4  # the last block is recomputed


def test_kv_exhaustion_preempts_newest_and_it_resumes_later():
    s = make(num_blocks=6, max_batched_tokens=100)
    a, b = req([1] * 11), req([2] * 11)  # 3 blocks each: the cache is full
    s.add(a)
    s.add(b)
    step(s)
    assert len(s.running) == 2 and s.blocks.num_free_blocks == 0
    assert step(s).preempted == []  # the 12th token still fits in 3 blocks
    out = step(s)  # a needs a 4th block for its 13th token: b (the newest) is preempted
    assert out.preempted == [b] and b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert s.waiting[0] is b and b.block_table == []
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    step(s)
    assert b.status == RequestStatus.RUNNING and b.num_computed_tokens == len(b.all_ids) - 1


def test_request_larger_than_cache_is_refused():
    s = make(num_blocks=2)
    big = req([1] * 20)
    s.add(big)
    out = s.schedule()
    assert out.refused == [big] and big.status == RequestStatus.FINISHED_REFUSED and not s.has_work


def test_bounded_waiting_queue():
    s = make(max_waiting=2)
    assert s.add(req([1])) and s.add(req([2])) and not s.add(req([3]))


def test_finish_frees_blocks_in_the_same_step():
    s = make(num_blocks=8)
    r = req([1] * 9)
    s.add(r)
    step(s)
    assert s.blocks.num_free_blocks == 8 - 3
    s.finish(r, RequestStatus.FINISHED_CANCELLED)
    assert s.blocks.num_free_blocks == 8 and not s.has_work


def test_block_manager_lru_eviction_and_refcounts():
    bm = BlockManager(4, BS)
    t1 = []
    assert bm.allocate(t1, 8)
    bm.register_full_blocks(t1, list(range(8)), 8, 0)
    bm.free_blocks(t1)
    assert bm.num_free_blocks == 4 and len(bm.cached) == 2
    hits = bm.match_prefix(list(range(9)))
    assert len(hits) == 2 and bm.num_free_blocks == 2  # referenced again
    other = []
    assert bm.allocate(other, 8) and not bm.allocate(other, 12)  # no free block left; unchanged
    assert len(other) == 2
    bm.free_blocks(hits)
    bm.free_blocks(other)
    t3 = []
    assert bm.allocate(t3, 16)  # must evict the cached blocks
    assert bm.stats.num_evictions == 2 and not bm.cached
    with pytest.raises(AssertionError):
        bm.free_blocks([t3[0], t3[0]])


def test_wasted_kv_is_under_ten_percent_on_mixed_lengths():
    import random

    rng = random.Random(0)
    bm = BlockManager(10_000, 16)
    lengths = [rng.randint(50, 2000) for _ in range(32)]
    tables = []
    for n in lengths:
        t = []
        assert bm.allocate(t, n)
        tables.append(t)
    allocated = sum(len(t) for t in tables) * 16
    assert (allocated - sum(lengths)) / allocated < 0.10


def test_prefix_chains_through_a_block_another_sequence_registered_first():
    """Two sequences computed the same prompt at once: the second's copy is not registered, but the blocks it
    computes after it still chain on, and a third prompt finds the first's blocks and then the second's."""
    bm = BlockManager(8, BS)
    a, b = [], []
    assert bm.allocate(a, 2 * BS) and bm.allocate(b, 3 * BS)
    shared, tail = list(range(2 * BS)), list(range(100, 100 + BS))
    bm.register_full_blocks(a, shared, 2 * BS, 0)
    assert bm.register_full_blocks(b, shared + tail, 3 * BS, 0) == 3
    assert len(bm.cached) == 3  # a's two blocks and b's third; b's first two are copies
    assert bm.match_prefix(shared + tail + [7]) == [a[0], a[1], b[2]]


def test_a_prefix_is_found_only_behind_the_same_blocks_even_after_eviction():
    """Keys chain on content ids that are never reused: once the first block's content is evicted and
    other content takes its place, a block cached behind the old content is not found behind the new."""
    bm = BlockManager(3, BS)
    first, second, other = list(range(BS)), list(range(50, 50 + BS)), list(range(200, 200 + BS))
    t = []
    assert bm.allocate(t, 2 * BS)
    bm.register_full_blocks(t, first + second, 2 * BS, 0)
    head = t[0]
    bm.free_blocks(t)  # both stay cached; the tail block is first in line to be reused
    u = []
    assert bm.allocate(u, 2 * BS)  # a free block and the tail block (evicted); the head block stays cached
    bm.register_full_blocks(u, other + second, 2 * BS, 0)
    assert bm.match_prefix(other + second + [1]) == u
    bm.free_blocks(u)
    assert bm.match_prefix(first + second + [1]) == [head]  # its old second block now holds other content
