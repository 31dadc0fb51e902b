"""Rate limits and quotas (assistant/server/limits.py, redis_limits.py): one set of behaviours, checked
on the in-process limiter with a fake clock and on the Redis limiter against a real `redis-server`
that the test starts (the `redis_url` fixture, tests/services.py; skipped on a laptop without it, a
failure under ASSISTANT_REQUIRE_REAL=1)."""

from __future__ import annotations

import threading

import pytest

from assistant.config import TierConfig
from assistant.server.limits import MemoryLimiter, _duration, seconds_to_utc_midnight
from tests.conftest import free_port, require_module


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis"])
def limiter(request):
    if request.param == "memory":
        yield MemoryLimiter(Clock())
        return
    from assistant.server.redis_limits import RedisLimiter

    url = request.getfixturevalue("redis_url")
    lim = RedisLimiter.from_url(url)
    lim._client.flushdb()
    yield lim
    lim.close()


def test_request_bucket_allows_a_burst_then_refuses_with_retry_after(limiter):
    tier = TierConfig(rpm=3)
    decisions = [limiter.admit("k1", tier, 10) for _ in range(4)]
    assert [d.allowed for d in decisions] == [True, True, True, False]
    refused = decisions[-1]
    assert refused.reason == "requests" and 15 <= refused.retry_after <= 20.5  # 1 request refills in 20 s
    headers = refused.headers()
    assert headers["retry-after"] in ("20", "19", "18", "17", "16", "15")
    assert headers["x-ratelimit-limit-requests"] == "3" and headers["x-ratelimit-remaining-requests"] == "0"
    assert decisions[0].headers()["x-ratelimit-remaining-requests"] == "2"
    assert "retry-after" not in decisions[0].headers()
    assert limiter.admit("k2", tier, 10).allowed  # another key has its own bucket


def test_token_bucket_reserves_the_estimate_and_settles_the_difference(limiter):
    tier = TierConfig(tpm=1000)
    first = limiter.admit("k", tier, 800)
    assert first.allowed and 199 <= first.tokens_left <= 201
    refused = limiter.admit("k", tier, 800)  # 200 left, 800 asked
    assert not refused.allowed and refused.reason == "tokens" and refused.retry_after > 30
    limiter.settle("k", tier, reserved=800, used=100)  # it used only 100: 700 come back
    again = limiter.admit("k", tier, 800)
    assert again.allowed and again.headers()["x-ratelimit-limit-tokens"] == "1000"


def test_a_request_larger_than_a_minute_of_tokens_runs_once_the_bucket_is_full(limiter):
    tier = TierConfig(tpm=100)
    assert limiter.admit("big", tier, 500).allowed  # full bucket: admitted, goes negative
    refused = limiter.admit("big", tier, 10)
    assert not refused.allowed and refused.tokens_left < 0


def test_daily_quota_refuses_until_utc_midnight(limiter):
    tier = TierConfig(daily_tokens=1000)
    assert limiter.admit("q", tier, 50).allowed
    limiter.settle("q", tier, reserved=50, used=1000)
    refused = limiter.admit("q", tier, 50)
    assert not refused.allowed and refused.reason == "daily_quota"
    assert 0 < refused.retry_after <= 86400 and "daily token quota" in refused.message()


def test_a_tier_without_limits_is_never_refused(limiter):
    assert all(limiter.admit("u", TierConfig(), 10**9).allowed for _ in range(50))


def test_memory_buckets_refill_with_time():
    clock = Clock()
    limiter = MemoryLimiter(clock)
    tier = TierConfig(rpm=60, daily_tokens=100)
    assert all(limiter.admit("k", tier, 1).allowed for _ in range(60))
    assert not limiter.admit("k", tier, 1).allowed
    clock.now += 1.0  # one request per second refills
    assert limiter.admit("k", tier, 1).allowed and not limiter.admit("k", tier, 1).allowed
    limiter.settle("k", tier, 1, 100)
    assert limiter.admit("k", tier, 1).reason == "daily_quota"
    clock.now += seconds_to_utc_midnight(clock.now) + 61  # a new UTC day, a refilled bucket
    assert limiter.admit("k", tier, 1).allowed


@pytest.mark.real
def test_redis_limits_are_shared_by_replicas_and_atomic(redis_url):
    """Two limiters (two server processes) on one Redis: one bucket; 40 racing admissions of a
    20-request bucket admit exactly 20."""
    from assistant.server.redis_limits import RedisLimiter

    a, b = RedisLimiter.from_url(redis_url), RedisLimiter.from_url(redis_url)
    a._client.flushdb()
    tier = TierConfig(rpm=20)
    results: list[bool] = []
    lock = threading.Lock()

    def hammer(limiter):
        for _ in range(10):
            ok = limiter.admit("shared", tier, 1).allowed
            with lock:
                results.append(ok)

    threads = [threading.Thread(target=hammer, args=(lim,)) for lim in (a, b, a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 40 and sum(results) == 20
    a.close()
    b.close()


def test_redis_down_is_an_error_that_says_so():
    from assistant.server.redis_limits import LimiterUnavailable, RedisLimiter

    require_module("redis", "pip install -e '.[gateway]'")
    limiter = RedisLimiter.from_url(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(LimiterUnavailable, match="Redis"):
        limiter.admit("k", TierConfig(rpm=1), 1)


def test_reset_durations_read_like_openais():
    assert _duration(0.25) == "250ms" and _duration(6) == "6s" and _duration(360) == "6m0s"
    assert _duration(3723) == "1h2m3s"


@pytest.mark.real
def test_two_servers_on_one_redis_share_a_keys_limit(tmp_path, redis_url):
    """Two apps (two replicas) with server.redis_url: one static key's 3 requests per minute in all."""
    import redis
    from fastapi.testclient import TestClient

    from tests.gateway_fakes import USER, bearer, make_app

    redis.Redis.from_url(redis_url).flushdb()
    settings = dict(redis_url=redis_url, api_keys="shared-key", tiers={"free": {"rpm": 3}})
    _, _, app_a = make_app(tmp_path / "a", *["ok"] * 4, **settings)
    _, _, app_b = make_app(tmp_path / "b", *["ok"] * 4, **settings)
    body = {"messages": [USER], "max_tokens": 4}
    with TestClient(app_a) as a, TestClient(app_b) as b:  # their shutdown stops the turn registries' listeners
        statuses = [client.post("/v1/chat/completions", json=body, headers=bearer("shared-key")).status_code
                    for client in (a, b, a, b)]
        listeners = [app.state.turns.running._thread for app in (app_a, app_b)]
        assert all(t.is_alive() for t in listeners)
    assert statuses == [200, 200, 200, 429]
    for t in listeners:
        t.join(5)
    assert not any(t.is_alive() for t in listeners), "a stopped server left its Redis listener running"
    app_a.state.gateway.close()
    app_b.state.gateway.close()


def test_a_replica_whose_redis_is_away_says_so_at_start():
    """server.redis_url set but nothing listening: the turn registry (redis_turns.py) refuses to start
    with the fix in the message, instead of serving turns that other replicas cannot cancel."""
    require_module("redis")
    from assistant.errors import ConfigError
    from assistant.server.redis_turns import RedisRunningTurns

    with pytest.raises(ConfigError, match="cannot be reached.*unset server.redis_url"):
        RedisRunningTurns.from_url(f"redis://127.0.0.1:{free_port()}/0")
