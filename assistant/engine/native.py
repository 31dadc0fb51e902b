"""The engine's hand-written CPU kernels (csrc/), built on first use: int8 decode linears and fused layer ops.

Why hand-written. A decode step of Qwen2.5-0.5B runs 97 int8 linears on 1-2 rows each. Through
PyTorch ops (fbgemm's prepacked GEMM plus the per-row quantization and the epilogue around it, and
~50 more small ops per layer for norms, RoPE, the KV gather and attention) a step was ~2,600 ops:
10-22 ms of a 60-95 ms step went to ops other than the GEMMs, more with the second OpenMP thread
and a busy neighbour. No library fuses per-row int8 quantization with a residual pass, and
torch.compile of the layer gained nothing here. Measured on this 2-vCPU machine, alternating
processes in one run: decode step 68-90 ms through PyTorch ops, 54 ms with the fused int8 linear
(csrc/int8_linear.cpp), 46.5-47 ms with the layer ops fused as well (csrc/layer_ops.cpp: RMSNorm,
RoPE with the KV-cache write, causal attention that reads the paged cache in place instead of
gathering K and V per layer). The calls release the GIL: the engine thread used to hold it through
every GEMV while the thread streaming tokens to the client waited (engine decode 17 -> 21 tok/s).
The GEMV itself (AVX-512 VNNI `vpdpbusd`, weights packed 64 outputs x 4 inputs per 256 bytes) is
not faster than fbgemm's on one isolated row when the machine is quiet (gate_up 0.73 vs 0.48 ms),
but it reads two rows for 3-10% more than one (fbgemm: 15-20% more) and stayed at 31-44 ms for all
97 GEMVs across runs where fbgemm's swung 24-89 ms. Measured later, with the whole model's weights
streamed (494 MB): a plain AVX-512 read of as many bytes ran at 13.3 GB/s, the 97 GEMVs at 11.2-11.6
GB/s, one thread or two alike. The kernel is within ~15% of the machine's bandwidth; fewer bytes is
what remains, hence csrc/lm_head.cpp: greedy rows screen the lm_head with a 4-bit copy and compute
only the candidates exactly (int8.py says what it saves). What else a step spent, profiled at 300
tokens of context (43 ms): 29 ms GEMVs, 6 ms head, 2.4 ms attention, and 4.5 ms in Python and ~40
small PyTorch ops per layer (silu, chunk, adds). csrc/decode_stack.cpp runs all layers of a step
whose sequences attend natively in one call (the same kernels in the same order, bit-identical to
model.py's loop, which still runs a step with more than 32 new tokens of a sequence; on this path prompts
go in 32-token steps, `Transformer.step_rows`), with SwiGLU as one more kernel:
step 42.3 -> 39.7 ms (medians, alternating, same run).
Steps with several rows (concurrent streams, speculated tokens). A step with R decode rows is 2R GEMM
rows (each row's residual row), and once the weights are streamed the multiply-adds decide: this
machine does ~2.5e9 `vpdpbusd` a second with both vCPUs busy (two processes pinned one per vCPU get
~1.1e9 each: the vCPUs share a core's vector units), ~2.2 ms per GEMM row of the 0.5B model. The
first kernels spent far more than that: their 8-row pass spilled its 32 accumulators, the screened
head streamed its 4-bit copy once per 8 rows with its accumulators stored every iteration, and 12+
rows went to oneDNN. csrc/int8_linear.cpp's design note says what replaced them (weights + 128 as the
unsigned operand, register tiles of 6 rows, chunked K so the weight stream overlaps the
multiply-adds); attention sums 16 keys' scores with one merge tree. Step time over a 1-row step,
0.5B, each row its own sequence at 300 tokens of context, old and new kernels alternating in one run:
4 rows 2.33-2.52x -> 1.38-1.39x, 8 rows 4.55-5.09x -> 1.95-2.22x, 16 rows 5.36-5.54x -> 3.98-4.12x
(aggregate decode rate at 8 streams 1.6-1.8x -> 3.6-4.1x one stream's). That was the multiply-add
floor while every linear gave generated rows the residual pass (16 GEMM rows: ~36 ms against a ~24 ms
1-row step). Then, profiled per kernel at 8 rows (real hidden states): gate_up 13.2-15 ms against 8.5-9 ms
for its bytes alone and ~9 ms for its multiply-adds alone; the screened head 7.2-8.2 ms against 3.2 ms.
What followed: (1) the residual pass only where it pays (`down`, int8.py has the measured quality):
8-row step 2.13x -> 1.95x, aggregate at 8 streams 4.15x -> 4.48x (two engines, same session);
(2) in a step of several register tiles, every tile now prefetches its share of the next chunk (the
k-th of T tiles every T-th word group) instead of the first tile all of it: the memory stream then
flows under every tile's multiply-adds. gate_up-shaped linear at 8 rows, 24 weight copies, alternating
builds: 14.3-15.2 -> 12.6-13.2 ms (1 row unchanged, 9.8-10.9 ms); (3) the screened head runs its
4-bit stream the same way, in chunks with shared prefetch; (4) greedy tokens come from a native argmax
(csrc/lm_head.cpp `argmax_rows`: torch's took 1.1 ms for 8 rows of 151,936 logits). [2026-11-30: the
linears' tiles now all prefetch every word group, the later ones repeating the first's (int8_linear.cpp),
which took 8-row steps from 1.42x to 1.26x a 1-row step; the head keeps the split of (3).] With all of them:
aggregate at 8 streams 4.59-4.72x one stream's in three bench runs (engine step 36.4 ms at 8 streams
against 22.4 ms at 1; the model's step curve 1.69-1.80x at 8 rows). Batch-1 decode gained as well,
since a generated row's gate_up is now one GEMM row: 39 -> 43-46 tok/s, same run, alternating processes.
(5) `down`'s generated rows keep their 16 largest activations exact instead of a residual GEMM row
(int8.py has the quality): a generated row is one GEMM row everywhere. Same run, two engines
alternating, decode only: 8 streams 4.41-4.50x -> 4.92-4.99x one stream's, 8-row step 1.91x -> 1.73x.
Per call at 8 rows, a down-shaped linear: one pass 281 us, with the outliers 302 us (selecting them
~1.2 us a row, their fp32 sums ~1.3 us a row), with the residual pass ~450 us. What bounds an 8-row
step now: this machine's vector units. A register-only loop of `vpdpbusd` runs ~1.9-2.2e9 a second on
the two vCPUs (they share one core); gate_up and the screened head reach ~2.1-2.2e9 at 8 rows, down
~1.9e9, so the GEMMs of an 8-row step are within ~10% of what the core can multiply.
Tried and dropped: prefetching attention's paged keys and values (no gain: cold attention at 8 rows
x 300 keys, 9.0 vs 9.7 ms; it is bound by this core's misses in flight, ~7 GB/s, not by the order of
the reads: a head-contiguous cache ran at the same bytes per second); a 16 KB prefetch distance or
16 KB chunks (within noise).
Profiled again on 2026-11-29 (each op timed in the layer loop, 0.5B, rows of their own sequences at 300 tokens
of context): an 8-row step spent 8.3 ms in gate_up (5.4 at 1 row), 5.1 in down (3.0), 2.8 in qkv and o (1.8),
4.8 in attention (1.0) and 6.7 in the screened head (2.1). Two of them changed. The head scanned an estimate
of every token for its candidates on one thread (~0.2 ms a row) after writing them all (9.7 MB at 16 rows);
lm_head.cpp now keeps each chunk's candidates as it streams (its design note): head 6.4 -> 5.6 ms at 8 rows,
13.9 -> 10.5 at 16 (step-curve A/B, three alternating process pairs). Attention read half of every key's
cache record per item (a key's kv heads sit side by side; reading 256 of every 512 bytes runs at half the
useful bytes per second of a sequential read here, 10.3 vs 21.8 GB/s on one thread) and the paged 8 KB
blocks in a random order reach ~14 GB/s on two threads, ~21 GB/s with the next block prefetched into L2;
`attend` now works per segment of a sequence's keys (layer_ops.cpp's design note has the figures).
What was measured and left: 2 MB pages (THP_MEM_ALLOC_ENABLE=1) made an isolated linear over 24 copies of
gate_up 23% faster but not a decode step (same curve, alternating runs); the GEMMs of an 8-row step cost ~3 ms
more inside the step than the same calls interleaved alone, unexplained.
Attention (csrc/layer_ops.cpp `attend`) was compute-bound, not bandwidth-bound: a horizontal sum per
key and head, the values re-read once per query head, loops over a head's vectors with a run-time
trip count (accumulators in memory). Now each (row, kv head) item is a template on hd / 16: 16 keys'
scores per head summed by one merge tree, 16 / V heads per pass over the values. 24 layers of one row,
same shapes as the 0.5B: hot caches 0.43 -> 0.21 ms per layer at 4,096 keys; cold, 300 keys 0.89 ->
~0.5 ms, 4,096 keys 12.7 -> ~14.6 ms fp32 (now reading ~100 MB of fp32 K and V) and 8.5 ms with
`engine.kv_dtype = "bfloat16"` (rope_store rounds like torch's .to(bfloat16), attend widens exactly).
Through the engine (bench/engine.py, one stream at 3,900 tokens of context, two engines alternating):
inter-token latency 35.8 ms fp32 KV, 30.9 ms bf16 KV, paired ratios 0.85-0.89; greedy answers the same
on 8 of 9 prompts, so bf16 KV stays opt-in (the default keeps the model's dtype).
Threads. The kernels split their work with csrc/pool.h, their own pool (its note says why not
at::parallel_for, which this extension, built without OpenMP, had run on one thread all along): the
engine's thread is one participant, engine.num_threads (or one per core) the count. 2 cores, the pool's
first version: step 29.2 -> 17.4 ms on the engine's thread, 8 rows 40.2 -> 24.4 ms; bench/engine.py after
its caller yields to a preempted worker: a 1-row step 14.6 ms, 8 streams 5.56x one stream's tok/s.
The int8 kernels keep the engine's arithmetic exactly (integer dot products, one float epilogue in a fixed
order, built with -ffp-contract=off), so prefill rows through `quantize` + `torch._int_mm` +
`finish` are bit-identical to decode rows through `linear`, and batching never changes a row.

Built with torch.utils.cpp_extension (g++ and ninja) into ~/.cache/assistant/native/<hash of the
sources, their paths and the flags>, once per checkout and source version: about a minute on 2
vCPUs. torch guards a build with a `lock` file that a killed build leaves behind, and the next build
then waits for it forever (a CI run hung 85 minutes on one). So builders first take an flock on
`build.flock` (the kernel drops it when a builder dies); whoever holds it knows no build is running
and removes a leftover `lock`.
AVX2 CPUs (2026-12-01). Without AVX-512, a CPU with AVX2 and FMA builds the same sources against
csrc/avx512_on_avx2.h (SIMDe maps each 512-bit intrinsic onto two 256-bit halves; the header says why the
bits are meant to stay the AVX-512 build's, and tests/test_engine_kernels.py compares the builds wherever both
run). Emulated vpdpbusd widens every byte, so int8_common.h has an AVX2 tile, `dot_tile_ymm` (vpmaddubsw on |x|
and the sign-flipped weight), and prompt chunks get `int_mm` over the same packed weights, since oneDNN's `_int_mm`
has no VNNI there. 2 Zen 3 cores, 0.5B, against the PyTorch-op path this replaced, same run: the model's step
at 300 tokens of context 102 -> 35-42 ms at 1 row, 259 -> 134-153 ms at 8; through the engine, decode
18.4-20.2 -> 23.2-27.0 tok/s (1.5B: 5.65-5.9 -> 8.2-10.0), the same tokens. Tried and dropped: one group of 16 outputs per pass in
`dot_tile` (2R accumulators instead of 8R, no spills) took the 1-row step from 35-42 to 84-87 ms.
Steps of several rows (2026-12-01, later): perf showed SIMDe's code, not the arithmetic, in their hot loops. The
tiles' accumulators, kept as emulated __m512i, were spilled and stored twice per multiply-add; vpermt2ps (the
attention scores' merge tree) ran lane by lane; vscalefps (exp's 2^n) called exp2f per lane; the value sums' FMAs
went through general registers; the head's estimates used emulated masked loads and compress-stores. Each now
has an AVX2 body on ymm registers of its own (int8_common.h `dot_tile_ymm` for the linears and the head's screen,
the head's estimates and exact candidate dots, layer_ops.cpp `scores16` and `weigh_heads_ymm`, exp16's two
exact power-of-two products), the same IEEE operations on the same values: 149 kernel outputs compared with a
build of the previous sources in one process were the same to the bit (linears at 1-31 rows, the head at 1-16,
attention over fp32 and bf16 caches up to 1,000 keys, SwiGLU), except SwiGLU at gates below -88.4, where the
emulation's 2^128 overflowed to inf and now is vscalefps's finite value (a test holds it). The
linears alone, 24 layers of the 0.5B's shapes, alternating builds in one process: 8 rows 59.9 -> 44.5 ms, 16 rows
116 -> 84. The model's step (300 tokens of context): 8 rows 123-133 -> 86-94 ms, 16 rows 222-245 -> 166-184
(then 77 and 154 ms with the head's estimates in AVX2 too, one run);
through the engine (bench/engine.py's decode-only phase, two pairs of alternating runs): 8 streams 65.8-74.0 ->
102.8-103.2 tok/s aggregate, one stream 25.6-26.9 -> 32.4-32.6.
Standalone, a register-tile GEMM that owns its accumulators reaches ~90-100 GMAC/s on 2 Zen 3 cores at 8-16 rows
(its 8-row pass over the 0.5B's linears 31-34 ms against ~20 ms for one row's bytes), so the linears' 8-row
share is near what these cores multiply; strips of 16 outputs with 3-row tiles (avx2_strips.h's shape) were no
faster there and slower at 2-4 rows in the product.
Without AVX2 and FMA, SIMDe's headers, a compiler, or with ASSISTANT_NATIVE=0, the engine uses the
PyTorch-op path instead (int8.py, model.py) and says why once. On that path, a CPU with AVX2 gets one kernel,
`avx2_kernels` (csrc/avx2_gemv.cpp: the linears' exact int8 GEMM, its own design note; int8.py has the
figures), built the same way into a directory of its own.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import time
import sys
from pathlib import Path
from types import ModuleType
from typing import Sequence

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("int8_linear.cpp", "lm_head.cpp", "layer_ops.cpp", "decode_stack.cpp")]
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni")
CFLAGS = ["-std=c++20", "-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni", "-ffp-contract=off"]
# Without AVX-512 but with AVX2 and FMA: the same sources, their 512-bit intrinsics on 256-bit halves through SIMDe
# (csrc/avx512_on_avx2.h says how, and why the bits stay those of the AVX-512 build).
EMULATED_FLAGS = ("avx2", "fma")
EMULATED_CFLAGS = ["-std=c++20", "-O3", "-mavx2", "-mfma", "-ffp-contract=off"]
SIMDE_HEADER = "simde/x86/avx512.h"  # Debian's libsimde-dev (make system installs it)
# Where those are missing but AVX2 is there: only the exact int8 GEMM of decode rows (csrc/avx2_gemv.cpp).
AVX2_SOURCES = [Path(__file__).parent / "csrc" / "avx2_gemv.cpp"]
AVX2_FLAGS = ("avx2",)
AVX2_CFLAGS = ["-std=c++20", "-O3", "-mavx2", "-ffp-contract=off"]


BUILD_WAIT_S = 900.0  # another process building the same sources: wait this long, then use PyTorch ops


def build_dir(cflags: list[str] | None = None) -> Path:
    """One directory per checkout and version of the sources and flags: torch's build file names the
    sources by absolute path, so two checkouts sharing a directory rebuild (and overwrite a loaded
    .so) whenever the other one ran last."""
    digest = hashlib.sha256("\0".join(CFLAGS if cflags is None else cflags).encode())
    for path in sorted(SOURCES[0].parent.glob("*.[ch]*")):  # the headers too
        digest.update(str(path.resolve()).encode() + b"\0" + path.read_bytes())
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "assistant" / "native" / digest.hexdigest()[:16]


def unavailable_reason(required: Sequence[str] | None = None) -> str | None:
    """Why the kernels cannot run on this machine (None: they can, once built). `required`: these CPU flags
    only; by default the full kernels, on AVX-512 VNNI or (emulated) on AVX2 with FMA and SIMDe's headers."""
    if os.environ.get("ASSISTANT_NATIVE", "1") == "0":
        return "disabled by ASSISTANT_NATIVE=0"
    if not sys.platform.startswith("linux"):
        return "the native int8 kernel is built for Linux only"
    try:
        flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    except OSError as exc:
        return f"cannot read /proc/cpuinfo: {exc}"
    missing = lambda need: [f for f in need if f not in flags]  # noqa: E731
    if required is not None:
        return f"this CPU lacks {', '.join(missing(required))}" if missing(required) else None
    if not missing(REQUIRED_FLAGS):
        return None
    if missing(EMULATED_FLAGS):
        return f"this CPU lacks {', '.join(missing(REQUIRED_FLAGS))} (AVX-512) and {', '.join(missing(EMULATED_FLAGS))}"
    if simde_include() is None:
        return (f"this CPU lacks {', '.join(missing(REQUIRED_FLAGS))}, and the AVX2 build needs SIMDe's headers "
                f"({SIMDE_HEADER}): install libsimde-dev (make system does)")
    return None


def target() -> str | None:
    """"avx512" or "avx2": the build the full kernels use on this CPU (None: they cannot run here)."""
    if unavailable_reason() is not None:
        return None
    return "avx512" if unavailable_reason(REQUIRED_FLAGS) is None else "avx2"


def simde_include() -> Path | None:
    """The include directory that holds SIMDe's AVX-512 header, or None."""
    for base in (os.environ.get("SIMDE_INCLUDE"), "/usr/include", "/usr/local/include", Path(sys.prefix) / "include"):
        if base and (Path(base) / SIMDE_HEADER).is_file():
            return Path(base)
    return None


def emulated_cflags() -> list[str]:
    """The AVX2 build's flags, with SIMDe's include directory where the compiler would not look."""
    include = simde_include()
    return EMULATED_CFLAGS + ([] if include is None or str(include) in ("/usr/include", "/usr/local/include")
                              else [f"-I{include}"])


@functools.cache
def int8_kernels() -> ModuleType | None:
    """The built extension, or None (then the reason is logged once)."""
    reason = unavailable_reason()
    if reason is None:
        try:
            if target() == "avx512":
                module = build()
            else:
                module = build(SOURCES, "assistant_engine_native_avx2", emulated_cflags())
            module.set_threads(_threads or torch_threads())
            return module
        except Exception as exc:  # noqa: BLE001 - no compiler / headers: the PyTorch-op path still works
            reason = f"building {SOURCES[0].parent} failed ({str(exc).strip().splitlines()[-1][:300]}); install g++ and ninja"
    if _avx2_gemm() is not None:
        log.warning("int8 decode kernel not used: %s; decoding through PyTorch ops and the AVX2 int8 GEMM", reason)
    else:
        log.warning("int8 decode kernel not used: %s; decoding through PyTorch ops (slower)", reason)
    return None


def avx2_kernels() -> ModuleType | None:
    """The AVX2 int8 GEMM (csrc/avx2_gemv.cpp) where the full kernels cannot run (no FMA, no SIMDe, a failed build)
    but AVX2 is there, or None."""
    return None if int8_kernels() is not None else _avx2_gemm()


@functools.cache
def _avx2_gemm() -> ModuleType | None:
    reason = unavailable_reason(AVX2_FLAGS)
    if reason is None:
        try:
            module = build(AVX2_SOURCES, "assistant_engine_avx2", AVX2_CFLAGS)
            module.set_threads(_threads or torch_threads())
            return module
        except Exception as exc:  # noqa: BLE001 - as above
            reason = f"building {AVX2_SOURCES[0]} failed ({str(exc).strip().splitlines()[-1][:300]}); install g++ and ninja"
    log.warning("AVX2 int8 kernel not used: %s; decode rows use bf16 activations (slower)", reason)
    return None


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


_threads = 0  # the kernels' thread count once loaded (0: torch's)


def set_threads(num_threads: int) -> None:
    """The kernels' thread count (loading.set_threads gives it): applied now when they are loaded, else
    when they load."""
    global _threads
    _threads = max(1, num_threads)
    for kernels in (int8_kernels, _avx2_gemm):
        if kernels.cache_info().currsize and (module := kernels()) is not None:
            module.set_threads(_threads)


def build(sources: list[Path] | None = None, name: str = "assistant_engine_native", cflags: list[str] | None = None,
          verbose: bool = False) -> ModuleType:
    from torch.utils.cpp_extension import load

    sources, cflags = sources or SOURCES, cflags or CFLAGS
    out = build_dir(cflags)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "build.flock", "w") as guard:
        _hold(guard, out)
        (out / "lock").unlink(missing_ok=True)  # torch's baton, left by a killed build: none is running now
        if not any(out.glob("*.so")):
            print("Building the int8 decode kernel (once, about a minute)...", file=sys.stderr, flush=True)
        return load(name=name, sources=[str(p) for p in sources], extra_cflags=cflags, build_directory=str(out),
                    verbose=verbose)


def _hold(guard, out: Path, wait_s: float | None = None) -> None:
    """Take the builders' flock, waiting up to BUILD_WAIT_S for another live builder."""
    deadline = time.monotonic() + (BUILD_WAIT_S if wait_s is None else wait_s)
    while True:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"another process has been building {out} for too long; "
                                   f"if none is, delete {out} and retry") from None
            time.sleep(0.5)
