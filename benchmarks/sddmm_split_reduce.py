"""The SDDMM's token split summed in a thread-block cluster against the float32 planes and their second kernel, at
BERT-large's weight-gradient shapes (``calls.sddmm_split_reduce``; ``JAXSPARSE_SDDMM_SPLIT_REDUCE``).

Each row runs one weight gradient with the bias gradient, as the training step asks for it (the tma engine on x rows:
2:4, and 64:2:8 through its 2:4 view; Q, K and V as one stacked call), both ways in one process on the same fresh random
inputs: ``planes`` writes each token range's float32 sums and adds them (and the bias gradient's planes) in
``SddmmReduceKernel``; ``cluster`` adds them in the ranges' cluster through distributed shared memory. The two results
must be the same bits. Times are the GPU's own, from ``jax.profiler`` traces (``common.trace_kernels``; launches
excluded, as ``jaxsparse-profile`` counts them): every SDDMM kernel of a call (the product and, with planes, the
reduction; the 2:4 view's build is not in it). ``floor_us``: the product's work (the dense weight gradient's on the
2:4 view) at the dense tensor rate, ``common.DENSE_TFLOPS``.

  python3 benchmarks/sddmm_split_reduce.py     # writes benchmarks/results/<gpu>/sddmm_split_reduce.json
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
import numpy as np  # noqa: E402

from jaxsparse import format as F  # noqa: E402

# (name, K, R, spec, layers): the step's SDDMM calls that split their tokens (Q, K and V stacked; attention out) and
# one that does not (FFN in), where the cluster can still sum the bias gradient's column tiles.
CASES = [("qkv", 1024, 1024, "64:2:8", 3), ("attention out", 1024, 1024, "64:2:8", 1),
         ("ffn in", 1024, 4096, "64:2:8", 1), ("qkv", 1024, 1024, "2:4", 3), ("attention out", 1024, 1024, "2:4", 1)]
REDUCES = ("planes", "cluster")


def floor_us(tokens: int, k: int, r: int, layers: int) -> float:
    """The product's work, ``2 T K R`` a layer (every product of the 2:4 view's quads), at the dense tensor rate."""
    return 2.0 * tokens * k * r * layers / (common.DENSE_TFLOPS * 1e12) * 1e6


def summarize(planes_us: float, cluster_us: float, floor: float) -> dict:
    """A row's derived figures from its two measured times (us)."""
    return {"planes_us": round(planes_us, 2), "cluster_us": round(cluster_us, 2),
            "saved_us": round(planes_us - cluster_us, 2), "speedup": round(planes_us / cluster_us, 4),
            "floor_us": round(floor, 2), "planes_over_floor": round(planes_us / floor, 3),
            "cluster_over_floor": round(cluster_us / floor, 3)}


def operands(tokens: int, k: int, r: int, spec: str, layers: int, seed: int = 0) -> tuple:
    """``(x, dys, sws)``: fresh random bf16 activations and output gradients, and ``layers`` weights pruned to
    ``spec`` by magnitude."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 1 + 2 * layers)
    x = jax.random.normal(keys[0], (tokens, k), jnp.bfloat16)
    dys, sws = [], []
    for i in range(layers):
        dys.append(jax.random.normal(keys[1 + 2 * i], (tokens, r), jnp.bfloat16))
        w = (jax.random.normal(keys[2 + 2 * i], (k, r)) / 32).astype(jnp.bfloat16)
        sws.append(F.compress(w, F.select_mask(w, spec), spec))
    return x, dys, sws


def gradient_fn(reduce: str, layers: int):
    """The call, traced with ``JAXSPARSE_SDDMM_SPLIT_REDUCE=reduce``: one layer's ``calls.sddmm`` on the tma engine, or
    ``calls.sddmm_stacked`` of several, each with its bias gradient."""
    from jaxsparse.ffi import calls

    def grads(x, dys, sws):
        if layers == 1:
            return [calls.sddmm(x, dys[0], sws[0], engine="tma", x_layout="row", bias_grad=True)]
        return calls.sddmm_stacked(x, dys, sws, "row", bias_grad=True)

    return jax.jit(common.with_env(grads, JAXSPARSE_SDDMM_SPLIT_REDUCE=reduce))


def measure(name: str, tokens: int, k: int, r: int, spec: str, layers: int) -> dict:
    x, dys, sws = operands(tokens, k, r, spec, layers)
    fns = {reduce: gradient_fn(reduce, layers) for reduce in REDUCES}
    got = {reduce: [np.asarray(a) for a in jax.tree.leaves(fn(x, dys, sws))] for reduce, fn in fns.items()}
    for a, b in zip(got["planes"], got["cluster"]):
        if not (np.isfinite(a).all() and np.array_equal(a, b)):
            raise RuntimeError(f"{name} {spec}: the cluster's sums are not the planes' bits")
    times, reduces = {}, {}
    for reduce, fn in fns.items():
        times[reduce] = common.trace_kernels(fn, (x, dys, sws), "Sddmm")["per_call_us"]
        try:
            reduces[reduce] = common.trace_kernels(fn, (x, dys, sws), "SddmmReduce")["count"] / 3
        except RuntimeError:  # no such kernel in the trace
            reduces[reduce] = 0
    return {"case": name, "spec": spec, "tokens": tokens, "K": k, "R": r, "layers": layers,
            **summarize(times["planes"], times["cluster"], floor_us(tokens, k, r, layers)),
            "reduce_launches_planes": reduces["planes"], "reduce_launches_cluster": reduces["cluster"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384, help="rows of the activation (BERT-large: 32 x 512)")
    ap.add_argument("--out", default=None, help="json path (default benchmarks/results/<gpu>/sddmm_split_reduce.json)")
    a = ap.parse_args(argv)
    if a.tokens < 1:
        ap.error(f"--tokens must be >= 1, got {a.tokens}")
    if common.missing_gpu_extension("sddmm_split_reduce.py"):
        return 1
    rows = [measure(name, a.tokens, k, r, spec, layers) for name, k, r, spec, layers in CASES]
    cols = ["case", "spec", "planes_us", "cluster_us", "saved_us", "speedup", "floor_us", "cluster_over_floor",
            "reduce_launches_planes", "reduce_launches_cluster"]
    print(common.table(rows, cols))
    common.write_json(common.results_path("sddmm_split_reduce.json", a.out),
                      {"benchmark": "sddmm_split_reduce", "description": __doc__.split("\n\n")[0],
                       "gpu": common.gpu_name(), "versions": common.versions(),
                       "timing": "every SDDMM kernel of a call, from jax.profiler traces (3 calls, after a warm-up)",
                       "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
