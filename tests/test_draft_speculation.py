"""Draft-model speculation (assistant/engine/draft.py) and the sampled verification rule.

Greedy output with a draft model must be plain decoding's, token for token, alone and inside a batch
of mixed sequences; rejected drafts must give back their blocks in both KV caches; the sampled rule
must keep the target's distribution. Fast tests run tiny random Qwen2 models (tests/test_speculation.py's
fixtures); one opt-in `real` test runs the packaged 0.5B drafting for the packaged 1.5B.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from assistant.engine.base import SamplingParams
from assistant.engine.draft import DRAFT, LOOKUP, DraftSeq, DraftSpeculator, expected_tokens
from assistant.engine.sampling import accept_sampled
from tests.test_speculation import BS, CharTokenizer, FixedCost, _prompts, _run, read_together, tiny_models  # noqa: F401


def _loaded(hf, name):
    import torch

    from assistant.engine.loading import LoadedModel

    return LoadedModel(hf, CharTokenizer(), torch.device("cpu"), name, 512)


def _engine(target, draft=None, **config):
    from assistant.config import EngineConfig
    from assistant.engine.local import LocalEngine

    engine_config = replace(EngineConfig(), kv_cache_mb=1, block_size=BS, quantize="int8", **config)
    engine = LocalEngine(_loaded(target, "tiny"), engine_config, None if draft is None else _loaded(draft, "tiny-draft"))
    if isinstance(engine.speculator, DraftSpeculator):  # decisions that do not depend on the machine's load
        engine.speculator.cost, engine.speculator.draft_cost = FixedCost(), FixedCost(scale=0.1)
    return engine


@pytest.fixture(scope="module")
def engines(tiny_models):
    """name -> engine: the sticky model drafted for by itself ("same": drafts are right), by the chaotic
    model ("wrong": drafts are mostly wrong), and alone without speculation ("plain")."""
    sticky, chaotic = tiny_models["sticky"], tiny_models["chaotic"]
    made = {"same": _engine(sticky, sticky), "wrong": _engine(sticky, chaotic),
            "plain": _engine(sticky, speculation="off")}
    yield made
    for engine in made.values():
        engine.close()


def _all_free(engine):
    draft = engine.speculator.blocks if isinstance(engine.speculator, DraftSpeculator) else engine.blocks
    return engine.blocks.num_free_blocks == engine.blocks.num_blocks and draft.num_free_blocks == draft.num_blocks


def test_greedy_output_with_a_draft_model_is_plain_greedy_output(engines):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in _prompts(5, seed=3):
        want = _run(engines["plain"], prompt, params)[:2]
        assert _run(engines["same"], prompt, params)[:2] == want
        assert _run(engines["wrong"], prompt, params)[:2] == want
    same, wrong = engines["same"].speculator.stats_by_source[DRAFT], engines["wrong"].speculator.stats_by_source[DRAFT]
    assert same.num_drafted > 0 and same.acceptance_rate > 0.9 and same.mean_tokens_per_step > 2.5
    assert wrong.num_drafted > wrong.num_accepted  # rejections, rolled back
    assert wrong.num_drafted < same.num_drafted / 2, "drafts that keep failing should be bought less"
    assert all(_all_free(e) for e in engines.values())


def test_a_batch_of_mixed_sequences_drafts_together_and_stays_exact(engines):
    on, off = engines["wrong"], engines["plain"]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    prompts = _prompts(4, seed=8)
    plain = [_run(off, p, params)[0] for p in prompts]
    sizes = []
    plan = on.speculator.plan

    def spy(*args):
        out = plan(*args)
        sizes.append(len(out))
        return out

    on.speculator.plan = spy
    try:
        streams = [on.generate(p, params) for p in prompts]  # queued before any is read: one batch
        streams.append(on.generate(prompts[0], SamplingParams(max_tokens=32, temperature=0.9, ignore_eos=True)))
        results = read_together(streams)
    finally:
        on.speculator.plan = plan
    assert [results[i] for i in range(len(prompts))] == plain
    assert len(results[len(prompts)]) == 32  # the sampled sequence ran beside them
    assert max(sizes) >= 2, "several sequences should have drafted in the same step"
    assert _all_free(on)


def test_rejected_drafts_give_their_blocks_back_in_both_caches(engines):
    """After every step a sequence holds target blocks for its committed tokens only, and draft blocks
    for the draft's tokens only; once it ends, both caches are whole again."""
    on = engines["wrong"]
    checks = []
    after_step = on.scheduler.after_step

    def check(request, num_new, num_accepted=0):
        drafted = bool(request.draft_ids)
        ready = after_step(request, num_new, num_accepted)
        state = request.spec
        if drafted:
            checks.append((len(request.block_table) <= on.blocks.blocks_needed(request.num_computed_tokens + 1),
                           len(state.block_table) <= on.speculator.blocks.blocks_needed(len(state.ids) + 1)))
        return ready

    on.scheduler.after_step = check
    try:
        _run(on, _prompts(3, seed=4)[2], SamplingParams(max_tokens=40, ignore_eos=True))
    finally:
        on.scheduler.after_step = after_step
    assert checks and all(a and b for a, b in checks)
    assert _all_free(on)


def test_the_draft_state_is_cut_back_to_the_committed_text():
    from assistant.engine.kv_cache import BlockManager

    class Request:
        prompt_ids = list(range(10))
        output_ids = [10, 11, 12]

        @property
        def all_ids(self):
            return self.prompt_ids + self.output_ids

    blocks = BlockManager(16, 4)
    speculator = DraftSpeculator(None, None, blocks, size_ratio=0.3)
    state = DraftSeq(started=True, ids=list(range(10)) + [10, 11, 99, 98, 97])
    blocks.allocate(state.block_table, len(state.ids))
    assert len(state.block_table) == 4
    speculator._sync(Request(), state)
    assert state.ids == list(range(12)) and len(state.block_table) == 3  # 99.. were rejected drafts
    assert state.num_registered == 3  # the full blocks of committed tokens are findable
    speculator.release(type("R", (), {"spec": state})())
    assert blocks.num_free_blocks == 16 and state.ids == []


def test_the_plan_drafts_far_when_drafts_are_cheap_and_right_and_not_at_all_when_they_are_wrong():
    from assistant.engine.kv_cache import BlockManager

    speculator = DraftSpeculator(None, None, BlockManager(8, 4), size_ratio=0.3)
    speculator.cost, speculator.draft_cost = FixedCost(), FixedCost(scale=0.1)
    good = DraftSeq(accepted=9.0, rejected=0.5, k_cap=6)
    bad = DraftSeq(accepted=0.2, rejected=3.0, k_cap=6)
    request = type("R", (), {"num_tokens": 20})()
    good.ids = bad.ids = list(range(19))
    k, ks, _ = speculator._choose([(request, 50, good)], 1, 1, 100)
    assert k == 6 and ks == [6]
    assert speculator._choose([(request, 50, bad)], 1, 1, 100)[:2] == (0, [0])
    assert speculator._choose([(request, 2, good)], 1, 1, 100)[1] == [2]  # max_tokens / context limit
    speculator.draft_cost = FixedCost(scale=2.0)  # a draft round dearer than a target step: never pays
    assert speculator._choose([(request, 50, good)], 1, 1, 100)[0] == 0
    assert expected_tokens(0.5, 3) == pytest.approx(0.875)


class CountingDraft:
    """A draft 'model' whose next token is always the last one + 1 (mod 50)."""

    device = "cpu"

    def forward(self, tokens, positions, seqs, kv, greedy=None):
        import torch

        last = torch.stack([tokens[s.start + s.num_new - 1] for s in seqs])
        return torch.nn.functional.one_hot((last + 1) % 50, 50).float()


class SlotsOnly:
    def slots(self, block_table, num_tokens):
        import torch

        return torch.arange(num_tokens)


def _request(prompt, output):
    from assistant.engine.scheduler import Request

    r = Request(list(prompt), SamplingParams(max_tokens=100), max_len=1000)
    r.output_ids = list(output)
    return r


def test_lookup_drafts_where_the_text_repeats_the_draft_model_elsewhere_and_only_for_one_stream():
    from assistant.engine.kv_cache import BlockManager

    speculator = DraftSpeculator(CountingDraft(), SlotsOnly(), BlockManager(64, 4), size_ratio=0.3)
    speculator.cost, speculator.draft_cost = FixedCost(), FixedCost(scale=0.1)
    repeating = _request([7, 8, 9, 30, 31, 7, 8], [9])  # "7 8 9" occurred before: lookup proposes 30 31 ...
    fresh = _request([1, 2, 3], [4])
    repeating.spec = DraftSeq()
    repeating.spec.lookup.accepted = [9.0] * 4  # lookup measured right 90% of the time on this sequence
    plan = dict((id(r), d) for r, d in speculator.plan([(repeating, 50)], 1, 1, 100))
    assert plan[id(repeating)][:2] == [30, 31] and repeating.spec.source == LOOKUP
    assert speculator.num_draft_rounds == 0  # lookup's drafts cost no draft-model round
    plan = dict((id(r), d) for r, d in speculator.plan([(fresh, 50)], 1, 1, 100))
    assert plan[id(fresh)] == [5, 6, 7][:len(plan[id(fresh)])] and fresh.spec.source == DRAFT
    assert speculator.num_draft_rounds == len(plan[id(fresh)]) >= 2
    # a lookup that keeps failing loses its sequences to the draft model
    repeating.spec.lookup.accepted = [0.1] * 4
    assert repeating.spec.lookup.alpha(3) < repeating.spec.alpha()
    assert dict((id(r), d) for r, d in speculator.plan([(repeating, 50)], 1, 1, 100))[id(repeating)][0] == 10
    # two sequences decoding: the draft model stays out (DRAFT_MAX_SEQS), lookup would still draft
    other = _request([11, 12, 13], [14])
    assert speculator.plan([(fresh, 50), (other, 50)], 2, 2, 100) == []


def test_sampled_verification_keeps_the_target_distribution():
    """Speculative sampling with a point-mass draft: the first token yielded is distributed as p_0, and
    after an accepted draft the next one as p_1 (chi-square, fixed seed, 20k trials, vocabulary 6)."""
    import torch

    generator = torch.Generator().manual_seed(1234)
    p = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.07, 0.03],
                      [0.05, 0.05, 0.50, 0.20, 0.10, 0.10],
                      [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]])
    drafts = [1, 2]
    trials = 20000
    first = torch.zeros(6)
    second = torch.zeros(6)
    for _ in range(trials):
        tokens = accept_sampled(p, drafts, generator)
        first[tokens[0]] += 1
        if tokens[0] == drafts[0]:
            second[tokens[1]] += 1
    for counts, probs in ((first, p[0]), (second, p[1])):
        expected = counts.sum() * probs
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 20.5, (counts, expected)  # 5 degrees of freedom: p = 0.001
    assert first[drafts[0]] / trials == pytest.approx(0.25, abs=0.02)
    # a draft the target would never pick is never yielded, and a certain one always is
    assert all(accept_sampled(torch.tensor([[0.0, 1.0], [0.5, 0.5]]), [0], generator)[0] == 1 for _ in range(50))
    assert all(accept_sampled(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), [1], generator) == [1, 0] for _ in range(50))


def test_unseeded_sampled_requests_speculate_and_seeded_ones_do_not(tiny_models):
    on = _engine(tiny_models["sticky"], tiny_models["sticky"])
    try:
        seeded = SamplingParams(max_tokens=30, temperature=0.7, seed=5, ignore_eos=True)
        first = _run(on, _prompts(2)[1], seeded)[0]
        assert on.speculator.stats.num_verify_steps == 0
        assert _run(on, _prompts(2)[1], seeded)[0] == first  # reproducible
        tokens = _run(on, _prompts(2)[1], SamplingParams(max_tokens=30, temperature=0.7, ignore_eos=True))[0]
        assert len(tokens) == 30 and on.speculator.stats.num_verify_steps > 0
        assert _all_free(on)
    finally:
        on.close()


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_models):
    from assistant.errors import ModelError

    class OtherTokenizer(CharTokenizer):
        def get_vocab(self):
            return {f"[{i}]": i for i in range(256)}

    import torch

    from assistant.config import EngineConfig
    from assistant.engine.loading import LoadedModel
    from assistant.engine.local import LocalEngine

    with pytest.raises(ModelError, match="another tokenizer"):
        LocalEngine(_loaded(tiny_models["sticky"], "tiny"), replace(EngineConfig(), kv_cache_mb=1, block_size=BS),
                    LoadedModel(tiny_models["chaotic"], OtherTokenizer(), torch.device("cpu"), "other", 512))


# -- the real models ----------------------------------------------------------------------------------

@pytest.mark.real
@pytest.mark.skipif(os.environ.get("ASSISTANT_TEST_LARGE") != "1",
                    reason="opt-in: set ASSISTANT_TEST_LARGE=1 after `assistant models prepare large`")
def test_real_small_model_drafting_for_the_large_one_is_exact(models_dir):
    from assistant.config import AssistantConfig
    from assistant.engine.loading import load_draft_model, load_model
    from assistant.engine.local import LocalEngine
    from tests.test_speculation import PASSAGES

    config = AssistantConfig.load(env={}, overrides={
        "engine.model": "large", "engine.draft_model": "qwen2.5-coder-0.5b", "models_dir": str(models_dir),
        "engine.kv_cache_mb": 256})
    loaded = load_model(config)
    on = LocalEngine(loaded, config.engine, load_draft_model(config))
    off = LocalEngine(loaded, replace(config.engine, speculation="off"))
    try:
        system = "Answer from the passages and cite [n].\n\n" + PASSAGES
        questions = ["Where does the Rhine begin and where does it end?", "Write a haiku about ships."]
        params = SamplingParams(max_tokens=64)
        for question in questions:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            assert _run(on, messages, params)[:2] == _run(off, messages, params)[:2]
        stats = on.speculator.stats
        assert isinstance(on.speculator, DraftSpeculator) and stats.num_accepted > 0
        assert _all_free(on)
    finally:
        on.close()
        off.close()
