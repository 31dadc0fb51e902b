"""Iteration-level scheduler (continuous batching) for the local engine.

NOTE — the model of scheduling (after vLLM v1):
  There are no prefill and decode phases. Every request has `all_ids` (prompt + generated tokens)
  and `num_computed_tokens` (how many of those already have KV in the cache). Each step the scheduler
  hands out a token budget: a request gets `num_new` tokens to catch up, which is a chunk of its
  prompt while it is prefilling and exactly 1 once it is decoding. After the step, a request whose
  computed count reached its length samples one token, which makes it one longer again.
  * Running requests are served first, oldest first, so streams already talking keep talking.
  * While any request is decoding, prefill gets at most `prefill_chunk` tokens per step, so a
    long prompt arriving never stalls running streams for more than one small chunk (chunked prefill).
    The engine tunes `prefill_chunk` (up to `max_prefill_chunk`) from measured step times.
  * Waiting requests are admitted FCFS while the budget, `max_num_seqs` and KV blocks allow; their
    prompts first reuse cached prefix blocks (prefix caching), which counts as already computed.
  * When a running request needs a block and none is free, the newest running request is preempted:
    its blocks are released and it goes back to the front of the waiting queue, to be recomputed
    later (cheaply when its blocks are still in the prefix cache). Never an out-of-memory crash.
  * A request that could not fit even in an empty cache is refused with a clear error, and the
    waiting queue is bounded (the engine refuses new work when it is full).
  * With a `Speculator` (speculate.py has its own NOTE), greedy decoding requests may then carry
    draft tokens in what is left of the budget and of the free KV blocks: such a request's step
    computes 1 + k tokens, and `after_step` keeps only the accepted ones (rolling back the rest).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from assistant.engine.base import SamplingParams
from assistant.engine.kv_cache import BlockManager


class RequestStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2  # EOS or a stop string
    FINISHED_LENGTH = 3  # max_tokens or the context window
    FINISHED_CANCELLED = 4  # caller cancelled / went away
    FINISHED_REFUSED = 5  # cannot ever fit in KV memory

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


_ids = itertools.count()


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    max_len: int  # prompt + answer may not exceed this (the context window)
    request_id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache (first admission)
    num_registered_blocks: int = 0  # full blocks already published to the prefix cache
    block_table: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    cancel: threading.Event = field(default_factory=threading.Event)
    state: Any = None  # engine-side per-request state (detokenizer, output queue, ...)
    draft_ids: list[int] = field(default_factory=list)  # speculative tokens verified in this step (after all_ids)
    spec: Any = None  # speculation state (speculate.SpecState), made on first use
    cache_limit: int | None = None  # only blocks within the first this many tokens may come from the prefix cache

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]]  # (request, num_new tokens to compute this step), in batch order
    num_batched_tokens: int  # sum of num_new
    preempted: list[Request]  # sent back to waiting this step
    refused: list[Request]  # finished with FINISHED_REFUSED this step


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16  # requests in the running batch
    max_batched_tokens: int = 512  # tokens computed per step (all requests together)
    max_prefill_chunk: int = 32  # prefill tokens per step while some request is decoding
    max_waiting: int = 64  # bounded waiting queue


def speculates(params: SamplingParams) -> bool:
    """Greedy rows, and sampled rows without a seed: a seeded answer must come out the same every
    time, and which drafts a step verifies depends on measured step times (speculate.py)."""
    return params.temperature == 0 or params.seed is None


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, speculator: Any = None) -> None:
        self.config, self.blocks, self.speculator = config, blocks, speculator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefill_chunk = config.max_prefill_chunk  # current cap while others decode (engine-tuned)

    def add(self, request: Request) -> bool:
        """Queue a request; False when the waiting queue is full."""
        if len(self.waiting) >= self.config.max_waiting:
            return False
        self.waiting.append(request)
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        refused: list[Request] = []
        decoding = any(r.num_computed_tokens >= len(r.prompt_ids) for r in self.running)
        prefill_cap = self.prefill_chunk if decoding else cfg.max_batched_tokens

        queue = list(self.running)
        while queue and budget > 0:
            request = queue.pop(0)
            num_new = self._num_new(request, budget, prefill_cap)
            while not self.blocks.allocate(request.block_table, request.num_computed_tokens + num_new):
                victim = self.running[-1]  # the newest
                self._preempt(victim)
                preempted.append(victim)
                if victim in queue:
                    queue.remove(victim)
                if victim is request:
                    num_new = 0
                    break
            if num_new:
                scheduled.append((request, num_new))
                budget -= num_new

        while self.waiting and not preempted and budget > 0 and len(self.running) < cfg.max_num_seqs:
            request = self.waiting[0]
            if self.blocks.blocks_needed(request.num_tokens) > self.blocks.num_blocks:
                self.waiting.popleft()
                request.status = RequestStatus.FINISHED_REFUSED
                refused.append(request)
                continue
            if not request.block_table:
                request.block_table = self.blocks.match_prefix(request.all_ids[:request.cache_limit])
                request.num_computed_tokens = len(request.block_table) * self.blocks.block_size
                if not request.output_ids:
                    request.num_cached_tokens = request.num_computed_tokens
            num_new = self._num_new(request, budget, prefill_cap)
            if not self.blocks.allocate(request.block_table, request.num_computed_tokens + num_new):
                self.blocks.free_blocks(request.block_table)  # give back the prefix hits; retry next step
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
            prefill_cap = min(prefill_cap, self.prefill_chunk)  # later admissions are chunked too
        if self.speculator is not None and scheduled:
            budget -= self._add_drafts(scheduled, budget)
        return SchedulerOutput(scheduled, cfg.max_batched_tokens - budget, preempted, refused)

    def _add_drafts(self, scheduled: list[tuple[Request, int]], budget: int) -> int:
        """Let greedy decoding requests verify drafts in the budget and free KV blocks left over
        (speculate.py's NOTE says how many); returns the draft tokens added."""
        candidates, where = [], {}
        for i, (r, n) in enumerate(scheduled):
            r.draft_ids = []
            if n == 1 and r.num_computed_tokens + 1 == r.num_tokens and r.output_ids and speculates(r.params):
                limit = min(r.params.max_tokens - len(r.output_ids) - 1, r.max_len - r.num_tokens)
                if limit > 0:
                    candidates.append((r, limit))
                    where[r.request_id] = i
        if not candidates or budget <= 0:
            return 0
        num_sampling = sum(1 for r, n in scheduled if r.num_computed_tokens + n == r.num_tokens)
        num_rows = sum(n for _, n in scheduled)
        added = 0
        for r, drafts in self.speculator.plan(candidates, num_rows, num_sampling, budget):
            room = (len(r.block_table) + self.blocks.num_free_blocks) * self.blocks.block_size - r.num_tokens
            drafts = drafts[:max(0, room)]  # free blocks only: nobody is preempted for a guess
            if drafts and self.blocks.allocate(r.block_table, r.num_tokens + len(drafts)):
                r.draft_ids = drafts
                scheduled[where[r.request_id]] = (r, 1 + len(drafts))
                added += len(drafts)
        return added

    def _num_new(self, request: Request, budget: int, prefill_cap: int) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining > 1:  # prefilling (or recomputing after preemption)
            return max(1, min(remaining, budget, prefill_cap))
        return min(remaining, budget)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.free_blocks(request.block_table)
        if self.speculator is not None:
            self.speculator.release(request)
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a request from the scheduler and release its KV blocks (within this step)."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free_blocks(request.block_table)
        if self.speculator is not None:
            self.speculator.release(request)

    def after_step(self, request: Request, num_new: int, num_accepted: int = 0) -> bool:
        """Account for a computed step; True when the request should sample its next token now.

        A verify step (request.draft_ids) keeps the KV of its last token and of the first
        `num_accepted` drafts, which the caller then appends; the rejected drafts' blocks are freed
        at once and never registered in the prefix cache."""
        token_ids = request.all_ids
        if request.draft_ids:
            token_ids += request.draft_ids[:num_accepted]
            num_new = 1 + num_accepted
            request.draft_ids = []
            self.blocks.truncate(request.block_table, request.num_computed_tokens + num_new + 1)
        request.num_computed_tokens += num_new
        request.num_registered_blocks = self.blocks.register_full_blocks(
            request.block_table, token_ids, request.num_computed_tokens, request.num_registered_blocks)
        return request.num_computed_tokens == len(token_ids)
