"""What the feed-forward epilogues cost: one FFN-sized product with and without the work ``sparse_mlp`` fuses.

In one process, on ``x [T, K] @ W [K, N]`` (BERT-large's FFN: 16384 tokens, 1024 x 4096; a 2:4 weight, which is also
what the 64:2:8 forward's 2:4 view and the transposed dX route run):

* ``xla dense``: XLA's bf16 product, for scale;
* ``act_mode 0``: the sparse product with bias (what every other layer runs);
* ``act_mode 1``: the product's epilogue writes act(z) and act'(z) (``calls.spmm(..., with_derivative=True)``);
  against it ``unfused 1``: the product with bias, then XLA's pass computing both;
* ``unfused 2``: the product, then XLA's multiply by a scale (what ``sparse_mlp``'s backward runs). Session 22 also
  timed an epilogue that multiplied (an act_mode 2 of its own, since removed): 0.314 ms against this row's 0.310
  (``results/<gpu>/session22/ffn_epilogue_with_act_mode_2.json``).

With ``--spec`` a V:2:M weight on the x^T route (Hopper, M >= 16; session 28), from x^T as the layer keeps it:

* ``xt act_mode 1 + transpose``: act(z) and act'(z), then ``jaxsparse_transpose`` of act(z) (what the block's second
  layer read before session 28);
* ``xt act_mode 2``: act(z)^T from the epilogue and act'(z) (``spmm_from_xt(..., transpose_out=True)``).

And the whole block ``act(x W1 + b1) W2 + b2`` (W2 [N, K]), value and gradient in every input: ``block xla dense``,
``block h row`` / ``block h col`` (``sparse_mlp`` with ``JAXSPARSE_MLP_HIDDEN`` row / col, transposable masks and
the transposed dX route, as the step runs them); their floor is the three products of both layers each at its own
floor (``common.spmm_floor_ms``).

Each row: median ms (``common.time_jax``), the floor of its bytes and products (HBM 3.0 TB/s, 2:4 at twice the
dense 790 TFLOP/s) and time over floor. Writes ``benchmarks/results/<gpu>/ffn_epilogue.json``.

  python3 benchmarks/ffn_epilogue.py [--spec 128:2:16]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import common  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--activation", default="gelu_erf")
    ap.add_argument("--spec", default="2:4", help="the weight's sparsity (default 2:4)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    common.import_jaxsparse_from_install_or_checkout()
    from jaxsparse import format as F
    from jaxsparse import reference
    from jaxsparse.ffi import calls

    if common.missing_gpu_extension("ffn_epilogue.py"):
        return 1

    t, k, n, act = a.tokens, a.k, a.n, a.activation
    spec = F.VNM.parse(a.spec)
    m = spec.m
    keys = jax.random.split(jax.random.PRNGKey(0), 12)
    dt = jnp.bfloat16

    def weight(key, rows, cols):
        w = (jax.random.normal(key, (rows, cols), jnp.float32) / rows ** 0.5).astype(dt)
        return w, F.compress(w, F.select_mask(w, a.spec, transposable=True), a.spec)

    w, sw = weight(keys[0], k, n)
    w2, sw2 = weight(keys[8], n, k)
    bias = jax.random.normal(keys[1], (n,), jnp.float32).astype(dt)
    bias2 = jax.random.normal(keys[9], (k,), jnp.float32).astype(dt)
    sets = [(jax.random.normal(keys[2 + i], (t, k), jnp.float32).astype(dt),
             jax.random.uniform(keys[4 + i], (t, n), jnp.float32).astype(dt)) for i in range(2)]

    cases = {
        "xla dense": (jax.jit(lambda x, s: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(dt)), 1, 0),
        "act_mode 0": (jax.jit(lambda x, s: calls.spmm(x, sw, bias)), 1, 0),
        "act_mode 1": (jax.jit(lambda x, s: calls.spmm(x, sw, bias, act, with_derivative=True)), 2, 0),
        "unfused 1": (jax.jit(lambda x, s: reference.activation_with_derivative(act, calls.spmm(x, sw, bias))), 2, 0),
        "unfused 2": (jax.jit(lambda x, s: (calls.spmm(x, sw).astype(jnp.float32) * s).astype(dt)), 1, 1),
    }
    xt_route = calls.spmm_x_layout(t, sw) == "col"
    if xt_route:  # from x^T as the layer keeps it (the sets' x transposed once, outside the timing)
        def act_mode_1_then_transpose(xt, s):
            h, d = calls.spmm_from_xt(xt, sw, bias, act, with_derivative=True)
            return calls.transpose(h), d

        cases["xt act_mode 1 + transpose"] = (jax.jit(act_mode_1_then_transpose), 3, 0)
        cases["xt act_mode 2"] = (jax.jit(lambda xt, s: calls.spmm_from_xt(
            xt, sw, bias, act, with_derivative=True, transpose_out=True)), 2, 0)
    xt_sets = [(calls.transpose(x), s) for x, s in sets] if xt_route else None
    rows = []
    for name, (fn, outputs, extra_inputs) in cases.items():
        ms = common.time_jax(fn, xt_sets if name.startswith("xt ") else sets)
        dense = name == "xla dense"
        floor = common.spmm_floor_ms(t, k, n, None if dense else m, spec.v)
        extra_bytes = (outputs - 1 + extra_inputs) * t * n * 2  # a second output, or the scale read
        mem = floor["memory_ms"] + 1e3 * extra_bytes / (common.HBM_TBPS * 1e12)
        floor_ms = max(floor["compute_ms"], mem)
        rows.append({"case": name, "ms": round(ms, 4), "floor_ms": round(floor_ms, 4),
                     "over_floor": round(ms / floor_ms, 2), "extra_bytes": extra_bytes})
    rows += _block_rows(a, w, bias, w2, bias2, sw, sw2, sets, m, spec.v)
    by = {r["case"]: r["ms"] for r in rows}
    for r in rows:
        r["vs_act_mode_0_ms"] = None if r["case"].startswith("block") else round(r["ms"] - by["act_mode 0"], 4)
    print(common.table(rows, ["case", "ms", "floor_ms", "over_floor", "vs_act_mode_0_ms"]))
    path = common.results_path("ffn_epilogue.json", a.out)
    common.write_json(path, {"benchmark": "ffn_epilogue", "gpu": common.gpu_name(), "versions": common.versions(),
                             "tokens": t, "k": k, "n": n, "spec": a.spec, "activation": act,
                             "timing": "common.time_jax: median of 15 x 20 calls after 5 warm-up calls",
                             "rows": rows})
    return 0


def _block_rows(a, w, bias, w2, bias2, sw, sw2, sets, m: int, v: int) -> list[dict]:
    """The whole feed-forward block, value and gradient: XLA dense, then ``sparse_mlp`` with each hidden hand-over
    its layers can take (``ops.mlp_hidden_layout``; the transposed dX route)."""
    from jaxsparse import ops, reference

    t, k, n, act = a.tokens, a.k, a.n, a.activation
    fn_act = reference.ACTIVATIONS[act]

    def dense_loss(x, g, w, b, w2, b2):  # as bf16 nn.Dense runs it: every product, forward and backward, in bf16
        h = fn_act(jnp.dot(x, w) + b)
        y = jnp.dot(h, w2) + b2
        return jnp.sum(y.astype(jnp.float32) * g)

    def sparse_loss(x, g, v1, b, v2, b2):
        y = ops.sparse_mlp(x, sw.replace(values=v1), b, sw2.replace(values=v2), b2, act)
        return jnp.sum(y.astype(jnp.float32) * g)

    gkeys = jax.random.split(jax.random.PRNGKey(1), len(sets))
    grad_sets = [(x, jax.random.normal(gk, (t, k), jnp.float32)) for (x, _), gk in zip(sets, gkeys)]  # g: y's weights
    cases = {"block xla dense": (dense_loss, (w, bias, w2, bias2), None)}
    for hidden in ("row", "col"):
        if hidden == "row" or ops.mlp_hidden_layout(t, sw, sw2, "auto") == "col":
            cases[f"block h {hidden}"] = (sparse_loss, (sw.values, bias, sw2.values, bias2), hidden)
    rows = []
    floor_dense = 3 * sum(common.spmm_floor_ms(t, *kn, None)["floor_ms"] for kn in ((k, n), (n, k)))
    floor_sparse = 3 * sum(common.spmm_floor_ms(t, *kn, m, v)["floor_ms"] for kn in ((k, n), (n, k)))
    for name, (loss, params, hidden) in cases.items():
        vg = jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3, 4, 5)))
        run = lambda x, g, vg=vg, params=params: vg(x, g, *params)
        # the routes are read when the block is traced: trace here
        with ops.dx_route_scope("transposed"), ops.mlp_hidden_scope(hidden):
            jax.block_until_ready(run(*grad_sets[0]))
        ms = common.time_jax(run, grad_sets)
        floor_ms = floor_dense if hidden is None else floor_sparse
        rows.append({"case": name, "ms": round(ms, 4), "floor_ms": round(floor_ms, 4),
                     "over_floor": round(ms / floor_ms, 2), "extra_bytes": 0})
    return rows


if __name__ == "__main__":
    sys.exit(main())
