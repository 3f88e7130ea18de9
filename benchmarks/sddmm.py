"""The weight-gradient SDDMM alone (``ops.sddmm``: the tma engine on x rows at 2:4 and on the 2:4 view of 64:2:8,
the x^T engine where the layer takes it) against XLA's dense dW product ``x^T dy`` and XLA's bias gradient, in one
process, 16384 tokens, BERT-large shapes; median of timed repetitions after warm-up. For M >= 8 it also times the
x^T engine with x^T given (``calls.sddmm_from_xt``: the condensed product, no transpose in the timing), the
bound on any route that hands that engine x^T without a transpose kernel, and the transpose kernel alone
(``calls.transpose``, what the x^T route adds) with its rate in TB/s (x read once, x^T written once).

  python3 benchmarks/sddmm.py     # writes benchmarks/results/<gpu>/sddmm.json
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
from jaxsparse.ffi import calls  # noqa: E402

TOKENS = 16384
SHAPES = [(1024, 4096), (4096, 1024), (1024, 1024)]


def dense_dw(x, dy):
    """XLA's dense weight gradient ``x^T dy`` (float32 accumulation, bf16 out)."""
    return jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32).astype(x.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--specs", default="2:4,64:2:8,128:2:16")
    ap.add_argument("--out", default=None, help="json path (default benchmarks/results/<gpu>/sddmm.json)")
    args = ap.parse_args()
    rows = []
    for k, n in SHAPES:
        xs, dys, w, _ = common.layer_operands(TOKENS, k, n)
        dense_ms = common.time_jax(jax.jit(dense_dw), list(zip(xs, dys)))
        db_ms = common.time_jax(jax.jit(lambda dy: jnp.sum(dy, axis=0, dtype=jnp.float32)), [(d,) for d in dys])
        rows.append(dict(K=k, N=n, case="dense dW (XLA)", ms=dense_ms, speedup=1.0))
        rows.append(dict(K=k, N=n, case="bias gradient (XLA reduce, alone)", ms=db_ms))
        tr_ms = common.time_jax(jax.jit(calls.transpose), [(x,) for x in xs])
        tbs = 2 * xs[0].size * xs[0].dtype.itemsize / (tr_ms * 1e-3) / 1e12
        rows.append(dict(K=k, N=n, case="transpose x (jaxsparse_transpose, alone)", ms=tr_ms, tb_per_s=tbs))
        print(f"{k:>5} {n:>5} transpose x {tr_ms:.4f} ms ({tbs:.2f} TB/s)", flush=True)
        print(f"{k:>5} {n:>5} dense dW {dense_ms:.4f} ms   bias gradient alone {db_ms:.4f} ms", flush=True)
        specs = [s for s in args.specs.split(",") if s]
        # x^T for the x^T-given rows, made once per shape (XLA's transpose, outside every timing).
        xts = [jnp.asarray(x.T) for x in xs] if any(F.VNM.parse(s).m >= 8 for s in specs) else []
        for spec in specs:
            sw = F.compress(w, F.select_mask(w, spec), spec)
            ms = common.time_jax(jax.jit(lambda x, dy, sw: ops.sddmm(x, dy, sw)),
                                 [(x, dy, sw) for x, dy in zip(xs, dys)])
            rows.append(dict(K=k, N=n, spec=spec, case="sddmm", ms=ms, speedup=dense_ms / ms))
            print(f"{k:>5} {n:>5} {spec:>9} sddmm {ms:.4f} ms {dense_ms / ms:.2f}x", flush=True)
            if F.VNM.parse(spec).m >= 8:
                ms = common.time_jax(jax.jit(lambda xt, dy, sw: calls.sddmm_from_xt(xt, dy, sw)),
                                     [(xt, dy, sw) for xt, dy in zip(xts, dys)])
                rows.append(dict(K=k, N=n, spec=spec, case="sddmm from x^T given", ms=ms, speedup=dense_ms / ms))
                print(f"{k:>5} {n:>5} {spec:>9} sddmm from x^T given {ms:.4f} ms {dense_ms / ms:.2f}x", flush=True)
    common.write_json(common.results_path("sddmm.json", args.out), dict(gpu=common.gpu_name(), tokens=TOKENS, versions=common.versions(), results=rows))


if __name__ == "__main__":
    main()
