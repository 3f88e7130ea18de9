"""What the feed-forward epilogues cost: one FFN-sized product with and without the work ``sparse_mlp`` fuses.

In one process, on ``x [T, K] @ W [K, N]`` (BERT-large's FFN: 16384 tokens, 1024 x 4096; a 2:4 weight, which is also
what the 64:2:8 forward's 2:4 view and the transposed dX route run):

* ``xla dense``: XLA's bf16 product, for scale;
* ``act_mode 0``: the sparse product with bias (what every other layer runs);
* ``act_mode 1``: the product's epilogue writes act(z) and act'(z) (``calls.spmm(..., with_derivative=True)``);
  against it ``unfused 1``: the product with bias, then XLA's pass computing both;
* ``unfused 2``: the product, then XLA's multiply by a scale (what ``sparse_mlp``'s backward runs). Session 22 also
  timed an epilogue that multiplied (act_mode 2, since removed): 0.314 ms against this row's 0.310
  (``results/<gpu>/session22/ffn_epilogue_with_act_mode_2.json``).

Each row: median ms (``common.time_jax``), the floor of its bytes and products (HBM 3.0 TB/s, 2:4 at twice the
dense 790 TFLOP/s) and time over floor. Writes ``benchmarks/results/<gpu>/ffn_epilogue.json``.

  python3 benchmarks/ffn_epilogue.py
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
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    common.import_jaxsparse_from_install_or_checkout()
    import jaxsparse.ffi as jffi
    from jaxsparse import format as F
    from jaxsparse import reference
    from jaxsparse.ffi import calls

    if jax.default_backend() != "gpu" or not jffi.available():
        print("ffn_epilogue.py needs a GPU and the built jaxsparse CUDA extension")
        return 1

    t, k, n, act = a.tokens, a.k, a.n, a.activation
    keys = jax.random.split(jax.random.PRNGKey(0), 8)
    dt = jnp.bfloat16
    w = (jax.random.normal(keys[0], (k, n), jnp.float32) / k ** 0.5).astype(dt)
    sw = F.compress(w, F.select_mask(w, "2:4"), "2:4")
    bias = jax.random.normal(keys[1], (n,), jnp.float32).astype(dt)
    sets = [(jax.random.normal(keys[2 + i], (t, k), jnp.float32).astype(dt),
             jax.random.uniform(keys[4 + i], (t, n), jnp.float32).astype(dt)) for i in range(2)]

    cases = {
        "xla dense": (jax.jit(lambda x, s: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(dt)), 1, 0),
        "act_mode 0": (jax.jit(lambda x, s: calls.spmm(x, sw, bias)), 1, 0),
        "act_mode 1": (jax.jit(lambda x, s: calls.spmm(x, sw, bias, act, with_derivative=True)), 2, 0),
        "unfused 1": (jax.jit(lambda x, s: reference.activation_with_derivative(act, calls.spmm(x, sw, bias))), 2, 0),
        "unfused 2": (jax.jit(lambda x, s: (calls.spmm(x, sw).astype(jnp.float32) * s).astype(dt)), 1, 1),
    }
    rows = []
    for name, (fn, outputs, extra_inputs) in cases.items():
        ms = common.time_jax(fn, sets)
        dense = name == "xla dense"
        floor = common.spmm_floor_ms(t, k, n, None if dense else 4)
        extra_bytes = (outputs - 1 + extra_inputs) * t * n * 2  # a second output, or the scale read
        mem = floor["memory_ms"] + 1e3 * extra_bytes / (common.HBM_TBPS * 1e12)
        floor_ms = max(floor["compute_ms"], mem)
        rows.append({"case": name, "ms": round(ms, 4), "floor_ms": round(floor_ms, 4),
                     "over_floor": round(ms / floor_ms, 2), "extra_bytes": extra_bytes})
    by = {r["case"]: r["ms"] for r in rows}
    for r in rows:
        r["vs_act_mode_0_ms"] = round(r["ms"] - by["act_mode 0"], 4)
    print(common.table(rows, ["case", "ms", "floor_ms", "over_floor", "vs_act_mode_0_ms"]))
    path = common.results_path("ffn_epilogue.json", a.out)
    common.write_json(path, {"benchmark": "ffn_epilogue", "gpu": common.gpu_name(), "versions": common.versions(),
                             "tokens": t, "k": k, "n": n, "spec": "2:4", "activation": act,
                             "timing": "common.time_jax: median of 15 x 20 calls after 5 warm-up calls",
                             "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
