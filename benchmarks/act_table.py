"""The feed-forward epilogue with its activation looked up (cuda/act_table.cuh) against computed in float32.

A feed-forward block's first product writes act(z) and act'(z) from its epilogue (``with_derivative``: act_mode 1,
[T, F] twice; act_mode 2 with ``h^T``, the 128:2:16 step's). Times that product at BERT-large's FFN in (1024 -> 4096)
and, for scale, the Q/K/V shape (1024 -> 1024), 16384 tokens, on the route each spec takes in the step (2:4 and 64:2:8:
x rows, the TMA row kernel; 128:2:16 and 128:2:32: x^T, auto tile), in one process:

- ``plain``: the product with its bias only (one [T, F] output: the bytes' floor of the others is this plus F
  columns more of stores);
- ``relu``: act_mode 1 with ReLU: the same stores as GELU, next to no math;
- ``gelu_erf, formula``: act_mode 1 (or 2) with the exact GELU computed in float32 (``JAXSPARSE_ACT_TABLE=off``);
- ``gelu_erf, table``: the same with the table (the default).

Median of ``common.time_jax``; the memory floor is the product's inputs and outputs at ``common.HBM_TBPS``. Writes
``benchmarks/results/<gpu>/act_table.json``.

  python3 benchmarks/act_table.py [--specs 2:4,64:2:8,128:2:16,128:2:32]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

import common  # noqa: E402

SHAPES = {"ffn_in": (1024, 4096), "qkvo": (1024, 1024)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", default="2:4,64:2:8,128:2:16,128:2:32")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    from jaxsparse import format as F
    from jaxsparse.ffi import calls

    if common.missing_gpu_extension("act_table.py"):
        return 1
    t = a.tokens
    rows = []
    for spec in a.specs.split(","):
        for shape, (k, n) in SHAPES.items():
            xs, _, w, bias = common.layer_operands(t, k, n)
            sw = F.compress(w, F.select_mask(w, spec, transposable=True), spec)
            col = calls.spmm_x_layout(t, sw, shares_xt=True) == "col"
            args = [(calls.transpose(x),) for x in xs] if col else [(x,) for x in xs]  # x^T as the layer keeps it
            floor_plain = 1e3 * (t * k + t * n) * 2 / (common.HBM_TBPS * 1e12)
            floor_pair = 1e3 * (t * k + 2 * t * n) * 2 / (common.HBM_TBPS * 1e12)
            # (name, activation, with_derivative, JAXSPARSE_ACT_TABLE, memory floor)
            cases = [("plain", None, False, "on", floor_plain), ("relu", "relu", True, "on", floor_pair),
                     ("gelu_erf, formula", "gelu_erf", True, "off", floor_pair),
                     ("gelu_erf, table", "gelu_erf", True, "on", floor_pair)]
            times = {}
            for name, act, deriv, table, floor in cases:
                modes = [False, True] if (deriv and col) else [False]
                for transposed in modes:
                    if col:  # the layer's x^T route; act_mode 2 where h^T is handed over
                        fn = lambda xt, act=act, deriv=deriv, tr=transposed: calls.spmm_from_xt(
                            xt, sw, bias, act, with_derivative=deriv, transpose_out=tr)
                    else:
                        fn = lambda x, act=act, deriv=deriv: calls.spmm(x, sw, bias, act, with_derivative=deriv)
                    ms = common.time_jax(jax.jit(common.with_env(fn, JAXSPARSE_ACT_TABLE=table)), args)
                    mode = "act 2" if transposed else ("act 1" if deriv else "plain")
                    times[(name, mode)] = ms
                    rows.append(dict(spec=spec, shape=shape, k=k, n=n, route="x^T" if col else "x rows", case=name,
                                     mode=mode, ms=round(ms, 4), floor_ms=round(floor, 4),
                                     over_floor=round(ms / floor, 2)))
                    print(f"{spec:9s} {shape:7s} {mode:6s} {name:18s} {ms:8.4f} ms  ({ms / floor:4.2f}x floor)",
                          flush=True)
            for mode in ("act 1", "act 2"):
                if ("gelu_erf, table", mode) in times:
                    ratio = times[("gelu_erf, formula", mode)] / times[("gelu_erf, table", mode)]
                    rows.append(dict(spec=spec, shape=shape, mode=mode, case="formula / table", ratio=round(ratio, 3)))
                    print(f"{spec:9s} {shape:7s} {mode:6s} formula / table: {ratio:.3f}x", flush=True)
    out = common.results_path("act_table.json", a.out)
    common.write_json(out, dict(benchmark="act_table", gpu=common.gpu_name(), versions=common.versions(), tokens=t,
                                hbm_tbps=common.HBM_TBPS, timing="common.time_jax: median of 15 x 20 calls after 5 "
                                "warm-up calls; the x^T route from x^T made beforehand", rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
