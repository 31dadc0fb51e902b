"""Prompt-lookup speculation (assistant/engine/speculate.py): greedy output with speculation must be
plain decoding's, token for token, and rejected drafts must leave no trace in the KV cache.

Fast tests: the n-gram drafter and the cost decision alone; the scheduler's rollback on synthetic
requests with a scripted "model" (no weights); the LocalEngine on randomly initialised tiny Qwen2
models with a character tokenizer (no packaged files). One `real` test: the packaged 0.5B on a
retrieval-style prompt, with and without speculation.
"""

from __future__ import annotations

import random
import threading
from dataclasses import replace

import pytest

from assistant.engine.base import SamplingParams
from assistant.engine.kv_cache import BlockManager
from assistant.engine.sampling import accept_greedy, accept_sampled
from assistant.engine.scheduler import Request, Scheduler, SchedulerConfig
from assistant.engine.speculate import NgramIndex, Speculator, SpecState

# -- the drafter and the decision, alone ------------------------------------------------------------


def _index(ids):
    index = NgramIndex()
    index.extend(ids, [])
    return index


def test_penalties_count_the_answer_and_the_drafts_before_each_row():
    import torch

    from assistant.engine.sampling import adjusted

    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((4, 2.0), (0, -100.0)))
    out = adjusted(torch.zeros(3, 6), params, answer=[1, 1, 2], drafts=[3, 1])
    assert out.tolist() == [[-100, -1.0, -0.75, 0, 2, 0],      # the answer: 1 twice, 2 once
                            [-100, -1.0, -0.75, -0.75, 2, 0],  # then the first draft, 3
                            [-100, -1.25, -0.75, -0.75, 2, 0]]  # then the second, 1 a third time
    assert adjusted(torch.zeros(1, 6), SamplingParams(presence_penalty=2.0), answer=[]).tolist() == [[0.0] * 6]


def test_ngram_index_drafts_what_followed_the_longest_most_recent_match():
    assert _index([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]).propose(3) == ([4, 5, 9], 3)  # "1 2 3", not "2 3"
    assert _index([1, 2, 9, 1, 2, 7, 1, 2]).propose(2) == ([7, 1], 2)  # "1 2" most recently before 7
    assert _index([5, 6, 7, 8, 9, 6]).propose(2) == ([7, 8], 1)  # only "6" matches
    assert _index([1, 2, 3]).propose(4) == ([], 0)


def test_ngram_index_follows_a_growing_sequence_and_continues_a_repeating_pattern():
    index = NgramIndex()
    index.extend([4, 5, 6], [4])
    assert index.propose(5) == ([5, 6, 4, 5, 6], 1)  # the pattern goes on from the drafts themselves
    index.extend([4, 5, 6], [4, 5])
    assert index.propose(2) == ([6, 4], 2)


def _request(prompt, output=(), temperature=0.0):
    r = Request(list(prompt), SamplingParams(max_tokens=100, temperature=temperature), max_len=10_000)
    r.output_ids = list(output)
    return r


def _candidate(alpha_hits=9.0):
    r = _request([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3], [4])  # "2 3 4" matched: drafts 5 6 7 ...
    r.spec = SpecState(k_cap=7)
    r.spec.accepted[3], r.spec.rejected[3] = alpha_hits, 1.0  # alpha_3 = 0.9
    return r


def _cost(speculator, seconds_for_rows):
    for rows in range(1, 40):
        speculator.observe_step(rows, seconds_for_rows(rows))


def test_plan_buys_drafts_where_they_pay_and_none_where_rows_cost_too_much():
    cheap = Speculator()
    _cost(cheap, lambda rows: 1.0 + 0.05 * (rows - 1))  # extra rows almost free: draft as far as the cap
    [(_, drafts)] = cheap.plan([(_candidate(), 100)], num_rows=1, num_sampling=1, budget=100)
    assert drafts == [5, 6, 7, 8, 9, 1, 2]
    dear = Speculator()
    _cost(dear, lambda rows: float(rows))  # each row costs a full step: never worth a guess
    assert dear.plan([(_candidate(), 100)], num_rows=1, num_sampling=1, budget=100) == []
    middle = Speculator()
    _cost(middle, lambda rows: 1.0 + 0.5 * (rows - 1))  # (1 + .9 + .81 + .729) / 2.5 beats 1 / 1 and 4 drafts
    [(_, drafts)] = middle.plan([(_candidate(), 100)], num_rows=1, num_sampling=1, budget=100)
    assert drafts == [5, 6, 7]


def test_plan_turns_speculation_off_under_load_and_respects_the_budget_and_limits():
    speculator = Speculator()
    _cost(speculator, lambda rows: 1.0 + 0.5 * (rows - 1))
    crowd = [(_candidate(), 100) for _ in range(12)]  # 12 sequences decode anyway: a guess adds 0.9 / 12
    assert speculator.plan(crowd, num_rows=12, num_sampling=12, budget=100) == []
    _cost(speculator, lambda rows: 1.0 + 0.05 * (rows - 1))
    assert [len(d) for _, d in speculator.plan([(_candidate(), 100)], 1, 1, budget=2)] == [2]
    assert [len(d) for _, d in speculator.plan([(_candidate(), 3)], 1, 1, budget=100)] == [3]


def test_step_cost_interpolates_extrapolates_and_forgets():
    from assistant.engine.speculate import PRIOR_ROW_COST, STALE_STEPS, StepCost

    cost = StepCost()
    assert cost.estimate(3) == pytest.approx(1 + 2 * PRIOR_ROW_COST)  # nothing measured: the prior
    cost.observe(2, 0.10)
    assert cost.estimate(1) == pytest.approx(0.10 / (1 + PRIOR_ROW_COST))  # below: scaled by the prior
    assert cost.estimate(4) == pytest.approx(0.10 + 2 * 0.10 * PRIOR_ROW_COST / (1 + PRIOR_ROW_COST))
    cost.observe(4, 0.30)
    assert cost.estimate(3) == pytest.approx(0.20)  # between: interpolated
    assert cost.estimate(8) == pytest.approx(0.30 + 4 * 0.10)  # beyond: the measured slope
    for _ in range(STALE_STEPS + 1):
        cost.observe(1, 0.05)
    assert cost.estimate(4) == pytest.approx(0.05 + 3 * 0.05 * PRIOR_ROW_COST)  # 2 and 4 are stale: explored again


def test_a_sequence_that_does_not_speculate_keeps_scoring_its_drafts():
    speculator = Speculator()
    _cost(speculator, lambda rows: float(rows))  # nothing pays: drafts are only scored ("shadow")
    r = _request([1, 2, 3, 4, 5, 6, 1, 2], [3])
    before = r.spec = SpecState()
    alpha = before.alpha(3)
    assert speculator.plan([(r, 10)], 1, 1, 10) == []
    assert r.spec.shadow is not None
    for token in (4, 5, 6):  # plain decoding confirms the drafts one by one
        r.output_ids.append(token)
        speculator.plan([(r, 10)], 1, 1, 10)
    assert r.spec.alpha(3) > alpha


# -- the scheduler: drafts in the step, rollback after it (scripted model, no weights) ----------------

BS = 4


def _next_token(ids):
    """A scripted greedy model: it copies the token 5 back (so drafts from the text are often right)
    but every 7th position it writes something new (so some drafts are rejected)."""
    return ids[-5] if len(ids) % 7 else (ids[-1] * 3 + 1) % 50


def _run_scheduler(scheduler, requests, max_steps=200):
    """Engine steps with the scripted model; checks the KV invariants after every step. -> the ids of
    the requests that verified drafts."""
    import torch

    drafted = set()
    for r in requests:
        scheduler.add(r)
    for _ in range(max_steps):
        if not scheduler.has_work:
            return drafted
        out = scheduler.schedule()
        assert out.num_batched_tokens <= scheduler.config.max_batched_tokens
        assert out.num_batched_tokens == sum(n for _, n in out.scheduled)
        for r, n in out.scheduled:
            if r.draft_ids:
                assert n == 1 + len(r.draft_ids) and r.params.seed is None
                drafted.add(r.request_id)
                ids = r.all_ids
                argmax = [_next_token(ids + r.draft_ids[:j]) for j in range(n)]
                if r.params.temperature == 0:
                    tokens = accept_greedy(r.draft_ids, argmax)
                else:  # the scripted model's distribution is a point mass at its next token
                    tokens = accept_sampled(torch.nn.functional.one_hot(torch.tensor(argmax), 50).float(),
                                            r.draft_ids)
                scheduler.speculator.record(r, len(tokens) - 1)
                assert scheduler.after_step(r, n, num_accepted=len(tokens) - 1)
                # rolled back: the committed KV is all that is counted, no block past the new length
                assert r.num_computed_tokens == r.num_tokens + len(tokens) - 1
                assert len(r.block_table) <= scheduler.blocks.blocks_needed(r.num_computed_tokens + 1)
            elif scheduler.after_step(r, n):
                tokens = [_next_token(r.all_ids)]
            else:
                continue
            for token in tokens:
                r.output_ids.append(token)
                if len(r.output_ids) == r.params.max_tokens:
                    scheduler.finish(r, r.status.FINISHED_LENGTH)
                    break
    raise AssertionError("requests did not finish")


def _plain(prompt, max_tokens):
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(_next_token(ids))
    return ids[len(prompt):]


def test_scheduler_verifies_drafts_and_rolls_back_rejected_ones():
    blocks = BlockManager(128, BS)
    speculator = Speculator()
    scheduler = Scheduler(SchedulerConfig(max_batched_tokens=64), blocks, speculator)
    prompts = [[(i * 7 + j) % 50 for j in range(9 + i)] for i in range(3)]
    requests = [Request(list(p), SamplingParams(max_tokens=40), max_len=1000) for p in prompts]
    requests.append(Request(list(prompts[0]), SamplingParams(max_tokens=40, temperature=1.0, seed=7), max_len=1000))
    requests.append(Request(list(prompts[1]), SamplingParams(max_tokens=40, temperature=1.0), max_len=1000))
    drafted = _run_scheduler(scheduler, requests)
    for r, p in zip(requests[:3] + requests[4:], prompts + prompts[1:2]):
        assert r.output_ids == _plain(p, 40)
    stats = speculator.stats
    assert stats.num_accepted > 0 and stats.num_drafted > stats.num_accepted  # accepted and rejected drafts
    assert requests[3].spec is None  # the seeded sampled request never drafted (its answer must be reproducible)
    assert requests[4].request_id in drafted  # the unseeded one verified drafts (by the sampling rule)
    assert blocks.num_free_blocks == blocks.num_blocks
    # only committed tokens reached the prefix cache: every cached block is a block of some final sequence
    finals = [r.all_ids for r in requests[:3]]
    key_of_id = {blocks.id_of[b]: key for key, b in blocks.cached.items()}
    for key in blocks.cached:
        chain: list[int] = []
        while True:
            parent, tokens = key
            chain[:0] = tokens
            if parent == 0:
                break
            key = key_of_id[parent]  # every cached block's prefix is cached too (nothing was evicted)
        assert any(f[:len(chain)] == chain for f in finals), chain


def test_drafts_only_take_what_the_budget_leaves_after_prefill():
    config = SchedulerConfig(max_batched_tokens=6, max_prefill_chunk=4)
    scheduler = Scheduler(config, BlockManager(64, BS), Speculator())
    decoding = Request([1, 2, 3, 4, 1, 2, 3], SamplingParams(max_tokens=40), max_len=1000)
    scheduler.add(decoding)
    out = scheduler.schedule()
    scheduler.after_step(decoding, 7)
    decoding.output_ids.append(4)
    scheduler.add(Request(list(range(20, 40)), SamplingParams(max_tokens=4), max_len=1000))
    out = scheduler.schedule()
    rows = dict((r.request_id, n) for r, n in out.scheduled)
    assert rows[decoding.request_id] == 1 + len(decoding.draft_ids) and len(decoding.draft_ids) == 1
    assert out.num_batched_tokens == 6  # 1 decode + 4 prefill (the tuned chunk) + 1 draft


# -- the engine on tiny random models -----------------------------------------------------------------

EOS = 255


class CharTokenizer:
    """Token i is one or two copies of a letter; EOS decodes to nothing (a special token)."""

    eos_token_id = EOS
    unk_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if i == EOS else chr(ord("a") + i % 26) * (1 + i % 2) for i in ids)

    def convert_tokens_to_ids(self, token):
        return None

    def get_vocab(self):
        return {f"<{i}>": i for i in range(256)}


def _tiny(init_range):
    """initializer_range 0.1 gives a 'sticky' model (it repeats itself in runs, so drafts are mostly
    accepted); 0.3 a chaotic one (drafts mostly rejected, speculation turns itself off)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=EOS, tie_word_embeddings=True, initializer_range=init_range)
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny_models():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield {"sticky": _tiny(0.1), "chaotic": _tiny(0.3)}
    torch.set_num_threads(threads)


class FixedCost:
    """A step-cost model that ignores the clock (each extra row costs a fifth of a step), so which
    drafts are verified does not depend on how busy the test machine is; the real one is tested above."""

    measured = True

    def __init__(self, scale=1.0):
        self.scale = scale

    def estimate(self, num_rows):
        return self.scale * (1.0 + 0.2 * (num_rows - 1))

    def observe(self, num_rows, seconds):
        pass


def _engine(hf, **config):
    import torch

    from assistant.config import EngineConfig
    from assistant.engine.loading import LoadedModel
    from assistant.engine.local import LocalEngine

    engine_config = replace(EngineConfig(), kv_cache_mb=1, block_size=BS, **config)
    engine = LocalEngine(LoadedModel(hf, CharTokenizer(), torch.device("cpu"), "tiny", 512), engine_config)
    if engine.speculator is not None:
        engine.speculator.cost = FixedCost()
    return engine


@pytest.fixture(scope="module", params=["none-pytorch", "int8-pytorch", "none-native", "int8-native"])
def pair(request, tiny_models):
    """(speculating engine, plain engine, model name) for each kind of weights and kernels."""
    from assistant.engine import int8 as int8_module
    from assistant.engine import model as model_module
    from assistant.engine import native

    quantize, kernels = request.param.split("-")
    if kernels == "native" and native.unavailable_reason() is not None:
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    engines = {}
    with pytest.MonkeyPatch.context() as mp:
        if kernels == "pytorch":  # the kernels are chosen when the engine's model is built
            mp.setattr(int8_module, "int8_kernels", lambda: None)
            mp.setattr(model_module, "int8_kernels", lambda: None)
        for name, hf in tiny_models.items():
            engines[name] = (_engine(hf, quantize=quantize), _engine(hf, quantize=quantize, speculation="off"))
    yield engines
    for on, off in engines.values():
        on.close()
        off.close()


def _run(engine, prompt, params):
    deltas = list(engine.generate(prompt, params))
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), deltas


def read_together(streams):
    """Read every token stream in its own thread (they decode in one batch); -> their token ids."""
    results = {}
    threads = [threading.Thread(target=lambda i=i, s=s: results.__setitem__(i, [t for d in s for t in d.token_ids]))
               for i, s in enumerate(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return [results.get(i) for i in range(len(streams))]


def _prompts(n, seed=1):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = [rng.randrange(250) for _ in range(12 + 3 * i)]
        out.append(text + text[:8] if i % 2 else text)  # every other prompt repeats part of itself
    return out


def test_speculative_greedy_output_is_plain_greedy_output(pair):
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    for name, (on, off) in pair.items():
        for prompt in _prompts(6):
            assert _run(on, prompt, params)[:2] == _run(off, prompt, params)[:2], name
    sticky, chaotic = pair["sticky"][0].speculator.stats, pair["chaotic"][0].speculator.stats
    assert sticky.num_accepted > 0 and sticky.mean_tokens_per_step > 1.5  # long accepted runs
    assert sticky.num_drafted > sticky.num_accepted and chaotic.num_drafted > chaotic.num_accepted  # rejections
    assert chaotic.num_drafted < 48 * 6 / 4, "drafts that keep failing should switch speculation off"
    for on, _ in pair.values():
        assert on.blocks.num_free_blocks == on.blocks.num_blocks


def test_logprobs_of_accepted_drafts_are_plain_decodings(pair):
    """A verify step's rows score the drafts they accept: with logprobs, speculation still carries runs of
    tokens in one delta, and each token's numbers are those plain decoding gives it."""
    on, off = pair["sticky"]
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=2)
    for prompt in _prompts(4, seed=7):
        got, want = _run(on, prompt, params), _run(off, prompt, params)
        assert got[:2] == want[:2]
        assert [len(d.logprobs) for d in got[2]] == [len(d.token_ids) for d in got[2]]
        mine, plain = [s for d in got[2] for s in d.logprobs], [s for d in want[2] for s in d.logprobs]
        assert [s.token for s in mine] == [s.token for s in plain]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(mine, plain)) < 1e-3
    assert max(len(d.token_ids) for d in got[2]) >= 3, "accepted runs should still come in single deltas"


def test_penalised_greedy_output_is_the_same_with_speculation(pair):
    on, off = pair["sticky"]
    params = SamplingParams(max_tokens=40, ignore_eos=True, presence_penalty=0.4, frequency_penalty=0.3,
                            logit_bias=((7, 1.5),))
    for prompt in _prompts(4, seed=9):
        assert _run(on, prompt, params)[:2] == _run(off, prompt, params)[:2]
    assert on.blocks.num_free_blocks == on.blocks.num_blocks


def test_concurrent_sequences_speculate_in_one_batch(pair):
    on, off = pair["sticky"]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = _prompts(5, seed=2)
    plain = [_run(off, p, params)[0] for p in prompts]
    steps = []
    schedule = on.scheduler.schedule

    def spy():
        out = schedule()
        steps.append(sum(1 for r, _ in out.scheduled if r.draft_ids))
        return out

    on.scheduler.schedule = spy
    try:
        sampled = on.generate(prompts[0], SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True))
        streams = [on.generate(p, params) for p in prompts]  # queued before any is read: one batch
        results = read_together([*streams, sampled])
    finally:
        on.scheduler.schedule = schedule
    assert [results[i] for i in range(len(prompts))] == plain
    assert len(results[len(prompts)]) == 40  # the sampled request ran beside them, without drafts
    assert max(steps) >= 2, "several sequences should have verified drafts in the same step"
    assert on.blocks.num_free_blocks == on.blocks.num_blocks


def test_max_tokens_and_stop_strings_inside_an_accepted_run(pair):
    on, off = pair["sticky"]
    prompt = _prompts(2, seed=5)[1]  # the sticky model's answer to it repeats in long runs
    full_tokens, full_text, deltas = _run(on, prompt, SamplingParams(max_tokens=48, ignore_eos=True))
    assert max(len(d.token_ids) for d in deltas) >= 3, "the stream should carry accepted runs in single deltas"
    for max_tokens in range(1, 20):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        got, want = _run(on, prompt, params), _run(off, prompt, params)
        assert got[:2] == want[:2] and len(got[0]) == max_tokens
        assert got[2][-1].finish_reason == "length" and got[2][-1].num_generated_tokens == max_tokens
    stops = {full_text[i:i + n] for i in range(0, len(full_text) - 4, 3) for n in (1, 3, 4)}
    for stop in sorted(stops):
        params = SamplingParams(max_tokens=48, stop=(stop, "zzzzzzzzz"), ignore_eos=True)
        got, want = _run(on, prompt, params), _run(off, prompt, params)
        assert (got[0], got[1], got[2][-1].finish_reason) == (want[0], want[1], want[2][-1].finish_reason), stop
        assert got[1] == full_text[:full_text.find(stop)] and got[2][-1].finish_reason == "stop"
    assert on.blocks.num_free_blocks == on.blocks.num_blocks


def test_eos_inside_an_accepted_run_ends_the_answer_there(tiny_models):
    """The EOS token can be a draft too: the answer ends at it, as plain decoding's does."""
    on, off = _engine(tiny_models["sticky"], quantize="int8"), _engine(tiny_models["sticky"], quantize="int8",
                                                                        speculation="off")
    try:
        prompt = _prompts(2)[1]
        tokens = _run(off, prompt, SamplingParams(max_tokens=40, ignore_eos=True))[0]
        on.eos_ids = off.eos_ids = {tokens[-1]}  # a token the sticky model repeats: it stops there
        params = SamplingParams(max_tokens=40)
        got, want = _run(on, prompt, params), _run(off, prompt, params)
        assert got[:2] == want[:2] and got[2][-1].finish_reason == want[2][-1].finish_reason == "stop"
        assert len(got[0]) < 40
    finally:
        on.close()
        off.close()


def test_rollback_frees_blocks_and_a_later_request_reuses_the_prefix_correctly(tiny_models):
    hf = tiny_models["sticky"]
    on = _engine(hf, quantize="int8")
    cold = _engine(hf, quantize="int8", speculation="off", prefix_cache=False)
    try:
        params = SamplingParams(max_tokens=48, ignore_eos=True)
        first_prompt = _prompts(5, seed=5)[4]  # the sticky model accepts about 60% of its drafts here
        first = _run(on, first_prompt, params)[0]
        stats = on.speculator.stats
        assert stats.num_drafted > stats.num_accepted > 0  # some drafts were rolled back
        assert on.blocks.num_free_blocks == on.blocks.num_blocks
        # a follow-up whose prompt is the first conversation: served from the blocks the first one
        # committed (accepted drafts included), and its answer must be the cold engine's
        follow_up = first_prompt + first[:40]
        tokens, text, deltas = _run(on, follow_up, params)
        assert deltas[-1].num_cached_tokens >= len(first_prompt) + 32
        assert (tokens, text) == _run(cold, follow_up, params)[:2]
    finally:
        on.close()
        cold.close()


def test_sampled_requests_never_speculate(tiny_models):
    on = _engine(tiny_models["sticky"], quantize="int8")
    try:
        params = SamplingParams(max_tokens=30, temperature=0.8, seed=1, ignore_eos=True)
        assert len(_run(on, _prompts(2)[1], params)[0]) == 30
        assert on.speculator.stats.num_verify_steps == 0
    finally:
        on.close()


def test_speculation_setting_is_checked():
    from assistant.config import AssistantConfig
    from assistant.errors import ConfigError

    assert AssistantConfig.load(env={}).engine.speculation == "prompt_lookup"
    with pytest.raises(ConfigError, match="prompt_lookup or off"):
        AssistantConfig.load(env={"ASSISTANT_ENGINE_SPECULATION": "ngram"})


# -- the real model -----------------------------------------------------------------------------------

PASSAGES = """[1] The Rhine is a river that begins in the Swiss canton of Graubunden in the southeastern Swiss Alps, forms part of the Swiss-Austrian, Swiss-Liechtenstein, Swiss-German and then the Franco-German border, then flows through the Rhineland and eventually empties into the North Sea in the Netherlands.
[2] The biggest city on the river Rhine is Cologne, Germany, with a population of more than 1,050,000 people. It is the second-longest river in Central and Western Europe, after the Danube, at about 1,230 km.
[3] Ships on the Rhine carry coal, oil, grain and containers between the port of Rotterdam and the industrial cities of the Ruhr valley and Switzerland."""


@pytest.mark.real
def test_real_model_greedy_answer_is_identical_with_and_without_speculation(models_dir):
    from assistant.config import AssistantConfig
    from assistant.engine.loading import load_model
    from assistant.engine.local import LocalEngine

    config = AssistantConfig.load(env={}, overrides={"engine.model": "qwen2.5-coder-0.5b",
                                                     "models_dir": str(models_dir), "engine.kv_cache_mb": 256})
    loaded = load_model(config)
    on = LocalEngine(loaded, config.engine)
    off = LocalEngine(loaded, replace(config.engine, speculation="off"))
    try:
        system = "Answer from the passages, quoting them, and cite [n].\n\n" + PASSAGES
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": "Where does the Rhine begin and where does it end? "
                                                "Which is its biggest city?"}]
        params = SamplingParams(max_tokens=96)
        got, got_text, _ = _run(on, messages, params)
        want, want_text, _ = _run(off, messages, params)
        assert got == want and got_text == want_text
        assert "Graubunden" in got_text or "North Sea" in got_text  # it did copy from the passages
        stats = on.speculator.stats
        assert stats.num_accepted > 0 and stats.mean_tokens_per_step > 1.5
    finally:
        on.close()
        off.close()
