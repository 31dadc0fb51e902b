"""Prometheus metrics of the gateway, served at /metrics (prometheus-client, text format).

Each app gets its own `CollectorRegistry` (several apps in one test process must not collide). What
is measured where:
  * middleware.py   requests by route and status, request latency
  * the /v1 and /api routes   time to first token, inter-token latency, generated tokens (rate() of
                    the counter is tokens/s), rate-limit and admission rejections, safety verdicts,
                    context-window utilisation of assistant turns
  * at scrape time  queue depth and running streams (admission.py), and from the engine's own
                    `stats()` when it has one (LocalEngine): KV blocks used, prefix-cache hit rate,
                    the engine's waiting and running requests.
Without prometheus-client installed, the metrics are no-ops and /metrics says how to install it.
"""

from __future__ import annotations

from typing import Any, Callable

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2)


class _Noop:
    def labels(self, *a: Any, **k: Any) -> "_Noop":
        return self

    def inc(self, *a: Any) -> None: ...

    def observe(self, *a: Any) -> None: ...

    def set(self, *a: Any) -> None: ...


class Metrics:
    def __init__(self, engine_stats: Callable[[], dict] | None = None,
                 admission: Any = None) -> None:
        try:
            import prometheus_client as prom
        except ImportError:
            self.available = False
            self.requests = self.latency = self.ttft = self.itl = self.tokens = _Noop()
            self.rate_limited = self.admission_rejected = self.safety = self.context_use = _Noop()
            self.response_cache = _Noop()
            return
        self.available = True
        self.registry = registry = prom.CollectorRegistry()
        self.requests = prom.Counter("assistant_requests", "HTTP requests by route and status",
                                     ["route", "status"], registry=registry)
        self.latency = prom.Histogram("assistant_request_latency_seconds", "HTTP request latency (to the last byte)",
                                      ["route"], buckets=LATENCY_BUCKETS, registry=registry)
        self.ttft = prom.Histogram("assistant_time_to_first_token_seconds", "Time to first token",
                                   ["model"], buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = prom.Histogram("assistant_inter_token_latency_seconds", "Time between streamed deltas",
                                  ["model"], buckets=ITL_BUCKETS, registry=registry)
        self.tokens = prom.Counter("assistant_generated_tokens", "Tokens generated (rate() = tokens/s)",
                                   ["model"], registry=registry)
        self.rate_limited = prom.Counter("assistant_rate_limit_rejections", "Requests refused by a rate limit",
                                         ["reason"], registry=registry)
        self.admission_rejected = prom.Counter("assistant_admission_rejections",
                                               "Requests refused because the engine queue was full", registry=registry)
        self.safety = prom.Counter("assistant_safety_verdicts", "Safety verdicts of assistant turns",
                                   ["stage", "allowed"], registry=registry)
        self.context_use = prom.Histogram("assistant_context_window_utilisation",
                                          "Prompt tokens / context window of assistant turns",
                                          buckets=(0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=registry)
        self.response_cache = prom.Counter("assistant_response_cache", "Semantic response cache lookups by result",
                                           ["result"], registry=registry)  # hit, miss
        if admission is not None:
            prom.Gauge("assistant_queue_depth", "Requests waiting for a generation slot",
                       registry=registry).set_function(lambda: admission.num_waiting)
            prom.Gauge("assistant_running_streams", "Generations running now",
                       registry=registry).set_function(lambda: admission.num_running)
        if engine_stats is not None:
            registry.register(_EngineCollector(engine_stats))

    def render(self) -> tuple[bytes, str]:
        if not self.available:
            return (b"# prometheus-client is not installed: pip install -e '.[gateway]' (make does it)\n",
                    "text/plain; charset=utf-8")
        import prometheus_client as prom

        return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST


class _EngineCollector:
    """The engine's own counters, read when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self._stats = stats

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        try:
            s = self._stats()
        except Exception:  # an engine that cannot say right now: no samples rather than a failed scrape
            return
        wanted = {
            "num_running": ("assistant_engine_running_requests", "Requests in the engine's running batch"),
            "num_waiting": ("assistant_engine_waiting_requests", "Requests queued inside the engine"),
            "prefix_cache_hit_rate": ("assistant_prefix_cache_hit_rate", "Prefix cache hits / lookups (blocks)"),
        }
        for key, (name, doc) in wanted.items():
            if key in s:
                yield GaugeMetricFamily(name, doc, value=float(s[key]))
        if "num_kv_blocks" in s and "free_kv_blocks" in s:
            yield GaugeMetricFamily("assistant_kv_blocks_used", "KV cache blocks in use",
                                    value=float(s["num_kv_blocks"] - s["free_kv_blocks"]))
            yield GaugeMetricFamily("assistant_kv_blocks_total", "KV cache blocks", value=float(s["num_kv_blocks"]))
