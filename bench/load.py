"""Load benchmark of the gateway: a real `assistant serve` process under concurrent streaming clients,
killed with `kill -9` mid-run and restarted, and the gateway's own overhead on time-to-first-token.

What runs (loopback only, bounded in time; every figure is measured in this run):
  1. overhead  the gateway's own share of time-to-first-token, one short chat at a time, no load (goal
               p50 <= 5 ms). In a child process: the server's app (`create_app` over `build_assistant`,
               the config the server gets) on uvicorn in a thread, and that app's own engine called
               directly, alternating request by request (one model, one prefix cache, the same moment
               of a shared machine whose speed drifts by tens of percent within a minute). Reported:
               TTFT p50 through HTTP and direct, and their difference (its 95% interval is the engine's
               spread, tens of ms here); and gateway_overhead_ms_p50, the p50 over HTTP requests of
               (client TTFT - the engine's share of that same request, timed around the engine's
               `generate`): auth, limits, admission, thread hops, SSE, HTTP, free of the engine's noise.
               The child exits before the server starts: one 0.5B model in memory at a time.
  2. server    `assistant serve` in a subprocess on a temp data dir and a free loopback port, the
               packaged 0.5B model (`ASSISTANT_MODELS_DIR`, else ./data/models; engine.large_model = ""
               so the 1.5B is never loaded), clients in the tiers `free` and `paid` of the default tier
               table (rate limits, priorities): a key for each paid client, `--free-keys` keys shared
               by the free ones, created with the `Keys` class that `assistant keys create` uses. Its
               TTFT one request at a time is the baseline of the TTFT under load.
  3. load      `--clients` streaming clients for `--duration` seconds of serving, each in a loop:
               raw /v1/chat/completions (60%), REST turns of a stored conversation (20%), and the model
               `assistant` (20%), all with small max_tokens. 429/503 are expected (rate limits, the
               bounded admission line: `--max-queued`); each must carry Retry-After and come at once,
               and the client waits that long. Any other 5xx is a failure.
  4. kill -9   halfway: the server is killed while streams are open, restarted on the same data dir,
               and every turn and usage row the server had acknowledged is looked up in the store (the
               product's Store and UsageLedger on the SQLite file), as are the store's totals read just
               before the kill. Acknowledged: a stream read to its end, or a 429/503 refusal (the
               ledger records refused requests too). Streams cut by the kill count as interrupted, not
               as errors. Then the second half runs.

  python bench/load.py [--duration 60] [--clients 50] [--max-tokens 12] [--quick]

Exit status 1 when a 5xx, a broken connection or a lost row was seen. Last line: one JSON object.
What is counted and computed (no model, no server) lives in bench/load_figures.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from bench.load_figures import (  # noqa: E402
    EngineClock, Outcome, SseLines, Tally, busy_gauges, classify, losses, ms, overhead_figures, percentile, result_line,
)

KINDS = ("v1", "turn", "v1", "assistant", "v1")  # what a client sends, in turn (offset by its index)
TIERS = ("free", "paid")  # client i gets a key of TIERS[i % 2]
TURNS_PER_CONVERSATION = 3  # a REST client starts a new conversation after this many turns
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "What colour is the sky?",
             "Say hello in Spanish.", "What is 2 + 3?", "Name a planet.", "What is Python?",
             "Give me a word that rhymes with cat."]
OVERHEAD_CHAT = [{"role": "user", "content": "Say hello."}]
WARMUP = 5  # requests before the TTFT samples, direct and over HTTP (prefix cache filled, code paths hot)



# -- the store, read with the product's own classes ------------------------------------------------
def read_store(url: str) -> tuple[dict[str, int], set[str], set[str]]:
    """(totals, request ids of every usage row, ids of every committed answer) of the store at `url`."""
    from sqlalchemy import select

    from assistant.store import Store, messages
    from assistant.usage import UsageLedger

    store = Store(url)
    try:
        ledger = UsageLedger(store.db)
        rows = {r.request_id for r in ledger.rows()}
        with store.db.connect() as c:
            turns = {r[0] for r in c.execute(select(messages.c.id).where(messages.c.role == "assistant")
                                             .where(messages.c.status == "complete"))}
        return {"usage_rows": ledger.count(), "turns": len(turns)}, rows, turns
    finally:
        store.close()


def create_keys(config: Any, num_clients: int, num_free_keys: int) -> list[tuple[str, str]]:
    """[(tier, key)] per client, tiers alternating: a key of its own for each paid client; the free
    clients share `num_free_keys` keys (0: one each), as a team shares one, so they meet its rate limit."""
    from assistant.keys import Keys
    from assistant.store import Store

    store = Store(config.store_url)
    made: dict[tuple[str, int], str] = {}
    out = []
    try:
        keys = Keys(store.db, tuple(config.server.tiers))
        for i in range(num_clients):
            tier = TIERS[i % len(TIERS)]
            slot = (tier, i // len(TIERS) % num_free_keys if tier == "free" and num_free_keys else i)
            if slot not in made:
                made[slot] = keys.create(f"load-{tier}-{slot[1]}", tier)[1]
            out.append((tier, made[slot]))
        return out
    finally:
        store.close()


# -- the server process ---------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`assistant serve` as a subprocess; its output goes to a log file in the data dir."""

    def __init__(self, config_path: Path, data_dir: Path, port: int) -> None:
        self.config_path, self.data_dir, self.port = config_path, data_dir, port
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = data_dir / "logs" / "serve.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [str(Path(sys.executable).with_name("assistant")), "serve", "--config", str(self.config_path),
                   "--data-dir", str(self.data_dir), "--port", str(self.port)]
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=os.environ.copy())

    def wait_ready(self, key: str, timeout_s: float = 600) -> float:
        """Seconds until GET /v1/models answers 200; raises with the log's tail if the server died."""
        import httpx

        started = time.perf_counter()
        while time.perf_counter() - started < timeout_s:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base}/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=5).is_success:
                    return time.perf_counter() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"the server did not answer within {timeout_s} s:\n{self.log_tail()}")

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


# -- gateway overhead: TTFT through HTTP vs the same engine called directly ----------------------
def http_ttft(http: Any, model: str, max_tokens: int) -> float | None:
    """One streamed chat through the whole stack (auth, limits, admission, SSE): seconds to the first
    chunk with text (the role chunk before it carries none)."""
    body = {"model": model, "messages": OVERHEAD_CHAT, "max_tokens": max_tokens, "stream": True}
    started = time.perf_counter()
    first = None
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    first = time.perf_counter() - started
    return first


def direct_ttft(engine: Any, params: Any) -> float | None:
    """The same chat with the engine called in-process: seconds to the first delta with text."""
    started = time.perf_counter()
    first = None
    for delta in engine.generate(OVERHEAD_CHAT, params):
        if first is None and delta.text:
            first = time.perf_counter() - started
    return first


def overhead_phase(config_path: Path, data_dir: Path, samples: int, max_tokens: int = 4) -> dict[str, Any]:
    """In this process: the server's app (`create_app`, as `assistant serve` builds it, without the web
    chat mounted after the API) on uvicorn in a thread, and its own engine called directly; the two
    alternate request by request, so both see one model, one prefix cache and the same moment of a
    noisy machine. The engine is timed inside each HTTP request too (EngineClock)."""
    import threading

    import httpx
    import uvicorn

    from assistant.app import build_assistant
    from assistant.config import AssistantConfig
    from assistant.engine import SamplingParams
    from assistant.server.app import create_app
    from assistant.server.gateway import Gateway

    config = AssistantConfig.load(config_path, overrides={"data_dir": str(data_dir)})
    key = create_keys(config, 2, 0)[1][1]  # a paid key: the rate limits are consulted, never hit
    direct, via_http, engine_share = [], [], []
    with build_assistant(config) as assistant:
        engine, params = assistant.models.engine(), SamplingParams(max_tokens=max_tokens)
        clock = EngineClock(engine)  # before create_app, which hands the engine to the /v1 routes
        gateway = Gateway.from_assistant(assistant)
        server = uvicorn.Server(uvicorn.Config(create_app(assistant, web_chat=False, gateway=gateway),
                                               host="127.0.0.1", port=free_port(), log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not server.started:
            raise RuntimeError("the in-process server did not start (see its messages above)")
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{server.config.port}", timeout=120,
                              headers={"authorization": f"Bearer {key}"}) as http:
                for i in range(WARMUP + samples):
                    pair = [("direct", lambda: direct_ttft(engine, params)),
                            ("http", lambda: http_ttft(http, assistant.models.default, max_tokens))]
                    for name, call in pair if i % 2 else pair[::-1]:  # ABBA: neither goes first always
                        timed = len(clock.ttfts)
                        ttft = call()
                        if i < WARMUP or ttft is None:
                            continue
                        if name == "direct":
                            direct.append(ttft)
                        elif len(clock.ttfts) > timed:
                            via_http.append(ttft)
                            engine_share.append(clock.ttfts[timed])
        finally:
            server.should_exit = True
            thread.join(timeout=10)
            gateway.close()
    return overhead_figures(direct, via_http, engine_share)


def run_overhead_phase(config_path: Path, data_dir: Path, samples: int) -> dict[str, Any]:
    """`overhead_phase` in a child process, so that its model's memory is gone before the server loads one."""
    command = [sys.executable, __file__, "--overhead-phase", str(config_path), str(data_dir), "--samples", str(samples)]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the overhead phase failed ({done.returncode}):\n{done.stdout[-3000:]}")
    return json.loads(lines[-1])


def idle_ttfts(base: str, key: str, model: str, samples: int) -> list[float]:
    """TTFT through the served process, one request at a time (the baseline of TTFT under load)."""
    import httpx

    with httpx.Client(base_url=base, headers={"authorization": f"Bearer {key}"}, timeout=120) as http:
        out = [http_ttft(http, model, 4) for _ in range(WARMUP + samples)][WARMUP:]
    return [x for x in out if x is not None]


# -- the load: streaming clients --------------------------------------------------------------------
@dataclass
class LoadState:
    up: asyncio.Event
    stopping: bool = False
    in_flight: int = 0
    in_flight_at_stop: int = 0


async def one_request(http: Any, state: LoadState, kind: str, tier: str, key: str, model: str, question: str,
                      max_tokens: int, conversation: str | None) -> Outcome:
    import httpx

    headers = {"authorization": f"Bearer {key}"}
    if kind == "turn":
        url, body = f"/api/conversations/{conversation}/turns", {"text": question, "max_tokens": max_tokens}
    else:
        url = "/v1/chat/completions"
        body = {"model": model if kind == "v1" else "assistant", "messages": [{"role": "user", "content": question}],
                "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    out = Outcome(kind, tier, "interrupted")
    started = time.perf_counter()
    state.in_flight += 1
    try:
        async with http.stream("POST", url, json=body, headers=headers) as response:
            out.status, out.request_id = response.status_code, response.headers.get("x-request-id", "")
            out.retry_after = response.headers.get("retry-after")
            if response.status_code != 200:
                await response.aread()
                out.ended, out.latency_s = classify(response.status_code, out.retry_after), time.perf_counter() - started
                return out
            sse, finished, failed = SseLines(), False, False
            async for line in response.aiter_lines():
                got = sse.feed(line)
                if got is None:
                    continue
                event, data = got
                if data == "[DONE]":
                    finished = True
                    continue
                payload = json.loads(data)
                text = ""
                if event in ("", "message"):  # an OpenAI chunk
                    if "error" in payload:
                        failed = True
                    choices = payload.get("choices") or []
                    text = (choices[0].get("delta") or {}).get("content") or "" if choices else ""
                    if payload.get("usage"):
                        out.tokens = payload["usage"]["completion_tokens"]
                elif event.removeprefix("assistant.") == "turn_started":
                    out.message_id = payload["message_id"]
                elif event.removeprefix("assistant.") == "usage":
                    out.tokens = payload["completion_tokens"]
                elif event == "text_delta":
                    text = payload["text"]
                elif event == "error":
                    failed = True
                elif event == "done":
                    finished = payload["finish_reason"] not in ("error", "cancelled")
                if text and out.ttft_s is None:
                    out.ttft_s = time.perf_counter() - started
            out.latency_s = time.perf_counter() - started
            # a stream that ends unfinished while the server is up was cut by the server: broken
            out.ended = ("stream_error" if failed else "complete" if finished
                         else "interrupted" if not state.up.is_set() else "broken")
            return out
    except httpx.TimeoutException:
        out.ended = "broken"
    except httpx.TransportError:  # connection refused or cut: the kill (server down), or a real failure
        out.ended = "interrupted" if not state.up.is_set() else "broken"
    finally:
        state.in_flight -= 1
    out.latency_s = time.perf_counter() - started
    return out


async def client(i: int, http: Any, state: LoadState, tally: Tally, tier: str, key: str, model: str,
                 max_tokens: int) -> None:
    import httpx

    conversation, turns, n = None, 0, 0
    while not state.stopping:
        await state.up.wait()
        if state.stopping:
            return
        kind = KINDS[(i + n) % len(KINDS)]
        question = QUESTIONS[(3 * i + n) % len(QUESTIONS)]
        n += 1
        if kind == "turn" and (conversation is None or turns >= TURNS_PER_CONVERSATION):
            try:
                created = await http.post("/api/conversations", json={"title": f"load {i}"},
                                          headers={"authorization": f"Bearer {key}"})
            except httpx.TransportError:
                if state.up.is_set():
                    tally.broken += 1
                continue
            if created.status_code != 201:
                tally.add(Outcome(kind, tier, classify(created.status_code, None), created.status_code))
                continue
            conversation, turns = created.json()["id"], 0
        outcome = await one_request(http, state, kind, tier, key, model, question, max_tokens, conversation)
        if state.stopping and outcome.ended in ("interrupted", "broken"):
            return  # cut by the end of the run, not by the server
        tally.add(outcome)
        turns += kind == "turn"
        if outcome.rejected:
            await asyncio.sleep(min(float(outcome.retry_after or 1), 10))


async def progress(state: LoadState, tally: Tally, http: Any, t0: float) -> None:
    while True:
        await asyncio.sleep(5)
        if not state.up.is_set():
            continue  # restarting: the restart prints its own lines
        c = tally.counts()
        try:
            text = (await http.get("/metrics", timeout=5)).text
            gauges = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                      if line.startswith(("assistant_running_streams ", "assistant_queue_depth "))}
            server = (f"; server: running {gauges.get('assistant_running_streams', 0):.0f}, "
                      f"queued {gauges.get('assistant_queue_depth', 0):.0f}")
        except Exception:
            if not state.up.is_set():
                continue  # killed meanwhile
            server = "; server: no metrics"
        print(f"  [{time.perf_counter() - t0:4.0f} s] {c['complete']} complete, {c['rejected_429']} x 429, "
              f"{c['rejected_503']} x 503, {c['five_xx']} x 5xx, {c['interrupted']} interrupted, "
              f"{state.in_flight} in flight{server}", flush=True)


async def run_load(server: Server, keys: list[tuple[str, str]], model: str, store_url: str, args: Any,
                   tally: Tally) -> dict[str, Any]:
    import httpx

    state = LoadState(asyncio.Event())
    state.up.set()
    t0 = time.perf_counter()
    half = args.duration / 2
    limits = httpx.Limits(max_connections=args.clients * 2 + 8, max_keepalive_connections=args.clients * 2 + 8)
    timeout = httpx.Timeout(300, connect=10)
    async with httpx.AsyncClient(base_url=server.base, limits=limits, timeout=timeout) as http:
        reporter = asyncio.create_task(progress(state, tally, http, t0))
        tasks = [asyncio.create_task(client(i, http, state, tally, tier, key, model, args.max_tokens))
                 for i, (tier, key) in enumerate(keys)]
        await asyncio.sleep(half)
        before, _, _ = await asyncio.to_thread(read_store, store_url)
        in_flight = state.in_flight
        state.up.clear()
        server.kill9()
        print(f"kill -9 at {time.perf_counter() - t0:.0f} s with {in_flight} requests in flight; store before: "
              f"{before['turns']} committed turns, {before['usage_rows']} usage rows", flush=True)
        await asyncio.sleep(1)  # the cut streams notice
        acked_rows, acked_turns = tally.acked_rows(), tally.acked_turns()
        down = time.perf_counter()
        server.start()
        restart_s = await asyncio.to_thread(server.wait_ready, keys[0][1])
        after, found_rows, committed = await asyncio.to_thread(read_store, store_url)
        loss = losses(acked_rows, found_rows, acked_turns, committed, before, after)
        print(f"restarted in {restart_s:.1f} s; store after: {after['turns']} committed turns, {after['usage_rows']} "
              f"usage rows; acknowledged before the kill: {len(acked_turns)} turns, {len(acked_rows)} usage rows; "
              f"lost: {loss['lost_turns']} turns, {loss['lost_usage_rows']} usage rows", flush=True)
        downtime = time.perf_counter() - down
        state.up.set()
        await asyncio.sleep(half)
        state.stopping, state.in_flight_at_stop = True, state.in_flight
        reporter.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, reporter, return_exceptions=True)
        serving_s = time.perf_counter() - t0 - downtime
    # every client went away mid-request: the server must cancel their generations, not finish them
    cut_at_end = state.in_flight_at_stop
    drain_s = await drain(server.base)
    print(f"{cut_at_end} requests cut by the end of the run: the server's streams and engine emptied "
          f"{f'in {drain_s:.1f} s' if drain_s is not None else 'NOT within 30 s'}", flush=True)
    return {**loss, "restart_s": round(restart_s, 1), "serving_s": round(serving_s, 1), "in_flight_at_kill": in_flight,
            "cut_at_end": cut_at_end, "drain_after_disconnect_s": round(drain_s, 1) if drain_s is not None else None}


async def drain(base: str, timeout_s: float = 30) -> float | None:
    """Seconds until the server holds no stream and no engine request any more; None if it still does."""
    import httpx

    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=base, timeout=5) as http:
        while time.perf_counter() - started < timeout_s:
            if busy_gauges((await http.get("/metrics")).text) == 0:
                return time.perf_counter() - started
            await asyncio.sleep(0.2)
    return None


# -- main ------------------------------------------------------------------------------------------
def write_config(path: Path, max_queued: int) -> None:
    path.write_text("[engine]\nlarge_model = \"\"  # never the 1.5B: one 0.5B server on a shared machine\n"
                    f"[server]\nmax_queued = {max_queued}\n")


def use_models_dir() -> Path:
    """The prepared models: ASSISTANT_MODELS_DIR, else this checkout's ./data/models (as the tests do),
    for this process and the servers it starts."""
    models_dir = Path(os.environ.get("ASSISTANT_MODELS_DIR", ROOT / "data" / "models")).resolve()
    os.environ["ASSISTANT_MODELS_DIR"] = str(models_dir)
    return models_dir


def main() -> int:
    if sys.argv[1:2] == ["--overhead-phase"]:  # the child process of run_overhead_phase
        use_models_dir()
        config_path, data_dir = Path(sys.argv[2]), Path(sys.argv[3])
        samples = int(sys.argv[sys.argv.index("--samples") + 1]) if "--samples" in sys.argv else 30
        print(json.dumps(overhead_phase(config_path, data_dir, samples)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60, help="seconds of load (the kill comes halfway)")
    parser.add_argument("--clients", type=int, default=50, help="concurrent streaming clients")
    parser.add_argument("--max-tokens", type=int, default=12, help="answer length of every load request")
    parser.add_argument("--max-queued", type=int, default=16,
                        help="server.max_queued: the admission line (beyond it: 503 + Retry-After)")
    parser.add_argument("--free-keys", type=int, default=5, help="keys the free-tier clients share (0: one each)")
    parser.add_argument("--samples", type=int, default=30, help="TTFT samples of the overhead, each way")
    parser.add_argument("--quick", action="store_true", help="20 s, 12 clients, 8 samples")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.clients, args.samples = min(args.duration, 20), min(args.clients, 12), min(args.samples, 8)

    from assistant.config import AssistantConfig
    from assistant.models import prepared_path, resolve_model_name

    models_dir = use_models_dir()
    if prepared_path(resolve_model_name("qwen2.5-coder-0.5b"), models_dir) is None:
        print(f"No prepared 0.5B model in {models_dir}: run `make setup` (or set ASSISTANT_MODELS_DIR).", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    tally = Tally()
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        data_dir = Path(tmp) / "data"
        config_path = Path(tmp) / "assistant.toml"
        write_config(config_path, args.max_queued)
        config = AssistantConfig.load(config_path, overrides={"data_dir": str(data_dir)})
        keys = create_keys(config, args.clients, args.free_keys)
        paid_key = next(k for t, k in keys if t == "paid")
        print(f"{args.clients} clients: " + ", ".join(
            f"{sum(t == tier for t, _ in keys)} {tier} with {len({k for t, k in keys if t == tier})} keys"
            for tier in TIERS) + f" ({', '.join(f'{n}: {t}' for n, t in config.server.tiers.items())}); "
              f"models from {models_dir}", flush=True)

        print(f"gateway overhead: the app in-process, {args.samples} requests through HTTP and {args.samples} to "
              f"its engine directly, alternating...", flush=True)
        phase_started = time.perf_counter()
        overhead = run_overhead_phase(config_path, Path(tmp) / "overhead-data", args.samples)
        overhead["overhead_phase_s"] = round(time.perf_counter() - phase_started, 1)
        print(f"  gateway overhead p50 {overhead['gateway_overhead_ms_p50']} ms, p95 {overhead['gateway_overhead_ms_p95']} ms "
              f"(goal p50 <= 5 ms): HTTP TTFT minus the engine's share of that same request "
              f"({overhead['overhead_phase_s']} s with the model load)", flush=True)
        print(f"  TTFT p50 through HTTP {overhead['ttft_http_p50_ms']} ms vs the engine called directly "
              f"{overhead['ttft_direct_p50_ms']} ms: {overhead['ttft_p50_difference_ms']} ms (95% interval "
              f"{overhead['ttft_p50_difference_ci95_ms']} ms: the engine's own spread)", flush=True)
        server = Server(config_path, data_dir, free_port())
        print(f"starting `assistant serve` on {server.base}...", flush=True)
        server.start()
        try:
            print(f"  ready in {server.wait_ready(paid_key):.1f} s", flush=True)
            model = config.engine.model
            idle = idle_ttfts(server.base, paid_key, model, 10)
            overhead["ttft_idle_p50_ms"] = ms(percentile(idle, 50))
            print(f"  TTFT p50 one request at a time: {overhead['ttft_idle_p50_ms']} ms", flush=True)
            print(f"load: {args.clients} clients for {args.duration:.0f} s, max_tokens {args.max_tokens}, "
                  f"kill -9 at half-time...", flush=True)
            run = asyncio.run(run_load(server, keys, model, config.store_url, args, tally))
            served_log = server.log_path.read_text(errors="replace")  # before Ctrl-C, whose own messages are not failures
        finally:
            server.stop()
            log = server.log_path.read_text(errors="replace") if server.log_path.exists() else ""
            kept_log = Path(tempfile.gettempdir()) / "bench-load-serve.log"  # the data dir goes, the log stays
            kept_log.write_text(log)
        _, rows_end, turns_end = read_store(config.store_url)
    summary = tally.summary(run.pop("serving_s"))
    loss = {k: run.pop(k) for k in ("lost_usage_rows", "lost_turns", "usage_rows_checked", "turns_checked")}
    extra = {**run, "clients": args.clients, "duration_s": args.duration, "max_tokens": args.max_tokens,
             "max_queued": args.max_queued, "broken_connections": tally.broken + summary["broken"],
             "unrecorded_rows_end": len(tally.acked_rows() - rows_end),
             "uncommitted_turns_end": len(tally.acked_turns() - turns_end),
             "server_tracebacks": served_log.count("Traceback"),
             "wall_s": round(time.perf_counter() - t0, 1)}
    idle_p50 = overhead["ttft_idle_p50_ms"]
    extra["ttft_load_vs_idle"] = round(summary["ttft_p50_ms"] / idle_p50, 1) if summary["ttft_p50_ms"] and idle_p50 else None
    result = result_line(summary, loss, overhead, extra)
    print(f"server log: {kept_log} ({result['server_tracebacks']} tracebacks)")
    print(f"{result['requests']} requests: {result['complete']} complete ({result['requests_per_s']} req/s, "
          f"{result['tokens_per_s']} tok/s), {result['rejected_429']} x 429 + {result['rejected_503']} x 503 "
          f"(p95 {result['rejection_p95_ms']} ms to the refusal), {result['interrupted']} interrupted by the kill")
    print(f"TTFT under load: p50 {result['ttft_p50_ms']} ms ({result['ttft_load_vs_idle']} x one at a time), "
          f"p95 {result['ttft_p95_ms']} ms; by kind "
          f"{result['ttft_p50_ms_by_kind']}; by tier {result['ttft_p50_ms_by_tier']}")
    failures = {k: result[k] for k in ("five_xx", "stream_error", "broken_connections", "lost_turns", "lost_usage_rows",
                                       "rejections_without_retry_after", "unrecorded_rows_end", "uncommitted_turns_end")
                if result[k]}
    if failures:
        print(f"server log (last 40 lines):\n" + "\n".join(log.splitlines()[-40:]))
        print(f"!!! FAILED: {failures}: every one of these must be 0 !!!")
    else:
        print("0 x 5xx, no lost turn, no lost usage row")
    print(json.dumps(result))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
