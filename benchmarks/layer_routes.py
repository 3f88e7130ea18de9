"""The numbers behind the auto layer route of a V:2:M weight (``calls.TMA_ROW_AUTO_M``): one sparse linear layer's
forward + backward (``jax.vjp`` under one ``jit``) against XLA's dense layer, on the default route and on the x^T
route (``JAXSPARSE_SPMM_X=col``: one ``jaxsparse_transpose`` feeds the x^T forward and the x^T SDDMM), 16384
tokens, BERT-large's FFN shapes, median of timed repetitions after warm-up.

  python3 benchmarks/layer_routes.py     # writes benchmarks/results/<gpu>/layer_routes.json
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

import common  # noqa: E402
from jaxsparse import format as F  # noqa: E402

TOKENS = 16384
SHAPES = [(1024, 4096), (4096, 1024)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--specs", default="2:4,64:2:8,128:2:16")
    ap.add_argument("--out", default=None, help="json path (default benchmarks/results/<gpu>/layer_routes.json)")
    args = ap.parse_args()
    rows = []
    for k, n in SHAPES:
        xs, dys, w, b = common.layer_operands(TOKENS, k, n)
        dense_ms = common.time_jax(jax.jit(common.dense_vjp), [(x, dy, w, b) for x, dy in zip(xs, dys)])
        rows.append(dict(K=k, N=n, case="dense XLA", ms=dense_ms, speedup=1.0))
        for spec in [s for s in args.specs.split(",") if s]:
            sw = F.compress(w, F.select_mask(w, spec), spec)
            sparse = lambda x, dy, sw, b: common.sparse_vjp(x, dy, sw.values, b, sw)
            cases = [("default route", jax.jit(sparse))]
            if F.VNM.parse(spec).m > 4:
                cases.append(("x^T route", jax.jit(common.with_env(sparse, JAXSPARSE_SPMM_X="col"))))
            for name, fn in cases:
                ms = common.time_jax(fn, [(x, dy, sw, b) for x, dy in zip(xs, dys)])
                rows.append(dict(K=k, N=n, spec=spec, case=name, ms=ms, speedup=dense_ms / ms))
                print(f'{k:>5} {n:>5} {spec:>9} {name:>14} fwd+bwd {ms:.4f} ms {dense_ms / ms:.2f}x', flush=True)
    common.write_json(common.results_path("layer_routes.json", args.out), dict(gpu=common.gpu_name(), tokens=TOKENS, versions=common.versions(), results=rows))


if __name__ == "__main__":
    main()
