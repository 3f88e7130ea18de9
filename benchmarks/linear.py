"""One sparse linear layer against the dense layer in XLA: forward, dW, dX, and forward+backward.

One process; the shapes of ``benchmarks/spmm.py`` (tokens 4096 and 16384; K x N in 768x768, 768x3072,
3072x768, 1024x1024, 1024x4096, 4096x1024), bf16, with a bias. Products, for ``y = x @ W + b``:

* ``fwd``: y (jaxsparse: ``calls.spmm``'s default route: on Hopper ``jaxsparse_transpose`` + ``jaxsparse_spmm_xt``,
  elsewhere ``jaxsparse_spmm``; dense: ``x @ w + b``); ``fwd x row-major``, ``fwd x col-major`` and
  ``fwd x^T given <tile>`` time the two routes and the x^T kernel alone at each tile;
* ``dW``: the weight gradient (jaxsparse: ``jaxsparse_sddmm`` into the compressed values; dense: ``x^T dy``);
* ``dX``: the input gradient (jaxsparse: ``jaxsparse_spmm_t``; dense: ``dy @ w^T``);
* ``fwd+bwd``: ``jax.vjp`` of the whole layer (y, dx, dW, db) under one ``jit``, on the routes the ops
  take by default (``ops.dx_route``, ``calls.sddmm_split``; set ``JAXSPARSE_DX`` / ``JAXSPARSE_SDDMM_SPLIT``
  to time others);
* ``dW mma.sync engine``, ``dW split=none`` and ``dX dense route``: the alternatives, timed beside the
  defaults (the SDDMM's portable engine and its one-pass grid; XLA's dense product over the decompressed
  weight);
* ``dX condensed`` and ``fwd+bwd condensed dX`` (M = 16, Hopper): ``jaxsparse_spmm_t_condensed``
  (``JAXSPARSE_DX=condensed``), its operands built by XLA in the call;
* ``dX transposed route``, ``dX transposed, W^T given`` and ``fwd+bwd transposed dX``: the
  ``JAXSPARSE_DX=transposed`` route on a weight whose mask was chosen transposable
  (``select_mask(..., transposable=True)``): dX as the 2:4 forward kernel on ``W^T`` with ``W^T`` built in the
  call (``ops.transpose_2_4``), then with ``W^T`` given, then the whole layer;
* ``dX blocks route`` and ``fwd+bwd blocks dX`` (M > 4): the ``JAXSPARSE_DX=blocks`` route (XLA: every V block's
  product over its kept columns as one batched product, then gathered terms per column) on a weight whose mask was
  chosen column-exclusive (``select_mask(..., exclusive_columns=True)``);
* ``... 2:4 view`` (V:2:M on Hopper): the forward, the SDDMM and the whole layer on the kernels that read
  ``x [T, K]`` as it is, with the weight as its 2:4 view (``jaxsparse.format.as_2_4``): no transpose.

Roofline floor per product (``floor_ms``; constants in ``benchmarks/common.py``): the larger of the
useful MMA work and the HBM traffic. Useful work is ``2*T*K*N`` at the dense rate for dense, and
``2*T*N*(2K/M)`` (the kept products) at the dense rate for sparse, which is the same as ``4/M`` of dense
at the sparse-tensor-core rate (the forward's floor in ``spmm.py``). Traffic: the two operands read and
the result written once (compressed weights with their metadata and column words). ``fwd+bwd`` sums the
three floors. Each row records ``compute_ms`` and ``memory_ms`` too.

Writes ``benchmarks/results/<gpu>/linear.json`` (and ``$OUT/linear.json`` when set).

  python3 benchmarks/linear.py            # all shapes
  python3 benchmarks/linear.py --quick    # 16384 tokens, three BERT-large shapes
  python3 benchmarks/linear.py --quick --only transpos   # and only the transposed-route alternatives
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402
from common import QUICK_SHAPES, QUICK_TOKENS, SHAPES, SPECS, TOKENS, dense_vjp, sparse_vjp, with_env  # noqa: E402
from jaxsparse import format as F  # noqa: E402

PRODUCTS = ("fwd", "dW", "dX", "fwd+bwd")


def floors(product: str, tokens: int, k: int, n: int, m: int | None, v: int = 1, itemsize: int = 2) -> dict:
    """Roofline of one product of the layer (see the module docstring); ``m`` None is dense."""
    if product == "fwd+bwd":
        parts = [floors(p, tokens, k, n, m, v, itemsize) for p in ("fwd", "dW", "dX")]
        out = {key: sum(p[key] for p in parts) for key in ("floor_ms", "compute_ms", "memory_ms")}
        out["bound"] = "/".join(p["bound"] for p in parts)
        return out
    act_in = tokens * k * itemsize  # x or dx
    act_out = tokens * n * itemsize  # y or dy
    if m is None:
        flops = 2.0 * tokens * k * n
        w_bytes = k * n * itemsize
    else:
        flops = 2.0 * tokens * n * (2 * k // m)
        g = k // m
        w_bytes = n * 2 * g * itemsize + n * (g // 8) * 4 + (0 if m == 4 else (n // v) * g * 4)
    io = act_in + act_out + w_bytes  # fwd: x, W in, y out; dW: x, dy in, W out; dX: dy, W in, dx out
    compute_ms = 1e3 * flops / (common.DENSE_TFLOPS * 1e12)
    memory_ms = 1e3 * io / (common.HBM_TBPS * 1e12)
    return {
        "floor_ms": max(compute_ms, memory_ms),
        "compute_ms": compute_ms,
        "memory_ms": memory_ms,
        "bound": "compute" if compute_ms >= memory_ms else "memory",
    }


def _rel(a: jax.Array, ref: jax.Array) -> float:
    a = a.astype(jnp.float32)
    if not bool(jnp.isfinite(a).all()):
        return float("nan")
    return float(jnp.linalg.norm(a - ref) / jnp.linalg.norm(ref))


def _err(product: str, fn, args: tuple, refs: dict) -> float:
    """Relative error of ``fn(*args)`` against the float32 reference of its product (dW whole, fwd and dX
    on the first 512 tokens)."""
    out = fn(*args)
    if product == "fwd+bwd":  # (y, (dx, dvalues, dbias)) of the layer's vjp: the worst of its three products
        y, (dx, dvalues, _) = out
        return max(_rel(y[:512], refs["fwd"]), _rel(dvalues, refs["dW"]), _rel(dx[:512], refs["dX"]))
    return _rel(out if product == "dW" else out[:512], refs[product])


def _row(base: dict, product: str, impl: str, ms: float, dense_ms: float, fl: dict, err: str) -> dict:
    """One result row: the time, its speedup over the dense product, and the product's roofline floor."""
    return dict(base, product=product, impl=impl, ms=round(ms, 4), speedup=round(dense_ms / ms, 2),
                floor_ms=round(fl["floor_ms"], 4), compute_ms=round(fl["compute_ms"], 4),
                memory_ms=round(fl["memory_ms"], 4), over_floor=round(ms / fl["floor_ms"], 2), bound=fl["bound"],
                err=err)


def _references(x0, dy0, b, sw: F.SparseWeight, hi) -> tuple[dict, jax.Array]:
    """Float32 references of the layer's products on one input set (fwd and dX on its first 512 tokens, dW whole,
    at ``sw``'s kept positions), and ``sw`` decompressed in float32."""
    wd = F.decompress(sw).astype(jnp.float32)
    refs = {"fwd": jnp.dot(x0[:512].astype(jnp.float32), wd, precision=hi) + b.astype(jnp.float32),
            "dW": F.compress_like(jnp.dot(x0.astype(jnp.float32).T, dy0.astype(jnp.float32), precision=hi), sw),
            "dX": jnp.dot(dy0[:512].astype(jnp.float32), wd.T, precision=hi)}
    return refs, wd


def _transposed_runs(w, x0, dy0, b, spec, select_t, hi) -> tuple[list, F.SparseWeight, F.SparseWeight]:
    """The transposed dX route (``JAXSPARSE_DX=transposed``) on a weight with a transposable mask: dX with ``W^T``
    built every call (``ops.transpose_2_4``, then the 2:4 forward kernel on it: the route as the layer runs it), dX
    with ``W^T`` given (the forward kernel alone; the difference is the build's device time, which a call of the
    build alone cannot show: that is bound by the host's dispatch, 0.045-0.126 ms in session 20), and the whole
    layer. Returns ``(label, product, fn, err, weight)`` rows (``weight`` is what ``fn`` takes in ``sw``'s place)
    and the weight with the transposable mask."""
    from jaxsparse import ops

    sw_t = F.compress(w, select_t(w, spec), spec)
    wt = jax.jit(ops.transpose_2_4)(sw_t)
    refs, wd = _references(x0, dy0, b, sw_t, hi)
    if not bool((F.decompress(wt).astype(jnp.float32) == wd.T).all()):
        raise SystemExit(f"ops.transpose_2_4 is not W^T at {spec} {w.shape}")
    dx = jax.jit(lambda x, dy, sw, b: ops._transposed_dx(dy, sw))
    dx_given = jax.jit(lambda x, dy, swt, b: ops.spmm(dy, swt))
    layer = jax.jit(with_env(lambda x, dy, sw, b: sparse_vjp(x, dy, sw.values, b, sw), JAXSPARSE_DX="transposed"))
    err = lambda prod, fn, weight: f"{_err(prod, fn, (x0, dy0, weight, b), refs):.1e}"
    return [("dX transposed route", "dX", dx, err("dX", dx, sw_t), sw_t),
            ("dX transposed, W^T given", "dX", dx_given, err("dX", dx_given, wt), wt),
            ("fwd+bwd transposed dX", "fwd+bwd", layer, err("fwd+bwd", layer, sw_t), sw_t)], sw_t, wt


def _blocks_runs(w, x0, dy0, b, spec, hi) -> tuple[list, F.SparseWeight]:
    """The ``JAXSPARSE_DX=blocks`` route on a weight whose mask was chosen column-exclusive
    (``select_mask(..., exclusive_columns=True)``, M > 4): dX alone and the whole layer, as ``_transposed_runs``."""
    from jaxsparse import ops

    sw_e = F.compress(w, jax.jit(lambda w: F.select_mask(w, spec, exclusive_columns=True))(w), spec)
    refs, _ = _references(x0, dy0, b, sw_e, hi)
    dx = jax.jit(lambda x, dy, sw, b: ops._block_dx(dy, sw))
    layer = jax.jit(with_env(lambda x, dy, sw, b: sparse_vjp(x, dy, sw.values, b, sw), JAXSPARSE_DX="blocks"))
    err = lambda prod, fn: f"{_err(prod, fn, (x0, dy0, sw_e, b), refs):.1e}"  # noqa: E731
    return [("dX blocks route", "dX", dx, err("dX", dx), sw_e),
            ("fwd+bwd blocks dX", "fwd+bwd", layer, err("fwd+bwd", layer), sw_e)], sw_e


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="16384 tokens, three BERT-large shapes")
    ap.add_argument("--specs", default=",".join(SPECS), help="comma-separated sparse specs")
    ap.add_argument("--out", default=None, help="json path (default benchmarks/results/<gpu>/linear.json)")
    ap.add_argument("--only", default="", help="comma-separated substrings: time only the alternative rows whose "
                                               "label holds one (the four default products always run)")
    args = ap.parse_args()

    import jaxsparse.ffi as jffi

    if not jffi.available():
        raise SystemExit(jffi.unavailable_reason())
    from jaxsparse import ops
    from jaxsparse.ffi import calls

    os.environ["JAXSPARSE_BACKEND"] = "cuda"  # every sparse product on its kernel, or an error
    os.environ.pop("JAXSPARSE_REFERENCE_OPS", None)
    tokens_list = QUICK_TOKENS if args.quick else TOKENS
    shapes = QUICK_SHAPES if args.quick else SHAPES
    specs = [s for s in args.specs.split(",") if s]
    reps = dict(warmup=5, inner=20, outer=15)
    hi = jax.lax.Precision.HIGHEST

    dense_fns = {
        "fwd": jax.jit(lambda x, dy, w, b: x @ w + b),
        "dW": jax.jit(lambda x, dy, w, b: x.T @ dy),
        "dX": jax.jit(lambda x, dy, w, b: dy @ w.T),
        "fwd+bwd": jax.jit(lambda x, dy, w, b: dense_vjp(x, dy, w, b)),
    }

    sparse_fns = {
        "fwd": jax.jit(lambda x, dy, sw, b: calls.spmm(x, sw, b, None)),
        "dW": jax.jit(lambda x, dy, sw, b: calls.sddmm(x, dy, sw)),
        "dX": jax.jit(lambda x, dy, sw, b: calls.spmm_t(dy, sw)),
        "fwd+bwd": jax.jit(lambda x, dy, sw, b: sparse_vjp(x, dy, sw.values, b, sw)),
    }
    # The alternatives the ops choose between, timed beside the kernels: (row label, product, function).
    # A variant may take x in another form: prep(x) is what its first argument gets.
    same = lambda x: x
    xt_of = lambda x: jnp.asarray(x.T)

    rows_24 = dict(JAXSPARSE_SPMM_X="row", JAXSPARSE_SPMM_ROW_KERNEL="tma", JAXSPARSE_SDDMM_ENGINE="tma")
    variants = [
        ("fwd x row-major", "fwd", jax.jit(lambda x, dy, sw, b: calls.spmm(x, sw, b, None, x_layout="row")), same),
        # The Hopper x^T SpMM with jaxsparse_transpose in front, then alone (x^T given) at each tile.
        ("fwd x col-major", "fwd", jax.jit(lambda x, dy, sw, b: calls.spmm(x, sw, b, None, x_layout="col")), same),
        *[(f"fwd x^T given {tile}", "fwd",
           jax.jit(lambda xt, dy, sw, b, tile=tile: calls.spmm_from_xt(xt, sw, b, None, tile)), xt_of)
          for tile in ("auto", "128x256", "64x256", "128x128", "64x128", "ws128x256", "ws64x256")],
        ("dW mma.sync engine", "dW", jax.jit(lambda x, dy, sw, b: calls.sddmm(x, dy, sw, engine="mma", x_layout="row")),
         same),
        ("dW split=none", "dW", jax.jit(lambda x, dy, sw, b: calls.sddmm(x, dy, sw, split="none")), same),
        ("dW x row-major", "dW", jax.jit(lambda x, dy, sw, b: calls.sddmm(x, dy, sw, x_layout="row")), same),
        # The x^T engine alone, x^T given; the "x col-major" row adds jaxsparse_transpose before it.
        ("dW x col-major", "dW", jax.jit(lambda x, dy, sw, b: calls.sddmm(x, dy, sw, x_layout="col")), same),
        ("dW x^T given", "dW", jax.jit(lambda xt, dy, sw, b: calls.sddmm_from_xt(xt, dy, sw)), xt_of),
        ("dX dense route", "dX", jax.jit(lambda x, dy, sw, b: ops._dense_dx(dy, sw)), same),
        # M = 16 on Hopper: per V block the product over its kept columns, then a one-hot scatter product (any mask).
        ("dX condensed", "dX", jax.jit(lambda x, dy, sw, b: calls.spmm_t_condensed(dy, sw)), same),
        ("fwd+bwd condensed dX", "fwd+bwd",
         jax.jit(with_env(lambda x, dy, sw, b: sparse_vjp(x, dy, sw.values, b, sw), JAXSPARSE_DX="condensed")), same),
        # M = 16, R <= 1024 on Hopper: dy's rows resident in shared memory, per V block the product over its kept
        # columns, summed in a shared tile in block order (any mask); the layer with it (elsewhere the transposed
        # route).
        ("dX resident", "dX", jax.jit(lambda x, dy, sw, b: calls.spmm_t_resident(dy, sw)), same),
        ("fwd+bwd resident dX", "fwd+bwd",
         jax.jit(with_env(lambda x, dy, sw, b: sparse_vjp(x, dy, sw.values, b, sw), JAXSPARSE_DX="resident")), same),
        # V:2:M through its 2:4 view (format.as_2_4) on the kernels that read x [T, K] as it is: the forward, the
        # SDDMM and the whole layer on that route (no transpose anywhere).
        ("fwd x rows, 2:4 view", "fwd", jax.jit(lambda x, dy, sw, b: calls.spmm(x, sw, b, None, x_layout="row",
                                                                                row_kernel="tma")), same),
        ("dW tma engine, 2:4 view", "dW", jax.jit(lambda x, dy, sw, b: calls.sddmm(x, dy, sw, engine="tma",
                                                                                   x_layout="row")), same),
        ("fwd+bwd x rows, 2:4 view", "fwd+bwd",
         jax.jit(with_env(lambda x, dy, sw, b: sparse_vjp(x, dy, sw.values, b, sw), **rows_24)), same),
        # The layer on the x^T route (one jaxsparse_transpose feeds the x^T forward and SDDMM).
        ("fwd+bwd x^T route", "fwd+bwd",
         jax.jit(with_env(lambda x, dy, sw, b: sparse_vjp(x, dy, sw.values, b, sw), JAXSPARSE_SPMM_X="col")), same),
    ]
    if not calls.hopper_gpu():
        # the x^T engines, the TMA kernels, the wgmma dX kernels
        hopper_only = ("col-major", "x^T", "x rows", "2:4 view", "condensed", "resident")
        variants = [v for v in variants if not any(h in v[0] for h in hopper_only)]
    wanted = lambda label: not args.only or any(o in label for o in args.only.split(",") if o)
    variants = [v for v in variants if wanted(v[0])]
    select = jax.jit(F.select_mask, static_argnums=1)
    select_t = jax.jit(lambda w, spec: F.select_mask(w, spec, transposable=True), static_argnums=1)
    rows: list[dict] = []
    key = jax.random.PRNGKey(7)

    def save() -> None:
        payload = dict(
            benchmark="one linear layer y = x @ W + b, bf16: fwd, dW, dX, fwd+bwd (jax.vjp), dense XLA vs jaxsparse",
            gpu=common.gpu_name(),
            versions=common.versions(),
            roofline=dict(dense_tflops=common.DENSE_TFLOPS, sparse_tflops=common.SPARSE_TFLOPS,
                          hbm_tbps=common.HBM_TBPS, note=__doc__.split("Roofline")[1].split("Writes")[0].strip()),
            fwd_bwd_routes=dict(spmm_x_layout=os.environ.get(calls.SPMM_X_LAYOUT_ENV, "auto"), dx=ops.dx_route(), sddmm_split=calls.sddmm_split(), sddmm_engine=calls.sddmm_engine(),
                                sddmm_x_layout=os.environ.get(calls.SDDMM_X_LAYOUT_ENV, "auto")),
            timing="median over 15 batches of 20 async calls (host clock between syncs), 3 rotating input sets",
            results=rows,
        )
        common.write_json(common.results_path("linear.json", args.out), payload)
        if os.environ.get("OUT"):
            common.write_json(os.path.join(os.environ["OUT"], "linear.json"), payload)

    for tokens in tokens_list:
        for k, n in shapes:
            key, kx, kd, kw, kb = jax.random.split(key, 5)
            xs = [jax.random.normal(kk, (tokens, k), jnp.float32).astype(jnp.bfloat16) for kk in jax.random.split(kx, 3)]
            dys = [jax.random.normal(kk, (tokens, n), jnp.float32).astype(jnp.bfloat16) for kk in jax.random.split(kd, 3)]
            w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
            b = jax.random.normal(kb, (n,), jnp.float32).astype(jnp.bfloat16)
            base = dict(tokens=tokens, K=k, N=n)
            dense_ms = {}
            for prod in PRODUCTS:
                ms = common.time_jax(dense_fns[prod], [(x, dy, w, b) for x, dy in zip(xs, dys)], **reps)
                dense_ms[prod] = ms
                fl = floors(prod, tokens, k, n, None)
                rows.append(_row(base, prod, "xla-dense", ms, ms, fl, ""))
                print(rows[-1], flush=True)
            for spec_s in specs:
                spec = F.VNM.parse(spec_s)
                sw = F.compress(w, select(w, spec), spec)
                # Errors against float32 references on the first input set (dX, fwd: first 512 tokens).
                x0, dy0 = xs[0], dys[0]
                refs, wd = _references(x0, dy0, b, sw, hi)
                args0 = (x0, dy0, sw, b)
                errs = {prod: _err(prod, sparse_fns[prod], args0, refs) for prod in refs}
                errs["fwd+bwd"] = max(errs.values())
                # The defaults (PRODUCTS), then the alternatives the ops choose between.
                runs = [(prod, prod, sparse_fns[prod], same, errs[prod]) for prod in PRODUCTS]
                runs += [(label, prod, fn, prep, _err(prod, fn, (prep(x0), dy0, sw, b), refs))
                         for label, prod, fn, prep in variants
                         if not (spec.v == 64 and label.startswith(("fwd x^T given 128x", "fwd x^T given ws128x")))  # 128-row tiles need V >= 128
                         and not (spec.m == 4 and ("2:4 view" in label or "x^T route" in label))  # 2:4: no x^T route
                         and not ("condensed" in label and spec.m != calls.CONDENSED_DX_M)
                         and not ("resident" in label and calls.spmm_t_resident_unsupported(sw))]
                for label, prod, fn, prep, err in runs:
                    ms = common.time_jax(fn, [(prep(x), dy, sw, b) for x, dy in zip(xs, dys)], **reps)
                    fl = floors(prod, tokens, k, n, spec.m, spec.v)
                    rows.append(_row(base, label, f"jaxsparse {spec_s}", ms, dense_ms[prod], fl, f"{err:.1e}"))
                    print(rows[-1], flush=True)

                def time_on_weight(runs, pairs):  # rows (label, product, fn, err, weight): weight in sw's place
                    for label, prod, fn, err, weight in [r for r in runs if wanted(r[0])]:
                        ms = common.time_jax(fn, [(x, dy, weight, b) for x, dy in pairs], **reps)
                        fl = floors(prod, tokens, k, n, spec.m, spec.v)
                        rows.append(_row(base, label, f"jaxsparse {spec_s}", ms, dense_ms[prod], fl, err))
                        print(rows[-1], flush=True)

                if n % 32 == 0:  # the transposed dX route: a transposable mask, W^T 2:4 along N
                    runs_t, sw_t, wt = _transposed_runs(w, x0, dy0, b, spec, select_t, hi)
                    time_on_weight(runs_t, list(zip(xs, dys)))
                    del sw_t, wt
                if F.takes_exclusive_columns(spec) and any(wanted(label) for label in ("dX blocks route",
                                                                                        "fwd+bwd blocks dX")):
                    runs_e, sw_e = _blocks_runs(w, x0, dy0, b, spec, hi)
                    time_on_weight(runs_e, list(zip(xs, dys)))
                    del sw_e
                del sw, wd, args0
            del xs, dys, w
            save()

    print()
    print(common.table(rows, ["tokens", "K", "N", "product", "impl", "ms", "speedup", "floor_ms", "over_floor", "err"]))


if __name__ == "__main__":
    main()
