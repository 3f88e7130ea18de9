"""The CUDA backward kernels against float32 references, on the GPU.

* ``jaxsparse_sddmm`` (``calls.sddmm``): the weight gradient ``x^T dy`` at the kept positions, in the
  layout of ``sw.values`` (output in the values dtype or float32);
* ``jaxsparse_spmm_t`` (``calls.spmm_t``): the input gradient ``dy @ W^T``.

Every check draws fresh random inputs, poisons the output memory with NaN first (a NaN array of the
output's size is allocated and freed just before the call, so the allocator hands the kernel that
memory), requires every output to be finite, and compares ``||out - ref|| / ||ref||`` (and the worst
row) with a float32 reference. Token counts hit every edge tile (1, 17, 200, 1000); K is chosen so that
the last group tile of both kernels is partial; every supported V and M and both dtypes run.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpu_common import (DTYPES, REJECT_CASES, SPECS, TOL, cuda_ready, gpu_marks, key, layout_moves, poison, select_mask,
                        standalone_layout_moves)
from gpu_common import compare as _compare
from jaxsparse import format as F


pytestmark = gpu_marks("jaxsparse_sddmm", "jaxsparse_spmm_t")

if cuda_ready("jaxsparse_sddmm", "jaxsparse_spmm_t"):
    from jaxsparse.ffi import calls

HIGHEST = jax.lax.Precision.HIGHEST

def _small_k(m: int) -> int:
    """K with G = K/M groups not a multiple of either kernel's group tile (where M allows it)."""
    return 24 * 32 if m == 32 else 40 * m


def _make(rng, t: int, k: int, r: int, spec: str, dtype, transposable: bool = False):
    kx, kd, kw = jax.random.split(rng, 3)
    x = jax.random.normal(kx, (t, k), jnp.float32).astype(dtype)
    dy = jax.random.normal(kd, (t, r), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, r), jnp.float32) / np.sqrt(k / 4)).astype(dtype)
    mask = F.select_mask(w, spec, transposable=True) if transposable else select_mask(w, F.VNM.parse(spec))
    return x, dy, F.compress(w, mask, spec)


def _sddmm_ref(x, dy, sw):
    dense = jnp.dot(x.astype(jnp.float32).T, dy.astype(jnp.float32), precision=HIGHEST)
    return F.compress_like(dense, sw)


def _spmm_t_ref(dy, sw):
    return jnp.dot(dy.astype(jnp.float32), F.decompress(sw).astype(jnp.float32).T, precision=HIGHEST)


def _hopper() -> bool:
    return any(getattr(d, "compute_capability", "") == "9.0" for d in jax.devices("gpu"))


def _engines(spec: str) -> list:
    """The SDDMM engines to test for a spec: mma.sync everywhere, wgmma on Hopper for M <= 16, and there the TMA
    engine on a row-major x (V:2:M through its 2:4 view, ``format.as_2_4``)."""
    m = F.VNM.parse(spec).m
    hopper = cuda_ready("jaxsparse_sddmm") and _hopper()
    return ["mma"] + (["wgmma"] if hopper and m <= 16 else []) + (["tma"] if hopper else [])


# The tma engine on V:2:M is the 2:4 engine behind format.as_2_4's index maps: one spec per extreme M.
ENGINE_CASES = [(s, e) for s in SPECS for e in ("mma", "wgmma")] + [(s, "tma") for s in ("2:4", "64:2:8", "128:2:32")]


def _engine_rows(spec: str, engine: str) -> int:
    """Rows for the engine's row tile: the wgmma engine takes R % 128 == 0 (384 = three 128-row tiles)."""
    r = _rows(spec)
    return r if engine == "mma" or r % 128 == 0 else 384


def _skip_unless_engine(spec: str, engine: str) -> None:
    if engine not in _engines(spec):
        pytest.skip(f"the {engine} engine does not run {spec} on this GPU")


def _check_sddmm(x, dy, sw, out_dtype, tol, split=1, engine="auto", x_layout="row"):
    out_dt = jnp.dtype(out_dtype or sw.values.dtype)
    poison(sw.values.shape, out_dt)
    out = jax.jit(lambda x, dy, sw: calls.sddmm(x, dy, sw, out_dtype, split, engine, x_layout))(x, dy, sw)
    out.block_until_ready()
    assert out.shape == sw.values.shape and out.dtype == out_dt
    return _compare(out, _sddmm_ref(x, dy, sw), tol, "sddmm")


def _check_spmm_t(dy, sw, tol):
    t, k = dy.shape[0], sw.shape[0]
    poison((t, k), dy.dtype)
    out = jax.jit(calls.spmm_t)(dy, sw)
    out.block_until_ready()
    assert out.shape == (t, k) and out.dtype == dy.dtype
    return _compare(out, _spmm_t_ref(dy, sw), tol, "spmm_t")


def _rows(spec: str) -> int:
    v = F.VNM.parse(spec).v
    return 192 if v == 1 else (128 if v == 64 else 256)  # 2:4: an odd number of 64-row tiles


# ----------------------------------------------------------------------------- SDDMM


@pytest.mark.parametrize("spec,engine", ENGINE_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("t", [1, 17, 200, 1000])
def test_sddmm_small(spec, engine, dtype, t):
    _skip_unless_engine(spec, engine)
    k = _small_k(F.VNM.parse(spec).m)
    x, dy, sw = _make(key("sddmm", spec, engine, str(dtype), t), t, k, _engine_rows(spec, engine), spec, dtype)
    _check_sddmm(x, dy, sw, None, TOL[dtype], engine=engine)


@pytest.mark.parametrize("spec,engine", ENGINE_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_sddmm_large_tiles(spec, engine, dtype):
    _skip_unless_engine(spec, engine)
    t, k, r = 1000, 1024, 2176
    x, dy, sw = _make(key("sddmm-large", spec, engine, str(dtype)), t, k, r, spec, dtype)
    _check_sddmm(x, dy, sw, None, TOL[dtype], engine=engine)


@pytest.mark.parametrize("spec", ["2:4", "64:2:8", "128:2:16", "64:2:32"])
@pytest.mark.parametrize("engine", ["mma", "wgmma", "tma"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_sddmm_float32_output(spec, engine, dtype):
    """float32 output (for float32 master weights): only accumulation order differs from the reference."""
    _skip_unless_engine(spec, engine)
    k = _small_k(F.VNM.parse(spec).m)
    x, dy, sw = _make(key("sddmm-f32", spec, engine, str(dtype)), 333, k, _engine_rows(spec, engine), spec, dtype)
    _check_sddmm(x, dy, sw, jnp.float32, 1e-4, engine=engine)


@pytest.mark.parametrize("spec,engine", ENGINE_CASES)
@pytest.mark.parametrize("split", [2, 3, 0], ids=["split2", "split3", "auto"])
@pytest.mark.parametrize("t", [200, 1000])
@pytest.mark.parametrize("out_dtype", [None, jnp.float32], ids=["values-dtype", "f32"])
def test_sddmm_token_split(spec, engine, split, t, out_dtype):
    """Token ranges reduced through the call's float32 partial buffer: same result as one pass (T = 200: 7 tiles, so
    3 ranges of 3, 3 and 1; auto picks ranges from the grid size)."""
    _skip_unless_engine(spec, engine)
    k = _small_k(F.VNM.parse(spec).m)
    x, dy, sw = _make(key("sddmm-split", spec, engine, split, t), t, k, _engine_rows(spec, engine), spec, jnp.bfloat16)
    _check_sddmm(x, dy, sw, out_dtype, TOL[jnp.bfloat16] if out_dtype is None else 1e-4, split, engine)


def test_sddmm_wgmma_engine_refuses_what_it_cannot_take():
    """Forcing the wgmma engine where it cannot run fails loudly (here R = 192, not a multiple of 128)."""
    x, dy, sw = _make(key("wgmma-rej"), 64, 512, 192, "2:4", jnp.bfloat16)
    with pytest.raises(Exception, match="wgmma engine"):
        jax.block_until_ready(jax.jit(lambda x, dy, sw: calls.sddmm(x, dy, sw, engine="wgmma"))(x, dy, sw))


# ----------------------------------------------------------------------------- SDDMM, column-major x
#
# x_layout="col": XLA hands the kernel x^T [K][T] (tokens contiguous) and the Hopper x^T engine copies the
# kept columns as rows. T must be a multiple of 8 and R of 128; stages are 64 tokens, tiles 32 groups.


def _skip_unless_col():
    if not _hopper():
        pytest.skip("the column-major x engine runs on Hopper (sm_90a) only")


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("t", [8, 72, 1000])
def test_sddmm_col_major_x(spec, dtype, t):
    """T = 8 (one partial stage), 72 (a full and a partial stage), 1000 (15 full + 40); G % 32 != 0."""
    _skip_unless_col()
    k = _small_k(F.VNM.parse(spec).m)
    x, dy, sw = _make(key("sddmm-col", spec, str(dtype), t), t, k, _engine_rows(spec, "wgmma"), spec, dtype)
    _check_sddmm(x, dy, sw, None, TOL[dtype], x_layout="col")


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_sddmm_col_major_x_large_tiles(spec, dtype):
    _skip_unless_col()
    t, k, r = 1024, 1024, 2176
    x, dy, sw = _make(key("sddmm-col-large", spec, str(dtype)), t, k, r, spec, dtype)
    _check_sddmm(x, dy, sw, None, TOL[dtype], x_layout="col")


@pytest.mark.parametrize("spec", ["2:4", "64:2:8", "128:2:16", "64:2:32"])
@pytest.mark.parametrize("split", [1, 3, 0], ids=["one-pass", "split3", "auto"])
@pytest.mark.parametrize("out_dtype", [None, jnp.float32], ids=["values-dtype", "f32"])
def test_sddmm_col_major_x_split_and_f32(spec, split, out_dtype):
    _skip_unless_col()
    k = _small_k(F.VNM.parse(spec).m)
    x, dy, sw = _make(key("sddmm-col-split", spec, split), 1000, k, _engine_rows(spec, "wgmma"), spec, jnp.bfloat16)
    _check_sddmm(x, dy, sw, out_dtype, TOL[jnp.bfloat16] if out_dtype is None else 1e-4, split, x_layout="col")


@pytest.mark.parametrize("t, r, what", [(17, 256, "T % 8"), (64, 192, "R % 128")])
def test_sddmm_col_major_x_rejects(t, r, what):
    """An explicit column-major x the kernel cannot take raises ValueError before anything is launched."""
    x, dy, sw = _make(key("sddmm-col-rej", what), t, 512, r, "2:4", jnp.bfloat16)
    with pytest.raises(ValueError, match=what.replace("%", "%")):
        calls.sddmm(x, dy, sw, x_layout="col")


@pytest.mark.parametrize("spec", ["2:4", "64:2:8", "128:2:16"])
def test_sddmm_col_major_x_repeatable(spec):
    """Same inputs twice, bit-identical outputs: no buffer is refilled while a wgmma still reads it."""
    _skip_unless_col()
    x, dy, sw = _make(key("rep-col", spec), 4096, 1024, 512, spec, jnp.bfloat16)
    f = jax.jit(lambda x, dy, sw: calls.sddmm(x, dy, sw, split=1, x_layout="col"))
    a = np.asarray(f(x, dy, sw).astype(jnp.float32))
    poison(a.shape, jnp.bfloat16)
    b = np.asarray(f(x, dy, sw).astype(jnp.float32))
    assert np.array_equal(a, b)
    _compare(b, _sddmm_ref(x, dy, sw), TOL[jnp.bfloat16], "sddmm")


def test_sddmm_col_major_x_transposes_with_its_own_kernel():
    """x^T comes from jaxsparse_transpose: XLA runs no transpose or copy kernel of its own for it."""
    _skip_unless_col()
    x, dy, sw = _make(key("hlo-col"), 256, 512, 256, "64:2:8", jnp.bfloat16)

    def backward(x, dy, sw):
        return calls.sddmm(jnp.tanh(x) * 2, dy * 3, sw, x_layout="col")

    text = jax.jit(backward).lower(x, dy, sw).compile().as_text()
    assert 'custom_call_target="jaxsparse_sddmm"' in text and 'custom_call_target="jaxsparse_transpose"' in text
    assert not standalone_layout_moves(text), (standalone_layout_moves(text), text)
    ref = _sddmm_ref(jnp.tanh(x.astype(jnp.float32)).astype(jnp.bfloat16) * 2, dy * 3, sw)
    _compare(jax.jit(backward)(x, dy, sw), ref, TOL[jnp.bfloat16], "sddmm (x^T behind a producer)")


@pytest.mark.parametrize("t", [8, 72, 1000, 4096])
@pytest.mark.parametrize("k", [64, 200, 1024])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_transpose_kernel(t, k, dtype):
    """jaxsparse_transpose is exact, including partial 64 x 64 tiles in both dimensions."""
    x = jax.random.normal(key("transpose", t, k, str(dtype)), (t, k), jnp.float32).astype(dtype)
    poison((k, t), dtype)
    out = jax.jit(calls.transpose)(x)
    assert out.shape == (k, t) and out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(x.astype(jnp.float32)).T)


def test_transpose_rejects():
    with pytest.raises(ValueError, match="T % 8"):
        calls.transpose(jnp.ones((17, 64), jnp.bfloat16))
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        calls.transpose(jnp.ones((16, 64), jnp.float32))


# ----------------------------------------------------------------------------- dX


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("t", [1, 17, 200, 1000])
def test_spmm_t_small(spec, dtype, t):
    k = _small_k(F.VNM.parse(spec).m)
    _, dy, sw = _make(key("spmm_t", spec, str(dtype), t), t, k, _rows(spec), spec, dtype)
    _check_spmm_t(dy, sw, TOL[dtype])


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_spmm_t_large_tiles(spec, dtype):
    t, k, r = 1000, 1024, 2176
    _, dy, sw = _make(key("spmm_t-large", spec, str(dtype)), t, k, r, spec, dtype)
    _check_spmm_t(dy, sw, TOL[dtype])


# ----------------------------------------------------------------------------- races, rejects, layouts


@pytest.mark.parametrize("spec", ["2:4", "64:2:8", "128:2:16"])
def test_backward_repeatable(spec):
    """Same inputs twice give bit-identical outputs (no race in the scatter or the epilogue)."""
    x, dy, sw = _make(key("rep", spec), 517, 512, 256, spec, jnp.bfloat16)
    f = jax.jit(lambda x, dy, sw: (calls.sddmm(x, dy, sw), calls.spmm_t(dy, sw)))
    a = [np.asarray(o.astype(jnp.float32)) for o in f(x, dy, sw)]
    poison(a[0].shape, jnp.bfloat16)
    poison(a[1].shape, jnp.bfloat16)
    b = [np.asarray(o.astype(jnp.float32)) for o in f(x, dy, sw)]
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


@pytest.mark.parametrize("k, r, spec, dtype, what", REJECT_CASES)
def test_backward_rejects(k, r, spec, dtype, what):
    w = jax.random.normal(key("rej", what), (k, r), jnp.float32).astype(dtype)
    sw = F.compress(w, F.select_mask(w, spec), spec)
    x, dy = jnp.ones((4, k), dtype), jnp.ones((4, r), dtype)
    with pytest.raises(ValueError, match=what):
        calls.sddmm(x, dy, sw)
    with pytest.raises(ValueError, match=what):
        calls.spmm_t(dy, sw)


def test_sddmm_rejects_out_dtype():
    x, dy, sw = _make(key("rej-out"), 8, 512, 128, "64:2:8", jnp.bfloat16)
    with pytest.raises(ValueError):
        calls.sddmm(x, dy, sw, jnp.float16)


def test_backward_no_transpose_in_hlo():
    """Producers in front of both calls: the optimized HLO holds the custom calls and no transpose or copy."""
    x, dy, sw = _make(key("hlo"), 256, 512, 256, "64:2:8", jnp.bfloat16)

    def backward(x, dy, sw):
        h = jnp.tanh(x) * 2
        g = dy * 3
        return calls.sddmm(h, g, sw, x_layout="row"), calls.spmm_t(g, sw)

    text = jax.jit(backward).lower(x, dy, sw).compile().as_text()
    assert "jaxsparse_sddmm" in text and "jaxsparse_spmm_t" in text
    assert not layout_moves(text), (layout_moves(text), text)


# ----------------------------------------------------------------------------- the SDDMM's bias gradient


def _check_sddmm_bias_grad(x, dy, sw, split=1, engine="auto", x_layout="row"):
    """``calls.sddmm(..., bias_grad=True)`` into poisoned memory: the values as :func:`_check_sddmm` checks them, and
    every one of the R sums against ``dy`` summed over tokens in float64 (float32 accumulation of 16-bit values: only
    the order differs). The kernel must take the sum: the handler's call returns it (its third result, R floats)."""
    r = sw.shape[1]
    assert calls.sddmm_bias_grad_fused(x.shape[0], sw, engine, x_layout)
    fn = jax.jit(lambda x, dy, sw: calls.sddmm(x, dy, sw, None, split, engine, x_layout, bias_grad=True))
    call = [line for line in fn.lower(x, dy, sw).as_text().splitlines() if "jaxsparse_sddmm" in line]
    assert call and f"tensor<{r}xf32>" in call[0], call
    poison(sw.values.shape, sw.values.dtype)
    poison((r,), jnp.float32)
    dvalues, dbias = jax.block_until_ready(fn(x, dy, sw))
    assert dbias.shape == (r,) and dbias.dtype == jnp.float32
    _compare(dvalues, _sddmm_ref(x, dy, sw), TOL[jnp.float16 if x.dtype == jnp.float16 else jnp.bfloat16],
             "sddmm with the bias gradient")
    got, want = np.asarray(dbias, np.float64), np.asarray(dy, np.float64).sum(0)
    assert np.isfinite(got).all(), f"non-finite bias gradient at rows {np.argwhere(~np.isfinite(got))[:5].ravel()}"
    scale = np.abs(np.asarray(dy, np.float64)).sum(0).max()
    assert np.abs(got - want).max() <= 1e-5 * scale, (np.abs(got - want).max(), scale)


# K = 1024, 1280 and 2304: four, five and nine column tiles of 64 groups (only the first four write their sums).
BIAS_GRAD_CASES = [(spec, k) for spec in ("2:4", "64:2:8", "128:2:32") for k in (1024, 1280, 2304)]


@pytest.mark.parametrize("spec,k", BIAS_GRAD_CASES)
@pytest.mark.parametrize("t,split", [(1, 1), (200, 3), (1000, 1), (1000, 0)], ids=["t1", "t200-split3", "t1000",
                                                                              "t1000-auto"])
def test_sddmm_bias_grad(spec, k, t, split):
    """The tma engine sums dy over tokens for the bias gradient (each of the first four column tiles one k16 step of
    every stage, planes summed in order; split ranges add their own planes) at tails of tokens and column tiles."""
    _skip_unless_engine(spec, "tma")
    x, dy, sw = _make(key("sddmm-bias", spec, k, t, split), t, k, 384, spec, jnp.bfloat16)
    _check_sddmm_bias_grad(x, dy, sw, split, "tma")  # (auto takes the tma engine at M <= 8 only)


@pytest.mark.parametrize("spec", ["2:4", "64:2:8"])
def test_sddmm_bias_grad_fp16_and_explicit_engine(spec):
    _skip_unless_engine(spec, "tma")
    x, dy, sw = _make(key("sddmm-bias-fp16", spec), 777, 1024, 256, spec, jnp.float16)
    _check_sddmm_bias_grad(x, dy, sw, 2, "tma")


# The x^T engine (x_layout "col"): 32 groups a column tile; K / M groups give one column tile (every CTA adds all four
# k16 steps of a stage), two (two steps each), three (the third's CTAs write nothing) and four.
BIAS_GRAD_COL_CASES = [("2:4", 128), ("2:4", 512), ("64:2:8", 256), ("64:2:8", 768), ("64:2:8", 1024),
                       ("128:2:16", 512), ("128:2:16", 1024), ("128:2:16", 1536), ("128:2:32", 1024)]


@pytest.mark.parametrize("spec,k", BIAS_GRAD_COL_CASES)
@pytest.mark.parametrize("t,split", [(8, 1), (200, 3), (1000, 1), (1000, 0)], ids=["t8", "t200-split3", "t1000",
                                                                              "t1000-auto"])
def test_sddmm_bias_grad_col_major_x(spec, k, t, split):
    """The x^T engine sums dy over tokens for the bias gradient at tails of tokens and of column tiles, through
    :func:`calls.sddmm` (after its transpose) and :func:`calls.sddmm_from_xt`."""
    _skip_unless_col()
    x, dy, sw = _make(key("sddmm-bias-col", spec, k, t, split), t, k, 384, spec, jnp.bfloat16)
    _check_sddmm_bias_grad(x, dy, sw, split, "auto", "col")
    poison((384,), jnp.float32)
    _, dbias = jax.jit(lambda xt, dy, sw: calls.sddmm_from_xt(xt, dy, sw, split=split, bias_grad=True))(x.T, dy, sw)
    np.testing.assert_array_equal(np.asarray(dbias), np.asarray(jax.jit(
        lambda x, dy, sw: calls.sddmm(x, dy, sw, None, split, None, "col", bias_grad=True))(x, dy, sw)[1]))


@pytest.mark.parametrize("spec", ["64:2:8", "128:2:16"])
def test_sddmm_bias_grad_col_major_x_fp16(spec):
    _skip_unless_col()
    x, dy, sw = _make(key("sddmm-bias-col-fp16", spec), 776, 1024, 256, spec, jnp.float16)
    _check_sddmm_bias_grad(x, dy, sw, 2, "auto", "col")


def test_sddmm_bias_grad_elsewhere_is_xlas_sum(monkeypatch):
    """Where the kernel does not sum (the mma engine, under four column tiles, JAXSPARSE_SDDMM_BIAS=off) the pair
    comes back all the same, the sum XLA's."""
    _skip_unless_engine("64:2:8", "tma")
    x, dy, sw = _make(key("sddmm-bias-xla"), 100, 1024, 256, "64:2:8", jnp.bfloat16)
    want = np.asarray(dy, np.float32).sum(0)
    assert not calls.sddmm_bias_grad_fused(100, sw, "mma", "row")
    _, dbias = jax.jit(lambda x, dy, sw: calls.sddmm(x, dy, sw, engine="mma", x_layout="row", bias_grad=True))(x, dy, sw)
    np.testing.assert_allclose(np.asarray(dbias), want, rtol=1e-5, atol=1e-3)
    x4, dy4, sw4 = _make(key("sddmm-bias-xla-narrow"), 100, 512, 256, "64:2:8", jnp.bfloat16)
    assert not calls.sddmm_bias_grad_fused(100, sw4, "tma", "row")  # two column tiles: under the four that write
    _, dbias = jax.jit(lambda x, dy, sw: calls.sddmm(x, dy, sw, engine="tma", x_layout="row", bias_grad=True))(x4, dy4,
                                                                                                              sw4)
    np.testing.assert_allclose(np.asarray(dbias), np.asarray(dy4, np.float32).sum(0), rtol=1e-5, atol=1e-3)
    monkeypatch.setenv("JAXSPARSE_SDDMM_BIAS", "off")
    assert not calls.sddmm_bias_grad_fused(100, sw, "tma", "row")
    _, dbias = jax.jit(lambda x, dy, sw: calls.sddmm(x, dy, sw, engine="tma", x_layout="row", bias_grad=True))(x, dy, sw)
    np.testing.assert_allclose(np.asarray(dbias), want, rtol=1e-5, atol=1e-3)


# ----------------------------------------------------------------------------- sparse_linear's VJP
#
# jax.grad of ops.sparse_linear under jit, with every product forced onto its kernel.


def _force_backward_kernels(monkeypatch, dx_route: str = "kernel") -> None:
    """Every sparse product on its GPU path (an unsupported operand raises instead of falling back)."""
    monkeypatch.setenv("JAXSPARSE_BACKEND", "cuda")
    monkeypatch.setenv("JAXSPARSE_DX", dx_route)
    monkeypatch.delenv("JAXSPARSE_REFERENCE_OPS", raising=False)


def _loss(sw):
    from jaxsparse import ops

    def loss(x, values, bias, target):
        y = ops.sparse_linear(x, sw.replace(values=values), bias)
        return jnp.sum(y.astype(jnp.float32) * target)

    return loss


def _grad_fn(sw):
    return jax.jit(jax.grad(_loss(sw), argnums=(0, 1, 2)))


def _bias_and_target(rng, t: int, r: int, dtype):
    """A bias and the cotangent of y, cast to the output dtype (the reference uses exactly that)."""
    kb, kt = jax.random.split(rng)
    bias = jax.random.normal(kb, (r,), jnp.float32).astype(dtype)
    return bias, jax.random.normal(kt, (t, r), jnp.float32).astype(dtype).astype(jnp.float32)


def _check_layer_grads(sw, x, bias, target, dtype):
    """The jitted gradients of the layer (output poisoned first) against the float32 references."""
    poison(x.shape, dtype)
    gx, gv, gb = _grad_fn(sw)(x, sw.values, bias, target)
    assert gx.dtype == dtype and gv.dtype == dtype and gv.shape == sw.values.shape
    dense = F.decompress(sw).astype(jnp.float32)
    _compare(gx, jnp.dot(target, dense.T, precision=HIGHEST), TOL[dtype], "dx")
    _compare(gv, F.compress_like(jnp.dot(x.astype(jnp.float32).T, target, precision=HIGHEST), sw), TOL[dtype],
             "dvalues")
    _compare(gb[None], target.sum(0)[None], TOL[dtype], "dbias")


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("t", [17, 1000])
@pytest.mark.parametrize("dx_route", ["kernel", "dense"])
def test_sparse_linear_grad_on_kernels(monkeypatch, spec, dtype, t, dx_route):
    _force_backward_kernels(monkeypatch, dx_route)
    k = _small_k(F.VNM.parse(spec).m)
    r = _rows(spec)
    x, _, sw = _make(key("grad", spec, str(dtype), t), t, k, r, spec, dtype)
    bias, target = _bias_and_target(key("grad-bt", spec, str(dtype), t), t, r, dtype)
    _check_layer_grads(sw, x, bias, target, dtype)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("t", [17, 1000])
def test_sparse_linear_grad_on_the_transposed_dx_route(monkeypatch, spec, dtype, t):
    """``JAXSPARSE_DX=transposed`` with a transposable mask: dX runs as the 2:4 forward kernel on ``W^T``
    (``format.transpose_2_4``); the layer's gradients match the float32 reference. K = 512 (the transposed
    weight's rows, a multiple of the forward's 64-row tile), R = 256 (its reduction, whole metadata words)."""
    _force_backward_kernels(monkeypatch, "transposed")
    k, r = 512, 256
    x, _, sw = _make(key("grad-t", spec, str(dtype), t), t, k, r, spec, dtype, transposable=True)
    bias, target = _bias_and_target(key("grad-t-bt", spec, str(dtype), t), t, r, dtype)
    _check_layer_grads(sw, x, bias, target, dtype)


def _grad_hlo(monkeypatch, spec: str, dx_route: str = "kernel") -> str:
    """Optimized HLO of the jitted value-and-gradient of a sparse layer, every product on its GPU path, x
    row-major everywhere (the column-major SDDMM operand has its own test below)."""
    _force_backward_kernels(monkeypatch, dx_route)
    monkeypatch.setenv("JAXSPARSE_SDDMM_X", "row")
    monkeypatch.setenv("JAXSPARSE_SPMM_X", "row")
    x, _, sw = _make(key("grad-hlo", spec), 256, 512, 256, spec, jnp.bfloat16)
    bias = jnp.zeros((256,), jnp.bfloat16)
    target = jnp.ones((256, 256), jnp.float32)
    # value_and_grad: the loss value keeps the forward SpMM alive (a linear loss's gradient needs no y).
    vg = jax.jit(jax.value_and_grad(_loss(sw), argnums=(0, 1, 2)))
    text = vg.lower(x, sw.values, bias, target).compile().as_text()
    assert not layout_moves(text), (layout_moves(text), text)  # no transpose or copy around the calls
    return text


def test_sparse_linear_grad_hlo_has_kernels_and_no_transpose(monkeypatch):
    """The jitted gradient runs the three kernels (the forward on the mma.sp row kernel: the auto route of 64:2:8
    on Hopper, the TMA row kernel on the 2:4 view, is pinned by test_sparse_linear_2_4_reads_x_as_it_is), and XLA
    puts no transpose or copy around them."""
    monkeypatch.setenv("JAXSPARSE_SPMM_ROW_KERNEL", "mma")
    text = _grad_hlo(monkeypatch, "64:2:8")
    for name in ("jaxsparse_spmm", "jaxsparse_sddmm", "jaxsparse_spmm_t"):
        assert f'custom_call_target="{name}"' in text, name


@pytest.mark.parametrize("spec", ["2:4", "64:2:8"])
def test_sparse_linear_grad_hlo_transposed_dx_route(monkeypatch, spec):
    """The transposed dX route (JAXSPARSE_DX=transposed): W^T comes from jaxsparse_transpose_2_4 and dX from the
    forward kernel on it; XLA puts no transpose or copy around the calls (dy is read as it is)."""
    text = _grad_hlo(monkeypatch, spec, dx_route="transposed")
    assert 'custom_call_target="jaxsparse_transpose_2_4"' in text
    assert 'custom_call_target="jaxsparse_sddmm"' in text
    assert 'custom_call_target="jaxsparse_spmm_t"' not in text  # the structured dX kernel is not on this route


def test_sparse_linear_grad_hlo_col_major_x_has_no_layout_kernel(monkeypatch):
    """With the SDDMM reading x^T, jaxsparse_transpose makes it: XLA runs no transpose or copy kernel."""
    _skip_unless_col()
    _force_backward_kernels(monkeypatch, "dense")
    monkeypatch.setenv("JAXSPARSE_SDDMM_X", "col")
    monkeypatch.setenv("JAXSPARSE_SPMM_X", "row")
    x, _, sw = _make(key("grad-hlo-col"), 256, 512, 256, "64:2:8", jnp.bfloat16)
    bias = jnp.zeros((256,), jnp.bfloat16)
    target = jnp.ones((256, 256), jnp.float32)
    loss = _loss(sw)
    vg = jax.jit(jax.value_and_grad(lambda x, v, b, t: loss(jnp.tanh(x) * 2, v, b, t), argnums=(0, 1, 2)))
    text = vg.lower(x, sw.values, bias, target).compile().as_text()
    assert 'custom_call_target="jaxsparse_sddmm"' in text and 'custom_call_target="jaxsparse_transpose"' in text
    assert not layout_moves(text), layout_moves(text)


@pytest.mark.parametrize("spec", ["2:4", "64:2:8"])
def test_sparse_linear_grad_hlo_x_transposed_route_transposes_once(monkeypatch, spec):
    """The layer's x^T route (JAXSPARSE_SPMM_X=col): one jaxsparse_transpose feeds the x^T SpMM and the
    SDDMM; XLA runs no transpose or copy kernel."""
    _skip_unless_col()
    _force_backward_kernels(monkeypatch, "dense")
    monkeypatch.setenv("JAXSPARSE_SPMM_X", "col")
    x, _, sw = _make(key("grad-hlo-xt", spec), 256, 512, 256, spec, jnp.bfloat16)
    bias = jnp.zeros((256,), jnp.bfloat16)
    target = jnp.ones((256, 256), jnp.float32)
    loss = _loss(sw)
    vg = jax.jit(jax.value_and_grad(lambda x, v, b, t: loss(jnp.tanh(x) * 2, v, b, t), argnums=(0, 1, 2)))
    text = vg.lower(x, sw.values, bias, target).compile().as_text()
    for name in ("jaxsparse_spmm_xt", "jaxsparse_sddmm", "jaxsparse_transpose"):
        assert f'custom_call_target="{name}"' in text, name
    assert text.count('custom_call_target="jaxsparse_transpose"') == 1
    assert 'custom_call_target="jaxsparse_spmm"' not in text
    assert not layout_moves(text), layout_moves(text)


@pytest.mark.parametrize("spec", ["2:4", "64:2:8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("t", [17, 1000])
def test_sparse_linear_2_4_reads_x_as_it_is(monkeypatch, spec, dtype, t):
    """2:4 and 64:2:8 (an M in calls.TMA_ROW_AUTO_M, through its 2:4 view) on Hopper, default routes: the TMA
    forward and the TMA SDDMM read x [T, K] as it is, so the jitted gradient runs no transpose of ours or XLA's,
    and matches the reference."""
    if not _hopper():
        pytest.skip("the TMA kernels run on Hopper")
    _force_backward_kernels(monkeypatch, "dense")
    for env in ("JAXSPARSE_SPMM_X", "JAXSPARSE_SDDMM_X", "JAXSPARSE_SPMM_ROW_KERNEL", "JAXSPARSE_SDDMM_ENGINE"):
        monkeypatch.delenv(env, raising=False)
    k, r = 1024, 384
    x, _, sw = _make(key("grad-2-4", spec, str(dtype), t), t, k, r, spec, dtype)
    bias, target = _bias_and_target(key("grad-2-4-bt", spec, str(dtype), t), t, r, dtype)
    vg = jax.jit(jax.value_and_grad(lambda x, v, b, tg: _loss(sw)(jnp.tanh(x), v, b, tg), argnums=(0, 1, 2)))
    text = vg.lower(x, sw.values, bias, target).compile().as_text()
    for name in ("jaxsparse_spmm_xt", "jaxsparse_sddmm") + (("jaxsparse_as_2_4",) if spec != "2:4" else ()):
        assert f'custom_call_target="{name}"' in text, name
    assert 'custom_call_target="jaxsparse_transpose"' not in text
    assert not layout_moves(text), layout_moves(text)
    _check_layer_grads(sw, x, bias, target, dtype)


@pytest.mark.parametrize("spec,dx_route", [("2:4", "kernel"), ("2:4", "dense"), ("64:2:8", "dense")])
def test_dense_dx_route_takes_the_dense_product_without_transposes(monkeypatch, spec, dx_route):
    """2:4 always, and any M on the dense route: dX is XLA's product over the decompressed weight."""
    text = _grad_hlo(monkeypatch, spec, dx_route)
    forward = "jaxsparse_spmm_xt" if calls.spmm_row_kernel(_make(key("k"), 8, 512, 256, spec, jnp.bfloat16)[2]) == "tma" \
        else "jaxsparse_spmm"
    for name in (forward, "jaxsparse_sddmm", "jaxsparse_decompress"):
        assert f'custom_call_target="{name}"' in text, name
    assert 'custom_call_target="jaxsparse_spmm_t"' not in text


# ----------------------------------------------------------------------------- sparse_mlp's VJP
#
# The feed-forward block act(x W1 + b1) W2 + b2 with the activation fused into the kernels: the first product's
# epilogue writes act(z) and act'(z), and the backward multiplies the second layer's input gradient by act'(z).


@pytest.mark.parametrize("spec", ["2:4", "64:2:8", "128:2:16"])
@pytest.mark.parametrize("activation", ["gelu_erf", "gelu"])
@pytest.mark.parametrize("dx_route", ["transposed", "dense"])
def test_sparse_mlp_grad_on_kernels(monkeypatch, spec, activation, dx_route):
    """``jax.grad`` of ``ops.sparse_mlp`` under ``jit`` (every product forced onto its kernel, outputs poisoned)
    against float32 references built from the dense weights; 1000 tokens (a tail on every tile)."""
    from jaxsparse import ops, reference

    _force_backward_kernels(monkeypatch, dx_route)
    dtype, t, k, f, r = jnp.bfloat16, 1000, 256, 512, 256
    spec_t = dx_route == "transposed"
    x, _, sw1 = _make(key("mlp", spec, activation, dx_route, 1), t, k, f, spec, dtype, transposable=spec_t)
    _, _, sw2 = _make(key("mlp", spec, activation, dx_route, 2), t, f, r, spec, dtype, transposable=spec_t)
    b1, _ = _bias_and_target(key("mlp-b1", spec), t, f, dtype)
    b2, target = _bias_and_target(key("mlp-b2", spec), t, r, dtype)

    def loss(x, v1, b1, v2, b2):
        y = ops.sparse_mlp(x, sw1.replace(values=v1), b1, sw2.replace(values=v2), b2, activation)
        return jnp.sum(y.astype(jnp.float32) * target)

    poison((4, t, f), dtype)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(x, sw1.values, b1, sw2.values, b2)
    assert [g.dtype for g in grads] == [dtype] * 5

    w1, w2 = F.decompress(sw1).astype(jnp.float32), F.decompress(sw2).astype(jnp.float32)

    def ref_loss(x, w1, b1, w2, b2):
        a = jnp.dot(x, w1, precision=HIGHEST) + b1
        y = jnp.dot(reference.ACTIVATIONS[activation](a), w2, precision=HIGHEST) + b2
        return jnp.sum(y * target)

    f32 = lambda a: a.astype(jnp.float32)
    gx, gw1, gb1, gw2, gb2 = jax.grad(ref_loss, argnums=(0, 1, 2, 3, 4))(f32(x), w1, f32(b1), w2, f32(b2))
    tol = 2 * TOL[dtype]  # two products and an activation's derivative in bf16 between them
    _compare(grads[0], gx, tol, "dx")
    _compare(grads[1], F.compress_like(gw1, sw1), tol, "dvalues1")
    _compare(grads[2][None], gb1[None], tol, "dbias1")
    _compare(grads[3], F.compress_like(gw2, sw2), tol, "dvalues2")
    _compare(grads[4][None], gb2[None], tol, "dbias2")


@pytest.mark.parametrize("spec", ["2:4", "64:2:8"])
def test_sparse_mlp_grad_hlo_fuses_the_activation(monkeypatch, spec):
    """On the transposed dX route the block's gradient holds one forward call that writes act(z) and act'(z)
    (act_mode 1) and no GELU of XLA's, and XLA puts no transpose or copy around the calls."""
    from jaxsparse import ops

    _force_backward_kernels(monkeypatch, "transposed")
    monkeypatch.setenv("JAXSPARSE_SPMM_X", "row")
    monkeypatch.setenv("JAXSPARSE_SDDMM_X", "row")
    x, _, sw1 = _make(key("mlp-hlo", spec, 1), 256, 256, 512, spec, jnp.bfloat16, transposable=True)
    _, _, sw2 = _make(key("mlp-hlo", spec, 2), 256, 512, 256, spec, jnp.bfloat16, transposable=True)

    def loss(x, v1, v2):
        y = ops.sparse_mlp(x, sw1.replace(values=v1), None, sw2.replace(values=v2), None, "gelu_erf")
        return jnp.sum(y.astype(jnp.float32))

    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(x, sw1.values, sw2.values).compile().as_text()
    assert not layout_moves(text), layout_moves(text)
    assert len(re.findall(r"act_mode = 1 ", text)) == 1, "one forward call writes act and act'"
    assert not re.search(r"= \S+ erf\(", text), "XLA computes no GELU: the kernels do"


@pytest.mark.parametrize("hidden", ["col", "row"])
def test_sparse_mlp_transposed_hidden_drops_the_transpose_of_h(monkeypatch, hidden):
    """128:2:16 on the x^T route (Hopper's default): with the hidden activation handed over as h^T (act_mode 2,
    ops.mlp_hidden_layout "col", the default there) the block's gradient runs one jaxsparse_transpose (of x) where
    the "row" hand-over runs two (x and h), and XLA adds no transpose or copy. (Its values: at 128:2:16
    test_sparse_mlp_grad_on_kernels runs this default route against float32 references.)"""
    from jaxsparse import ops

    _skip_unless_col()
    _force_backward_kernels(monkeypatch, "transposed")
    monkeypatch.delenv("JAXSPARSE_SPMM_X", raising=False)
    monkeypatch.delenv("JAXSPARSE_SPMM_XT_TILE", raising=False)
    monkeypatch.setenv(ops.MLP_HIDDEN_ENV, hidden)
    spec = "128:2:16"
    x, _, sw1 = _make(key("mlp-ht", 1), 256, 512, 512, spec, jnp.bfloat16, transposable=True)
    _, _, sw2 = _make(key("mlp-ht", 2), 256, 512, 256, spec, jnp.bfloat16, transposable=True)
    assert ops.mlp_hidden_layout(256, sw1, sw2) == hidden

    def loss(x, v1, v2):
        y = ops.sparse_mlp(x, sw1.replace(values=v1), None, sw2.replace(values=v2), None, "gelu_erf")
        return jnp.sum(y.astype(jnp.float32))

    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(x, sw1.values, sw2.values).compile().as_text()
    assert not layout_moves(text), layout_moves(text)
    assert text.count('custom_call_target="jaxsparse_transpose"') == (1 if hidden == "col" else 2)
    assert len(re.findall(r"act_mode = 2 ", text)) == (1 if hidden == "col" else 0)


# ----------------------------------------------------------------------------- layers sharing their input
#
# calls.spmm_sum: sum_i x_i @ W_i for up to three 2:4 weights of one shape, one jaxsparse_spmm_xt call whose reduction
# runs over the products in turn; calls.spmm_t_sum: the same over W^T's views, all built by one
# jaxsparse_transpose_2_4 call (the input gradient of ops.shared_linear). Hopper only.


def _sum_ref(xs, sws):
    return sum(jnp.dot(x.astype(jnp.float32), F.decompress(sw).astype(jnp.float32), precision=HIGHEST)
               for x, sw in zip(xs, sws))


@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("t, k, r", [(1000, 128, 384), (200, 64, 192), (4096, 1024, 256)])
def test_spmm_sum_kernel(parts, dtype, t, k, r):
    """One call against the float32 sum of the products, output poisoned: a token tail on the 256-token tiles (1000,
    200), one 64-k step a product (K = 64), 128- and 64-feature tiles (R = 384, 192), and BERT's 1024-deep parts."""
    _skip_unless_col()
    xs, sws = [], []
    for i in range(parts):
        x, _, sw = _make(key("spmm-sum", parts, str(dtype), t, k, r, i), t, k, r, "2:4", dtype)
        xs.append(x)
        sws.append(sw)
    poison((t, r), dtype)
    y = jax.jit(calls.spmm_sum)(xs, sws)
    assert y.shape == (t, r) and y.dtype == dtype
    _compare(y, _sum_ref(xs, sws), TOL[dtype], f"spmm_sum of {parts}")


def test_spmm_sum_refuses_what_the_kernel_cannot_take():
    _skip_unless_col()
    x, _, sw = _make(key("spmm-sum-bad"), 64, 128, 128, "2:4", jnp.bfloat16)
    _, _, sw8 = _make(key("spmm-sum-bad8"), 64, 128, 128, "64:2:8", jnp.bfloat16)
    _, _, wide = _make(key("spmm-sum-badr"), 64, 128, 256, "2:4", jnp.bfloat16)
    x96, _, sw96 = _make(key("spmm-sum-bad96"), 64, 96, 128, "2:4", jnp.bfloat16)
    with pytest.raises(ValueError, match="2:4 weights"):
        calls.spmm_sum([x, x], [sw, sw8])
    with pytest.raises(ValueError, match="one shape and dtype"):
        calls.spmm_sum([x, x], [sw, wide])
    with pytest.raises(ValueError, match="K % 64"):
        calls.spmm_sum([x96, x96], [sw96, sw96])
    with pytest.raises(ValueError, match="one to 3"):
        calls.spmm_sum([x] * 4, [sw] * 4)
    with pytest.raises(ValueError, match="every x must be"):
        calls.spmm_sum([x, x[:32]], [sw, sw])


@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("spec", ["2:4", "128:2:16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_spmm_t_sum_kernel(parts, spec, dtype):
    """``calls.spmm_t_sum`` (one stacked W^T build, one summed product) against the float32 ``sum_i dy_i W_i^T``,
    output poisoned, with a token tail; the compiled function holds exactly one call of each."""
    _skip_unless_col()
    t, k, r = 1000, 256, 256
    dys, sws = [], []
    for i in range(parts):
        _, dy, sw = _make(key("spmm-t-sum", parts, spec, str(dtype), i), t, k, r, spec, dtype, transposable=True)
        dys.append(dy)
        sws.append(sw)
    f = jax.jit(calls.spmm_t_sum).lower(dys, sws).compile()
    text = f.as_text()
    assert text.count('custom_call_target="jaxsparse_transpose_2_4"') == 1
    assert text.count('custom_call_target="jaxsparse_spmm_xt"') == 1
    poison((t, k), dtype)
    y = f(dys, sws)
    assert y.shape == (t, k) and y.dtype == dtype
    _compare(y, sum(_spmm_t_ref(dy, sw) for dy, sw in zip(dys, sws)), TOL[dtype], f"spmm_t_sum of {parts}")


def test_spmm_t_sum_refuses_what_the_kernels_cannot_take():
    _skip_unless_col()
    _, dy, sw = _make(key("spmm-t-sum-bad"), 64, 128, 128, "2:4", jnp.bfloat16, transposable=True)
    _, _, sw16 = _make(key("spmm-t-sum-bad16"), 64, 128, 128, "128:2:16", jnp.bfloat16, transposable=True)
    _, dy96, sw96 = _make(key("spmm-t-sum-bad96"), 64, 128, 96, "2:4", jnp.bfloat16, transposable=True)
    with pytest.raises(ValueError, match="one shape and spec"):
        calls.spmm_t_sum([dy, dy], [sw, sw16])
    with pytest.raises(ValueError, match="K % 64"):
        calls.spmm_t_sum([dy96, dy96], [sw96, sw96])
    with pytest.raises(ValueError, match="one to 3"):
        calls.spmm_t_sum([dy] * 4, [sw] * 4)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        calls.spmm_t_sum([dy], [sw.replace(values=sw.values.astype(jnp.float32))])


# (spec, x layout) of calls.sddmm_stacked: the tma engine on 2:4 and on 64:2:8's 2:4 view; the x^T engine's
# warp-specialized kernel (V = 128), its gathering kernel (V = 64) and its deep kernel (2:4).
STACKED_CASES = [("2:4", "row"), ("64:2:8", "row"), ("128:2:16", "col"), ("64:2:32", "col"), ("2:4", "col")]


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("spec, layout", STACKED_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_sddmm_stacked_kernel(parts, spec, layout, dtype, bias):
    """``calls.sddmm_stacked`` (one ``jaxsparse_sddmm`` over two or three layers' rows, each dy by its own descriptor)
    against each layer's float32 ``x^T dy`` at its mask and ``dy`` summed over tokens, output poisoned; a token tail
    and a partial last group tile (K = 40 M, 24 x 32 at M = 32)."""
    _skip_unless_col()
    t, r = 1000, 256
    k = _small_k(F.VNM.parse(spec).m)
    made = [_make(key("sddmm-stacked", parts, spec, layout, str(dtype), i), t, k, r, spec, dtype) for i in range(parts)]
    x, dys, sws = made[0][0], [dy for _, dy, _ in made], [sw for _, _, sw in made]
    xin = jnp.asarray(x.T) if layout == "col" else x
    f = jax.jit(lambda a, d, s: calls.sddmm_stacked(a, d, s, layout, bias)).lower(xin, dys, sws).compile()
    assert f.as_text().count('custom_call_target="jaxsparse_sddmm"') == 1
    poison((parts * r, sws[0].values.shape[1]), dtype)
    outs = f(xin, dys, sws)
    assert len(outs) == parts
    for i, (out, dy, sw) in enumerate(zip(outs, dys, sws)):
        dvalues, dbias = out if bias else (out, None)
        assert dvalues.shape == sw.values.shape and dvalues.dtype == dtype
        _compare(dvalues, _sddmm_ref(x, dy, sw), TOL[dtype], f"layer {i} dvalues")
        if bias:
            assert dbias.dtype == jnp.float32
            _compare(dbias[None], dy.astype(jnp.float32).sum(0)[None], TOL[dtype], f"layer {i} dbias")


def test_sddmm_stacked_refuses_what_the_kernels_cannot_take():
    """``calls.sddmm_stacked`` refuses before the call (ValueError naming the constraint), and the handler refuses a
    further layer whose dy or metadata shape is not the first's (the call fails)."""
    _skip_unless_col()
    x, dy, sw = _make(key("sddmm-stacked-bad"), 64, 160, 128, "2:4", jnp.bfloat16)
    _, dy16, sw16 = _make(key("sddmm-stacked-bad16"), 64, 640, 128, "128:2:16", jnp.bfloat16)
    with pytest.raises(ValueError, match="one shape, spec and dtype"):
        calls.sddmm_stacked(x, [dy, dy], [sw, sw16], "row")
    with pytest.raises(ValueError, match="one to 3"):
        calls.sddmm_stacked(x, [dy] * 4, [sw] * 4, "row")
    with pytest.raises(ValueError, match="tma engine"):
        calls.sddmm_stacked(jnp.zeros((64, 640), jnp.bfloat16), [dy16, dy16], [sw16, sw16], "row")
    with pytest.raises(ValueError, match="T % 8"):
        calls.sddmm_stacked(jnp.zeros((640, 60), jnp.bfloat16), [dy16[:60]] * 2, [sw16, sw16], "col")
    with pytest.raises(ValueError, match="x\\^T"):
        calls.sddmm_stacked(x, [dy16, dy16], [sw16, sw16], "col")
    stacked = F.SparseWeight(jax.ShapeDtypeStruct((256, 80), jnp.bfloat16), None, sw.metadata, (160, 256), sw.spec)
    with pytest.raises(Exception, match="every further dy must have dy's shape"):
        jax.block_until_ready(calls._sddmm_call(x, dy, stacked, jnp.bfloat16, None, calls.SDDMM_ENGINES["tma"], 0,
                                                further=((dy[:32], sw),)))
    with pytest.raises(Exception, match="metadata"):  # a further layer's metadata of another shape
        jax.block_until_ready(calls._sddmm_call(x, dy, stacked, jnp.bfloat16, None, calls.SDDMM_ENGINES["tma"], 0,
                                                further=((dy, sw.replace(metadata=sw.metadata[:64])),)))
    # metadata holding both layers' rows (as_2_4_stacked's): the further layer must not bring its own as well
    both = stacked.replace(metadata=jnp.concatenate([sw.metadata, sw.metadata]))
    with pytest.raises(Exception, match="further layers' columns and metadata must be empty"):
        jax.block_until_ready(calls._sddmm_call(x, dy, both, jnp.bfloat16, None, calls.SDDMM_ENGINES["tma"], 0,
                                                further=((dy, sw),)))


# calls.spmm_stacked: the forward of up to three layers of one input (query, key, value) by one jaxsparse_spmm_xt call
# over their rows stacked, each output written where it is held (attribute y_parts). Hopper only.
STACKED_FORWARD_CASES = [("2:4", "row"), ("64:2:8", "row"), ("128:2:16", "col"), ("64:2:32", "col")]


def _forward_ref(x, sw, bias):
    y = jnp.dot(x.astype(jnp.float32), F.decompress(sw).astype(jnp.float32), precision=HIGHEST)
    return y if bias is None else y + bias.astype(jnp.float32)


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("spec, layout", STACKED_FORWARD_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("bias", ["none", "all", "some", "f32"])
def test_spmm_stacked_kernel(parts, spec, layout, dtype, bias):
    """``calls.spmm_stacked`` (one ``jaxsparse_spmm_xt`` over two or three layers' rows, each output its own array)
    against each layer's float32 ``x W_i + b_i``, outputs poisoned; a token tail (1000 tokens on 128- and 256-token
    tiles), a partial last group tile (K = 40 M, 24 x 32 at M = 32), biases in x's dtype or float32 and a missing one
    (zeros added); the compiled function holds one call and no slice or copy of its outputs."""
    _skip_unless_col()
    t, r = 1000, 256
    k = _small_k(F.VNM.parse(spec).m)
    made = [_make(key("spmm-stacked", parts, spec, layout, str(dtype), bias, i), t, k, r, spec, dtype)
            for i in range(parts)]
    x, sws = made[0][0], [sw for _, _, sw in made]
    bdtype = jnp.float32 if bias == "f32" else dtype
    biases = [None if bias == "none" or (bias == "some" and i == 1) else
              jax.random.normal(key("spmm-stacked-bias", spec, i), (r,), jnp.float32).astype(bdtype)
              for i in range(parts)]
    xin = jnp.asarray(x.T) if layout == "col" else x
    f = jax.jit(lambda a, s, b: calls.spmm_stacked(a, s, b, layout)).lower(xin, sws, biases).compile()
    text = f.as_text()
    assert text.count('custom_call_target="jaxsparse_spmm_xt"') == 1
    # a V:2:M weight on the row route: the layers' 2:4 views by one stacked build (as_2_4_stacked), not concatenated
    assert text.count('custom_call_target="jaxsparse_as_2_4"') == int(layout == "row" and spec != "2:4")
    assert not layout_moves(text), layout_moves(text)
    for _ in range(parts):
        poison((t, r), dtype)
    ys = f(xin, sws, biases)
    assert len(ys) == parts
    for i, (y, sw, b) in enumerate(zip(ys, sws, biases)):
        assert y.shape == (t, r) and y.dtype == dtype
        _compare(y, _forward_ref(x, sw, b), TOL[dtype], f"layer {i}")


def test_spmm_stacked_refuses_what_the_kernels_cannot_take():
    """``calls.spmm_stacked`` refuses before the call (ValueError naming the constraint), and the handler refuses
    y_parts with an epilogue that writes a second output (the call fails)."""
    _skip_unless_col()
    x, _, sw = _make(key("spmm-stacked-bad"), 64, 160, 128, "2:4", jnp.bfloat16)
    _, _, sw16 = _make(key("spmm-stacked-bad16"), 64, 640, 128, "128:2:16", jnp.bfloat16)
    _, _, narrow = _make(key("spmm-stacked-bad64"), 64, 160, 64, "2:4", jnp.bfloat16)
    with pytest.raises(ValueError, match="one shape, spec and dtype"):
        calls.spmm_stacked(x, [sw, sw16], None, "row")
    with pytest.raises(ValueError, match="one to 3"):
        calls.spmm_stacked(x, [sw] * 4, None, "row")
    with pytest.raises(ValueError, match="R % 128"):
        calls.spmm_stacked(x, [narrow] * 2, None, "row")
    with pytest.raises(ValueError, match="TMA row kernel"):
        calls.spmm_stacked(jnp.zeros((64, 640), jnp.bfloat16), [sw16, sw16], None, "row")
    with pytest.raises(ValueError, match="T % 8"):
        calls.spmm_stacked(jnp.zeros((640, 60), jnp.bfloat16), [sw16, sw16], None, "col")
    with pytest.raises(ValueError, match="x\\^T"):
        calls.spmm_stacked(x, [sw16, sw16], None, "col")
    with pytest.raises(ValueError, match="one bias"):
        calls.spmm_stacked(x, [sw, sw], [None], "row")
    with pytest.raises(Exception, match="y_parts = 2 needs act_mode 0"):
        jax.block_until_ready(calls._spmm_xt_call(x, sw, None, "gelu", x_rows=True, act_mode=1, y_parts=2))


@pytest.mark.parametrize("spec", ["2:4", "64:2:8", "128:2:16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("t", [17, 1000])
@pytest.mark.parametrize("shared_spmm", ["auto", "off"])
def test_shared_linear_forward_on_kernels(monkeypatch, spec, dtype, t, shared_spmm):
    """``shared_linear``'s three outputs against the float32 references, outputs poisoned: one stacked forward call
    where it runs (``JAXSPARSE_SHARED_SPMM`` auto; 17 tokens on the x^T route fall back to three), three with it off;
    the x^T route transposes x once either way."""
    _skip_unless_col()
    from jaxsparse import ops

    monkeypatch.setenv(ops.SHARED_SPMM_ENV, shared_spmm)
    k = r = 256
    made = [_make(key("shared-fwd", spec, str(dtype), t, i), t, k, r, spec, dtype, transposable=True) for i in range(3)]
    x, sws = made[0][0], [sw for _, _, sw in made]
    biases = [jax.random.normal(key("shared-fwd-bias", spec, i), (r,), jnp.float32).astype(dtype) for i in range(3)]
    # (a new function each case: jit's cache would hand the off case the auto case's trace)
    f = jax.jit(lambda a, s, b: ops.shared_linear(a, s, b)).lower(x, sws, biases).compile()
    text = f.as_text()
    col = ops.linear_x_layout(t, sws[0]) == "col"
    stacked = shared_spmm == "auto" and not (spec == "128:2:16" and t % 8)  # 17 tokens: the mma row kernel
    products = sum(text.count(f'custom_call_target="{c}"') for c in ("jaxsparse_spmm_xt", "jaxsparse_spmm"))
    assert products == (1 if stacked else 3), (spec, t, shared_spmm, products)
    assert text.count('custom_call_target="jaxsparse_transpose"') == int(col)
    for _ in range(3):
        poison((t, r), dtype)
    ys = f(x, sws, biases)
    for i, (y, sw, b) in enumerate(zip(ys, sws, biases)):
        assert y.shape == (t, r) and y.dtype == dtype
        _compare(y, _forward_ref(x, sw, b), TOL[dtype], f"layer {i}")


def _shared_grads(monkeypatch, spec: str, dtype, t: int, shared: str, shared_sddmm: str = "auto"):
    """``jax.grad`` under ``jit`` of three layers of one input through ``ops.shared_linear`` (every product on its GPU
    path, the transposed dX route, ``JAXSPARSE_SHARED_DX=shared``, ``JAXSPARSE_SHARED_SDDMM=shared_sddmm``), outputs
    poisoned first; and what it takes."""
    from jaxsparse import ops

    _force_backward_kernels(monkeypatch, "transposed")
    monkeypatch.setenv(ops.SHARED_DX_ENV, shared)
    monkeypatch.setenv(ops.SHARED_SDDMM_ENV, shared_sddmm)
    k = r = 256
    parts = [_make(key("shared", spec, str(dtype), t, i), t, k, r, spec, dtype, transposable=True) for i in range(3)]
    x, sws = parts[0][0], [sw for _, _, sw in parts]
    biases, targets = zip(*(_bias_and_target(key("shared-bt", spec, str(dtype), t, i), t, r, dtype) for i in range(3)))

    def loss(x, values, biases):
        ys = ops.shared_linear(x, [sw.replace(values=v) for sw, v in zip(sws, values)], biases)
        return sum(jnp.sum(y.astype(jnp.float32) * tg) for y, tg in zip(ys, targets))

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    poison(x.shape, dtype)
    _, grads = grad(x, [sw.values for sw in sws], list(biases))
    return grads, (x, sws, targets), grad.lower(x, [sw.values for sw in sws], list(biases)).compile().as_text()


@pytest.mark.parametrize("spec", ["2:4", "64:2:8", "128:2:16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("t", [17, 1000])
@pytest.mark.parametrize("shared_sddmm", ["auto", "off"])
def test_shared_linear_grads_on_kernels(monkeypatch, spec, dtype, t, shared_sddmm):
    """The three layers' gradients through ``shared_linear`` against the float32 references: dx the sum of the three
    products (one ``spmm_t_sum``), each layer's values and bias gradients (one stacked SDDMM where it runs, else one
    a layer)."""
    _skip_unless_col()
    (gx, gv, gb), (x, sws, targets), _ = _shared_grads(monkeypatch, spec, dtype, t, "auto", shared_sddmm)
    dense = [F.decompress(sw).astype(jnp.float32) for sw in sws]
    assert gx.dtype == dtype
    _compare(gx, sum(jnp.dot(tg, d.T, precision=HIGHEST) for tg, d in zip(targets, dense)), TOL[dtype], "dx")
    for g, b, sw, tg in zip(gv, gb, sws, targets):
        _compare(g, F.compress_like(jnp.dot(x.astype(jnp.float32).T, tg, precision=HIGHEST), sw), TOL[dtype],
                 "dvalues")
        _compare(b[None], tg.sum(0)[None], TOL[dtype], "dbias")


@pytest.mark.parametrize("spec", ["2:4", "128:2:16"])
def test_shared_linear_runs_one_weight_gradient_call(monkeypatch, spec):
    """With ``JAXSPARSE_SHARED_SDDMM`` on, the three layers' weight gradients are one ``jaxsparse_sddmm`` call (three
    with it off), on the tma engine (2:4) and on the x^T engine (128:2:16), and nothing is concatenated for it (each
    layer's dy, columns and metadata are read where they are)."""
    _skip_unless_col()
    from jaxsparse.profile import parse_hlo

    t = 1000
    cats = {}
    for shared, want in (("auto", 1), ("off", 3)):
        *_, text = _shared_grads(monkeypatch, spec, jnp.bfloat16, t, "auto", shared)
        assert text.count('custom_call_target="jaxsparse_sddmm"') == want, (shared, spec)
        cats[shared] = sorted(i.opcode for i in parse_hlo(text).values() if "concatenate" in (i.opcode, *i.fused_opcodes))
    assert cats["auto"] == cats["off"], cats  # the stacked call adds no concatenation


def test_shared_linear_builds_the_views_once(monkeypatch):
    """At 64:2:8 on the row route, the gradient of the three layers builds their 2:4 views by one ``jaxsparse_as_2_4``
    call (as_2_4_stacked), which the stacked forward and the stacked SDDMM both read (XLA holds one), and concatenates
    none of them; with both stacked calls off, one view a layer, shared by each layer's forward and SDDMM."""
    _skip_unless_col()
    from jaxsparse import ops

    for shared, want in (("auto", 1), ("off", 3)):
        monkeypatch.setenv(ops.SHARED_SPMM_ENV, shared)
        *_, text = _shared_grads(monkeypatch, "64:2:8", jnp.bfloat16, 1000, "auto", shared)
        assert text.count('custom_call_target="jaxsparse_as_2_4"') == want, (shared, text.count("jaxsparse_as_2_4"))
        assert text.count('custom_call_target="jaxsparse_sddmm"') == want  # one stacked, or one a layer


def test_shared_linear_runs_one_input_gradient_product(monkeypatch):
    """With ``JAXSPARSE_SHARED_DX`` on, the gradient holds two ``jaxsparse_spmm_xt`` calls fewer than with it off (one
    input-gradient product for the three layers instead of three) and one ``jaxsparse_transpose_2_4`` (the three W^T
    views stacked by one call) instead of three, and no activation is transposed or copied by a kernel of its own.
    Moves smaller than one activation (of the weights) are allowed."""
    _skip_unless_col()
    from jaxsparse.profile import parse_hlo

    t, r = 1000, 256
    counts = {}
    for shared in ("auto", "off"):
        *_, text = _shared_grads(monkeypatch, "2:4", jnp.bfloat16, t, shared)
        counts[shared] = text.count('custom_call_target="jaxsparse_spmm_xt"')
        builds = text.count('custom_call_target="jaxsparse_transpose_2_4"')
        assert builds == (1 if shared == "auto" else 3), (shared, builds)
        infos = parse_hlo(text)
        big = [m for m in standalone_layout_moves(text) if infos[m.split(":")[0]].io_bytes >= t * r * 2]
        assert not big, (shared, big)
    assert counts["auto"] == counts["off"] - 2, counts
