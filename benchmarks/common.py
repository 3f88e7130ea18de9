"""Shared helpers for the benchmarks: timing, the H100 roofline, and result files.

Timing: a batch of ``inner`` asynchronous calls is timed on the host between two device syncs, and the
median over ``outer`` batches divided by ``inner`` is reported; inputs rotate among a few sets so that
repeated calls do not all hit L2. JAX's dispatch of a jitted call (a few microseconds) overlaps with the
previous kernel, so for kernels longer than that the number is device time.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import time
from typing import Any, Callable, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_jaxsparse_from_install_or_checkout() -> bool:
    """Make ``import jaxsparse`` find the installed package (it carries the built CUDA extension), or
    this checkout when none is installed; True when the checkout is used (then the kernels are absent
    unless the extension was built in place)."""
    import importlib.util
    import sys

    if importlib.util.find_spec("jaxsparse") is not None:
        return False
    if REPO not in sys.path:
        sys.path.append(REPO)
    return True


def dense_vjp(x, dy, w, b):
    """One dense linear layer's forward and backward, ``(y, (dx, dw, db))`` of ``jax.vjp`` at cotangent ``dy``."""
    import jax

    y, f = jax.vjp(lambda x, w, b: x @ w + b, x, w, b)
    return y, f(dy)


def sparse_vjp(x, dy, values, b, sw):
    """The same for ``jaxsparse.ops.sparse_linear`` with ``sw``'s values replaced by ``values``:
    ``(y, (dx, dvalues, db))``."""
    import jax

    from jaxsparse import ops

    y, f = jax.vjp(lambda x, v, b: ops.sparse_linear(x, sw.replace(values=v), b), x, values, b)
    return y, f(dy)


def layer_operands(tokens: int, k: int, n: int, sets: int = 2) -> tuple[list, list, Any, Any]:
    """Fresh bf16 operands of one linear layer ``[tokens, k] -> [tokens, n]``, seeded by the shape: ``sets`` inputs
    x and cotangents dy (timed in turn, so no call sees the previous one's data), the weight ``w [k, n]`` (scaled
    by 1/sqrt(k)) and a bias ``b [n]``."""
    import jax
    import jax.numpy as jnp

    kx, kd, kw, kb = jax.random.split(jax.random.PRNGKey(k + n), 4)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
    xs = [normal(jax.random.fold_in(kx, i), (tokens, k)) for i in range(sets)]
    dys = [normal(jax.random.fold_in(kd, i), (tokens, n)) for i in range(sets)]
    w = (jax.random.normal(kw, (k, n), jnp.float32) / jnp.sqrt(float(k))).astype(jnp.bfloat16)
    return xs, dys, w, normal(kb, (n,))


def env_scope(**env: str | None):
    """These environment settings for the block (a value of None leaves that variable as it is), each restored on
    exit: the layers read their routes from the environment when they are traced (``jaxsparse.dispatch.env_scope``,
    imported here because this module sets up the import of jaxsparse)."""
    from jaxsparse import dispatch

    return dispatch.env_scope(env)


def with_env(fn: Callable, **env: str) -> Callable:
    """``fn`` traced with these environment settings (the layer reads its routes from them at trace time)."""
    def traced(*a):
        with env_scope(**env):
            return fn(*a)
    return traced


# Measured on the H100 of this workplace (docs/kernel-notes.md): dense bf16 GEMM and device copy.
DENSE_TFLOPS = 790.0
SPARSE_TFLOPS = 2 * DENSE_TFLOPS
HBM_TBPS = 3.0  # also jaxsparse.profile.HBM_TBPS (this module sets up the import of jaxsparse, so it cannot import it)

# The shapes of the kernel benchmarks (issues 3 and 4): BERT-base and BERT-large linears.
TOKENS = [16384, 4096]  # the targets (16384 tokens) first, so a cut-short run still has them
SHAPES = [(768, 768), (768, 3072), (3072, 768), (1024, 1024), (1024, 4096), (4096, 1024)]
SPECS = ["2:4", "64:2:8", "128:2:16", "128:2:32"]
QUICK_TOKENS = [16384]
QUICK_SHAPES = [(1024, 1024), (1024, 4096), (4096, 1024)]


def time_jax(fn: Callable, arg_sets: Sequence[tuple], *, warmup: int = 5, inner: int = 20, outer: int = 15) -> float:
    """Median milliseconds per call of ``fn(*args)`` (already jitted), rotating over ``arg_sets``."""
    import jax

    out = None
    for i in range(warmup):
        out = fn(*arg_sets[i % len(arg_sets)])
    jax.block_until_ready(out)
    times = []
    for _ in range(outer):
        t0 = time.perf_counter()
        for i in range(inner):
            out = fn(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return 1e3 * statistics.median(times)


def trace_kernels(fn: Callable, args: tuple, match: str, calls: int = 3) -> dict:
    """The GPU's own time for the kernels of ``fn(*args)`` (already jitted) whose names contain ``match`` (empty: every
    kernel), read from a ``jax.profiler`` trace of ``calls`` calls after a warm-up call outside it (launches excluded,
    as ``jaxsparse-profile`` counts them): ``{"median_us"`` (one kernel), ``"per_call_us"`` (all of a call's matching
    kernels), ``"count"}``. ``RuntimeError`` when nothing matches."""
    import tempfile

    import jax

    from jaxsparse.profile import device_events, latest_xplane

    jax.block_until_ready(fn(*args))  # compile and warm up outside the trace
    tmp = tempfile.mkdtemp(prefix="jaxsparse-trace-")
    with jax.profiler.trace(tmp):
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
    events, _ = device_events(latest_xplane(tmp))
    durations = [e.duration_ns / 1e3 for e in events if match in e.name and "memcpy" not in e.name.lower()]
    if not durations:
        raise RuntimeError(f"no kernel named like {match!r} in the trace: {sorted({e.name for e in events})[:10]}")
    return {"median_us": statistics.median(durations), "per_call_us": sum(durations) / calls, "count": len(durations)}


def time_torch(fn: Callable[[int], Any], n_sets: int, *, warmup: int = 5, inner: int = 20, outer: int = 15) -> float:
    """Median milliseconds per call of ``fn(i)`` with CUDA events around batches of ``inner`` calls."""
    import torch

    for i in range(warmup):
        fn(i % n_sets)
    torch.cuda.synchronize()
    times = []
    for _ in range(outer):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(inner):
            fn(i % n_sets)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def spmm_floor_ms(tokens: int, k: int, n: int, m: int | None, v: int = 1, itemsize: int = 2) -> dict:
    """Roofline floor of ``[T, K] @ [K, N]``: dense (m None) or V:2:M sparse (m = 4 for 2:4)."""
    if m is None:
        flops_time = 2.0 * tokens * k * n / (DENSE_TFLOPS * 1e12)
        w_bytes = k * n * itemsize
    else:
        flops_time = 2.0 * tokens * n * (4 * k // m) / (SPARSE_TFLOPS * 1e12)
        g = k // m
        w_bytes = n * 2 * g * itemsize + n * (g // 8) * 4 + (0 if m == 4 else (n // v) * g * 4)
    io_bytes = tokens * k * itemsize + tokens * n * itemsize + w_bytes
    mem_time = io_bytes / (HBM_TBPS * 1e12)
    return {
        "floor_ms": 1e3 * max(flops_time, mem_time),
        "compute_ms": 1e3 * flops_time,
        "memory_ms": 1e3 * mem_time,
        "bound": "compute" if flops_time >= mem_time else "memory",
    }


def missing_gpu_extension(script: str) -> bool:
    """True, after printing why, when this process has no GPU backend or no built jaxsparse CUDA extension (what the
    kernel-only benchmarks need); ``script`` names the caller in the message."""
    import jax

    import jaxsparse.ffi as jffi

    if jax.default_backend() == "gpu" and jffi.available():
        return False
    print(f"{script} needs a GPU and the built jaxsparse CUDA extension")
    return True


def gpu_name() -> str:
    import jax

    return jax.devices()[0].device_kind


def gpu_slug(name: str | None = None) -> str:
    name = name or gpu_name()
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def versions() -> dict:
    out = {"python": platform.python_version()}
    for mod in ("jax", "jaxlib", "numpy", "torch"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - optional packages
            pass
    try:
        import torch

        out["torch_cuda"] = torch.version.cuda
    except Exception:  # noqa: BLE001
        pass
    return out


def results_path(name: str, out: str | None = None) -> str:
    """``out`` if given, else ``benchmarks/results/<gpu>/<name>``: where a benchmark writes its results."""
    return out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", gpu_slug(), name)


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, sort_keys=False)
    print(f"wrote {path}")


def probe_document(raw: str) -> dict:
    """The JSON a CUDA probe printed (the ``benchmarks/*_probe.sh`` scripts), with the GPU's name (unless the
    probe wrote its own) and :func:`versions` added."""
    with open(raw) as f:
        doc = json.load(f)
    if "gpu" not in doc:
        doc["gpu"] = gpu_name()
    doc["versions"] = versions()
    return doc


def table(rows: list[dict], cols: list[str]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    line = "  ".join(c.rjust(widths[c]) for c in cols)
    out = [line, "-" * len(line)]
    for r in rows:
        out.append("  ".join(str(r.get(c, "")).rjust(widths[c]) for c in cols))
    return "\n".join(out)
