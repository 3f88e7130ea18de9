"""A layer whose weight is G diagonal 2:4 blocks, against the dense layer and the V:2:M layer of the same density.

A V:2:M mask whose blocks are tied in runs that partition the input features (each input feature kept by one run
of blocks) is, once the input features are relabelled so that each run's come together, a block-diagonal matrix of
G = M / 4 diagonal blocks, 2:4 sparse inside: density 1 / (2 G), the density of V:2:M. Where the layer's input
features can be relabelled at no cost (the FFN's hidden features, which the first FFN layer produces in any order
its rows are stored in), the layer's three products are then G 2:4 products of 1/G the size, on contiguous slices
(docs/kernel-notes.md, session 31). This script times, fwd+bwd (jax.vjp) under one jit at 16384 tokens, median of
timed repetitions, in one process: XLA's dense layer; the V:2:M layer the step runs (transposable masks, transposed
input gradient); the G blocks as G separate 2:4 sparse_linear calls on their own contiguous operands (what the layout
could gain before any kernel took it); and ``jaxsparse.ops.diagonal_linear`` (one call a product: the TMA row kernel
and the SDDMM's tma engine reading each block's columns of x, the input gradient on the stacked W^T blocks); and
the same with a chunk table (``diagonal_linear(..., chunks=)``, a random permutation of x's 64-column chunks: the
layout for layers whose inputs cannot be relabelled, which reads x and writes the input gradient by the table).

  python3 benchmarks/block_diagonal.py     # writes benchmarks/results/<gpu>/block_diagonal.json
  python3 benchmarks/block_diagonal.py --no-separate --out /tmp/b.json   # without the G separate layers
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import common  # noqa: E402
from jaxsparse import format as F  # noqa: E402
from jaxsparse import ops  # noqa: E402

CASE_NOTES = {"blocks_separate_ms": "G separate sparse_linear calls on contiguous operands",
              "diagonal_linear_ms": "jaxsparse.ops.diagonal_linear (one kernel a product)",
              "diagonal_chunked_ms": "diagonal_linear with a chunk table (a random permutation of x's 64-column "
                                     "chunks)"}

TOKENS = 16384
# (K, N, V:2:M spec, G of the same density): BERT-large's FFN out, attention's four layers and FFN in.
CASES = [(4096, 1024, "128:2:16", 4), (4096, 1024, "64:2:8", 2), (1024, 1024, "128:2:16", 4),
         (1024, 1024, "64:2:8", 2), (1024, 4096, "128:2:16", 4), (1024, 4096, "64:2:8", 2)]


def _sparse(w, spec: str):
    return F.compress(w, F.select_mask(w, spec, transposable=True), spec)


def _diagonal_floor_ms(tokens: int, k: int, n: int, g: int) -> float:
    """The roofline floor of the diagonal layer's fwd+bwd: per product (forward, input gradient, SDDMM) the larger of
    its activation bytes (one [T, K] and one [T, N] bf16 array) at HBM speed and its 2:4 products (each block's dense
    MACs halved) at the sparse tensor rate."""
    bytes_ = 2 * tokens * (k + n)
    flops = 2 * tokens * k * n / g
    one = max(bytes_ / (common.HBM_TBPS * 1e12), flops / (common.SPARSE_TFLOPS * 1e12)) * 1e3
    return 3 * one


def _table(kind: str, chunks: int, g: int, seed: int) -> jax.Array:
    """A chunk table ``[g, chunks / g]`` of x's ``chunks`` 64-column chunks (``--table``)."""
    if kind == "identity":
        return jnp.arange(chunks, dtype=jnp.int32).reshape(g, -1)
    table = jax.random.permutation(jax.random.PRNGKey(seed), chunks).astype(jnp.int32).reshape(g, -1)
    return jnp.sort(table, axis=1) if kind == "sorted" else table


def _groups_vjp(xs, dys, sws, bs):
    """The G blocks' layers, each fwd+bwd, under the caller's jit."""
    return [common.sparse_vjp(x, dy, sw.values, b, sw) for x, dy, sw, b in zip(xs, dys, sws, bs)]


def main() -> None:
    if common.missing_gpu_extension("block_diagonal.py"):
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="json path (default benchmarks/results/<gpu>/block_diagonal.json)")
    ap.add_argument("--no-separate", action="store_true", help="skip the G separate sparse_linear layers")
    ap.add_argument("--table", default="random", choices=("random", "sorted", "identity"),
                    help="the chunked rows' table: a random permutation of x's chunks, the same sets ascending within "
                         "each block (as jaxsparse.format.diagonal_chunks gives them), or the contiguous chunks "
                         "(the tables' own cost)")
    args = ap.parse_args()
    rows = []
    with ops.dx_route_scope("transposed"):
        for k, n, spec, g in CASES:
            xs, dys, w, b = common.layer_operands(TOKENS, k, n)
            dense_ms = common.time_jax(jax.jit(common.dense_vjp), [(x, dy, w, b) for x, dy in zip(xs, dys)])
            sw = _sparse(w, spec)
            vnm_ms = common.time_jax(jax.jit(lambda x, dy, sw, b: common.sparse_vjp(x, dy, sw.values, b, sw)),
                                     [(x, dy, sw, b) for x, dy in zip(xs, dys)])
            kg, ng = k // g, n // g
            bd_ms = None
            if not args.no_separate:
                blocks = [_sparse(w[i * kg:(i + 1) * kg, i * ng:(i + 1) * ng], "2:4") for i in range(g)]
                split = lambda a, width: [a[:, i * width:(i + 1) * width] for i in range(g)]
                sets = [(split(x, kg), split(dy, ng), blocks, [b[i * ng:(i + 1) * ng] for i in range(g)])
                        for x, dy in zip(xs, dys)]
                sets = [jax.block_until_ready(jax.tree.map(lambda a: a.copy(), s)) for s in sets]  # contiguous
                bd_ms = common.time_jax(jax.jit(_groups_vjp), sets)
            stacked = _sparse(F.stack_diagonal_blocks(w, g), "2:4")
            diag = lambda x, dy, sw, b, t: jax.vjp(
                lambda x, v, b: ops.diagonal_linear(x, sw.replace(values=v), g, b, chunks=t), x, sw.values, b)[1](dy)
            diag_ms = common.time_jax(jax.jit(lambda x, dy, sw, b: diag(x, dy, sw, b, None)),
                                      [(x, dy, stacked, b) for x, dy in zip(xs, dys)])
            table = _table(args.table, k // 64, g, k + n + g)
            chunked_ms = common.time_jax(jax.jit(diag), [(x, dy, stacked, b, table) for x, dy in zip(xs, dys)])
            floor_ms = _diagonal_floor_ms(TOKENS, k, n, g)
            row = dict(K=k, N=n, spec=spec, G=g, dense_ms=dense_ms, vnm_ms=vnm_ms, blocks_separate_ms=bd_ms,
                       diagonal_linear_ms=diag_ms, diagonal_chunked_ms=chunked_ms, diagonal_floor_ms=floor_ms,
                       diagonal_over_floor=diag_ms / floor_ms, chunked_over_floor=chunked_ms / floor_ms,
                       vnm_speedup=dense_ms / vnm_ms, blocks_speedup=dense_ms / bd_ms if bd_ms else None,
                       diagonal_speedup=dense_ms / diag_ms, chunked_speedup=dense_ms / chunked_ms,
                       diagonal_over_vnm=vnm_ms / diag_ms)
            rows.append(row)
            separate = f"{g} separate {bd_ms:.4f} ({dense_ms / bd_ms:.2f}x)  " if bd_ms else ""
            print(f"{k:>5} {n:>5} {spec:>9} dense {dense_ms:.4f}  V:2:M {vnm_ms:.4f} ({dense_ms / vnm_ms:.2f}x)  "
                  f"{separate}diagonal_linear {diag_ms:.4f} ({dense_ms / diag_ms:.2f}x)  chunked {chunked_ms:.4f} "
                  f"({dense_ms / chunked_ms:.2f}x, {chunked_ms / floor_ms:.2f}x floor) ms fwd+bwd", flush=True)
    common.write_json(common.results_path("block_diagonal.json", args.out),
                      dict(gpu=common.gpu_name(), tokens=TOKENS, versions=common.versions(), dx_route="transposed",
                           table=args.table,
                           cases=CASE_NOTES, results=rows))


if __name__ == "__main__":
    main()
