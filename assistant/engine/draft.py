"""Draft-model speculation: a small model with the same tokenizer guesses a big model's next tokens.

NOTE — how it works and how it decides (engine.draft_model; speculate.py has the prompt-lookup twin):

  The draft model's KV. The draft keeps its own paged KV cache with its own `BlockManager` (as many
  blocks as the target's cache, so it never runs out first; its prefix cache shares system prompts
  and documents between sequences like the target's does). Per sequence, `DraftSeq.ids` are the
  tokens whose KV the draft cache holds. They run ahead of the committed text while drafting and
  are cut back to the committed text afterwards: the next plan compares them with the sequence's
  tokens, truncates to the common prefix and frees the blocks past it (a rejected draft's KV is never
  read again, and only full blocks of committed tokens are registered in the draft's prefix cache).
  A finished or preempted sequence frees its draft blocks (`release`, called by the scheduler).

  Drafting. Each step, the sequences that speculate run K rounds of the draft model in one ragged
  batch per round: round 0 feeds each sequence's tokens the draft has not seen (usually the token
  the last step produced, plus the last accepted draft; the whole prompt the first time, at most
  CATCHUP_MAX tokens a step, during which that sequence does not speculate) and takes the argmax as
  draft 1; round i feeds draft i and takes draft i + 1. Drafts are the draft model's greedy choice,
  i.e. a one-point proposal distribution, so the target verifies them with the same rules as
  prompt lookup's drafts (speculate.py): argmax equality for greedy rows, and for sampled rows the
  accept/reject rule of `sampling.accept_sampled`, which keeps the target's distribution exactly.

  Prompt lookup or the draft model. Copying costs no draft round: on answers that quote their
  passages the 1.5B ran 3.35x faster with lookup and 1.74x with the draft model, which is right as
  often but pays K draft rounds per step. So a sequence whose tail matches its earlier text
  (speculate.py's n-gram index) gets both offers, each as the step's expected tokens per second:
  lookup's best prefix of its proposal at lookup's measured acceptance for that match length, and
  the draft model's best K below. The better one drafts; a lookup proposal not taken is scored
  against what decoding produces (its "shadow"), so lookup's acceptance stays measured. Both
  together (bench/speculation.py --large, 1 stream): passages 2.68x, free-form 1.37x (lookup alone
  1.15x). At two streams the draft model lost (0.83x free-form) although its cost model said it
  paid, so it only drafts while at most DRAFT_MAX_SEQS sequences decode; with more, the step is
  planned by prompt lookup alone (speculate.Speculator.plan: its own choice by worth and cost).

  Whether to speculate, and how far. Unlike prompt lookup, drafts cost a draft-model step per
  round, on top of the verify step's extra rows. Per sequence, decayed counts of accepted drafts
  and of first rejections give alpha (the chance that a draft is right given the one before was),
  and k_cap (+2 after a fully accepted run, -1 after a rejection) bounds its drafts. For each K in
  1..k_max every candidate drafts min(K, its k_cap, its limits) tokens, and the plan picks the K
  that maximises the step's expected tokens per second:
      (tokens the step makes anyway + sum over sequences of alpha + alpha^2 + ... + alpha^k)
      / (target step with the extra rows + the K draft rounds)
  or K = 0 (plain decoding) when none beats it. Both times are measured (`StepCost` per row count:
  the target's verify steps, the draft's rounds); before a draft round is measured, a round is
  taken as the draft/target weight ratio times a target step of as many rows. Under load the
  target step already makes many tokens and a draft round adds its cost for every sequence's small
  expected gain, so K falls and speculation turns itself off. A sequence that stops speculating
  drifts back towards the prior (alpha 0.75) and is tried again later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from assistant.engine.speculate import DECAY, K_MAX as LOOKUP_K_MAX, SpeculationStats, Speculator, SpecState, StepCost

LOOKUP, DRAFT = "lookup", "draft"  # where a step's drafts came from
K_MAX_DRAFT = 6  # drafts per sequence per step
# the draft model drafts only while at most this many sequences decode. Measured (bench/speculation.py
# --large, 2 vCPU): 1 stream 1.27x free-form / 1.82x passages, 2 streams 0.83x / 1.20x with the cost model
# alone deciding; two streams already fill the verify step's cheap rows
DRAFT_MAX_SEQS = 1
K_INIT = 3
CATCHUP_MAX = 256  # tokens the draft computes for one lagging sequence in one step
MAX_MEASURED_ROWS = 32  # draft rounds with more rows (catch-up) are not fed to the cost model
FORGET = 0.97  # per step without speculating, a sequence's evidence fades towards the prior
# (accepted, rejected) pseudo-counts: alpha = 0.75 before any evidence. A draft model of the same family
# agrees with its target on most tokens (prompt lookup's prior is 0.5: most text has no earlier match)
DRAFT_PRIOR = (3.0, 1.0)


@dataclass
class DraftSeq:
    """One sequence's draft-model state (Request.spec)."""

    block_table: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # tokens with KV in the draft cache, in order
    num_registered: int = 0
    k_cap: int = K_INIT
    accepted: float = DRAFT_PRIOR[0]
    rejected: float = DRAFT_PRIOR[1]
    started: bool = False  # the prefix cache was consulted
    lookup: SpecState = field(default_factory=SpecState)  # prompt lookup's state for the same sequence
    source: str = ""  # who made the drafts in flight: LOOKUP or DRAFT

    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def record(self, num_accepted: int, num_drafted: int) -> None:
        self.accepted = DECAY * self.accepted + num_accepted
        self.rejected = DECAY * self.rejected + (num_accepted < num_drafted)

    def fade(self) -> None:
        self.accepted = FORGET * self.accepted + (1 - FORGET) * DRAFT_PRIOR[0]
        self.rejected = FORGET * self.rejected + (1 - FORGET) * DRAFT_PRIOR[1]


def expected_tokens(alpha: float, k: int) -> float:
    """alpha + alpha^2 + ... + alpha^k: accepted drafts expected from k drafts."""
    return sum(alpha ** i for i in range(1, k + 1))


class DraftSpeculator:
    """Draft-model speculation for the scheduler (`plan`, `release`) and the engine (`verify`, ...).

    `model` is the draft Transformer, `kv` and `blocks` its own cache; `size_ratio` = its weight bytes
    over the target's (the cost prior)."""

    def __init__(self, model: Any, kv: Any, blocks: Any, *, size_ratio: float, k_max: int = K_MAX_DRAFT) -> None:
        import torch

        self.model, self.kv, self.blocks = model, kv, blocks
        self.size_ratio, self.k_max = size_ratio, k_max
        self.lookup = Speculator(state_of=lambda request: request.spec.lookup)  # plans batches (module NOTE)
        self.draft_cost = StepCost()  # draft rounds by rows (measured here)
        self.stats = SpeculationStats()
        self.stats_by_source = {LOOKUP: SpeculationStats(), DRAFT: SpeculationStats()}
        self.num_draft_rounds = 0
        self._torch = torch

    @property
    def cost(self) -> StepCost:
        """The target's step time by rows (the engine feeds it), shared with prompt lookup's plan."""
        return self.lookup.cost

    @cost.setter
    def cost(self, value: StepCost) -> None:
        self.lookup.cost = value

    # -- the scheduler's side ---------------------------------------------------------------------
    def plan(self, candidates: Sequence[tuple[Any, int]], num_rows: int, num_sampling: int,
             budget: int) -> list[tuple[Any, list[int]]]:
        """Drafts for this step (same contract as speculate.Speculator.plan; module NOTE)."""
        for request, _ in candidates:
            request.spec = request.spec or DraftSeq()
            self._sync(request, request.spec)
        if num_sampling > DRAFT_MAX_SEQS:  # a batch: prompt lookup alone, with its own choice of drafts
            out = self.lookup.plan(candidates, num_rows, num_sampling, budget)
            for request, _ in out:
                request.spec.source = LOOKUP
            return out
        out: list[tuple[Any, list[int]]] = []
        ready, lagging, lookups = [], [], {}
        for request, limit in candidates:  # at most DRAFT_MAX_SEQS of them
            state = request.spec
            look = state.lookup
            look.index.extend(request.prompt_ids, request.output_ids)
            look.score_shadow()
            drafts, n = look.index.propose(min(limit, look.k_cap, LOOKUP_K_MAX, budget))
            if drafts:
                lookups[id(request)] = (drafts, n)
            lag = request.num_tokens - len(state.ids)
            (lagging if lag > CATCHUP_MAX else ready).append((request, limit, state))
        if lagging:
            self._catch_up([(r, s) for r, _, s in lagging])
        k, ks, draft_rate = self._choose(ready, num_rows, num_sampling, budget)
        by_lookup = {}
        for request, _ in candidates:  # lookup instead, where its drafts promise more tokens per second
            if id(request) in lookups:
                drafts, n = lookups[id(request)]
                j, rate = self._lookup_choice(request.spec.lookup.alpha(n), len(drafts), num_rows, num_sampling)
                if j and rate >= draft_rate:
                    by_lookup[id(request)] = drafts[:j]
        for request, limit in candidates:
            state, proposal = request.spec, lookups.get(id(request))
            if id(request) in by_lookup:
                state.lookup.order, state.source = proposal[1], LOOKUP
                out.append((request, by_lookup[id(request)]))
            elif proposal and state.lookup.shadow is None:  # keep measuring what lookup would have got
                state.lookup.shadow = (len(state.lookup.index.ids), proposal[0], proposal[1])
        if by_lookup:  # (with one sequence: the draft model is out of this step)
            ready = [(r, limit, s) for r, limit, s in ready if id(r) not in by_lookup]
            ks = [0] * len(ready)
        for (_, _, state), n in zip(ready, ks):
            if not n:
                state.fade()
        if any(ks):
            for r, d in self._draft([(r, s, n) for (r, _, s), n in zip(ready, ks) if n]):
                if d:
                    r.spec.source = DRAFT
                    out.append((r, d))
        return out

    def _lookup_choice(self, alpha: float, num_drafts: int, num_rows: int, num_sampling: int) -> tuple[int, float]:
        """How many of a lookup proposal's drafts to verify (0: none pays), and the step's tokens per
        second with them."""
        best, best_rate = 0, num_sampling / self.cost.estimate(num_rows)
        for j in range(1, num_drafts + 1):
            rate = (num_sampling + expected_tokens(alpha, j)) / self.cost.estimate(num_rows + j)
            if rate > best_rate:
                best, best_rate = j, rate
        return best, best_rate

    def release(self, request: Any) -> None:
        """The sequence finished or was preempted: free its draft KV."""
        state = request.spec
        if isinstance(state, DraftSeq):
            self.blocks.free_blocks(state.block_table)
            state.ids, state.num_registered, state.started = [], 0, False

    # -- the engine's side ------------------------------------------------------------------------
    def record(self, request: Any, num_accepted: int) -> None:
        """A verify step kept `num_accepted` of the request's drafts (request.draft_ids)."""
        num_drafted, state = len(request.draft_ids), request.spec
        if state.source == LOOKUP:
            state.lookup.settle(num_accepted, num_drafted, LOOKUP_K_MAX)
        else:
            state.record(num_accepted, num_drafted)
            state.k_cap = min(self.k_max, state.k_cap + 2) if num_accepted == num_drafted else max(1, state.k_cap - 1)
        self.stats.add(num_drafted, num_accepted)
        self.stats_by_source[state.source].add(num_drafted, num_accepted)

    def observe_step(self, num_rows: int, seconds: float) -> None:
        self.cost.observe(num_rows, seconds)

    # -- internals ---------------------------------------------------------------------------------
    def _sync(self, request: Any, state: DraftSeq) -> None:
        """Cut the draft's tokens back to the common prefix with the sequence's (module NOTE)."""
        all_ids = request.all_ids
        if not state.started:
            state.block_table = self.blocks.match_prefix(all_ids)
            state.ids = all_ids[:len(state.block_table) * self.blocks.block_size]
            state.num_registered = len(state.block_table)
            state.started = True
            return
        ids, common = state.ids, min(len(state.ids), len(all_ids) - 1)  # the last token is always fed
        for i in range(max(0, state.num_registered * self.blocks.block_size), common):
            if ids[i] != all_ids[i]:
                common = i
                break
        if common < len(ids):
            del ids[common:]
            self.blocks.truncate(state.block_table, common)
        state.num_registered = self.blocks.register_full_blocks(state.block_table, ids, len(ids), state.num_registered)

    def _choose(self, ready: list[tuple[Any, int, DraftSeq]], num_rows: int, num_sampling: int,
                budget: int) -> tuple[int, list[int], float]:
        """The K of the module NOTE, each sequence's drafts under it, and the step's expected tokens
        per second then (K = 0: plain decoding's)."""
        none = [0] * len(ready)
        best, best_ks = 0, none
        best_rate = num_sampling / self.cost.estimate(num_rows)
        if not ready or budget <= 0:
            return 0, none, best_rate
        for k in range(1, self.k_max + 1):
            ks = [min(k, state.k_cap, limit) for _, limit, state in ready]
            if sum(ks) > budget:
                break
            gain = num_sampling + sum(expected_tokens(state.alpha(), n) for (_, _, state), n in zip(ready, ks))
            seconds = self.cost.estimate(num_rows + sum(ks))
            for i in range(k):  # (catching up on a prompt is not counted: it is paid once, to start)
                rows = sum(1 for n in ks if n > i)
                if rows:
                    seconds += self._round_seconds(rows)
            if gain / seconds > best_rate:
                best, best_ks, best_rate = k, ks, gain / seconds
        return best, best_ks, best_rate

    def _round_seconds(self, rows: int) -> float:
        if self.draft_cost.measured:
            return self.draft_cost.estimate(rows)
        return self.size_ratio * self.cost.estimate(rows)  # unmeasured: in the target's units

    def _draft(self, seqs: list[tuple[Any, DraftSeq, int]]) -> list[tuple[Any, list[int]]]:
        """Run the draft rounds; -> (request, drafts) for each sequence (module NOTE)."""
        drafts: list[list[int]] = [[] for _ in seqs]
        feed = {j: r.all_ids[len(s.ids):] for j, (r, s, _) in enumerate(seqs)}  # round 0: what it has not seen
        for i in range(max(n for _, _, n in seqs)):
            batch = [j for j in feed if seqs[j][2] > i]
            argmax = self._forward([(seqs[j][1], feed[j], len(seqs[j][0].prompt_ids)) for j in batch])
            feed = {}
            for j, token in zip(batch, argmax):
                if token is not None:  # None: no draft KV memory left, this sequence stops drafting
                    drafts[j].append(token)
                    feed[j] = [token]
        return [(r, d) for (r, _, _), d in zip(seqs, drafts)]

    def _catch_up(self, seqs: list[tuple[Any, DraftSeq]]) -> None:
        """Lagging sequences compute up to CATCHUP_MAX of the tokens the draft has not seen, in forwards the
        size of the draft's native layer stack where it has one (model.py `step_rows`: ~2x cheaper per token)."""
        piece = self.model.step_rows or CATCHUP_MAX
        for r, s in seqs:
            end = len(s.ids) + CATCHUP_MAX
            while len(s.ids) < min(end, r.num_tokens):
                before = len(s.ids)
                self._forward([(s, r.all_ids[before:min(before + piece, end)], len(r.prompt_ids))], measure=False)
                if len(s.ids) == before:  # no draft KV memory left: it stays behind
                    break

    def _forward(self, items: list[tuple[DraftSeq, list[int], int]], measure: bool = True) -> list[int | None]:
        """One ragged draft step: append each item's tokens to its sequence's draft KV (item: state, new
        tokens, prompt length); -> the argmax after each item's last token (None where the draft cache
        had no room)."""
        from assistant.engine.model import SeqBatch, argmax as greedy_tokens

        torch = self._torch
        tokens: list[int] = []
        positions: list[int] = []
        seqs = []
        kept = []
        for j, (state, new, prompt_len) in enumerate(items):
            start = len(state.ids)
            if not self.blocks.allocate(state.block_table, start + len(new)):
                continue
            seqs.append(SeqBatch(len(tokens), len(new), start + len(new),
                                 self.kv.slots(state.block_table, start + len(new)), prompt_len))
            tokens.extend(new)
            positions.extend(range(start, start + len(new)))
            kept.append(j)
        out: list[int | None] = [None] * len(items)
        if not kept:
            return out
        begin = time.perf_counter()
        with torch.inference_mode():
            logits = self.model.forward(torch.tensor(tokens, device=self.model.device),
                                        torch.tensor(positions, device=self.model.device), seqs, self.kv,
                                        greedy=[True] * len(seqs))
            argmax = greedy_tokens(logits)
        if measure and len(tokens) <= MAX_MEASURED_ROWS:
            self.draft_cost.observe(len(tokens), time.perf_counter() - begin)
        self.num_draft_rounds += 1
        for j, token in zip(kept, argmax):
            state, new, _ = items[j]
            state.ids.extend(new)
            out[j] = int(token)
        return out
