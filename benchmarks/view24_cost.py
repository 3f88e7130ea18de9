"""Device time of the two per-step weight builds (``jaxsparse_transpose_2_4``: W^T for the transposed dX route;
``jaxsparse_as_2_4``: the 2:4 view of a V:2:M weight) at BERT-large's shapes, against an XLA pass that moves the
same bytes.

A build called alone under ``jit`` times the host's dispatch (``transpose_2_4_cost.py``), and so does a batch of
builds timed on the host clock (session 39's first version of this script: 13-30 us a build, and 5-13 us for the XLA
pass of the same bytes, against 6.8 us a build in the step's profile). Here one jitted function makes ``CALLS``
builds of ``CALLS`` different weights under ``jax.profiler.trace``, and each row is the median kernel duration read
from the trace (``jaxsparse.profile.device_events``): the GPU's time for one build, launch excluded, as the step's
profile counts it. The XLA row (``xla_pass_us``) reads an array of the build's input size and writes one of its
output size the same way: what the build's bytes cost in an XLA kernel. ``step`` adds them up over one BERT-large
step's builds (:data:`STEP_LAYER`).

  python3 benchmarks/view24_cost.py     # writes benchmarks/results/<gpu>/view24_cost.json
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

common.import_jaxsparse_from_install_or_checkout()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxsparse import format as F  # noqa: E402
from jaxsparse.ffi import calls  # noqa: E402

CALLS = 48
# (K, R, spec): BERT-large's attention (1024 x 1024) and FFN kernels, and the diagonal FFN out as the stacked 2:4
# weight its W^T is built from (jaxsparse.ops.diagonal_linear: 2 blocks, 2048 x 1024, at 64:2:8; 4, 1024 x 1024, at
# 128:2:16).
CASES = [(1024, 1024, "64:2:8"), (1024, 4096, "64:2:8"), (4096, 1024, "64:2:8"), (2048, 1024, "2:4"),
         (1024, 1024, "128:2:16"), (1024, 4096, "128:2:16"), (4096, 1024, "128:2:16"), (1024, 1024, "2:4")]
# One encoder layer of the recommended BERT-large step (transposable masks, FFN out as M/4 diagonal 2:4 blocks):
# (K, R, spec, count). Each weight builds W^T for the input gradient, and the V:2:M ones their 2:4 view for the forward.
STEP_LAYER = {"64:2:8": [(1024, 1024, "64:2:8", 4), (1024, 4096, "64:2:8", 1), (2048, 1024, "2:4", 1)],
              "128:2:16": [(1024, 1024, "128:2:16", 4), (1024, 4096, "128:2:16", 1), (1024, 1024, "2:4", 1)]}
LAYERS = 24  # BERT-large


def step_totals(rows: list[dict], layers: int = LAYERS) -> dict:
    """Kernel time of the builds a step makes (:data:`STEP_LAYER` times ``layers``), from the per-build rows, by
    sparsity and build: ``{"64:2:8": {"transpose_2_4": {"us_per_layer": ..., "ms_per_step": ..., "builds_per_step":
    ...}, ...}}``. A step's shape missing from ``rows`` raises ``KeyError``."""
    by_case = {(r["K"], r["R"], r["spec"], r["build"]): r["kernel_us"] for r in rows}
    out = {}
    for sparsity, layer in STEP_LAYER.items():
        totals = {}
        for k, r, spec, count in layer:
            for build in ("transpose_2_4", "as_2_4") if F.VNM.parse(spec).m > 4 else ("transpose_2_4",):
                t = totals.setdefault(build, {"us_per_layer": 0.0, "builds_per_step": 0})
                t["us_per_layer"] += count * by_case[(k, r, spec, build)]
                t["builds_per_step"] += count * layers
        for t in totals.values():
            t["us_per_layer"] = round(t["us_per_layer"], 2)
            t["ms_per_step"] = round(t["us_per_layer"] * layers / 1e3, 3)
        out[sparsity] = totals
    return out


def _weights(k: int, r: int, spec: str) -> list[F.SparseWeight]:
    w = (jax.random.normal(jax.random.PRNGKey(k + r), (k, r)) / 32).astype(jnp.bfloat16)
    sw = F.compress(w, F.select_mask(w, spec, transposable=True), spec)
    keys = jax.random.split(jax.random.PRNGKey(1), CALLS)
    return [sw.replace(values=(sw.values * (1 + jax.random.uniform(kk, ()))).astype(sw.values.dtype)) for kk in keys]


def _nbytes(tree) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(tree))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="json path (default benchmarks/results/<gpu>/view24_cost.json)")
    args = ap.parse_args()
    rows = []
    for k, r, spec in CASES:
        sws = _weights(k, r, spec)
        builds = [("transpose_2_4", calls.transpose_2_4, "Transpose24Kernel")]
        if F.VNM.parse(spec).m > 4:
            builds.append(("as_2_4", lambda sw: calls.as_2_4(sw)[0], "As24Kernel"))
        for name, build, kernel in builds:
            out = jax.jit(build)(sws[0])
            in_bytes, out_bytes = _nbytes((sws[0].values, sws[0].columns, sws[0].metadata)), _nbytes(out)
            timed = common.trace_kernels(jax.jit(lambda ws: [build(w) for w in ws]), (sws,), kernel)
            us, n = timed["median_us"], timed["count"]
            # The XLA pass of the same bytes: read an array of the input's size, write one of the output's.
            src = [jnp.zeros((in_bytes // 2,), jnp.bfloat16) + i for i in range(CALLS)]
            n_in, n_out = in_bytes // 2, out_bytes // 2
            grow = (lambda x: jnp.pad(x * 2, (0, n_out - n_in))) if n_out >= n_in else (lambda x: (x * 2)[:n_out])
            xla_us = common.trace_kernels(jax.jit(lambda xs: [grow(x) for x in xs]), (src,), "")["median_us"]
            row = dict(K=k, R=r, spec=spec, build=name, kernel_us=round(us, 2), kernels_traced=n,
                       xla_pass_us=round(xla_us, 2), in_bytes=in_bytes, out_bytes=out_bytes,
                       floor_us=round((in_bytes + out_bytes) / 3.0e6, 2))
            rows.append(row)
            print(f"{k:>5} {r:>5} {spec:>9} {name:>14} {row['kernel_us']:7.2f} us  (XLA pass of the bytes "
                  f"{row['xla_pass_us']:6.2f} us, HBM floor {row['floor_us']:5.2f} us)", flush=True)
    steps = step_totals(rows)
    for sparsity, totals in steps.items():
        print(f"a BERT-large step at {sparsity} (FFN out diagonal): " + ", ".join(
            f"{name} {t['us_per_layer']:.1f} us a layer, {t['ms_per_step']:.3f} ms ({t['builds_per_step']} builds)"
            for name, t in totals.items()))
    common.write_json(common.results_path("view24_cost.json", args.out),
                      dict(gpu=common.gpu_name(), versions=common.versions(), calls_per_batch=CALLS,
                           timing="median kernel duration from jax.profiler traces (3 calls of CALLS builds)",
                           results=rows, step=steps))


if __name__ == "__main__":
    main()
