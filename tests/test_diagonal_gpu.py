"""Diagonal 2:4 blocks on the GPU kernels (``calls.spmm_blocks``, ``calls.sddmm_blocks``, ``ops.diagonal_linear``)
against float32 references.

A weight of G diagonal 2:4 blocks is stored stacked along its outputs: a 2:4 weight ``(K, R)`` whose output feature
``r`` reads x's columns ``(r // (R / G)) K + [0, K)`` (``jaxsparse.ops.diagonal_linear``). Every check draws fresh
random inputs (each block's columns of x differ, so a kernel reading the wrong block's columns fails), poisons the
output memory with NaN first, requires every output to be finite and compares ``||out - ref|| / ||ref||`` (and the
worst row) with a float32 reference built from the dense block-diagonal matrix. Token counts hit the token tile's
edges (1 and 1000: the row kernel's tile is 256 tokens, the SDDMM's stage 64).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpu_common import DTYPES, TOL, cuda_ready, gpu_marks, key, poison
from gpu_common import compare as _compare
from jaxsparse import format as F
from jaxsparse import ops

pytestmark = gpu_marks("jaxsparse_spmm_xt", "jaxsparse_sddmm")

if cuda_ready("jaxsparse_spmm_xt", "jaxsparse_sddmm"):
    from jaxsparse.ffi import calls

HIGHEST = jax.lax.Precision.HIGHEST
# (blocks, K per block, R): 128-row tiles of one block each, blocks of one or several tiles and 64-column stages.
SHAPES = [(2, 128, 256), (4, 256, 512), (2, 512, 1024), (8, 128, 1024)]


def _hopper() -> bool:
    return any(str(getattr(d, "compute_capability", "")).startswith("9") for d in jax.devices("gpu"))


needs_hopper = pytest.mark.skipif(not (cuda_ready("jaxsparse_spmm_xt") and _hopper()),
                                  reason="diagonal blocks run on the Hopper kernels")


def _assert_on_kernels(f) -> None:
    """The compiled ``f`` (no arguments) calls the blocks' forward and SDDMM kernels."""
    text = f.lower().compile().as_text()
    for target in ("jaxsparse_spmm_xt", "jaxsparse_sddmm"):
        assert f'custom_call_target="{target}"' in text, target


def _make(rng, t: int, blocks: int, k: int, r: int, dtype):
    """x [t, blocks k], dy [t, r], the stacked weight (transposable 2:4 masks) and its dense block-diagonal form."""
    kx, kd, kw, kb = jax.random.split(rng, 4)
    x = jax.random.normal(kx, (t, blocks * k), jnp.float32).astype(dtype)
    dy = jax.random.normal(kd, (t, r), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, r), jnp.float32) / np.sqrt(k / 2)).astype(dtype)
    sw = F.compress(w, F.select_mask(w, "2:4", transposable=True), "2:4")
    stacked = np.asarray(F.decompress(sw).astype(jnp.float32))  # [k, r]
    rb = r // blocks
    dense = np.zeros((blocks * k, r), np.float32)
    for b in range(blocks):
        dense[b * k:(b + 1) * k, b * rb:(b + 1) * rb] = stacked[:, b * rb:(b + 1) * rb]
    bias = jax.random.normal(kb, (r,), jnp.float32).astype(dtype)
    return x, dy, sw, jnp.asarray(dense), bias


def _f32(a):
    return jnp.asarray(a).astype(jnp.float32)


@needs_hopper
@pytest.mark.parametrize("blocks, k, r", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("t", [1, 1000])
def test_spmm_blocks(blocks, k, r, dtype, t):
    x, _, sw, dense, bias = _make(key("spmm_blocks", blocks, k, r, str(dtype), t), t, blocks, k, r, dtype)
    poison((t, r), dtype)
    out = calls.spmm_blocks(x, sw, blocks, bias)
    ref = jnp.dot(_f32(x), dense, precision=HIGHEST) + _f32(bias)
    _compare(out, ref, TOL[dtype], f"spmm_blocks G={blocks} K={k} R={r} t={t}")


@needs_hopper
@pytest.mark.parametrize("blocks, k, r", SHAPES)
@pytest.mark.parametrize("dtype, out_dtype", [(jnp.bfloat16, None), (jnp.float16, None), (jnp.bfloat16, jnp.float32)],
                         ids=["bf16", "fp16", "bf16-f32"])
@pytest.mark.parametrize("t", [1, 1000])
def test_sddmm_blocks(blocks, k, r, dtype, t, out_dtype):
    x, dy, sw, _, _ = _make(key("sddmm_blocks", blocks, k, r, str(dtype), t), t, blocks, k, r, dtype)
    poison(sw.values.shape, out_dtype or dtype)
    out = calls.sddmm_blocks(x, dy, sw, blocks, out_dtype)
    assert out.dtype == jnp.dtype(out_dtype or dtype)
    dense = jnp.dot(_f32(x).T, _f32(dy), precision=HIGHEST)  # [blocks k, r]
    ref = F.compress_like(F.stack_diagonal_blocks(dense, blocks), sw)
    _compare(out, ref, TOL[dtype], f"sddmm_blocks G={blocks} K={k} R={r} t={t}")


@needs_hopper
@pytest.mark.parametrize("blocks, k, r", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("t", [1000])
@pytest.mark.parametrize("chunked", [False, True], ids=["contiguous", "chunked"])
def test_diagonal_linear_grad_on_kernels(blocks, k, r, dtype, t, chunked):
    """``jax.grad`` of ``diagonal_linear`` under ``jit`` (forward, input gradient on the stacked ``W^T`` blocks and
    the SDDMM, all on the kernels) against the dense block-diagonal layer in float32; ``chunked``: through a random
    chunk table (the forward and the SDDMM read x by it, the input gradient writes its chunks back by it)."""
    rng = key("diag_grad", blocks, k, r, str(dtype), t, chunked)
    if chunked:
        x, dy, sw, dense, bias, table = _make_chunked(rng, t, blocks, k, r, dtype)
        rows = F.chunk_columns(table)  # the stacked weight's rows among x's features
    else:
        (x, dy, sw, dense, bias), table, rows = _make(rng, t, blocks, k, r, dtype), None, slice(None)
    f = jax.jit(lambda x, v, b: jax.vjp(lambda x, v, b: ops.diagonal_linear(x, sw.replace(values=v), blocks, b,
                                                                            chunks=table), x, v, b)[1](dy))
    poison((t, blocks * k), dtype)
    dx, dv, db = f(x, sw.values, bias)
    ref_dx = jnp.dot(_f32(dy), dense.T, precision=HIGHEST)
    ref_dw = jnp.dot(_f32(x).T, _f32(dy), precision=HIGHEST)[rows]
    what = f"diagonal_linear G={blocks} K={k} R={r} t={t}{' chunked' if chunked else ''}"
    _compare(dx, ref_dx, TOL[dtype], what + " dx")
    _compare(dv, F.compress_like(F.stack_diagonal_blocks(ref_dw, blocks), sw), TOL[dtype], what + " dvalues")
    _compare(db[None], _f32(dy).sum(0)[None], TOL[dtype], what + " dbias")
    text = f.lower(x, sw.values, bias).compile().as_text()
    assert 'custom_call_target="jaxsparse_spmm_xt"' in text and 'custom_call_target="jaxsparse_sddmm"' in text


# dz = dh * act'(z) in the input gradient's epilogue (mul): (blocks, K per block, R, tokens). The last shape has more
# tiles (256) than an H200 has SMs, so CTAs run several tiles and the ring's barrier phases go on across the two slots
# mul takes a tile; 1000 tokens end inside a 128-token epilogue chunk.
MUL_SHAPES = [(2, 128, 256, 1), (4, 256, 512, 1000), (2, 512, 1024, 1000), (2, 512, 1024, 8192)]


def _mul_ref(y32, mul, dtype):
    """The kernel's result rounded to ``dtype``, times ``mul`` in float32, rounded again (jaxsparse.ops._times)."""
    return (jnp.asarray(y32).astype(dtype).astype(jnp.float32) * _f32(mul)).astype(dtype)


@needs_hopper
@pytest.mark.parametrize("blocks, k, r, t", MUL_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_spmm_blocks_mul(blocks, k, r, t, dtype, with_bias):
    """``spmm_blocks(..., mul=m)``: ``(x W + b) * m`` with m brought into shared memory by the producer's TMA, two
    ring slots a tile, against the float32 product rounded as the kernel rounds it."""
    rng = key("spmm_blocks_mul", blocks, k, r, t, str(dtype), with_bias)
    x, _, sw, dense, bias = _make(rng, t, blocks, k, r, dtype)
    mul = jax.random.normal(jax.random.fold_in(rng, 3), (t, r), jnp.float32).astype(dtype)
    bias = bias if with_bias else None
    poison((t, r), dtype)
    out = jax.block_until_ready(calls.spmm_blocks(x, sw, blocks, bias, mul=mul))
    y32 = jnp.dot(_f32(x), dense, precision=HIGHEST) + (0 if bias is None else _f32(bias))
    _compare(out, _f32(_mul_ref(y32, mul, dtype)), TOL[dtype], f"spmm_blocks mul G={blocks} K={k} R={r} t={t}")


@needs_hopper
def test_spmm_blocks_mul_on_the_64_row_tile(monkeypatch):
    """One block (the layer's own tile setting applies) on ws64x256: one 256-token epilogue chunk a tile."""
    monkeypatch.setenv("JAXSPARSE_SPMM_XT_TILE", "ws64x256")
    rng = key("spmm_blocks_mul_64")
    x, _, sw, dense, _ = _make(rng, 1000, 1, 256, 512, jnp.bfloat16)
    mul = jax.random.normal(jax.random.fold_in(rng, 3), (1000, 512), jnp.float32).astype(jnp.bfloat16)
    poison((1000, 512), jnp.bfloat16)
    out = calls.spmm_blocks(x, sw, 1, mul=mul)
    ref = _mul_ref(jnp.dot(_f32(x), dense, precision=HIGHEST), mul, jnp.bfloat16)
    _compare(out, _f32(ref), TOL[jnp.bfloat16], "spmm_blocks mul ws64x256")


@needs_hopper
def test_spmm_blocks_mul_rejects():
    x, _, sw, _, _ = _make(key("mul_reject"), 64, 2, 128, 256, jnp.bfloat16)
    mul = jnp.ones((64, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="mul needs"):
        calls.spmm_blocks(x, sw, 2, mul=mul[:, :128])
    with pytest.raises(ValueError, match="mul needs"):
        calls.spmm_blocks(x, sw, 2, mul=mul.astype(jnp.float16))
    with pytest.raises(ValueError, match="mul needs"):
        calls.spmm_blocks(x, sw, 2, activation="relu", mul=mul)
    with pytest.raises(ValueError, match="mul needs"):
        calls.spmm_blocks(x, sw, 2, y_chunks=jnp.arange(4, dtype=jnp.int32), mul=mul)


def _mlp_operands(rng, spec: str, blocks: int, t: int, k: int, f: int, r: int):
    """Fresh bf16 operands of ``sparse_mlp`` with a diagonal second layer: ``x [t, k]``, ``dy [t, r]``, the first
    layer ``(k, f)`` at ``spec`` with its bias ``[f]``, and the second as ``blocks`` diagonal 2:4 blocks ``(f / blocks,
    r)``; both masks transposable."""
    kx, kd, k1, k2, kb = jax.random.split(rng, 5)
    x = jax.random.normal(kx, (t, k), jnp.float32).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (t, r), jnp.float32).astype(jnp.bfloat16)
    w1 = (jax.random.normal(k1, (k, f), jnp.float32) / np.sqrt(k / 4)).astype(jnp.bfloat16)
    sw1 = F.compress(w1, F.select_mask(w1, spec, transposable=True), spec)
    w2 = (jax.random.normal(k2, (f // blocks, r), jnp.float32) / np.sqrt(f / blocks / 2)).astype(jnp.bfloat16)
    sw2 = F.compress(w2, F.select_mask(w2, "2:4", transposable=True), "2:4")
    b1 = jax.random.normal(kb, (f,), jnp.float32).astype(jnp.bfloat16)
    return x, dy, sw1, b1, sw2


@needs_hopper
@pytest.mark.parametrize("spec, blocks, sddmm_bias", [("64:2:8", 2, "on"), ("128:2:16", 4, "on"),
                                                      ("128:2:16", 4, "off")])
def test_dz_epilogue_equals_xlas_multiply(monkeypatch, spec, blocks, sddmm_bias):
    """``sparse_mlp`` with a diagonal second layer: with ``JAXSPARSE_DZ_EPILOGUE=on`` its input gradient's call takes
    ``act'`` as ``mul`` and XLA's multiply is gone; every gradient is bit for bit the one of ``off`` (the same float32
    products, rounded the same way), except FFN in's bias gradient where XLA sums ``dz`` (equal within rounding).
    ``auto`` takes the epilogue where FFN in's SDDMM sums the bias gradient (the tma engine on the 2:4 view at 64:2:8,
    K = 1024; the x^T engine at 128:2:16), not where XLA sums ``dz`` (``JAXSPARSE_SDDMM_BIAS=off``)."""
    monkeypatch.setenv("JAXSPARSE_SDDMM_BIAS", sddmm_bias)
    auto_on = sddmm_bias == "on"
    t, f, r = 1000, 2048, 512
    x, dy, sw1, b1, sw2 = _mlp_operands(key("dz_epilogue", spec), spec, blocks, t, 1024, f, r)
    b2 = jnp.ones((r,), jnp.bfloat16)
    assert ops._bias_grad_by_xla(t, sw1, b1) is not auto_on

    def grads(x, v1, b1, v2, b2):
        g = lambda x, v1, b1, v2, b2: ops.sparse_mlp(x, sw1.replace(values=v1), b1, sw2.replace(values=v2), b2,
                                                    "gelu_erf", blocks=blocks)
        return jax.vjp(g, x, v1, b1, v2, b2)[1](dy)

    args = (x, sw1.values, b1, sw2.values, b2)
    got = {}
    for setting, in_epilogue in (("on", True), ("off", False), ("auto", auto_on)):
        monkeypatch.setenv("JAXSPARSE_DZ_EPILOGUE", setting)
        with ops.dx_route_scope("transposed"):
            fn = jax.jit(lambda *a: grads(*a))  # a new function each time: the setting is read when it is traced
            calls_xt = [line for line in fn.lower(*args).as_text().splitlines() if "jaxsparse_spmm_xt" in line]
            # mul is the operand before the two empty x_parts operands (calls._spmm_xt_call)
            with_mul = [line for line in calls_xt
                        if f"tensor<{t}x{f}xbf16>, tensor<0xbf16>, tensor<0xbf16>) ->" in line]
            assert len(with_mul) == int(in_epilogue), (setting, calls_xt)
            poison((t, f), jnp.bfloat16)
            got[setting] = [np.asarray(_f32(g)) for g in jax.block_until_ready(fn(*args))]
    for setting in ("on", "auto"):
        for name, a, b in zip(("dx", "dvalues1", "dbias1", "dvalues2", "dbias2"), got[setting], got["off"]):
            assert np.isfinite(a).all(), name
            if name == "dbias1" and not auto_on:
                # XLA sums dz here: with off it fuses the multiply into the sum and, allowed excess precision, sums
                # the float32 products unrounded, where on sums the kernel's bf16 dz (rounding 2^-9 each)
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-2 * np.abs(b).max(), err_msg=f"{spec} {name}")
            else:
                np.testing.assert_array_equal(a, b, err_msg=f"{spec} {name}: {setting}'s dz against XLA's")


@needs_hopper
def test_blocks_reject():
    x, dy, sw, _, _ = _make(key("blocks_reject"), 64, 2, 128, 256, jnp.bfloat16)
    with pytest.raises(ValueError, match="128"):  # R = 256 over 4 blocks: 64-row blocks
        calls.spmm_blocks(jnp.ones((64, 4 * 128), jnp.bfloat16), sw, 4)
    with pytest.raises(ValueError, match="x must be"):
        calls.spmm_blocks(x[:, :128], sw, 2)
    with pytest.raises(ValueError, match="dy must be"):
        calls.sddmm_blocks(x, dy[:, :128], sw, 2)
    with pytest.raises(ValueError, match="dtype"):
        calls.spmm_blocks(x.astype(jnp.float16), sw, 2)


@needs_hopper
@pytest.mark.parametrize("spec, blocks", [("64:2:8", 2), ("128:2:16", 4)])
def test_sparse_mlp_with_diagonal_out_on_kernels(monkeypatch, spec, blocks):
    """``sparse_mlp`` with a second layer of diagonal blocks (the fused first product's epilogue writes ``h`` and
    ``act'``; the second runs on the blocks) under ``jit``: outputs and every gradient against the same function on
    the reference path."""
    t, r = 1000, 512
    x, dy, sw1, b1, sw2 = _mlp_operands(key("mlp_diag", spec), spec, blocks, t, 256, 1024, r)
    b2 = jnp.zeros((r,), jnp.bfloat16)

    def run():
        g = lambda x, v1, b1, v2, b2: ops.sparse_mlp(x, sw1.replace(values=v1), b1, sw2.replace(values=v2), b2,
                                                    "gelu_erf", blocks=blocks)
        y, vjp = jax.vjp(g, x, sw1.values, b1, sw2.values, b2)
        return (y, *vjp(dy))

    with ops.dx_route_scope("transposed"):
        _assert_on_kernels(jax.jit(run))  # not the reference, which `auto` would fall back to with a warning
        poison((t, r), jnp.bfloat16)
        got = jax.jit(run)()
    monkeypatch.setenv("JAXSPARSE_BACKEND", "reference")
    with ops.dx_route_scope("transposed"):
        want = jax.jit(run)()
    for name, a, b in zip(("y", "dx", "dvalues1", "dbias1", "dvalues2", "dbias2"), got, want):
        a, b = _f32(a), _f32(b)
        _compare(a if a.ndim == 2 else a[None], b if b.ndim == 2 else b[None], 2 * TOL[jnp.bfloat16],
                 f"sparse_mlp {spec} blocks={blocks} {name}")


# ----------------------------------------------------------------------------- chunk tables (no relabelling)


def _make_chunked(rng, t: int, blocks: int, k: int, r: int, dtype):
    """As :func:`_make`, with a random chunk table (a permutation of x's 64-column chunks, so each block reads chunks
    scattered over x) and the dense ``[blocks k, r]`` matrix whose block ``b`` sits at the rows the table names."""
    x, dy, sw, dense, bias = _make(rng, t, blocks, k, r, dtype)
    perm = np.asarray(jax.random.permutation(jax.random.fold_in(rng, 7), blocks * k // 64), np.int32)
    table = jnp.asarray(perm.reshape(blocks, k // 64))
    scattered = np.zeros_like(np.asarray(dense))
    scattered[np.asarray(F.chunk_columns(table))] = np.asarray(dense)
    return x, dy, sw, jnp.asarray(scattered), bias, table


@needs_hopper
@pytest.mark.parametrize("blocks, k, r", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("t", [1, 1000])
def test_spmm_blocks_chunked(blocks, k, r, dtype, t):
    x, _, sw, dense, bias, table = _make_chunked(key("spmm_chunks", blocks, k, r, str(dtype), t), t, blocks, k, r,
                                                 dtype)
    poison((t, r), dtype)
    out = calls.spmm_blocks(x, sw, blocks, bias, x_chunks=table)
    ref = jnp.dot(_f32(x), dense, precision=HIGHEST) + _f32(bias)
    _compare(out, ref, TOL[dtype], f"spmm_blocks chunked G={blocks} K={k} R={r} t={t}")


@needs_hopper
@pytest.mark.parametrize("blocks, k, r", SHAPES)
@pytest.mark.parametrize("dtype, out_dtype", [(jnp.bfloat16, None), (jnp.bfloat16, jnp.float32)],
                         ids=["bf16", "bf16-f32"])
@pytest.mark.parametrize("t", [1, 1000])
def test_sddmm_blocks_chunked(blocks, k, r, dtype, t, out_dtype):
    x, dy, sw, _, _, table = _make_chunked(key("sddmm_chunks", blocks, k, r, str(dtype), t), t, blocks, k, r, dtype)
    poison(sw.values.shape, out_dtype or dtype)
    out = calls.sddmm_blocks(x, dy, sw, blocks, out_dtype, x_chunks=table)
    dense = jnp.dot(_f32(x).T, _f32(dy), precision=HIGHEST)[F.chunk_columns(table)]  # stacked order
    ref = F.compress_like(F.stack_diagonal_blocks(dense, blocks), sw)
    _compare(out, ref, TOL[dtype], f"sddmm_blocks chunked G={blocks} K={k} R={r} t={t}")


@needs_hopper
def test_chunk_tables_reject():
    x, dy, sw, _, _, table = _make_chunked(key("chunks_reject"), 64, 2, 128, 256, jnp.bfloat16)
    with pytest.raises(ValueError, match="chunk table"):
        calls.spmm_blocks(x, sw, 2, x_chunks=table.reshape(-1))
    with pytest.raises(ValueError, match="integer"):
        calls.sddmm_blocks(x, dy, sw, 2, x_chunks=table.astype(jnp.float32))
    with pytest.raises(ValueError, match="y_chunks"):
        calls.spmm_blocks(x, sw, 2, y_chunks=jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="y_chunks"):
        calls.spmm_blocks(x, sw, 2, activation="relu", y_chunks=jnp.arange(4, dtype=jnp.int32))


@needs_hopper
@pytest.mark.parametrize("blocks", [2, 4])
def test_diagonal_mlp_on_kernels(monkeypatch, blocks):
    """``diagonal_mlp`` (both layers diagonal blocks read through random chunk tables; the first epilogue writes ``h``
    and ``act'``) under ``jit``: outputs and every gradient against the same function on the reference path."""
    t, k, f, r = 1000, 512, 2048, 512
    kx, kd, k1, k2, kb, kp = jax.random.split(key("diag_mlp", blocks), 6)
    x = jax.random.normal(kx, (t, k), jnp.float32).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (t, r), jnp.float32).astype(jnp.bfloat16)

    def layer(rng, kin, kout):
        w = jax.random.normal(rng, (kin // blocks, kout), jnp.float32) / np.sqrt(kin / blocks / 2)
        w = w.astype(jnp.bfloat16)
        sw = F.compress(w, F.select_mask(w, "2:4", transposable=True), "2:4")
        table = jax.random.permutation(jax.random.fold_in(rng, 1), kin // 64).astype(jnp.int32).reshape(blocks, -1)
        return sw, table

    (sw1, c1), (sw2, c2) = layer(k1, k, f), layer(k2, f, r)
    b1 = jax.random.normal(kb, (f,), jnp.float32).astype(jnp.bfloat16)
    b2 = jax.random.normal(kp, (r,), jnp.float32).astype(jnp.bfloat16)

    def run():
        g = lambda x, v1, b1, v2, b2: ops.diagonal_mlp(x, sw1.replace(values=v1), b1, c1, sw2.replace(values=v2), b2,
                                                      c2, blocks)
        y, vjp = jax.vjp(g, x, sw1.values, b1, sw2.values, b2)
        return (y, *vjp(dy))

    _assert_on_kernels(jax.jit(run))  # not the reference, which `auto` would fall back to with a warning
    poison((t, r), jnp.bfloat16)
    got = jax.jit(run)()
    monkeypatch.setenv("JAXSPARSE_BACKEND", "reference")
    want = jax.jit(run)()
    for name, a, b in zip(("y", "dx", "dvalues1", "dbias1", "dvalues2", "dbias2"), got, want):
        a, b = _f32(a), _f32(b)
        _compare(a if a.ndim == 2 else a[None], b if b.ndim == 2 else b[None], 2 * TOL[jnp.bfloat16],
                 f"diagonal_mlp blocks={blocks} {name}")
