"""The parts of bench/load.py that need no model and no server (bench/load_figures.py: percentiles,
what counts as a rejection or a 5xx, which rows and turns must survive the kill, the JSON line's
keys, the engine clock; and the keys it makes), with made-up outcomes and fakes."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from bench import load
from bench import load_figures as figures


def test_percentile_matches_numpy():
    values = [0.3, 0.1, 0.9, 0.5, 0.2, 0.7, 0.4]
    for q in (0, 50, 95, 100):
        assert figures.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert figures.percentile([], 50) is None
    assert figures.percentile([2.0], 95) == 2.0


def test_the_overhead_interval_covers_the_p50_difference():
    direct = [0.100, 0.104, 0.098, 0.120, 0.101, 0.099, 0.140, 0.102]
    http = [x + 0.004 for x in direct]
    lo, hi = figures.p50_difference_ci(direct, http, num_resamples=500)
    assert lo <= 0.004 <= hi and hi - lo < 0.05


def test_engine_clock_times_each_request_to_its_first_text():
    class Delta:
        def __init__(self, text):
            self.text = text

    class Engine:
        closed = 0

        def generate(self, prompt, params, **kwargs):
            try:
                yield Delta("")  # a delta without text does not count
                time.sleep(0.02)
                yield Delta("Hi")
                yield Delta("!")
            finally:
                Engine.closed += 1

    engine = Engine()
    clock = figures.EngineClock(engine)
    assert [d.text for d in engine.generate([], None)] == ["", "Hi", "!"]
    stream = engine.generate([], None)
    next(stream)
    stream.close()  # a stream cut before its first text: no time, and the engine's stream is closed
    assert len(clock.ttfts) == 1 and 0.02 <= clock.ttfts[0] < 1 and Engine.closed == 2
    overhead = figures.overhead_figures([0.100, 0.120, 0.110], [0.104, 0.125, 0.113], [0.101, 0.121, 0.110])
    assert overhead["gateway_overhead_ms_p50"] == 3.0 and overhead["ttft_p50_difference_ms"] == 3.0
    assert overhead["overhead_samples"] == 3


def test_refusals_with_retry_after_are_rejections_not_5xx():
    O = figures.Outcome
    assert figures.classify(429, "3") == "rejected" and figures.classify(503, "2") == "rejected"
    assert figures.classify(503, None) == "http_error" and figures.classify(500, None) == "http_error"
    busy = O("v1", "free", "rejected", 503, retry_after="2", request_id="r1")
    limited = O("v1", "free", "rejected", 429, retry_after="3", request_id="r2")
    bare_503 = O("v1", "free", "http_error", 503, request_id="r3")
    crash = O("turn", "paid", "http_error", 500, request_id="r4")
    assert busy.rejected and limited.rejected and not busy.five_xx and not limited.five_xx
    assert bare_503.five_xx and not bare_503.rejected  # a 503 that does not say when to retry is a failure
    assert crash.five_xx


def test_only_what_the_server_finished_must_survive_the_kill():
    O = figures.Outcome
    tally = figures.Tally()
    tally.add(O("v1", "free", "complete", 200, ttft_s=0.1, tokens=12, request_id="a"))
    tally.add(O("turn", "paid", "complete", 200, ttft_s=0.3, tokens=10, request_id="b", message_id="m1"))
    tally.add(O("assistant", "paid", "complete", 200, ttft_s=0.5, tokens=8, request_id="c", message_id="m2"))
    tally.add(O("turn", "free", "interrupted", 200, request_id="d", message_id="m3"))  # cut by the kill
    tally.add(O("v1", "free", "interrupted"))  # no response at all
    tally.add(O("v1", "free", "rejected", 429, retry_after="1", request_id="e"))
    tally.add(O("v1", "paid", "stream_error", 200, request_id="f"))
    assert tally.acked_rows() == {"a", "b", "c", "e"}
    assert tally.acked_turns() == {"m1", "m2"}
    c = tally.counts()
    assert (c["requests"], c["complete"], c["interrupted"], c["rejected_429"], c["five_xx"], c["stream_error"]) == \
           (7, 3, 2, 1, 0, 1)
    s = tally.summary(serving_s=10.0)
    assert s["requests_per_s"] == 0.3 and s["tokens_per_s"] == 3.0
    assert s["ttft_p50_ms"] == 300.0 and s["ttft_p50_ms_by_kind"] == {"assistant": 500.0, "turn": 300.0, "v1": 100.0}
    assert s["rejected_429_503"] == 1 and s["rejections_without_retry_after"] == 0


def test_losses_count_missing_acknowledged_rows_and_shrunk_totals():
    before = {"usage_rows": 10, "turns": 4}
    ok = figures.losses({"a", "b"}, {"a", "b", "z"}, {"m1"}, {"m1", "m9"}, before, {"usage_rows": 11, "turns": 4})
    assert ok["lost_usage_rows"] == 0 and ok["lost_turns"] == 0
    assert ok["usage_rows_checked"] == 2 and ok["turns_checked"] == 1
    lost = figures.losses({"a", "b"}, {"a"}, {"m1", "m2"}, {"m1"}, before, {"usage_rows": 7, "turns": 4})
    assert lost["lost_usage_rows"] == 3  # the totals shrank by 3: more than the one acknowledged row missing
    assert lost["lost_turns"] == 1


def test_paid_clients_get_a_key_each_and_free_ones_share(tmp_path):
    from assistant.config import AssistantConfig
    from assistant.keys import Keys
    from assistant.store import Store

    config = AssistantConfig.load(env={}, overrides={"data_dir": str(tmp_path)})
    keys = load.create_keys(config, 10, 2)
    assert [t for t, _ in keys] == ["free", "paid"] * 5
    assert len({k for t, k in keys if t == "paid"}) == 5 and len({k for t, k in keys if t == "free"}) == 2
    store = Store(config.store_url)
    try:
        assert sorted(k.tier for k in Keys(store.db).list()) == ["free"] * 2 + ["paid"] * 5
    finally:
        store.close()


def test_busy_gauges_add_what_the_server_and_engine_hold():
    text = ("# HELP assistant_running_streams Generations running now\nassistant_running_streams 2.0\n"
            "assistant_queue_depth 1.0\nassistant_engine_running_requests 3.0\nassistant_engine_waiting_requests 0.0\n"
            'assistant_requests_total{route="/metrics",status="200"} 9.0\n')
    assert figures.busy_gauges(text) == 6.0
    assert figures.busy_gauges("assistant_running_streams 0.0\nassistant_queue_depth 0.0\n") == 0


def test_sse_lines():
    sse = figures.SseLines()
    assert sse.feed("event: text_delta") is None
    assert sse.feed('data: {"text": "Hi"}') == ("text_delta", '{"text": "Hi"}')
    assert sse.feed("") is None
    assert sse.feed("data: [DONE]") == ("", "[DONE]")


def test_result_line_has_the_required_keys():
    tally = figures.Tally([figures.Outcome("v1", "free", "complete", 200, ttft_s=0.2, tokens=4, request_id="a")])
    loss = figures.losses({"a"}, {"a"}, set(), set(), {"usage_rows": 1, "turns": 0}, {"usage_rows": 1, "turns": 0})
    line = figures.result_line(tally.summary(2.0), loss, {"gateway_overhead_ms_p50": 1.5}, {"clients": 1})
    assert set(figures.REQUIRED_KEYS) <= set(line)
    assert json.loads(json.dumps(line))["five_xx"] == 0
    with pytest.raises(AssertionError, match="gateway_overhead_ms_p50"):
        figures.result_line(tally.summary(2.0), loss, {}, {})
