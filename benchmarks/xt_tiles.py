"""The x^T SpMM's tiles side by side on BERT-large's layer shapes: which tile each use of the product runs fastest on.

For each spec and layer shape (16384 tokens; Q/K/V/attention-out 1024 -> 1024, FFN in 1024 -> 4096, FFN out
4096 -> 1024), times ``calls.spmm_from_xt`` from x^T as the layer keeps it, in the three epilogue modes the step
runs (``plain``: bias only; ``act 1``: act(z) and act'(z); ``act 2``: act(z)^T and act'(z), the FFN's first product
since session 28), on every tile that takes it (``calls.SPMM_XT_TILES``; the warp-specialized ones do not take
act_mode 2), and XLA's dense product for scale. Median of ``common.time_jax``; one process, so the rows compare.
Writes ``benchmarks/results/<gpu>/xt_tiles.json``.

  python3 benchmarks/xt_tiles.py [--specs 128:2:16,128:2:32] [--tiles auto,128x128,128x256] [--modes "plain,act 1"]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import common  # noqa: E402

SHAPES = {"qkvo": (1024, 1024), "ffn_in": (1024, 4096), "ffn_out": (4096, 1024)}
MODES = {"plain": {}, "act 1": {"with_derivative": True}, "act 2": {"with_derivative": True, "transpose_out": True}}


def main(argv=None) -> int:
    from jaxsparse import format as F
    from jaxsparse.ffi import calls

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", default="128:2:16,128:2:32")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--tiles", default=",".join(calls.SPMM_XT_TILES), help="comma-separated tile names (default: all)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated epilogue modes (default: all)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    tiles, modes = a.tiles.split(","), a.modes.split(",")
    for name, chosen, known in (("tile", tiles, calls.SPMM_XT_TILES), ("mode", modes, MODES)):
        if unknown := [c for c in chosen if c not in known]:
            ap.error(f"unknown {name}(s) {unknown}; choose from {list(known)}")
    if common.missing_gpu_extension("xt_tiles.py"):
        return 1
    dt, t = jnp.bfloat16, a.tokens  # common.layer_operands' dtype
    rows = []
    for spec in a.specs.split(","):
        for shape, (k, n) in SHAPES.items():
            xs, _, w, bias = common.layer_operands(t, k, n)
            sw = F.compress(w, F.select_mask(w, spec, transposable=True), spec)
            xts = [(calls.transpose(x),) for x in xs]
            xs = [(x,) for x in xs]
            dense = common.time_jax(jax.jit(lambda x: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(dt)),
                                    xs)
            rows.append(dict(spec=spec, shape=shape, k=k, n=n, mode="xla dense", tile="-", ms=round(dense, 4)))
            for mode in modes:
                kw = MODES[mode]
                act = "gelu_erf" if kw else None
                for tile in tiles:
                    if kw.get("transpose_out") and calls.transpose_out_problem(tile):
                        continue
                    fn = jax.jit(lambda xt, tile=tile, kw=kw, act=act: calls.spmm_from_xt(xt, sw, bias, act, tile=tile,
                                                                                          **kw))
                    try:
                        ms = round(common.time_jax(fn, xts), 4)
                    except Exception as e:  # a tile the shape cannot take: recorded, not fatal
                        ms, err = None, str(e).splitlines()[0][:120]
                    else:
                        err = ""
                    rows.append(dict(spec=spec, shape=shape, k=k, n=n, mode=mode, tile=tile, ms=ms, err=err))
                    print(f"{spec:9s} {shape:8s} {mode:6s} {tile:10s} {ms if ms is not None else err}", flush=True)
    out = common.results_path("xt_tiles.json", a.out)
    common.write_json(out, dict(benchmark="xt_tiles", gpu=common.gpu_name(), versions=common.versions(), tokens=t,
                                timing="common.time_jax: median of 15 x 20 calls after 5 warm-up calls", rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
