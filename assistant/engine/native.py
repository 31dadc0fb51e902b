"""The engine's hand-written CPU kernels (csrc/), built on first use: int8 decode linears and fused layer ops.

Why hand-written. A decode step of Qwen2.5-0.5B runs 97 int8 linears on 1-2 rows each. Through
PyTorch ops (fbgemm's prepacked GEMM plus the per-row quantization and the epilogue around it) each
linear is ~15 tensor ops, and a step ~2,600 ops: measured here 10-22 ms of a 60-95 ms step went to
ops other than the GEMMs, the share growing with the second OpenMP thread and with a busy neighbour,
and fbgemm's own step time swung 24-89 ms between identical runs. The kernel fuses the quantization,
the residual pass (model.py), an AVX-512 VNNI GEMV that streams each weight byte once for all rows,
and the epilogue into one call. It keeps the engine's arithmetic exactly (integer dot products, the
same float epilogue in the same order), so prefill rows through `quantize` + `torch._int_mm` +
`finish` are bit-identical to decode rows through `linear`, and batching never changes a row.
The same reasoning fused the rest of a layer's small ops (csrc/layer_ops.cpp): RMSNorm, RoPE with
the KV-cache write, and single-query attention that reads the paged cache in place instead of
gathering K and V per layer. Every path of the model calls these same functions.

Built with torch.utils.cpp_extension (g++ and ninja) into ~/.cache/assistant/native, once per source
version: about a minute on 2 vCPUs. Without AVX-512 VNNI, a compiler, or with ASSISTANT_NATIVE=0, the
engine uses the PyTorch-op path instead (model.py) and says why once.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("int8_linear.cpp", "layer_ops.cpp")]
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512_vnni")
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni", "-ffp-contract=off"]


def build_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "assistant" / "native"


def unavailable_reason() -> str | None:
    """Why the kernel cannot run on this machine (None: it can, once built)."""
    if os.environ.get("ASSISTANT_NATIVE", "1") == "0":
        return "disabled by ASSISTANT_NATIVE=0"
    if not sys.platform.startswith("linux"):
        return "the native int8 kernel is built for Linux only"
    try:
        flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    except OSError as exc:
        return f"cannot read /proc/cpuinfo: {exc}"
    missing = [f for f in REQUIRED_FLAGS if f not in flags]
    return f"this CPU lacks {', '.join(missing)}" if missing else None


@functools.cache
def int8_kernels() -> ModuleType | None:
    """The built extension, or None (then the reason is logged once)."""
    reason = unavailable_reason()
    if reason is None:
        try:
            return build()
        except Exception as exc:  # noqa: BLE001 - no compiler / headers: the PyTorch-op path still works
            reason = f"building {SOURCES[0].parent} failed ({str(exc).strip().splitlines()[-1][:300]}); install g++ and ninja"
    log.warning("int8 decode kernel not used: %s; decoding through PyTorch ops (slower)", reason)
    return None


def build(verbose: bool = False) -> ModuleType:
    from torch.utils.cpp_extension import load

    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    if not any(out.glob("*.so")):
        print("Building the int8 decode kernel (once, about a minute)...", file=sys.stderr, flush=True)
    return load(name="assistant_engine_native", sources=[str(p) for p in SOURCES], extra_cflags=CFLAGS, build_directory=str(out),
                verbose=verbose)
