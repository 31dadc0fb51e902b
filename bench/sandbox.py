"""Sandbox latency: warm exec and cold start of DockerExecutor vs a fresh container per call.

    .venv/bin/python bench/sandbox.py [--runtime runc|runsc] [--warm 100] [--cold 10]

Measured in the same run, with the same image and limits:
  warm exec   a trivial cell in a conversation's warm container (kernel over the attached socket)
  cold start  the first cell of a new conversation (container create + start + kernel ready + cell)
  fresh run   the `docker run --rm` equivalent per call: create + start + wait + logs + remove
  exec/cell   `docker exec python3 -c ...` in a warm container, the obvious alternative to the kernel
Targets: warm p50 <= 60 ms, cold start p50 <= 1 s. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from assistant.config import SandboxConfig  # noqa: E402
from sandbox.executor import DockerExecutor, connect  # noqa: E402

CELL = "x = sum(range(100))\nx"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def bench_warm(executor: DockerExecutor, n: int) -> list[float]:
    executor.run(CELL, "bench-warm")  # start it
    times = []
    for _ in range(n):
        t = time.perf_counter()
        out = executor.run(CELL, "bench-warm")
        times.append(time.perf_counter() - t)
        assert out.stdout.strip() == "4950", out
    return times


def bench_cold(executor: DockerExecutor, n: int) -> list[float]:
    times = []
    for i in range(n):
        t = time.perf_counter()
        out = executor.run(CELL, f"bench-cold-{i}")
        times.append(time.perf_counter() - t)
        assert out.stdout.strip() == "4950", out
        executor.reset(f"bench-cold-{i}")
    return times


def _host_config(api, cfg: SandboxConfig) -> dict:
    return api.create_host_config(
        network_mode="none", mem_limit=f"{cfg.memory_mb}m", memswap_limit=f"{cfg.memory_mb}m",
        nano_cpus=int(cfg.cpus * 1e9), pids_limit=cfg.pids_limit, read_only=True,
        tmpfs={"/tmp": f"rw,nosuid,nodev,noexec,size={cfg.tmpfs_mb}m"}, cap_drop=["ALL"],
        security_opt=["no-new-privileges"], runtime=cfg.runtime,
    )  # fmt: skip


def bench_fresh(client, cfg: SandboxConfig, n: int) -> list[float]:
    api, times = client.api, []
    for _ in range(n):
        t = time.perf_counter()
        cid = api.create_container(
            cfg.image, command=["python3", "-c", "x = sum(range(100)); print(x)"], user="65534:65534",
            host_config=_host_config(api, cfg), network_disabled=True,
        )["Id"]  # fmt: skip
        api.start(cid)
        api.wait(cid, timeout=60)
        logs = api.logs(cid, stdout=True, stderr=False)
        api.remove_container(cid, force=True)
        times.append(time.perf_counter() - t)
        assert logs.strip() == b"4950", logs
    return times


def bench_exec_per_cell(client, cfg: SandboxConfig, n: int) -> list[float]:
    api = client.api
    cid = api.create_container(
        cfg.image, command=["sleep", "infinity"], user="65534:65534", host_config=_host_config(api, cfg),
        network_disabled=True,
    )["Id"]  # fmt: skip
    api.start(cid)
    times = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            exec_id = api.exec_create(cid, ["python3", "-c", "x = sum(range(100)); print(x)"])["Id"]
            out = api.exec_start(exec_id)
            times.append(time.perf_counter() - t)
            assert out.strip() == b"4950", out
    finally:
        api.remove_container(cid, force=True)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", choices=("runc", "runsc"), default="runc")
    parser.add_argument("--warm", type=int, default=100, help="warm cells timed")
    parser.add_argument("--cold", type=int, default=10, help="cold starts and fresh runs timed")
    args = parser.parse_args()
    cfg = dataclasses.replace(SandboxConfig(), runtime=args.runtime, max_containers=2)
    client = connect(cfg)

    with DockerExecutor(cfg, client=client) as executor:
        warm = bench_warm(executor, args.warm)
        cold = bench_cold(executor, args.cold)
    fresh = bench_fresh(client, cfg, args.cold)
    exec_cell = bench_exec_per_cell(client, cfg, args.cold)

    ms = 1000.0
    warm_p50, warm_p95 = percentile(warm, 0.5) * ms, percentile(warm, 0.95) * ms
    cold_p50, fresh_p50 = statistics.median(cold), statistics.median(fresh)
    exec_p50 = statistics.median(exec_cell) * ms
    print(f"runtime {args.runtime}, image {cfg.image}, {args.warm} warm cells, {args.cold} cold starts")
    print(f"warm exec     p50 {warm_p50:8.1f} ms   p95 {warm_p95:8.1f} ms   (target p50 <= 60 ms)")
    print(f"cold start    p50 {cold_p50 * ms:8.1f} ms                   (target <= 1000 ms)")
    print(f"fresh run     p50 {fresh_p50 * ms:8.1f} ms   (container per call)")
    print(f"docker exec   p50 {exec_p50:8.1f} ms   (python3 per cell in a warm container)")
    print(f"ratios: fresh/warm {fresh_p50 * ms / warm_p50:.0f}x, exec/warm {exec_p50 / warm_p50:.0f}x, "
          f"fresh/cold {fresh_p50 / cold_p50:.2f}x")  # fmt: skip
    print(json.dumps({
        "warm_exec_p50_ms": round(warm_p50, 2),
        "warm_exec_p95_ms": round(warm_p95, 2),
        "cold_start_p50_s": round(cold_p50, 3),
        "fresh_run_p50_s": round(fresh_p50, 3),
        "docker_exec_p50_ms": round(exec_p50, 2),
        "runtime": args.runtime,
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
