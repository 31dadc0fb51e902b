"""Prompt-lookup speculation: greedy sequences guess their next tokens from their own text.

NOTE — how it works and how it decides (engine.speculation = "prompt_lookup", the default):

  Drafting. An answer that quotes its prompt (retrieved passages, code it was shown, the question it
  repeats) or repeats itself continues text that already exists. `NgramIndex` keeps, per sequence,
  the most recent earlier occurrence of every 1-, 2- and 3-gram of prompt + output; a sequence whose
  last n tokens (longest n first) occurred before drafts the tokens that followed them. No second
  model, microseconds of Python per step.

  Verification. A drafting sequence's step carries 1 + k rows (its last token and the k drafts)
  through the same ragged forward as every other sequence of the step, like a short prefill chunk
  with logits at every row. Draft i is accepted while it equals the model's argmax after draft
  i - 1; the step then yields the accepted drafts plus the model's own next token (1 to k + 1
  tokens), which is exactly what plain greedy decoding would have produced one step at a time. The
  rejected drafts' KV is rolled back: the sequence's computed length only counts committed tokens,
  blocks past its new length are freed at once, and only full blocks of committed tokens are ever
  registered in the prefix cache (a rejected token's slot is rewritten before its block can fill).
  Sampled rows (temperature > 0) without a seed speculate too: they keep drafts by the rule of
  `sampling.accept_sampled`, which yields tokens distributed exactly as sampling one at a time; a
  seeded row never does (which drafts a step verifies depends on measured times, and a seed must
  give the same answer every time).

  Whether to speculate, and how far. A draft costs a row in the step, and a step's time grows with its
  rows (a lot on CPUs where a multi-row step costs far more than a one-row step: bench/speculation.py
  measures it). So each step the engine buys drafts only where they are expected to pay:
  * acceptance: per sequence and per match length n, decayed counts of accepted drafts and of first
    rejections give alpha_n, the chance that a draft is right given the one before it was. Proposals
    that were not verified (the sequence did not speculate that step) are still scored against the
    tokens plain decoding produced ("shadow" scoring, free), so a sequence whose speculation is off
    keeps measuring what it would gain and turns it back on when its text starts to repeat;
  * cost: `StepCost` measures the step time for each row count R (steps without prefill; an EMA per R,
    forgotten after STALE_STEPS steps, so a changed machine load is noticed). An unmeasured R is
    interpolated between measured neighbours, or extrapolated beyond them along the measured slope
    (at least PRIOR_ROW_COST of a step per row, an optimistic prior, so that a row count that might
    pay gets tried and measured once; the measurement then replaces the guess);
  * choice: the step already holds R rows that will produce G tokens (one per sequence that samples).
    Draft i of sequence s is worth alpha_s^i expected tokens. All candidate drafts are sorted by that
    worth and the engine keeps the prefix of j drafts that maximises (G + their worth) / t(R + j), the
    step's expected tokens per second; j = 0 (plain decoding) whenever no prefix beats it.
  * per sequence, k is also capped: + 2 after a fully accepted run, - 1 after a rejection, within
    [1, K_MAX] (K_MAX keeps a verifying sequence within half the 32 GEMM rows of the fused int8 linear).
  Under load this lowers k and then turns speculation off by itself: with G sequences in the step a
  draft adds alpha^i / G to the step's tokens but its row's full share to the step's time, so only
  near-certain drafts pay in a big batch. The scheduler gives drafts only the token budget and free KV
  blocks left after every running sequence's token, prefill chunks and admissions (never preempting
  anyone for a guess), and drafts stop at max_tokens and the context window.

Measured (bench/speculation.py, 2-vCPU AMD EPYC with AVX-512 VNNI, native int8 kernels, 1 thread,
3 alternating rounds, medians of the paired ratios; answers identical with and without, 32/32):
Qwen2.5-Coder-0.5B, answers quoting retrieved passages: 1 stream 36.8 -> 67.3 tok/s (1.83x; 91% of
drafts accepted, 2.6 tokens per verifying step), 4 streams 1.23x; free-form answers: 1 stream 1.16x,
4 streams 0.96x (speculation all but off: 0.5% of tokens from verifying steps; rounds 0.93-1.03).
The 1.5B: passages 1 stream 1.65x, 4 streams 1.11x; free-form 1.09x and 1.02x. What bounds it is
the step time by rows the engine measured in the same run (over a 1-row step): 2 rows 1.03x, 3 rows
1.59x, 4 rows 2.21x, 8 rows 5.37x. One draft is nearly free, a third row already costs half a step,
so k stays at 1-2 and a batch of 4 leaves little room; multi-row steps at one-row cost (issue 18,
capability 0) are what would let k grow. Those were the first kernels. With the multi-row kernels of
2026-11-24 (bench/engine.py's step curve at 300 tokens of context: 2 rows 1.12x, 4 rows 1.47x, 8 rows
2.25x), `bench/speculation.py --quick` (2 prompts per kind, 3 rounds, 0.5B): passages 1 stream 39.5 ->
130.2 tok/s = 3.24x (rounds 3.09-3.48; 86% of drafts accepted, 4.4 tokens per verifying step), 2 streams
2.05x; free-form 1.14x and 1.29x; answers identical 8/8.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

K_MAX = 7  # drafts per sequence per step: 1 + 7 rows and their residual rows, half the fused linear's 32
K_INIT = 3  # cap on a sequence's first drafts
N_MAX, N_MIN = 3, 1  # n-gram lengths matched, longest first
PRIOR = (1.0, 1.0)  # (accepted, rejected) pseudo-counts per match length: alpha = 0.5 before any evidence
DECAY = 0.8  # weight of the older evidence at each new outcome (recent text predicts best)
STEP_EMA = 0.2  # weight of the newest step time in a row count's average
STALE_STEPS = 256  # a row count's measurement older than this many steps is re-explored
PRIOR_ROW_COST = 0.15  # unmeasured: each extra row adds this share of a 1-row step (optimistic, to explore)


class NgramIndex:
    """The most recent earlier occurrence of each n-gram (n = N_MIN..N_MAX) of one growing sequence."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.last_end: list[dict[tuple[int, ...], int]] = [{} for _ in range(N_MAX + 1)]  # n -> gram -> end
        self.num_indexed = 0  # n-grams ending at positions <= this are in the index

    def extend(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Catch up with the sequence (it only ever grows)."""
        n = len(self.ids)
        if n < len(prompt_ids):
            self.ids.extend(prompt_ids[n:])
            n = len(self.ids)
        self.ids.extend(output_ids[n - len(prompt_ids):])

    def propose(self, k: int) -> tuple[list[int], int]:
        """Up to k drafts continuing the longest earlier match of the sequence's tail, and that match's
        length n (0: no match). Copying past the end of the text continues from the drafts themselves
        (a repeating pattern goes on repeating)."""
        ids, length = self.ids, len(self.ids)
        for end in range(self.num_indexed + 1, length):  # grams ending before the tail's own end
            for n in range(N_MIN, min(N_MAX, end) + 1):
                self.last_end[n][tuple(ids[end - n:end])] = end
        self.num_indexed = max(self.num_indexed, length - 1)
        for n in range(min(N_MAX, length), N_MIN - 1, -1):
            end = self.last_end[n].get(tuple(ids[length - n:]))
            if end is not None:
                drafts: list[int] = []
                for j in range(k):
                    src = end + j
                    drafts.append(ids[src] if src < length else drafts[src - length])
                return drafts, n
        return [], 0


@dataclass
class SpecState:
    """One sequence's speculation state (Request.spec)."""

    index: NgramIndex = field(default_factory=NgramIndex)
    k_cap: int = K_INIT
    accepted: list[float] = field(default_factory=lambda: [PRIOR[0]] * (N_MAX + 1))  # decayed, per match length
    rejected: list[float] = field(default_factory=lambda: [PRIOR[1]] * (N_MAX + 1))
    order: int = 0  # match length of the drafts in flight
    shadow: tuple[int, list[int], int] | None = None  # (position, drafts, n) proposed but not verified

    def alpha(self, n: int) -> float:
        return self.accepted[n] / (self.accepted[n] + self.rejected[n])

    def record(self, n: int, num_accepted: int, num_drafted: int) -> None:
        self.accepted[n] = DECAY * self.accepted[n] + num_accepted
        self.rejected[n] = DECAY * self.rejected[n] + (num_accepted < num_drafted)

    def settle(self, num_accepted: int, num_drafted: int, k_max: int) -> None:
        """A verify step of this sequence's drafts (match length `order`) kept `num_accepted`."""
        self.record(self.order, num_accepted, num_drafted)
        self.k_cap = min(k_max, self.k_cap + 2) if num_accepted == num_drafted else max(1, self.k_cap - 1)

    def score_shadow(self) -> None:
        """Score an unverified proposal against the tokens decoding produced since (module NOTE)."""
        if self.shadow is None:
            return
        position, drafts, n = self.shadow
        actual = self.index.ids[position:position + len(drafts)]
        m = 0
        while m < len(actual) and actual[m] == drafts[m]:
            m += 1
        if m < len(actual) or len(actual) == len(drafts):  # a mismatch seen, or every draft confirmed
            self.record(n, m, len(drafts))
            self.shadow = None


@dataclass
class SpeculationStats:
    num_verify_steps: int = 0  # sequence-steps that carried drafts
    num_drafted: int = 0  # draft tokens verified
    num_accepted: int = 0  # of those, accepted
    num_emitted: int = 0  # tokens those steps produced (accepted + the model's own next token)

    def add(self, num_drafted: int, num_accepted: int) -> None:
        self.num_verify_steps += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_emitted += num_accepted + 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        return self.num_emitted / self.num_verify_steps if self.num_verify_steps else 0.0


class StepCost:
    """Measured seconds of a step without prefill, by its number of rows (module NOTE)."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}
        self.updated: dict[int, int] = {}
        self.num_steps = 0

    def observe(self, num_rows: int, seconds: float) -> None:
        self.num_steps += 1
        old = self.seconds.get(num_rows) if self._fresh(num_rows) else None
        self.seconds[num_rows] = seconds if old is None else (1 - STEP_EMA) * old + STEP_EMA * seconds
        self.updated[num_rows] = self.num_steps

    def estimate(self, num_rows: int) -> float:
        """Seconds (or, with nothing measured yet, 1-row-step units) for a step of num_rows rows:
        measured, else interpolated between measured row counts; beyond the largest, extrapolated along
        the measured slope (at least the prior's); below the smallest, scaled by the prior."""
        fresh = sorted(r for r in self.seconds if self._fresh(r))
        if num_rows in fresh:
            return self.seconds[num_rows]
        if not fresh:
            return prior_cost(num_rows)
        below = [r for r in fresh if r < num_rows]
        above = [r for r in fresh if r > num_rows]
        t = self.seconds
        if below and above:
            lo, hi = below[-1], above[0]
            w = (num_rows - lo) / (hi - lo)
            return (1 - w) * t[lo] + w * t[hi]
        if above:
            return t[above[0]] * prior_cost(num_rows) / prior_cost(above[0])
        hi = below[-1]
        slope = t[fresh[0]] * PRIOR_ROW_COST / prior_cost(fresh[0])  # the prior's, in seconds per row
        if len(below) > 1:
            slope = max(slope, (t[hi] - t[below[-2]]) / (hi - below[-2]))
        return t[hi] + slope * (num_rows - hi)

    @property
    def measured(self) -> bool:
        """Some row count has a fresh measurement (estimates are in seconds, not 1-row-step units)."""
        return any(self._fresh(r) for r in self.seconds)

    def _fresh(self, num_rows: int) -> bool:
        return self.num_steps - self.updated.get(num_rows, -STALE_STEPS - 1) <= STALE_STEPS


def prior_cost(num_rows: int) -> float:
    return 1.0 + PRIOR_ROW_COST * (num_rows - 1)


def own_state(request: Any) -> SpecState:
    request.spec = request.spec or SpecState()
    return request.spec


class Speculator:
    """Prompt lookup for the scheduler (`plan`) and the engine (`verify`, `observe_step`)."""

    def __init__(self, k_max: int = K_MAX, state_of: Callable[[Any], SpecState] | None = None) -> None:
        self.k_max = k_max
        self.state_of = state_of or own_state  # where a request keeps its SpecState (draft.py nests it)
        self.cost = StepCost()
        self.stats = SpeculationStats()

    def plan(self, candidates: Sequence[tuple[Any, int]], num_rows: int, num_sampling: int,
             budget: int) -> list[tuple[Any, list[int]]]:
        """Drafts for this step. candidates: (request, most drafts its limits allow), greedy requests
        decoding one token this step; num_rows / num_sampling: rows already scheduled and how many
        tokens they will produce; budget: rows left. -> (request, drafts) for those that speculate."""
        offers: list[tuple[float, int, int]] = []  # (worth, candidate, i-th draft)
        proposals: list[tuple[Any, list[int], int]] = []
        for c, (request, limit) in enumerate(candidates):
            state = self.state_of(request)
            state.index.extend(request.prompt_ids, request.output_ids)
            state.score_shadow()
            drafts, n = state.index.propose(min(limit, state.k_cap, self.k_max))
            proposals.append((request, drafts, n))
            worth = 1.0
            for i in range(len(drafts)):
                worth *= state.alpha(n)
                offers.append((worth, c, i))
        offers.sort(key=lambda o: -o[0])
        offers = offers[:max(0, budget)]
        best, best_rate, gained = 0, num_sampling / self.cost.estimate(num_rows), float(num_sampling)
        for j, (worth, _, _) in enumerate(offers, start=1):
            gained += worth
            rate = gained / self.cost.estimate(num_rows + j)
            if rate > best_rate:
                best, best_rate = j, rate
        counts = [0] * len(candidates)
        for _, c, _ in offers[:best]:
            counts[c] += 1  # a sequence's drafts are worth less and less: its best ones form a prefix
        out = []
        for (request, drafts, n), k in zip(proposals, counts):
            state = self.state_of(request)
            if k:
                state.order = n
                out.append((request, drafts[:k]))
            elif drafts and state.shadow is None:
                state.shadow = (len(state.index.ids), drafts, n)
        return out

    def record(self, request: Any, num_accepted: int) -> None:
        """A verify step kept the first `num_accepted` of the request's drafts (request.draft_ids; the
        engine decides which with `sampling.accept_drafts`)."""
        self.state_of(request).settle(num_accepted, len(request.draft_ids), self.k_max)
        self.stats.add(len(request.draft_ids), num_accepted)

    def release(self, request: Any) -> None:
        """The sequence finished or was preempted (its n-gram index stays valid: nothing to free)."""

    def observe_step(self, num_rows: int, seconds: float) -> None:
        """The time of a step without prefill tokens (feeds the cost model)."""
        self.cost.observe(num_rows, seconds)
