"""LocalEngine: the in-process LLM with continuous batching, a paged KV cache and prefix caching.

Threads: callers of `generate` only enqueue a Request and read TokenDeltas from its queue; one engine
thread owns the model, the scheduler and the KV cache and runs steps in a loop:

    schedule (scheduler.py) -> one ragged forward over every scheduled token (model.py)
      -> sample per request -> detokenise + stop strings -> deltas to each request's queue

Requests speculate (engine.speculation = "prompt_lookup", speculate.py; or a small model of the same
tokenizer drafts, engine.draft_model, draft.py): a step may verify drafts, and then yields several
tokens at once, in one delta. Greedy rows keep the drafts the model's argmax agrees with; sampled rows
without a seed keep them by the speculative-sampling rule (sampling.accept_sampled), which leaves the
distribution unchanged; seeded rows never speculate, so a seed gives the same answer every time.

Cancelling (the caller's event, or closing the iterator when a client goes away) is noticed at the
start of the next step, and the request's KV blocks are released in that same step.

Failure isolation (one step serves many requests, so one request's problem must not become every
request's problem; see `_loop`):
  * `submit` checks what the engine thread relies on (token ids in the vocabulary, finite sampling
    values, string stop sequences, an integer seed) in the caller's thread: a bad request is refused
    before it is queued, with a ValueError its caller sees.
  * Inside a step, everything done for one request (building its slice of the batch, sampling its
    row, detokenising, matching its stop strings, accounting its KV) runs under its own guard: an
    error finishes that request alone, its consumer gets an EngineError, the rest of the step goes on.
  * Only the batched forward (and the batched argmax over its logits) is shared: if it fails, the
    requests in that step fail (the cause is ours or the hardware's, not one request's), and so does
    anything unexpected outside a request's guard. Either way the engine thread lives on and keeps
    serving later requests; it only ends on `close()`.

What was measured before writing this (MACHINE.md, same machine): transformers' continuous-batching
manager (`generate_batch`, paged|sdpa attention) reached 2.0x sequential `generate()` for 8 prompts,
short of the 4x target, and its per-token overhead dominates small models; hence the hand-written
scheduler/KV cache here, with HF `generate()` kept as the baseline in bench/engine.py.
"""

from __future__ import annotations

import atexit
import logging
import math
import numbers
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Sequence

from assistant.config import AssistantConfig, EngineConfig, int8_residual_linears
from assistant.engine.base import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    Engine,
    Prompt,
    SamplingParams,
    TokenDelta,
    TokenLogprob,
    check_biased_tokens,
)
from assistant.engine.cuda_graphs import DecodeGraphs
from assistant.engine.detokenize import IncrementalDetokenizer, StopMatcher
from assistant.engine.kv_cache import BlockManager, KVCache
from assistant.engine.draft import DraftSpeculator
from assistant.engine.loading import (
    ChatTemplateEncoding,
    LoadedModel,
    check_same_vocabulary,
    eos_token_ids,
    load_draft_model,
    load_model,
)
from assistant.engine.model import SeqBatch, Transformer, argmax
from assistant.engine.sampling import (accept_greedy, accept_sampled, adjusted, logits_to_probs, sample,
                                      token_logprobs)
from assistant.engine.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig
from assistant.engine.speculate import Speculator
from assistant.engine.taps import HiddenTap
from assistant.errors import EngineBusy, EngineError, ModelError

log = logging.getLogger(__name__)

# A step carrying a prefill chunk may take this many times a pure decode step. The promise is 2.5x at
# p95 (the bench's ITL figure); inter-token gaps also carry the step's sampling and streaming, and a
# shared machine adds noise, so the tuner aims below it (measured at 2.0: steady mixed steps at
# 2.05-2.2x the decode average, p95 2.1-2.7x across bench runs).
ITL_TARGET = 1.8
MIN_PREFILL_CHUNK = 4  # ... but a waiting prompt always advances by at least this many tokens
INITIAL_PREFILL_CHUNK = 8  # before the first mixed step is measured (the limit was 64: a 6x stall)
EMA = 0.2  # weight of the newest measurement in the step-time averages

# Engines still running, closed at interpreter exit: a daemon thread that leaves a native step (the GIL released)
# once Python is finalizing is ended with pthread_exit, whose unwinding through the kernels' C++ frames aborts
# the process ("terminate called without an active exception", exit code 134), so a program that ends mid-answer
# (Ctrl-C in the terminal chat, a notebook kernel stopped) crashed. atexit runs before that finalization.
_LIVE: "weakref.WeakSet[LocalEngine]" = weakref.WeakSet()


@atexit.register
def _close_live_engines() -> None:
    for engine in list(_LIVE):
        engine.close()


_FINISH = {RequestStatus.FINISHED_STOPPED: FINISH_STOP, RequestStatus.FINISHED_LENGTH: FINISH_LENGTH,
           RequestStatus.FINISHED_CANCELLED: FINISH_CANCELLED}


@dataclass
class _Stream:
    """Engine-thread state of one request."""

    out: "queue.SimpleQueue[TokenDelta | Exception]"
    detok: IncrementalDetokenizer
    stops: StopMatcher
    generator: Any  # torch.Generator for seeded sampling, or None
    user_cancel: threading.Event | None
    tap: Any = None  # taps.HiddenTap filled while the prompt is prefilled, or None
    rows: int = 1  # logits rows of the request in the current step (SeqBatch.num_logits)
    prompt_scored: list = field(default_factory=list)  # TokenLogprob of prompt positions 1.. (prompt_logprobs)
    prompt_sent: bool = False  # whether a delta carried them


def resolve_quantize(quantize: str, device: Any) -> str | None:
    if quantize == "auto":
        return "int8" if device.type == "cpu" else None
    return None if quantize == "none" else quantize


class _TokenStream:
    """The deltas of one request, as an iterator whose close() cancels the request even when it is
    called before the first read (a generator's `finally` would not run then: a server that gives up
    on a request it admitted late would leave it decoding to max_tokens for nobody)."""

    def __init__(self, engine: "LocalEngine", request: Request) -> None:
        self._engine, self._request, self._finished = engine, request, False

    def __iter__(self) -> "_TokenStream":
        return self

    def __next__(self) -> TokenDelta:
        if self._finished:
            raise StopIteration
        item = self._request.state.out.get()
        if isinstance(item, Exception):
            self._finished = True
            raise item
        if item.finish_reason:
            self._finished = True
        return item

    def close(self) -> None:
        if not self._finished:
            self._finished = True
            self._engine._abandon(self._request)

    def __del__(self) -> None:
        self.close()


class LocalEngine(ChatTemplateEncoding, Engine):
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, draft: LoadedModel | None = None) -> None:
        import torch

        config = config or EngineConfig()
        self.tokenizer, self.device, self.name = loaded.tokenizer, loaded.device, loaded.name
        hf = loaded.model
        self._torch = torch
        self.quantize = resolve_quantize(config.quantize, loaded.device)
        residual = int8_residual_linears(config.int8_residual)
        self.model = Transformer.from_hf(hf, quantize=self.quantize, residual=residual, outliers=config.int8_outliers)
        self.eos_ids = eos_token_ids(hf, self.tokenizer)
        args = self.model.args
        kv_dtype = self.model.dtype if config.kv_dtype == "auto" else getattr(torch, config.kv_dtype)
        per_token = KVCache.bytes_per_token(args.num_layers, args.num_kv_heads, args.head_dim, kv_dtype)
        num_blocks = max(2, config.kv_cache_mb * 2**20 // (per_token * config.block_size))
        graphs = config.cuda_graphs and loaded.device.type == "cuda"
        # with graphs, one block more than the block manager hands out: the padding rows' scratch block
        self.kv = KVCache(args.num_layers, num_blocks + (1 if graphs else 0), config.block_size, args.num_kv_heads,
                          args.head_dim, kv_dtype, loaded.device, compute_dtype=self.model.dtype)
        self.blocks = BlockManager(num_blocks, config.block_size, enable_prefix_cache=config.prefix_cache)
        self.context_window = min(loaded.context_window, num_blocks * config.block_size)
        self.graphs = DecodeGraphs(self.model, self.kv, scratch_block=num_blocks, max_batch=config.max_num_seqs,
                                   max_len=self.context_window) if graphs else None
        if graphs and draft is None and config.speculation == "prompt_lookup":
            config = replace(config, speculation="off")  # verify steps are not graphed: plain graphed decode wins
        self.speculator = self._speculator(config, draft, num_blocks)
        # On the native CPU path a step of more rows than the layer stack takes costs ~2x as much per token
        # (model.py `step_rows`), so no step is planned bigger, unless the running streams alone need more rows.
        step_tokens = config.max_batched_tokens
        if self.model.step_rows is not None:
            step_tokens = max(min(step_tokens, self.model.step_rows), config.max_num_seqs)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, step_tokens, config.max_prefill_chunk,
                                                   config.max_waiting), self.blocks, self.speculator)
        self.scheduler.prefill_chunk = min(INITIAL_PREFILL_CHUNK, config.max_prefill_chunk)  # until measured
        self._decode_step_s = 0.0  # EMA of a step without prefill tokens
        self._prefill_token_s = 0.0  # EMA of the extra time per prefill token in a mixed step
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    @classmethod
    def from_config(cls, config: AssistantConfig) -> "LocalEngine":
        return cls(load_model(config), config.engine, load_draft_model(config))

    def _speculator(self, config: EngineConfig, draft: LoadedModel | None, num_blocks: int) -> Any:
        """None (engine.speculation = "off"), the draft model's (draft.py) or prompt lookup (speculate.py)."""
        if config.speculation == "off":
            return None
        if draft is None:
            return Speculator()
        check_same_vocabulary(self.tokenizer, draft.tokenizer, draft.name)
        model = Transformer.from_hf(draft.model, quantize=resolve_quantize(config.quantize, draft.device),
                                    residual=int8_residual_linears(config.int8_residual), outliers=config.int8_outliers)
        args = model.args
        if min(args.max_position, 32768) < self.context_window:
            raise ModelError(f"engine.draft_model {draft.name!r} reads {args.max_position} tokens of context, fewer "
                             f"than the {self.context_window} of the model it drafts for: set "
                             f"engine.max_context_tokens = {args.max_position} or pick another draft model.")
        kv_dtype = model.dtype if config.kv_dtype == "auto" else getattr(self._torch, config.kv_dtype)
        kv = KVCache(args.num_layers, num_blocks, config.block_size, args.num_kv_heads, args.head_dim, kv_dtype,
                     draft.device, compute_dtype=model.dtype)  # as many tokens as the target's cache holds
        blocks = BlockManager(num_blocks, config.block_size, enable_prefix_cache=config.prefix_cache)
        return DraftSpeculator(model, kv, blocks, size_ratio=model.decode_bytes() / self.model.decode_bytes())

    def stats(self) -> dict[str, Any]:
        s = self.blocks.stats
        out = {"num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
               "free_kv_blocks": self.blocks.num_free_blocks, "num_kv_blocks": self.blocks.num_blocks,
               "prefix_cache_queries": s.num_queries, "prefix_cache_hits": s.num_hits,
               "prefix_cache_hit_rate": round(s.hit_rate, 4), "prefix_cache_evictions": s.num_evictions}
        if self.speculator is not None:
            p = self.speculator.stats
            out.update({"spec_verify_steps": p.num_verify_steps, "spec_drafted": p.num_drafted,
                        "spec_accepted": p.num_accepted, "spec_acceptance_rate": round(p.acceptance_rate, 4),
                        "spec_tokens_per_step": round(p.mean_tokens_per_step, 3)})
        if self.graphs is not None:
            out.update(self.graphs.stats())
        return out

    # -- requests ---------------------------------------------------------------------------------
    def generate(self, prompt: Prompt, params: SamplingParams, *, tools: Sequence[dict] | None = None,
                 cancel: threading.Event | None = None, tap: HiddenTap | None = None) -> Iterator[TokenDelta]:
        """Engine.generate; `tap` (taps.py) also collects the mean hidden states of a message in the
        prompt while it prefills."""
        try:
            request = self.submit(self.checked_prompt_ids(prompt, params, tools), params, cancel, tap=tap)
        except BaseException:
            if tap is not None:
                tap.decline("the request was refused")
            raise
        return self._stream(request)

    def submit(self, prompt_ids: list[int], params: SamplingParams, cancel: threading.Event | None = None, *,
               tap: HiddenTap | None = None) -> Request:
        self._check_request(prompt_ids, params)
        prompt_ids = [int(t) for t in prompt_ids]
        generator = None
        if params.seed is not None and params.temperature > 0:
            generator = self._torch.Generator(device=self.device).manual_seed(params.seed)
        request = Request(list(prompt_ids), params, max_len=self.context_window)
        if params.prompt_logprobs is not None:
            request.cache_limit = 0  # every prompt position is computed here: its logits score the next token
        if tap is not None:
            bad = next((n for n in tap.layers if not 0 < n <= self.model.args.num_layers), None)
            if bad is not None:
                raise ValueError(f"The model has {self.model.args.num_layers} layers: no hidden state {bad} to tap.")
            if tap.bind(prompt_ids, lambda text: self.tokenizer(text, add_special_tokens=False)["input_ids"]):
                request.cache_limit = tap.limit  # every position of the span is computed by this request
            else:
                tap = None
        request.state = _Stream(queue.SimpleQueue(), IncrementalDetokenizer(self.tokenizer, prompt_ids),
                                StopMatcher(params.stop), generator, cancel, tap)
        with self._cond:
            if self._closed:
                raise EngineError("The engine has been shut down.")
            if not self.scheduler.add(request):
                raise EngineBusy(f"The engine is at capacity ({self.scheduler.config.max_waiting} requests waiting): "
                                 "retry in a moment, or raise engine.max_waiting.")
            self._cond.notify()
        return request

    def _check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Refuse, in the caller's thread, what would otherwise raise inside the engine thread."""
        params.verify()
        vocab = self.model.args.vocab_size
        if not prompt_ids:
            raise ValueError("The prompt is empty.")
        bad = next((t for t in prompt_ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)
                    or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"Token id {bad!r} is not in the model's vocabulary (integers 0..{vocab - 1}).")
        for name in ("temperature", "top_p"):
            value = getattr(params, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r} must be a finite number.")
        for name in ("top_k", "max_tokens"):
            if isinstance(getattr(params, name), bool) or not isinstance(getattr(params, name), numbers.Integral):
                raise ValueError(f"{name}={getattr(params, name)!r} must be an integer.")
        if isinstance(params.stop, str) or not all(isinstance(s, str) and s for s in params.stop):
            raise ValueError(f"stop={params.stop!r} must be a sequence of non-empty strings.")
        if params.seed is not None and (isinstance(params.seed, bool) or not isinstance(params.seed, numbers.Integral)):
            raise ValueError(f"seed={params.seed!r} must be an integer.")
        check_biased_tokens(params, vocab)

    def _stream(self, request: Request) -> Iterator[TokenDelta]:
        return _TokenStream(self, request)

    def _abandon(self, request: Request) -> None:
        """The caller stopped reading: free the request's slot within one step."""
        request.cancel.set()
        with self._cond:
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # -- the engine thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        """The engine thread. Error handling, from narrow to wide (design note in the module docstring):
        per-request work in `_inputs` / `_process` fails only its request; a failing batched forward
        fails the step's requests; anything else unexpected fails what the step held (or, if the
        scheduler itself failed, what it holds) and the loop goes on. Only `close()` ends it."""
        while True:
            scheduled: list[tuple[Request, int]] = []
            try:
                with self._cond:
                    while not self._closed and not self.scheduler.has_work:
                        self._cond.wait()
                    if self._closed:
                        for r in [*self.scheduler.running, *self.scheduler.waiting]:
                            self._fail(r, EngineError("The engine was shut down."))
                        return
                    self._reap_cancelled()
                    out = self.scheduler.schedule()
                scheduled = out.scheduled
                for r in out.refused:
                    if r.state.tap is not None:
                        r.state.tap.decline("the request did not fit in the KV cache")
                    r.state.out.put(EngineError(
                        f"This request needs {r.num_tokens} tokens of KV memory but the cache holds "
                        f"{self.blocks.num_blocks * self.blocks.block_size}: raise engine.kv_cache_mb."))
                if scheduled:
                    self._step(scheduled)
            except Exception as e:  # a bug outside any one request's guard: fail what it touched, go on
                log.exception("engine step failed")
                with self._cond:
                    victims = [r for r, _ in scheduled] or [*self.scheduler.running, *self.scheduler.waiting]
                for r in victims:
                    try:
                        self._fail(r, self._error("The engine step failed", e))
                    except Exception:  # the scheduler is broken too: still tell the consumer
                        log.exception("could not release a failed request")
                        r.state.out.put(self._error("The engine step failed", e))

    def _step(self, scheduled: list[tuple[Request, int]]) -> None:
        batch = self._inputs(scheduled)
        if batch is None:
            return
        scheduled, tokens, positions, seqs = batch
        prefill = any(r.num_computed_tokens < len(r.prompt_ids) for r, _ in scheduled)
        try:  # shared by every request in the step: a failure here is ours (or the hardware's)
            start = time.perf_counter()
            logits = self._forward(scheduled, tokens, positions, seqs)
            self._tune_prefill_chunk(scheduled, time.perf_counter() - start)
        except Exception as e:
            log.exception("batched forward failed")
            for r, _ in scheduled:
                self._fail(r, self._error("Generation failed", e))
            return
        for seq, (r, _) in zip(seqs, scheduled):
            if seq.tap is not None:  # its rows of this step are summed in: the span is done up to here
                seq.tap.advance(r.num_computed_tokens + seq.tap_rows[1])
        self._process(scheduled, logits)
        if self.speculator is not None and not prefill:  # what a step of so many rows costs, with its streaming
            self.speculator.observe_step(len(tokens), time.perf_counter() - start)

    @staticmethod
    def _error(what: str, cause: Exception) -> EngineError:
        error = EngineError(f"{what}: {type(cause).__name__}: {cause}")
        error.__cause__ = cause
        return error

    def _tune_prefill_chunk(self, scheduled: list[tuple[Request, int]], seconds: float) -> None:
        """Keep steps that carry prefill within ITL_TARGET x a decode step (measured, not guessed:
        the ratio of prefill to decode cost depends on the machine, threads, quantization and load)."""
        num_prefill = sum(n for r, n in scheduled if r.num_computed_tokens < len(r.prompt_ids))
        num_drafts = sum(len(r.draft_ids) for r, _ in scheduled)  # speculative rows (speculate.py)
        if num_prefill == 0:
            if num_drafts == 0:  # a verify step is no plain decode step: the speculator measures those
                old = self._decode_step_s
                self._decode_step_s = seconds if not old else (1 - EMA) * old + EMA * seconds
            return
        if not self._decode_step_s or len(scheduled) == 1:
            return  # nothing decoding alongside: no stream to protect
        per_token = max(seconds - self._decode_step_s, 0.0) / (num_prefill + num_drafts)  # a draft row ~ a prompt row
        self._prefill_token_s = per_token if not self._prefill_token_s else (1 - EMA) * self._prefill_token_s + EMA * per_token
        if self._prefill_token_s > 0:
            chunk = int((ITL_TARGET - 1) * self._decode_step_s / self._prefill_token_s)
            self.scheduler.prefill_chunk = max(MIN_PREFILL_CHUNK, min(chunk, self.scheduler.config.max_prefill_chunk))

    def _reap_cancelled(self) -> None:
        for r in [*self.scheduler.running, *self.scheduler.waiting]:
            if r.cancel.is_set() or (r.state.user_cancel is not None and r.state.user_cancel.is_set()):
                self.scheduler.finish(r, RequestStatus.FINISHED_CANCELLED)
                if r.state.tap is not None:
                    r.state.tap.decline("the request was cancelled")
                r.state.out.put(self._delta(r, "", (), FINISH_CANCELLED))

    def _fail(self, request: Request, error: Exception) -> None:
        with self._cond:
            if not request.status.finished:
                self.scheduler.finish(request, RequestStatus.FINISHED_CANCELLED)
        if request.state.tap is not None:
            request.state.tap.decline(f"the request failed: {error}")
        request.state.out.put(error)

    def _inputs(self, scheduled: list[tuple[Request, int]]) -> tuple[Any, ...] | None:
        """Each request's slice of the ragged batch, built under its own guard: a request whose inputs
        cannot be built (say a token id outside the vocabulary slipped past `submit`) is failed and
        left out of the step. None when nothing is left to run."""
        vocab = self.model.args.vocab_size
        taps = {r.request_id: (r.state.tap, rows) for r, n in scheduled if r.state.tap is not None
                and (rows := r.state.tap.rows(r.num_computed_tokens, n)) is not None}
        graphed = self.graphs is not None and len(scheduled) <= self.graphs.max_batch and not taps and all(
            n == 1 and not r.draft_ids for r, n in scheduled)  # a plain decode step: no slot tensors needed
        kept: list[tuple[Request, int]] = []
        tokens: list[int] = []
        positions: list[int] = []
        seqs: list[SeqBatch] = []
        for r, n in scheduled:
            try:
                start = r.num_computed_tokens
                new = (r.all_ids + r.draft_ids)[start:start + n]
                if len(new) != n or not all(isinstance(t, int) and 0 <= t < vocab for t in new):
                    raise ValueError(f"invalid token ids for positions {start}..{start + n - 1}")
                slots = None if graphed else self.kv.slots(r.block_table, start + n)
                # a prefill chunk of a request that scores its prompt: every row; else the last (and the drafts')
                rows = n if r.params.prompt_logprobs is not None and start < len(r.prompt_ids) else 1 + len(r.draft_ids)
                r.state.rows = rows
                seq = SeqBatch(len(tokens), n, start + n, slots, len(r.prompt_ids), num_logits=rows,
                               **(dict(zip(("tap", "tap_rows"), taps[r.request_id])) if r.request_id in taps else {}))
            except Exception as e:
                log.exception("request %s failed while building its step inputs", r.request_id)
                self._fail(r, self._error("This request failed", e))
                continue
            kept.append((r, n))
            seqs.append(seq)
            tokens.extend(new)
            positions.extend(range(start, start + n))
        return (kept, tokens, positions, seqs) if kept else None

    def _forward(self, scheduled: list[tuple[Request, int]], tokens: list[int], positions: list[int],
                 seqs: list[SeqBatch]) -> Any:
        torch = self._torch
        with torch.inference_mode():
            if seqs[0].kv_slots is None:  # `_inputs` found a plain decode step: replay its CUDA graph
                return self.graphs.run(tokens, positions, [r.block_table for r, _ in scheduled])
            return self.model.forward(torch.tensor(tokens, device=self.device),
                                      torch.tensor(positions, device=self.device), seqs, self.kv,
                                      greedy=[self._argmax_only(r) for r, _ in scheduled])

    @staticmethod
    def _argmax_only(r: Request) -> bool:
        """Whether the request's rows of this step need only their argmax (the screened lm_head): greedy,
        and none of its numbers shown (logprobs, a prompt being scored) or changed (penalties, bias)."""
        scoring_prompt = r.state.rows > 1 + len(r.draft_ids)
        return (r.params.temperature == 0 and r.params.logprobs is None and not scoring_prompt
                and not r.params.adjusts_logits)

    def _process(self, scheduled: list[tuple[Request, int]], logits: Any) -> None:
        """Sample (or verify drafts), detokenise and stream per request, each under its own guard (see
        `_loop`). logits has `state.rows` rows per request, in batch order: 1 + len(draft_ids), or a whole
        prefill chunk when the request scores its prompt; its token comes from the last 1 + len(draft_ids)
        of them after its penalties and logit bias, its logprobs from the raw rows."""
        raw, logits = logits, self._adjusted(scheduled, logits)
        greedy = argmax(logits)  # batched: a failure fails the step
        ready = []
        with self._cond:
            row = 0
            for r, n in scheduled:
                chunk, row = row, row + r.state.rows
                first = row - 1 - len(r.draft_ids)
                try:
                    if r.state.rows > 1 + len(r.draft_ids):  # a prefill chunk scoring its prompt
                        self._score_prompt(r, raw[chunk:row], r.num_computed_tokens)
                    if r.draft_ids:  # speculate.py: the accepted drafts and the model's own next token
                        if r.params.temperature == 0:
                            tokens = accept_greedy(r.draft_ids, greedy[first:row])
                        else:
                            tokens = accept_sampled(logits_to_probs(logits[first:row], r.params), r.draft_ids,
                                                    r.state.generator)
                        self.speculator.record(r, len(tokens) - 1)
                        if self.scheduler.after_step(r, n, num_accepted=len(tokens) - 1):
                            ready.append((first, r, tokens))
                    elif self.scheduler.after_step(r, n):
                        ready.append((first, r, None))
                except Exception as e:
                    log.exception("request %s failed after its step", r.request_id)
                    self._fail(r, self._error("This request failed", e))
        for i, r, tokens in ready:
            try:
                if tokens is None:
                    if r.params.temperature == 0:
                        tokens = [greedy[i]]
                    else:
                        tokens = [int(sample(logits[i:i + 1], r.params, r.state.generator).item())]
                scored = () if r.params.logprobs is None else tuple(
                    token_logprobs(raw[i:], tokens, r.params.logprobs, self.token_text))
                self._append(r, tokens, scored)
            except Exception as e:  # this request's sampling / detokenising / stop strings
                log.exception("request %s failed while producing its token", r.request_id)
                self._fail(r, self._error("This request failed", e))

    @staticmethod
    def _adjusted(scheduled: list[tuple[Request, int]], logits: Any) -> Any:
        """`logits` with each request's penalties and logit bias applied to its rows (a copy, when any
        request has them)."""
        if not any(r.params.adjusts_logits for r, _ in scheduled):
            return logits
        out, row = logits.clone(), 0
        for r, _ in scheduled:
            row += r.state.rows
            first = row - 1 - len(r.draft_ids)  # the rows that choose tokens
            if r.params.adjusts_logits:
                out[first:row] = adjusted(logits[first:row], r.params, r.output_ids, r.draft_ids)
        return out

    def _score_prompt(self, r: Request, rows: Any, start: int) -> None:
        """Keep the log-probabilities of the prompt tokens this prefill chunk's rows predict (row j, at
        position start + j, predicts position start + j + 1), each position once (a preempted request
        computes its prompt again)."""
        done = 1 + len(r.state.prompt_scored)  # the next position to score
        first, end = max(start + 1, done), min(start + rows.size(0), len(r.prompt_ids) - 1) + 1
        if first < end and first <= done:
            r.state.prompt_scored.extend(token_logprobs(rows[first - start - 1:], r.prompt_ids[first:end],
                                                        r.params.prompt_logprobs, self.token_text))

    def _append(self, r: Request, tokens: list[int], scored: tuple[TokenLogprob, ...] = ()) -> None:
        """Append tokens one by one as plain decoding would, stopping at EOS, a stop string, max_tokens
        or the context window (later accepted drafts are dropped); one delta for all of them, with the
        log-probabilities of the tokens it holds (`scored`, one per token, when the request asks; none for
        the end-of-sequence token)."""
        s = r.state
        status = None
        text = ""
        appended = []
        for token in tokens:
            r.output_ids.append(token)
            appended.append(token)
            if token in self.eos_ids and not r.params.ignore_eos:
                status, text = RequestStatus.FINISHED_STOPPED, text + s.stops.flush()
            else:
                text += s.stops.push(s.detok.push(token))
                if s.stops.stopped:
                    status = RequestStatus.FINISHED_STOPPED
                elif len(r.output_ids) >= r.params.max_tokens or r.num_tokens >= r.max_len:
                    status, text = RequestStatus.FINISHED_LENGTH, text + s.stops.flush()
            if status is not None:
                break
        if status is not None:
            with self._cond:
                self.scheduler.finish(r, status)
        kept = scored[:len(appended)]
        if kept and appended[-1] in self.eos_ids and not r.params.ignore_eos:
            kept = kept[:-1]  # the end of the answer is no part of its text: OpenAI's logprobs leave it out
        prompt = ()
        if r.params.prompt_logprobs is not None and not s.prompt_sent:
            prompt, s.prompt_sent = tuple(s.prompt_scored), True
        s.out.put(self._delta(r, text, tuple(appended), _FINISH.get(status) if status else None, kept, prompt))

    @staticmethod
    def _delta(r: Request, text: str, token_ids: tuple[int, ...], finish: str | None,
               scored: tuple[TokenLogprob, ...] = (), prompt: tuple[TokenLogprob, ...] = ()) -> TokenDelta:
        return TokenDelta(text, token_ids, finish, len(r.prompt_ids), len(r.output_ids), r.num_cached_tokens, scored,
                          prompt)
