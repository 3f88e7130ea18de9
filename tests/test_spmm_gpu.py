"""The CUDA forward SpMM (``jaxsparse_spmm``) against a float32 reference, on the GPU.

Every check draws fresh random inputs, poisons the output memory with NaN first (a NaN array of the
output's size is allocated and freed just before the call, so the allocator hands the kernel that
memory), and compares ``||y - ref|| / ||ref||`` with a float32 reference built from
``jaxsparse.format.decompress``. Token counts hit every edge tile (1, 17, 200, 1000); every supported
V and M and both dtypes run; bias and the fused GELU run too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpu_common import DTYPES, REJECT_CASES, SPECS, TOL, cuda_ready, gpu_marks, key, layout_moves, poison, select_mask
from jaxsparse import format as F


pytestmark = gpu_marks("jaxsparse_spmm")

if cuda_ready("jaxsparse_spmm"):
    from jaxsparse.ffi import calls



def _make(rng, t, k, r, spec, dtype, with_bias):
    kx, kw, kb = jax.random.split(rng, 3)
    x = jax.random.normal(kx, (t, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, r), jnp.float32) / np.sqrt(k / 4)).astype(dtype)
    mask = select_mask(w, F.VNM.parse(spec))
    sw = F.compress(w, mask, spec)
    bias = jax.random.normal(kb, (r,), jnp.float32).astype(dtype) if with_bias else None
    return x, sw, bias


def _reference(x, sw, bias, activation):
    w = F.decompress(sw).astype(jnp.float32)
    y = jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if activation == "gelu":
        y = jax.nn.gelu(y, approximate=True)
    return y


def _check(x, sw, bias, activation, tol, tile=None, row_kernel="mma"):
    """``tile`` None: the row route with ``row_kernel`` (``mma``: ``jaxsparse_spmm``; ``tma``: the Hopper kernel
    reading x [T, K]); else the Hopper x^T kernel with that tile."""
    t, r = x.shape[0], sw.shape[1]
    poison((t, r), x.dtype)
    if tile is None:
        fn = jax.jit(lambda x, sw, b: calls.spmm(x, sw, b, activation, x_layout="row", row_kernel=row_kernel))
    else:
        fn = jax.jit(lambda x, sw, b: calls.spmm_from_xt(calls.transpose(x), sw, b, activation, tile))
    y = fn(x, sw, bias)
    y.block_until_ready()
    assert y.shape == (t, r) and y.dtype == x.dtype
    y32 = np.asarray(y.astype(jnp.float32))
    assert np.isfinite(y32).all(), f"non-finite outputs: {np.argwhere(~np.isfinite(y32))[:5]}"
    ref = np.asarray(_reference(x, sw, bias, activation))
    err = np.linalg.norm(y32 - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err < tol, f"relative error {err:.3e} >= {tol}"
    # Rows and tokens at the tile edges must be right too, not just on average.
    row_err = np.linalg.norm(y32 - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-30)
    assert row_err.max() < 4 * tol, f"worst token row error {row_err.max():.3e} (row {row_err.argmax()})"
    return err


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("t", [1, 17, 200, 1000])
def test_spmm_small(spec, dtype, t):
    v = F.VNM.parse(spec).v
    r = 128 if v <= 64 else 256
    r = r + 64 if v == 1 else r  # R = 192 for 2:4: a 64-row tile tail
    k = 512 if F.VNM.parse(spec).m <= 16 else 768
    x, sw, bias = _make(key("small", spec, str(dtype), t), t, k, r, spec, dtype, with_bias=False)
    _check(x, sw, bias, None, TOL[dtype])


@pytest.mark.parametrize("k", [160, 288])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_spmm_partial_last_stage(k, dtype):
    """The ``mma`` row kernel at 2:4 takes 16 groups (64 features) a stage; K = 160 and 288 leave a partial last
    stage (40 and 72 groups), which no other shape here reaches."""
    x, sw, bias = _make(key("partial_stage", k, str(dtype)), 200, k, 192, "2:4", dtype, with_bias=True)
    _check(x, sw, bias, None, TOL[dtype])


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_spmm_large_tiles(spec, dtype):
    """Enough tiles that the dispatcher picks the 128-row tile wherever V allows it."""
    t, k, r = 1000, 256, 2176
    x, sw, bias = _make(key("large", spec, str(dtype)), t, k, r, spec, dtype, with_bias=True)
    _check(x, sw, bias, None, TOL[dtype])


@pytest.mark.parametrize("spec", ["2:4", "64:2:8", "128:2:16"])
@pytest.mark.parametrize("activation, bias_dtype", [(None, "same"), ("gelu", None), ("gelu", "same"), ("gelu", "f32")])
def test_spmm_epilogue(spec, activation, bias_dtype):
    dtype = jnp.bfloat16
    t, k, r = 333, 1024, 384
    x, sw, bias = _make(key("epi", spec, activation, bias_dtype), t, k, r, spec, dtype, with_bias=bias_dtype is not None)
    if bias_dtype == "f32":
        bias = bias.astype(jnp.float32)
    _check(x, sw, bias, activation, TOL[dtype])


def test_spmm_row_kernel_choice():
    """auto takes the TMA kernel on Hopper for the M in TMA_ROW_AUTO_M and mma.sp for the others; an explicit
    tma it cannot run (R % 64 != 0) raises."""
    x, sw24, _ = _make(key("choice"), 8, 512, 192, "2:4", jnp.bfloat16, with_bias=False)
    _, sw8, _ = _make(key("choice8"), 8, 512, 128, "64:2:8", jnp.bfloat16, with_bias=False)
    for sw in (sw24, sw8):
        want = "tma" if calls.hopper_gpu() and sw.spec.m in calls.TMA_ROW_AUTO_M else "mma"
        assert calls.spmm_row_kernel(sw, "auto") == want
    assert calls.spmm_row_kernel(sw8, "tma") == "tma"
    with pytest.raises(ValueError, match="R % 64 == 0"):
        calls.spmm_row_kernel(sw24.replace(shape=(512, 96)), "tma")
    with pytest.raises(ValueError, match="one of"):
        calls.spmm_row_kernel(sw24, "fast")


def test_spmm_fresh_inputs_repeatable():
    """Same inputs twice give bit-identical outputs (no race); different inputs give different outputs."""
    spec, dtype = "64:2:8", jnp.bfloat16
    x, sw, bias = _make(key("rep"), 517, 512, 256, spec, dtype, with_bias=True)
    f = jax.jit(lambda x, sw, b: calls.spmm(x, sw, b, "gelu", x_layout="row"))
    a = np.asarray(f(x, sw, bias).astype(jnp.float32))
    poison(a.shape, dtype)
    b = np.asarray(f(x, sw, bias).astype(jnp.float32))
    assert np.array_equal(a, b)
    x2, _, _ = _make(key("rep2"), 517, 512, 256, spec, dtype, with_bias=True)
    c = np.asarray(f(x2, sw, bias).astype(jnp.float32))
    assert np.isfinite(c).all() and (c != a).mean() > 0.9  # other inputs: (almost) every output differs


@pytest.mark.parametrize("k, r, spec, dtype, what", REJECT_CASES)
def test_spmm_rejects(k, r, spec, dtype, what):
    w = jax.random.normal(key("rej", what), (k, r), jnp.float32).astype(dtype)
    sw = F.compress(w, F.select_mask(w, spec), spec)
    x = jnp.ones((4, k), dtype)
    with pytest.raises(ValueError, match=what):
        calls.spmm(x, sw, None, None)


def test_spmm_no_transpose_in_hlo():
    """The optimized HLO of a jitted layer holds the custom call and no transpose or copy of x."""
    x, sw, bias = _make(key("hlo"), 256, 512, 256, "64:2:8", jnp.bfloat16, with_bias=True)

    def layer(x, sw, b):
        h = jnp.tanh(x) * 2  # a producer fusion in front, as in a real network
        return calls.spmm(h, sw, b, "gelu", x_layout="row")

    text = jax.jit(layer).lower(x, sw, bias).compile().as_text()
    assert "jaxsparse_spmm" in text
    assert not layout_moves(text), (layout_moves(text), text)


# ----------------------------------------------------------------------------- the Hopper x^T kernel

XT_TILES = ["128x256", "64x256", "128x128", "64x128", "ws128x256", "ws64x256"]
xt_marks = pytest.mark.skipif(not (cuda_ready("jaxsparse_spmm_xt") and calls.hopper_gpu()),
                              reason="the x^T SpMM needs a Hopper GPU")


def _xt_tiles(spec):
    """The tiles the x^T kernel can take for ``spec``: 128-feature tiles need V >= 128 (or 2:4)."""
    v = F.VNM.parse(spec).v
    return [t for t in XT_TILES if v != 64 or t.removeprefix("ws").startswith("64x")]


@xt_marks
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("t", [1, 17, 200, 1000])
@pytest.mark.parametrize("k, r", [(512, 192), (768, 2176), (160, 384)], ids=["ws64", "ws128", "ws128-meta-cp"])
def test_spmm_rows_tma(dtype, t, k, r):
    """2:4 from x [T, K] as it is (TMA boxes of x, wgmma.sp): token tails, a 64-row tile (R = 192) and
    enough 128-row tiles that the persistent grid runs several per CTA.  The 128-row tiles take their metadata by
    TMA pairs where G/8 % 4 == 0 (K = 768) and by cp.async where not (K = 160: G/8 = 5)."""
    x, sw, bias = _make(key("rows-tma", str(dtype), t, k), t, k, r, "2:4", dtype, with_bias=True)
    _check(x, sw, bias, None, TOL[dtype], row_kernel="tma")


@xt_marks
@pytest.mark.parametrize("spec", [s for s in SPECS if F.VNM.parse(s).m > 4])
@pytest.mark.parametrize("t", [17, 1000])
def test_spmm_rows_tma_v2m(spec, t):
    """V:2:M from x [T, K] on the TMA row kernel through the weight's 2:4 view (``calls.as_2_4``): 128-feature
    tiles (R = 384) and token tails."""
    m = F.VNM.parse(spec).m
    x, sw, bias = _make(key("rows-tma-v2m", spec, t), t, 768 if m in (4, 32) else 512, 384, spec, jnp.bfloat16,
                        with_bias=True)
    _check(x, sw, bias, None, TOL[jnp.bfloat16], row_kernel="tma")


@xt_marks
@pytest.mark.parametrize("tile, r", [("ws128x256", 640), ("ws64x256", 320)])
def test_spmm_rows_tma_persistent(tile, r, monkeypatch):
    """2:4 from x [T, K] with more tiles than the persistent grid has CTAs, so each runs several (barrier phases
    and the metadata pipeline carry over across tiles), an odd feature-block count, a token tail, bias and GELU."""
    monkeypatch.setenv(calls.SPMM_XT_TILE_ENV, tile)
    x, sw, bias = _make(key("rows-tma-persist", r, tile), 256 * 40 + 72, 512, r, "2:4", jnp.bfloat16, with_bias=True)
    _check(x, sw, bias, "gelu", TOL[jnp.bfloat16], row_kernel="tma")


@xt_marks
@pytest.mark.parametrize("activation, bias_dtype", [(None, "same"), ("gelu", None), ("gelu", "f32")])
def test_spmm_rows_tma_epilogue(activation, bias_dtype):
    dtype = jnp.bfloat16
    x, sw, bias = _make(key("rows-tma-epi", activation, bias_dtype), 333, 1024, 384, "2:4", dtype,
                        with_bias=bias_dtype is not None)
    if bias_dtype == "f32":
        bias = bias.astype(jnp.float32)
    _check(x, sw, bias, activation, TOL[dtype], row_kernel="tma")


@xt_marks
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("t", [8, 72, 1000])
def test_spmm_xt(spec, dtype, t):
    """Every tile; token tails (72, 1000) and a condensed-k tail (4G % 64 != 0 at M = 32, K = 768)."""
    m = F.VNM.parse(spec).m
    k = 768 if m in (4, 32) else 512
    for tile in _xt_tiles(spec):
        x, sw, bias = _make(key("xt", spec, str(dtype), t, tile), t, k, 384, spec, dtype, with_bias=False)
        _check(x, sw, bias, None, TOL[dtype], tile=tile)


@xt_marks
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_spmm_xt_large(spec, dtype):
    """Many CTAs, BERT-large-like K, the auto tile."""
    x, sw, bias = _make(key("xt-large", spec, str(dtype)), 1024, 1024, 1152, spec, dtype, with_bias=True)
    _check(x, sw, bias, None, TOL[dtype], tile="auto")


@xt_marks
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("tile", ["ws128x256", "ws64x256"])
def test_spmm_xt_persistent(spec, tile):
    """More tiles than SMs, so each CTA of the persistent kernel runs several (barrier phases carry over),
    with a token tail in the last tile row and a bias with GELU."""
    if F.VNM.parse(spec).v == 64 and tile.startswith("ws128"):
        pytest.skip("128-feature tiles need V >= 128")
    x, sw, bias = _make(key("xt-persist", spec, tile), 256 * 40 + 72, 512, 1024, spec, jnp.bfloat16, with_bias=True)
    _check(x, sw, bias, "gelu", TOL[jnp.bfloat16], tile=tile)


@xt_marks
@pytest.mark.parametrize("spec", ["2:4", "64:2:8", "128:2:16"])
@pytest.mark.parametrize("activation, bias_dtype", [(None, "same"), ("gelu", None), ("gelu", "same"), ("gelu", "f32")])
def test_spmm_xt_epilogue(spec, activation, bias_dtype):
    dtype = jnp.bfloat16
    x, sw, bias = _make(key("xt-epi", spec, activation, bias_dtype), 336, 1024, 384, spec, dtype,
                        with_bias=bias_dtype is not None)
    if bias_dtype == "f32":
        bias = bias.astype(jnp.float32)
    for tile in _xt_tiles(spec):
        _check(x, sw, bias, activation, TOL[dtype], tile=tile)


@xt_marks
def test_spmm_xt_repeatable_and_routes():
    """Bit-identical twice; calls.spmm's x_layout="col" is transpose + the x^T kernel; refusals name the rule."""
    spec, dtype = "128:2:16", jnp.bfloat16
    x, sw, bias = _make(key("xt-rep"), 520, 512, 256, spec, dtype, with_bias=True)
    f = jax.jit(lambda x, sw, b: calls.spmm_from_xt(calls.transpose(x), sw, b, "gelu"))
    a = np.asarray(f(x, sw, bias).astype(jnp.float32))
    poison(a.shape, dtype)
    assert np.array_equal(a, np.asarray(f(x, sw, bias).astype(jnp.float32)))
    g = jax.jit(lambda x, sw, b: calls.spmm(x, sw, b, "gelu", x_layout="col"))
    assert np.array_equal(a, np.asarray(g(x, sw, bias).astype(jnp.float32)))
    text = jax.jit(lambda x, sw, b: calls.spmm(x, sw, b, "gelu", x_layout="col")).lower(x, sw, bias).compile().as_text()
    assert "jaxsparse_transpose" in text and "jaxsparse_spmm_xt" in text
    assert not layout_moves(text), layout_moves(text)  # XLA itself moves nothing
    with pytest.raises(ValueError, match="T % 8"):
        calls.spmm(x[:13], sw, None, None, x_layout="col")
    x64, sw64, _ = _make(key("xt-rej"), 16, 512, 192, "64:2:8", dtype, with_bias=False)
    with pytest.raises(ValueError, match="R % 128"):
        calls.spmm(x64, sw64, None, None, x_layout="col")


# ----------------------------------------------------------------------------- the feed-forward epilogues
#
# act_mode 1 (act(z) and act'(z), both written by the epilogue), on each route the layer products take: the mma row kernel (XLA does the extra work there), the TMA row kernel (2:4, and
# 64:2:8 through its 2:4 view) and the x^T kernel with a warp-specialized and a plain tile.

FUSED_ROUTES = [("2:4", "row-mma"), ("2:4", "row-tma"), ("64:2:8", "row-tma"), ("128:2:16", "xt-auto"),
                ("128:2:16", "xt-128x128"), ("64:2:8", "xt-64x128")]


def _fused_route(monkeypatch, route: str) -> None:
    """Sends calls.spmm down ``route`` (through the environment it reads)."""
    if route.startswith("row-"):
        monkeypatch.setenv(calls.SPMM_X_LAYOUT_ENV, "row")
        monkeypatch.setenv(calls.SPMM_ROW_KERNEL_ENV, route.removeprefix("row-"))
        monkeypatch.delenv(calls.SPMM_XT_TILE_ENV, raising=False)
    else:
        monkeypatch.setenv(calls.SPMM_X_LAYOUT_ENV, "col")
        monkeypatch.setenv(calls.SPMM_XT_TILE_ENV, route.removeprefix("xt-"))


def _rel_err(out, ref) -> float:
    out32 = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out32).all(), f"non-finite outputs: {np.argwhere(~np.isfinite(out32))[:5]}"
    ref = np.asarray(ref, np.float32)
    return float(np.linalg.norm(out32 - ref) / max(np.linalg.norm(ref), 1e-30))


@xt_marks
@pytest.mark.parametrize("spec, route", FUSED_ROUTES)
@pytest.mark.parametrize("activation", ["gelu_erf", "gelu", "relu"])
def test_spmm_with_derivative(monkeypatch, spec, route, activation):
    """``with_derivative``: act(z) and act'(z) for z = x W + b; a token tail (1000 = 3 x 256 + 232)."""
    from jaxsparse import reference

    _fused_route(monkeypatch, route)
    dtype, t = jnp.bfloat16, 1000
    x, sw, bias = _make(key("with-deriv", spec, route, activation), t, 512, 384, spec, dtype, with_bias=True)
    poison((2, t, 384), dtype)
    h, d = jax.jit(lambda x, sw, b: calls.spmm(x, sw, b, activation, with_derivative=True))(x, sw, bias)
    assert h.shape == d.shape == (t, 384) and h.dtype == d.dtype == dtype
    z = _reference(x, sw, bias, None)
    assert _rel_err(h, reference.ACTIVATIONS[activation](z)) < TOL[dtype]
    assert _rel_err(d, reference.activation_with_derivative(activation, z)[1]) < TOL[dtype]


@xt_marks
@pytest.mark.parametrize("spec, tile", [("128:2:16", "auto"), ("128:2:16", "128x256"), ("128:2:16", "64x256"),
                                        ("64:2:8", "64x128"), ("128:2:32", "128x128"), ("2:4", "auto")])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_spmm_from_xt_transposed_activation(spec, tile, dtype):
    """act_mode 2 (``transpose_out``): act(z)^T [R, T] and act'(z) [T, R], each from its own staged tile,
    both poisoned first; 1000 tokens (a tail on every token tile) and 384 features (a tail of 128-feature tiles
    over the 256-wide ones)."""
    from jaxsparse import reference

    t, r = 1000, 384
    x, sw, bias = _make(key("xt-transposed", spec, tile, str(dtype)), t, 512, r, spec, dtype, with_bias=True)
    poison((2, t, r), dtype)
    f = jax.jit(lambda xt, sw, b: calls.spmm_from_xt(xt, sw, b, "gelu_erf", tile, with_derivative=True,
                                                      transpose_out=True))
    ht, d = f(calls.transpose(x), sw, bias)
    assert ht.shape == (r, t) and d.shape == (t, r) and ht.dtype == d.dtype == dtype
    z = _reference(x, sw, bias, None)
    f_ref, d_ref = reference.activation_with_derivative("gelu_erf", z)
    assert _rel_err(ht, f_ref.T) < TOL[dtype]
    assert _rel_err(d, d_ref) < TOL[dtype]
    # every row of h^T (a feature) and of act'(z) (a token) is written, the tails included
    assert np.all(np.abs(np.asarray(ht.astype(jnp.float32)) - np.asarray(f_ref.T)).max(axis=1) < 0.1)
    assert np.all(np.abs(np.asarray(d.astype(jnp.float32)) - np.asarray(d_ref)).max(axis=1) < 0.1)


@xt_marks
def test_spmm_from_xt_transposed_activation_rejects():
    x, sw, bias = _make(key("xt-transposed-rejects"), 256, 512, 256, "128:2:16", jnp.bfloat16, with_bias=True)
    xt = calls.transpose(x)
    with pytest.raises(ValueError, match="transpose_out needs with_derivative"):
        calls.spmm_from_xt(xt, sw, bias, "gelu", transpose_out=True)
    with pytest.raises(ValueError, match="plain x\\^T tiles"):
        calls.spmm_from_xt(xt, sw, bias, "gelu", "ws128x256", with_derivative=True, transpose_out=True)


# ----------------------------------------------------------------------------- the bf16 activation table
#
# act_mode 1 and 2 in bf16 with a GELU read act(z) and act'(z) from a table of z's bf16 codes (cuda/act_table.cuh),
# with Taylor polynomials below |z| = 2^-4 and limits beyond 4 and -16. Every branch gives the correctly rounded bf16
# of the exact function, so each output is checked element by element against the function in float64 (erfc, exp) at the
# kernel's own z (the same product without activation: z rounded to bf16, as the epilogue rounds it), on biases that put
# z in every range. The float32 formula (JAXSPARSE_ACT_TABLE=off) is off by an ulp here and there; so is this check's
# own rounding (float64 -> float32 -> bf16), so a few one-ulp differences pass and nothing larger does.

TABLE_BIASES = np.array([-40.0, -17.0, -16.0, -13.0, -6.0, -4.0, -1.5, -0.25, -0.05, 0.0, 0.0, 0.03, 0.3, 1.0, 3.9, 4.0,
                         6.0, 30.0], np.float32)


def _exact_gelu(activation: str, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(act(z), act'(z)) in float64, for "gelu" (tanh) or "gelu_erf"."""
    import math

    z = z.astype(np.float64)
    if activation == "gelu_erf":  # Phi(z) = erfc(-z / sqrt 2) / 2: no cancellation in the negative tail
        cdf = 0.5 * np.frompyfunc(math.erfc, 1, 1)(-z / math.sqrt(2.0)).astype(np.float64)
        return z * cdf, cdf + z * np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    k0, k1 = math.sqrt(2.0 / math.pi), 0.044715
    u = k0 * (z + k1 * z ** 3)
    with np.errstate(over="ignore"):  # 1 + tanh(u) and 1 - tanh(u) without cancellation (e^(2|u|) may overflow to inf)
        plus, minus = 2.0 / (1.0 + np.exp(-2.0 * u)), 2.0 / (1.0 + np.exp(2.0 * u))
    return 0.5 * z * plus, 0.5 * plus + 0.5 * z * plus * minus * k0 * (1.0 + 3.0 * k1 * z * z)


def _bf16_ulps(out, exact: np.ndarray) -> np.ndarray:
    """Distance in bf16 codes (monotone order) between the bf16 array ``out`` and ``exact`` rounded to bf16."""
    def ordered(a):
        bits = np.asarray(a, jnp.bfloat16).view(np.uint16).astype(np.int32)
        return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)

    return np.abs(ordered(out) - ordered(exact.astype(np.float32).astype(jnp.bfloat16)))


@xt_marks
@pytest.mark.parametrize("spec, route", [("2:4", "row-tma"), ("64:2:8", "row-tma"), ("128:2:16", "xt-128x128"),
                                         ("128:2:16", "xt-ws128x256"), ("128:2:16", "xt-transposed")])
@pytest.mark.parametrize("activation", ["gelu_erf", "gelu"])
@pytest.mark.parametrize("table", ["on", "off"])
def test_activation_table_every_range(monkeypatch, spec, route, activation, table):
    """act(z) and act'(z) from the epilogue, element by element against the exact function at the kernel's own z, z
    spread over every range of the table (``TABLE_BIASES``); a token whose input holds a NaN gets NaN in both outputs.
    1000 tokens (a tail tile), 256 features."""
    monkeypatch.setenv(calls.ACT_TABLE_ENV, table)
    transposed = route == "xt-transposed"
    _fused_route(monkeypatch, "xt-128x128" if transposed else route)
    t, k, r, dtype = 1000, 512, 256, jnp.bfloat16
    x, sw, _ = _make(key("act-table", spec, route, activation), t, k, r, spec, dtype, with_bias=False)
    x = (x.astype(jnp.float32) * 0.2).astype(dtype).at[17].set(jnp.nan)  # products of std ~0.3; token 17 all NaN
    bias = jnp.asarray(np.resize(TABLE_BIASES, r), dtype)
    z = jax.jit(lambda x, sw, b: calls.spmm(x, sw, b))(x, sw, bias)  # the kernel's z, rounded to bf16
    poison((2, t, r), dtype)
    if transposed:
        ht, d = jax.jit(lambda x, sw, b: calls.spmm_from_xt(calls.transpose(x), sw, b, activation, "128x128",
                                                             with_derivative=True, transpose_out=True))(x, sw, bias)
        h = ht.T
    else:
        h, d = jax.jit(lambda x, sw, b: calls.spmm(x, sw, b, activation, with_derivative=True))(x, sw, bias)
    z32, h, d = (np.asarray(a.astype(jnp.float32)) for a in (z, h, d))
    nan_row = np.zeros(t, bool)
    nan_row[17] = True
    assert np.isnan(z32[17]).all() and np.isnan(h[17]).all() and np.isnan(d[17]).all()
    assert np.isfinite(z32[~nan_row]).all() and np.isfinite(h[~nan_row]).all() and np.isfinite(d[~nan_row]).all()
    zz = z32[~nan_row]
    for lo, hi in [(-np.inf, -16), (-16, -4), (-4, -2 ** -4), (-2 ** -4, 2 ** -4), (2 ** -4, 4), (4, np.inf)]:
        assert ((zz > lo) & (zz < hi)).sum() > 100, f"few z in ({lo}, {hi})"
    f_exact, d_exact = _exact_gelu(activation, zz)
    # The float32 formula loses the far negative tail (1 + erf(z / sqrt 2) cancels below z = -3): checked above it.
    checked = np.ones_like(zz, bool) if table == "on" else zz > -3
    for name, out, exact in [("act", h[~nan_row], f_exact), ("act'", d[~nan_row], d_exact)]:
        ulps = _bf16_ulps(out[checked], exact[checked])
        worst = ulps.argmax()
        assert ulps.max() <= 1, (f"{name}: {ulps.max()} bf16 ulps at z = {zz[checked][worst]}: {out[checked][worst]} "
                                 f"against {exact[checked][worst]}")
        assert (ulps > 0).mean() < (1e-4 if table == "on" else 1e-2), f"{name}: {(ulps > 0).mean():.2e} off by an ulp"


def test_fused_epilogue_rejects():
    x, sw, bias = _make(key("fused-rejects"), 64, 512, 384, "2:4", jnp.bfloat16, with_bias=True)
    with pytest.raises(ValueError, match="with_derivative needs an activation"):
        calls.spmm(x, sw, bias, None, with_derivative=True)
    with pytest.raises(ValueError, match="activation must be one of"):
        calls.spmm(x, sw, bias, "tanh")
