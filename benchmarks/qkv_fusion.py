"""Q, K and V as one product: is one ``[hidden -> 3 hidden]`` layer faster than three ``[hidden -> hidden]`` ones?

Forward and backward (``jax.vjp``: y, dx, dW, db) of an encoder layer's three attention projections, side by side in
one process, dense (XLA) and sparse (``jaxsparse.ops.sparse_linear``, masks chosen transposable and
``JAXSPARSE_DX=transposed``, as the BERT-large step runs them), three ways:

* ``three``: three layers on the same x, as ``models/bert.py`` has them;
* ``fused, split``: one layer whose weight is the three side by side, its output split into q, k and v and its
  cotangent their concatenation (what a model would have to do, since the attention takes three arrays);
* ``fused, whole``: the same layer with y and dy whole, no split and no concatenation: the bound that a kernel
  writing and reading the three parts itself could reach;
* ``shared dx`` (sparse only): the three layers as one ``jaxsparse.ops.shared_linear``, what ``models/bert.py`` runs
  on compressed layers: three forwards and weight gradients, and one input-gradient product whose reduction runs over
  the three ``dy`` (``JAXSPARSE_SHARED_DX``; dx written once instead of three times and summed by XLA).

The fused sparse weight is the three masks side by side (a V-row block never straddles two parts when ``hidden`` is a
multiple of V), so the fused layer computes what the three do; the script checks that before it times anything. Each
row has its roofline floor (``benchmarks/linear.py``'s, summed over the products; the three layers read x three
times, the fused layer once) and its time over it.

  python3 benchmarks/qkv_fusion.py                            # writes benchmarks/results/<gpu or cpu>/qkv_fusion.json
  python3 benchmarks/qkv_fusion.py --tokens 256 --hidden 256   # small, e.g. on a CPU
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

common.import_jaxsparse_from_install_or_checkout()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxsparse import format as F, ops  # noqa: E402
from linear import floors  # noqa: E402

PARTS = 3  # q, k, v
VARIANTS = ("three", "fused, split", "fused, whole")
SPARSE_VARIANTS = VARIANTS + ("shared dx",)


def _rel(a: jax.Array, ref: jax.Array) -> float:
    a, ref = a.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm((a - ref).ravel()) / jnp.linalg.norm(ref.ravel()))


def cut(a: jax.Array, hidden: int) -> list[jax.Array]:
    """The three parts (q, k, v) of a fused array along its last axis."""
    return [a[..., i * hidden:(i + 1) * hidden] for i in range(PARTS)]


def sparse_weights(w: jax.Array, spec: str) -> tuple[F.SparseWeight, list[F.SparseWeight]]:
    """The fused sparse weight (a transposable mask chosen on the whole ``w``) and its three parts, each compressed
    with its slice of that mask."""
    mask = F.select_mask(w, spec, transposable=True)
    hidden = w.shape[0]
    return F.compress(w, mask, spec), [F.compress(wp, mp, spec) for wp, mp in zip(cut(w, hidden), cut(mask, hidden))]


def layers(w: jax.Array, b: jax.Array, spec: str | None) -> dict[str, tuple[Callable, object]]:
    """For each variant, ``(fn, weight)``: ``fn(x, dy, weight) -> (y, grads)`` and what it takes as ``weight``
    (dense: the masked kernel or its parts; sparse: the compressed values or the parts' values). ``dy`` is the list of
    the parts' cotangents for ``three`` and ``fused, split``, their concatenation for ``fused, whole``. The variants
    differ only in how the layer is cut; each applies one product, dense (``x @ w + b``) or sparse."""
    hidden = w.shape[0]
    bs = cut(b, hidden)
    if spec is None:
        fused_weight, part_weights = w, cut(w, hidden)
        fused = lambda x, wt, bias: x @ wt + bias
        part = lambda i, x, wt, bias: x @ wt + bias
    else:
        sw, parts = sparse_weights(w, spec)
        fused_weight, part_weights = sw.values, [p.values for p in parts]
        fused = lambda x, v, bias: ops.sparse_linear(x, sw.replace(values=v), bias)
        part = lambda i, x, v, bias: ops.sparse_linear(x, parts[i].replace(values=v), bias)

        def shared(x, dy, ws):
            y, g = jax.vjp(lambda x, ws, bs: ops.shared_linear(x, [p.replace(values=v) for p, v in zip(parts, ws)], bs),
                           x, ws, bs)
            return y, g(tuple(dy))

    def three(x, dy, ws):
        y, g = jax.vjp(lambda x, ws, bs: tuple(part(i, x, *wb) for i, wb in enumerate(zip(ws, bs))), x, ws, bs)
        return y, g(tuple(dy))

    def split(x, dy, wf):
        y, g = jax.vjp(lambda x, wf, b: tuple(jnp.split(fused(x, wf, b), PARTS, axis=-1)), x, wf, b)
        return y, g(tuple(dy))

    def whole(x, dy, wf):
        y, g = jax.vjp(fused, x, wf, b)
        return y, g(dy)

    fns = {"three": (three, part_weights), "fused, split": (split, fused_weight), "fused, whole": (whole, fused_weight)}
    if spec is not None:
        check_fused(three, split, parts, sw, hidden)
        check_shared(three, shared, parts)
        fns["shared dx"] = (shared, part_weights)
    return fns


def check_shared(three: Callable, shared: Callable, parts: Sequence[F.SparseWeight], tokens: int = 128,
                 tol: float = 2e-2) -> dict:
    """``shared dx`` against the three layers on fresh random bf16 inputs: y, dx, dW and db within ``tol``; raises
    otherwise."""
    x, dy = _check_inputs(12, tokens, parts[0].shape[0])
    ws = [p.values for p in parts]
    (y3, g3), (ys, gs) = jax.jit(three)(x, dy, ws), jax.jit(shared)(x, dy, ws)
    err = dict(y=max(_rel(a, r) for a, r in zip(ys, y3)), dx=_rel(gs[0], g3[0]),
               dw=max(_rel(a, r) for a, r in zip(gs[1], g3[1])), db=max(_rel(a, r) for a, r in zip(gs[2], g3[2])))
    return _within(err, tol, "shared_linear is not the three layers")


def _check_inputs(seed: int, tokens: int, hidden: int) -> tuple[jax.Array, list[jax.Array]]:
    """Fresh random bf16 ``x [tokens, hidden]`` and the three parts' cotangents, for the checks before timing."""
    kx, kd = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (tokens, hidden), jnp.float32).astype(jnp.bfloat16)
    return x, [d.astype(jnp.bfloat16) for d in jax.random.normal(kd, (PARTS, tokens, hidden), jnp.float32)]


def _within(err: dict, tol: float, what: str) -> dict:
    """``err`` when every relative error is within ``tol`` (NaN is not); raises ``SystemExit`` naming ``what``
    otherwise."""
    bad = {k: v for k, v in err.items() if not v <= tol}
    if bad:
        raise SystemExit(f"{what}: relative errors {bad} (tolerance {tol})")
    return err


def check_fused(three: Callable, split: Callable, parts: Sequence[F.SparseWeight], sw: F.SparseWeight,
                hidden: int, tokens: int = 128, tol: float = 2e-2) -> dict:
    """The fused sparse layer against the three on fresh random bf16 inputs: y, dx, the dense weight gradients and
    the bias gradients within ``tol`` (relative, float32 accumulation in both); raises otherwise."""
    x, dy = _check_inputs(11, tokens, hidden)
    (y3, g3), (yf, gf) = jax.jit(three)(x, dy, [p.values for p in parts]), jax.jit(split)(x, dy, sw.values)
    dw3 = jnp.concatenate([F.decompress(p.replace(values=v)) for p, v in zip(parts, g3[1])], axis=1)
    err = dict(y=max(_rel(a, r) for a, r in zip(yf, y3)), dx=_rel(gf[0], g3[0]),
               dw=_rel(F.decompress(sw.replace(values=gf[1])), dw3), db=_rel(gf[2], jnp.concatenate(g3[2])))
    return _within(err, tol, "the fused sparse layer is not the three")


def floor_ms(variant: str, tokens: int, hidden: int, spec: str | None) -> float:
    """The roofline floor of a variant's forward and backward (``linear.floors`` summed over fwd, dW and dX)."""
    vnm = None if spec is None else F.VNM.parse(spec)
    m, v = (None, 1) if vnm is None else (vnm.m, vnm.v)
    if variant == "three":
        return PARTS * floors("fwd+bwd", tokens, hidden, hidden, m, v)["floor_ms"]
    if variant == "shared dx":  # the three forwards and weight gradients, one dX over the three dy
        one = sum(floors(p, tokens, hidden, hidden, m, v)["floor_ms"] for p in ("fwd", "dW"))
        return PARTS * one + floors("dX", tokens, hidden, PARTS * hidden, m, v)["floor_ms"]
    return floors("fwd+bwd", tokens, hidden, PARTS * hidden, m, v)["floor_ms"]


def _time_all(args: argparse.Namespace) -> list[dict]:
    """Every variant, dense and sparse, timed: one row each (printed as it is measured)."""
    kx, kd, kw, kb = jax.random.split(jax.random.key(3), 4)
    bf = lambda key, shape, scale=1.0: (jax.random.normal(key, shape, jnp.float32) * scale).astype(jnp.bfloat16)
    h, t = args.hidden, args.tokens
    xs = [bf(k, (t, h)) for k in jax.random.split(kx, 2)]
    dys = [[bf(k, (t, h)) for k in jax.random.split(kk, PARTS)] for kk in jax.random.split(kd, 2)]
    w = bf(kw, (h, PARTS * h), h ** -0.5)
    b = bf(kb, (PARTS * h,))
    rows = []
    for spec in (None, args.sparsity):
        wd = (w * F.select_mask(w, args.sparsity, transposable=True)).astype(w.dtype) if spec is None else w
        # the dense layers take the sparse layer's masked weight: the same numbers, XLA's dense products
        fns = layers(wd, b, spec)
        three_ms = None
        for variant in VARIANTS if spec is None else SPARSE_VARIANTS:
            fn, weight = fns[variant]
            dy_of = (lambda dy: jnp.concatenate(dy, axis=-1)) if variant == "fused, whole" else (lambda dy: dy)
            ms = common.time_jax(jax.jit(fn), [(x, dy_of(dy), weight) for x, dy in zip(xs, dys)])
            three_ms = ms if variant == "three" else three_ms
            fl = floor_ms(variant, t, h, spec)
            rows.append(dict(impl=spec or "dense", variant=variant, ms=ms, vs_three=three_ms / ms, floor_ms=fl,
                             over_floor=ms / fl))
            print(f"{spec or 'dense':8s} {variant:13s} {ms:8.4f} ms  {three_ms / ms:5.2f}x of three  "
                  f"{ms / fl:5.2f}x over its floor ({fl:.4f} ms)", flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384, help="rows of x (BERT-large step: 32 x 512)")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size (BERT-large: 1024)")
    ap.add_argument("--sparsity", default="64:2:8", help="the sparse layers' V:N:M pattern")
    ap.add_argument("--out", default=None, help="json path (default benchmarks/results/<gpu or cpu>/qkv_fusion.json)")
    args = ap.parse_args(argv)
    # Every sparse product on its kernel (or an error) on a GPU, and dX on W^T as in the step; both are read when the
    # layers are traced, and both are restored on return (a caller's later layers must not inherit them).
    backend = "cuda" if jax.default_backend() == "gpu" else None
    with common.env_scope(JAXSPARSE_BACKEND=backend, JAXSPARSE_DX="transposed"):
        rows = _time_all(args)
    payload = dict(benchmark="Q, K, V projections: three layers against one fused layer, forward + backward (jax.vjp)",
                   gpu=common.gpu_name(), versions=common.versions(), tokens=args.tokens, hidden=args.hidden, parts=PARTS,
                   sparsity=args.sparsity, dx_route="transposed", masks="transposable",
                   timing="median over 15 batches of 20 async calls (host clock between syncs), 2 rotating input sets",
                   roofline=dict(dense_tflops=common.DENSE_TFLOPS, hbm_tbps=common.HBM_TBPS), rows=rows)
    common.write_json(common.results_path("qkv_fusion.json", args.out), payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
