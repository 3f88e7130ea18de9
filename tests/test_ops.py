"""Reference ops and sparse_linear against the masked dense product; dispatch; bad input."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsparse import dispatch, ffi, ops, reference
from jaxsparse import format as F

SPECS = ["2:4", "64:2:8", "64:2:16", "128:2:16", "64:2:32"]


def make(seed: int, spec: str, k: int = 256, r: int = 128, tokens=(3, 7), dtype=jnp.float32, transposable=False,
         exclusive=False):
    kw, kx, kb = jax.random.split(jax.random.PRNGKey(seed), 3)
    w = jax.random.normal(kw, (k, r), jnp.float32)
    mask = F.select_mask(w, spec, transposable=transposable, exclusive_columns=exclusive)
    sw = F.compress(w.astype(dtype), mask, spec)
    x = jax.random.normal(kx, (*tokens, k), jnp.float32).astype(dtype)
    bias = jax.random.normal(kb, (r,), jnp.float32).astype(dtype)
    dense = jnp.where(mask, w.astype(dtype), 0).astype(jnp.float32)
    return x, sw, bias, dense


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all(), "non-finite output"
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2), (jnp.float16, 2e-3)])
def test_reference_products(spec, dtype, tol):
    x, sw, bias, dense = make(1, spec, dtype=dtype)
    x32 = x.astype(jnp.float32)
    x2 = x.reshape(-1, x.shape[-1])
    dy = jax.random.normal(jax.random.PRNGKey(9), (x2.shape[0], sw.shape[1])).astype(dtype)
    y = reference.spmm(x2, sw, bias, "gelu")
    assert y.dtype == dtype
    assert rel_err(y, jax.nn.gelu(x32.reshape(x2.shape) @ dense + bias.astype(jnp.float32), approximate=True)) < tol
    assert rel_err(reference.spmm_t(dy, sw), dy.astype(jnp.float32) @ dense.T) < tol
    dvals = reference.sddmm(x2, dy, sw, jnp.float32)
    expect = F.compress_like(x32.reshape(x2.shape).T @ dy.astype(jnp.float32), sw)
    assert dvals.dtype == jnp.float32 and rel_err(dvals, expect) < tol


@pytest.mark.parametrize("spec", SPECS)
def test_sparse_linear_matches_masked_dense(spec):
    x, sw, bias, dense = make(2, spec)
    y = jax.jit(ops.sparse_linear)(x, sw, bias)
    assert y.shape == (*x.shape[:-1], sw.shape[1])
    assert rel_err(y, x @ dense + bias) < 1e-6


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("use_bias", [True, False])
def test_sparse_linear_gradients(spec, use_bias):
    """The gradient w.r.t. the compressed values is the masked dense gradient, gathered."""
    x, sw, bias, dense = make(3, spec)
    bias = bias if use_bias else None
    target = jax.random.normal(jax.random.PRNGKey(5), (*x.shape[:-1], sw.shape[1]))

    def sparse_loss(x, values, bias):
        return jnp.sum(jnp.tanh(ops.sparse_linear(x, sw.replace(values=values), bias)) * target)

    def dense_loss(x, w, bias):
        y = x @ w + (0 if bias is None else bias)
        return jnp.sum(jnp.tanh(y) * target)

    mask = F.decompress(sw) != 0
    gx, gv, gb = jax.jit(jax.grad(sparse_loss, argnums=(0, 1, 2)))(x, sw.values, bias)
    dx, dw, db = jax.grad(dense_loss, argnums=(0, 1, 2))(x, dense, bias)
    assert rel_err(gx, dx) < 1e-5
    assert rel_err(gv, F.compress_like(jnp.where(mask, dw, 0), sw)) < 1e-5
    if use_bias:
        assert rel_err(gb, db) < 1e-5
    else:
        assert gb is None


def test_sparse_linear_numerical_gradient():
    """Finite differences in float64-free form: directional derivative along a random direction."""
    x, sw, bias, _ = make(4, "64:2:8", tokens=(5,))
    f = lambda v: jnp.sum(jnp.sin(ops.sparse_linear(x, sw.replace(values=v), bias)))
    direction = jax.random.normal(jax.random.PRNGKey(6), sw.values.shape)
    eps = 1e-3
    numeric = (f(sw.values + eps * direction) - f(sw.values - eps * direction)) / (2 * eps)
    analytic = jnp.vdot(jax.grad(f)(sw.values), direction)
    assert float(numeric) == pytest.approx(float(analytic), rel=1e-2)


def test_grad_of_whole_sparse_weight_gives_float0_for_indices():
    x, sw, bias, _ = make(5, "64:2:16")
    g = jax.grad(lambda s: ops.sparse_linear(x, s, bias).sum(), allow_int=True)(sw)
    assert g.values.shape == sw.values.shape
    assert g.metadata.dtype == jax.dtypes.float0 and g.columns.dtype == jax.dtypes.float0


def test_vmap_over_stacked_weights():
    xs, sws = [], []
    for seed in range(3):
        x, sw, _, _ = make(10 + seed, "64:2:8", tokens=(4,))
        xs.append(x)
        sws.append(sw)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *sws)
    y = jax.vmap(ops.sparse_linear)(jnp.stack(xs), stacked)
    for i in range(3):
        np.testing.assert_allclose(y[i], ops.sparse_linear(xs[i], sws[i]), rtol=1e-6, atol=1e-6)


def test_ops_decompress_matches_format():
    _, sw, _, dense = make(6, "128:2:16")
    np.testing.assert_array_equal(np.asarray(ops.decompress(sw)), np.asarray(dense))


def test_masked_linear():
    x, _, bias, dense = make(7, "64:2:8")
    w = jax.random.normal(jax.random.PRNGKey(8), dense.shape)
    mask = dense != 0
    y = ops.masked_linear(x, w, mask, bias)
    assert rel_err(y, x @ jnp.where(mask, w, 0) + bias) < 1e-6
    gw = jax.grad(lambda w: ops.masked_linear(x, w, mask).sum())(w)
    assert not np.asarray(gw)[~np.asarray(mask)].any()


# ----------------------------------------------------------------------------- bad input


def test_bad_operands():
    x, sw, bias, _ = make(0, "64:2:8")
    with pytest.raises(ValueError, match="last dimension must be 256"):
        ops.sparse_linear(x[..., :128], sw)
    with pytest.raises(ValueError, match="dtype"):
        ops.sparse_linear(x.astype(jnp.bfloat16), sw)
    with pytest.raises(ValueError, match="bias must have shape"):
        ops.sparse_linear(x, sw, bias[:10])
    with pytest.raises(ValueError, match="SparseWeight"):
        ops.sparse_linear(x, jnp.ones((256, 128)))
    with pytest.raises(ValueError, match="activation"):
        ops.spmm(x, sw, activation="relu6")
    with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
        ops.spmm(x.astype(jnp.int32), sw.replace(values=sw.values.astype(jnp.int32)))
    with pytest.raises(ValueError, match="leading dimensions"):
        ops.sddmm(x, jnp.ones((2, 2, 128)), sw)
    for name, bad in (("values", sw.values[:, :8]), ("metadata", sw.metadata[:4]), ("columns", None)):
        with pytest.raises(ValueError, match=f"needs {name} of shape"):  # arrays that disagree with the shape
            ops.sparse_linear(x, sw.replace(**{name: bad}), bias)
    with pytest.raises(ValueError, match="metadata must be uint32"):
        ops.sparse_linear(x, sw.replace(metadata=sw.metadata.astype(jnp.int32)), bias)
    dense_w = jnp.ones((256, 128))
    with pytest.raises(ValueError, match="bias must have shape"):
        ops.masked_linear(x, dense_w, dense_w != 0, bias[:1])
    with pytest.raises(ValueError, match="last dimension"):
        ops.masked_linear(jnp.ones(()), dense_w, dense_w != 0)


def test_kernel_constraints_are_named():
    _, sw, _, _ = make(0, "64:2:8")
    assert "bfloat16 or float16" in ops.spmm_unsupported(sw)
    _, sw16, _, _ = make(0, "64:2:8", dtype=jnp.bfloat16)
    assert ops.spmm_unsupported(sw16) is None
    _, sw_v, _, _ = make(0, "32:2:8", dtype=jnp.bfloat16)
    assert "V in" in ops.spmm_unsupported(sw_v)
    _, sw_r, _, _ = make(0, "2:4", r=96, dtype=jnp.bfloat16)
    assert "multiple of 64" in ops.spmm_unsupported(sw_r)


# ----------------------------------------------------------------------------- dispatch


def test_backend_env(monkeypatch):
    monkeypatch.setenv("JAXSPARSE_BACKEND", "reference")
    assert dispatch.backend() == "reference"
    monkeypatch.setenv("JAXSPARSE_BACKEND", "tpu")
    with pytest.raises(ValueError, match="JAXSPARSE_BACKEND"):
        dispatch.backend()
    monkeypatch.delenv("JAXSPARSE_BACKEND")
    assert dispatch.backend() == "auto"


def test_forced_reference_and_auto_both_give_the_masked_product(monkeypatch):
    """``JAXSPARSE_BACKEND=reference`` and ``auto`` both give ``x @ (W * mask) + b`` to bf16 accuracy; on a GPU with
    the extension ``auto`` runs the kernel and ``reference`` does not (on a CPU both are the reference)."""
    x, sw, bias, dense = make(1, "2:4", dtype=jnp.bfloat16)
    ref = x.astype(jnp.float32) @ dense + bias.astype(jnp.float32)
    on_kernels = dispatch._has_gpu() and ffi.available()
    for backend in ("auto", "reference"):
        monkeypatch.setenv("JAXSPARSE_BACKEND", backend)
        f = jax.jit(lambda x, s, b: ops.spmm(x, s, b))
        text = f.lower(x, sw, bias).compile().as_text()
        kernel = 'custom_call_target="jaxsparse_spmm' in text  # (the reference only names its scope so)
        assert kernel == (on_kernels and backend == "auto"), backend
        out = np.asarray(f(x, sw, bias), np.float32)
        assert np.isfinite(out).all()
        assert rel_err(out, ref) < 1e-2, backend


def test_forced_cuda_without_gpu_is_a_clear_error(monkeypatch):
    if dispatch._has_gpu() and ffi.available():
        pytest.skip("a GPU and the extension are present: forcing cuda is valid here")
    monkeypatch.setenv("JAXSPARSE_BACKEND", "cuda")
    x, sw, bias, _ = make(1, "2:4", dtype=jnp.bfloat16)
    with pytest.raises(RuntimeError, match="JAXSPARSE_BACKEND=cuda"):
        ops.spmm(x, sw, bias)


def test_forced_cuda_rejects_unsupported_operands(monkeypatch):
    monkeypatch.setattr(ffi, "available", lambda: True)
    monkeypatch.setattr(dispatch, "_has_gpu", lambda: True)
    monkeypatch.setenv("JAXSPARSE_BACKEND", "cuda")
    x, sw, _, _ = make(1, "64:2:8")  # float32: the kernels take bf16/fp16 only
    with pytest.raises(ValueError, match="cannot take these operands: the kernels take bfloat16"):
        ops.spmm(x, sw)


def test_reference_ops_env_routes_one_op_to_the_reference(monkeypatch):
    monkeypatch.setattr(ffi, "available", lambda: True)
    monkeypatch.setattr(dispatch, "_has_gpu", lambda: True)
    monkeypatch.setenv("JAXSPARSE_BACKEND", "cuda")
    monkeypatch.setenv("JAXSPARSE_REFERENCE_OPS", "sddmm, spmm")
    assert dispatch.reference_ops() == {"sddmm", "spmm"}
    x, sw, _, _ = make(1, "64:2:8")  # float32: forced cuda would raise; the override takes the reference
    np.testing.assert_allclose(np.asarray(ops.spmm(x, sw)), np.asarray(reference.spmm(x, sw)), rtol=1e-6)
    with pytest.raises(ValueError, match="cannot take these operands"):
        ops.spmm_t(jnp.ones((4, sw.shape[1]), x.dtype), sw)  # not overridden: still forced to the kernel
    monkeypatch.setenv("JAXSPARSE_REFERENCE_OPS", "sddmm,matmul")
    with pytest.raises(ValueError, match="unknown ops \\['matmul'\\]"):
        dispatch.reference_ops()


def test_sddmm_out_dtype_is_checked():
    x, sw, _, _ = make(0, "64:2:8", dtype=jnp.bfloat16)
    dy = jnp.ones((*x.shape[:-1], sw.shape[1]), x.dtype)
    assert ops.sddmm(x, dy, sw, jnp.float32).dtype == jnp.float32
    with pytest.raises(ValueError, match="out_dtype must be the values dtype"):
        ops.sddmm(x, dy, sw, jnp.float16)


def test_dense_dx_route_of_2_4(monkeypatch):
    """2:4's dX on the GPU is the dense product over the decompressed weight: its maths, with the CUDA
    decompression replaced by the format's."""
    from jaxsparse.ffi import calls

    monkeypatch.setattr(calls, "decompress", F.decompress)
    x, sw, _, _ = make(2, "2:4", dtype=jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(5), (*x.shape[:-1], sw.shape[1])).astype(jnp.bfloat16)
    dy2 = dy.reshape(-1, sw.shape[1])
    got = ops._dense_dx(dy2, sw)
    ref = reference.spmm_t(dy2.astype(jnp.float32), sw.replace(values=sw.values.astype(jnp.float32)))
    assert got.dtype == jnp.bfloat16 and got.shape == (dy2.shape[0], sw.shape[0])
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref), rtol=2e-2, atol=2e-2)


def test_sddmm_split_setting(monkeypatch):
    from jaxsparse.ffi import calls

    monkeypatch.delenv(calls.SDDMM_SPLIT_ENV, raising=False)
    assert calls.sddmm_split() == 0  # auto: measured on the H100 (docs/kernel-notes.md)
    assert calls.sddmm_split("auto") == 0 and calls.sddmm_split(4) == 4
    monkeypatch.setenv(calls.SDDMM_SPLIT_ENV, "none")
    assert calls.sddmm_split() == 1
    monkeypatch.setenv(calls.SDDMM_SPLIT_ENV, "3")
    assert calls.sddmm_split() == 3
    monkeypatch.setenv(calls.SDDMM_SPLIT_ENV, "many")
    with pytest.raises(ValueError, match="JAXSPARSE_SDDMM_SPLIT"):
        calls.sddmm_split()
    with pytest.raises(ValueError, match="split"):
        calls.sddmm_split(-1)


def _handler_splits(split, tiles, tokens, bt, ctas_per_sm, sms):
    """cuda/sddmm.cu's ChooseSplits and LaunchSplit's no-empty-range step, for a GPU of ``sms`` SMs."""
    all_kt = -(-tokens // bt)
    s = split
    if s == 0:
        if 2 * tiles > sms:
            return 1
        want = max(1, sms // tiles) if ctas_per_sm == 1 else -(-2 * sms // tiles)
        s = min(want, all_kt // 4, 16)
    s = max(1, min(s, all_kt))
    if s == 1:
        return 1
    per = -(-all_kt // s)
    return -(-all_kt // per)


@pytest.mark.parametrize("sms", [132, 256])
def test_sddmm_partial_buffer_holds_every_split_the_handler_takes(sms):
    """The SDDMM's float32 partial buffer (its second result) has room for every token split the handler's rule
    picks, for each engine's tiles (rows x groups per CTA, tokens per stage, CTAs per SM in cuda/sddmm.cu), so the
    buffer never caps a split; and it is empty where the handler cannot split."""
    from jaxsparse.ffi import calls

    engines = [(128, 64, 64, 1), (128, 32, 64, 1), (128, 32, 32, 2), (128, 16, 32, 2), (64, 32, 32, 2),
               (64, 16, 32, 2), (64, 8, 32, 2)]
    checked = 0
    for rows in (128, 256, 1024, 4096):
        for groups in (8, 64, 256, 1024):
            n = rows * 2 * groups
            for tokens in (1, 100, 200, 1000, 16384):
                for split in (0, 2, 3, 16):
                    need = max(_handler_splits(split, (rows // br) * -(-groups // gc), tokens, bt, cps, sms)
                               for br, gc, bt, cps in engines)
                    have = calls.sddmm_partial_elements(tokens, n, split)
                    assert have % n == 0
                    assert have // n >= (need if need > 1 else 0), (rows, groups, tokens, split)
                    checked += need > 1
                    # with the kernel's bias gradient: its planes on top, and the handler's rule (ranges at most
                    # elements // (n + ways R)) still takes every split; its planes fit when nothing splits
                    with_bias = calls.sddmm_partial_elements(tokens, n, split, bias_rows=rows)
                    ways = calls.SDDMM_BIAS_WAYS
                    assert with_bias - have == max(have // n, 1) * ways * rows
                    assert with_bias // (n + ways * rows) >= (need if need > 1 else 0), (rows, groups, tokens, split)
    assert checked > 100  # the grid exercises real splits
    assert calls.sddmm_partial_elements(16384, 4096 * 2 * 512, 0) == 0  # 1024x4096 at 2:4 fills the GPU
    assert calls.sddmm_partial_elements(16384, 1024 * 2 * 256, 1) == 0


def test_sddmm_bias_grad_fused_setting_and_narrow_weights(monkeypatch):
    """The kernel's bias gradient: a bad ``JAXSPARSE_SDDMM_BIAS`` raises naming it; a weight of under four column
    tiles of the tma engine (K < 772) or ``off`` leave the sum to XLA; the x^T engine sums it at any width."""
    from jaxsparse.ffi import calls

    narrow = F.compress(jnp.ones((512, 256), jnp.bfloat16), F.select_mask(jnp.ones((512, 256)), "2:4"), "2:4")
    wide = F.compress(jnp.ones((1024, 256), jnp.bfloat16), F.select_mask(jnp.ones((1024, 256)), "2:4"), "2:4")
    monkeypatch.setenv(calls.SDDMM_BIAS_ENV, "yes")
    with pytest.raises(ValueError, match=calls.SDDMM_BIAS_ENV):
        calls.sddmm_bias_grad_fused(100, wide)
    monkeypatch.setenv(calls.SDDMM_BIAS_ENV, "on")
    assert not calls.sddmm_bias_grad_fused(100, narrow, engine="tma", x_layout="row")
    assert calls.sddmm_bias_grad_fused(104, narrow, x_layout="col")  # the x^T engine: any number of column tiles
    monkeypatch.setenv(calls.SDDMM_BIAS_ENV, "off")
    assert not calls.sddmm_bias_grad_fused(100, wide, engine="tma", x_layout="row")
    assert not calls.sddmm_bias_grad_fused(104, narrow, x_layout="col")


def test_dz_epilogue_setting(monkeypatch):
    from jaxsparse.ffi import calls

    monkeypatch.delenv(calls.DZ_EPILOGUE_ENV, raising=False)
    assert calls.dz_epilogue(dz_summed=False) and not calls.dz_epilogue(dz_summed=True)  # auto
    monkeypatch.setenv(calls.DZ_EPILOGUE_ENV, "on")
    assert calls.dz_epilogue(dz_summed=False) and calls.dz_epilogue(dz_summed=True)
    monkeypatch.setenv(calls.DZ_EPILOGUE_ENV, "off")
    assert not calls.dz_epilogue(dz_summed=False) and not calls.dz_epilogue(dz_summed=True)
    monkeypatch.setenv(calls.DZ_EPILOGUE_ENV, "xla")
    with pytest.raises(ValueError, match=calls.DZ_EPILOGUE_ENV):
        calls.dz_epilogue(dz_summed=False)


def test_dx_route_setting(monkeypatch):
    monkeypatch.delenv(ops.DX_ROUTE_ENV, raising=False)
    assert ops.dx_route() == "dense"  # the v1 kernel loses to the dense route on the H100 (kernel-notes)
    assert ops.dx_route("kernel") == "kernel"
    monkeypatch.setenv(ops.DX_ROUTE_ENV, " Kernel ")
    assert ops.dx_route() == "kernel"
    monkeypatch.setenv(ops.DX_ROUTE_ENV, "sparse")
    with pytest.raises(ValueError, match="JAXSPARSE_DX"):
        ops.dx_route()
    x, sw, _, _ = make(3, "64:2:8")
    with pytest.raises(ValueError, match="JAXSPARSE_DX"):
        ops.spmm_t(jnp.ones((4, sw.shape[1]), x.dtype), sw)  # a bad setting fails loudly, not silently dense
    monkeypatch.setenv(ops.DX_ROUTE_ENV, "transposed")
    assert ops.dx_route() == "transposed"
    monkeypatch.setenv(ops.DX_ROUTE_ENV, "condensed")
    assert ops.dx_route() == "condensed"
    monkeypatch.setenv(ops.DX_ROUTE_ENV, "blocks")
    assert ops.dx_route() == "blocks"
    monkeypatch.setenv(ops.DX_ROUTE_ENV, "resident")
    assert ops.dx_route() == "resident"


@pytest.mark.parametrize("transposable", [True, False])
def test_resident_dx_route_off_its_kernel_is_the_transposed_route(monkeypatch, transposable):
    """``JAXSPARSE_DX=resident`` where its kernel does not apply (here: no Hopper GPU) is the transposed route: with a
    transposable mask the layer's gradient equals the masked dense one; with a plain mask dx is NaN, never wrong."""
    monkeypatch.setenv(ops.DX_ROUTE_ENV, "resident")
    x, sw, bias, dense = make(15, "128:2:16", k=512, r=256, transposable=transposable)
    target = jax.random.normal(jax.random.PRNGKey(16), (*x.shape[:-1], sw.shape[1]))
    gx = jax.jit(jax.grad(lambda x: jnp.sum(ops.sparse_linear(x, sw, bias).astype(jnp.float32) * target)))(x)
    dx = jax.grad(lambda x: jnp.sum((x @ dense + bias) * target))(x.astype(jnp.float32))
    gx, dx = np.asarray(gx, np.float32), np.asarray(dx)
    if transposable:
        np.testing.assert_allclose(gx, dx, rtol=1e-5, atol=1e-5)
    else:  # NaN in the input features W^T cannot hold, right in every other
        nan = np.isnan(gx).reshape(-1, gx.shape[-1]).any(0)
        assert nan.any() and not nan.all()
        np.testing.assert_allclose(gx[..., ~nan], dx[..., ~nan], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["128:2:16", "64:2:8"])
def test_condensed_dx_route_gives_the_layer_gradients(monkeypatch, spec):
    """``JAXSPARSE_DX=condensed`` on any mask (M = 16 takes the kernel on a Hopper GPU, other specs and platforms the
    dense route or the reference): ``jax.grad`` of the layer under ``jit`` equals the masked dense gradients."""
    monkeypatch.setenv(ops.DX_ROUTE_ENV, "condensed")
    x, sw, bias, dense = make(13, spec)
    target = jax.random.normal(jax.random.PRNGKey(14), (*x.shape[:-1], sw.shape[1]))
    gx = jax.jit(jax.grad(lambda x: jnp.sum(ops.sparse_linear(x, sw, bias).astype(jnp.float32) * target)))(x)
    dx = jax.grad(lambda x: jnp.sum((x @ dense + bias) * target))(x.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(gx, np.float32), np.asarray(dx), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_blocks_dx_route_gives_the_layer_gradients(monkeypatch, spec, dtype, tol):
    """``JAXSPARSE_DX=blocks`` on a column-exclusive mask (2:4 takes the dense route): ``jax.grad`` of the layer under
    ``jit`` equals the masked dense gradients, and the compiled backward holds the route's batched product."""
    monkeypatch.setenv(ops.DX_ROUTE_ENV, "blocks")
    x, sw, bias, dense = make(21, spec, r=512, dtype=dtype, exclusive=F.VNM.parse(spec).m > 4)
    target = jax.random.normal(jax.random.PRNGKey(22), (*x.shape[:-1], sw.shape[1]))

    def sparse_loss(x, values, bias):
        return jnp.sum(jnp.tanh(ops.sparse_linear(x, sw.replace(values=values), bias).astype(jnp.float32)) * target)

    grad = jax.jit(jax.grad(sparse_loss, argnums=(0, 1, 2)))
    gx, gv, gb = grad(x, sw.values, bias)
    dx, dw, db = jax.grad(lambda x, w, b: jnp.sum(jnp.tanh(x @ w + b) * target), argnums=(0, 1, 2))(
        x.astype(jnp.float32), dense, bias.astype(jnp.float32))
    assert rel_err(gx, dx) < tol
    assert rel_err(gv, F.compress_like(dw, sw)) < tol and rel_err(gb, db) < tol
    if sw.columns is not None:  # the route ran: dx's blocks product is a batched dot over the R/V blocks
        hlo = grad.lower(x, sw.values, bias).as_text()
        assert f"{sw.shape[1] // sw.spec.v}x" in hlo and "gather" in hlo


def test_blocks_dx_route_is_nan_where_a_column_breaks_the_cap(monkeypatch):
    """On a plain mask the columns kept by more blocks than ``column_cap`` get NaN input gradients, never wrong ones;
    every other column is exact."""
    x, sw, _, dense = make(23, "64:2:8", r=512)
    dy = jax.random.normal(jax.random.PRNGKey(24), (9, sw.shape[1]))
    got = np.asarray(ops.spmm_t(dy, sw, route="blocks"))
    used = np.asarray(F.kept_mask(sw)).T.reshape(8, 64, sw.shape[0] // 8, 8).any(axis=1).sum(axis=0).reshape(-1)
    over = used > F.column_cap(sw.shape[1], sw.spec)
    assert over.any() and (~over).any()
    assert np.isnan(got[:, over]).all() and np.isfinite(got[:, ~over]).all()
    np.testing.assert_allclose(got[:, ~over], np.asarray(dy @ dense.T)[:, ~over], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_transposed_dx_route_gives_the_layer_gradients(monkeypatch, spec, dtype, tol):
    """``JAXSPARSE_DX=transposed`` on a transposable mask: ``jax.grad`` of the layer under ``jit`` equals the
    masked dense gradients (dX through the 2:4 forward product of ``W^T``)."""
    monkeypatch.setenv(ops.DX_ROUTE_ENV, "transposed")
    x, sw, bias, dense = make(11, spec, dtype=dtype, transposable=True)
    target = jax.random.normal(jax.random.PRNGKey(12), (*x.shape[:-1], sw.shape[1]))

    def sparse_loss(x, values, bias):
        y = ops.sparse_linear(x, sw.replace(values=values), bias).astype(jnp.float32)
        return jnp.sum(jnp.tanh(y) * target)

    def dense_loss(x, w, bias):
        return jnp.sum(jnp.tanh(x @ w + bias) * target)

    gx, gv, gb = jax.jit(jax.grad(sparse_loss, argnums=(0, 1, 2)))(x, sw.values, bias)
    dx, dw, db = jax.grad(dense_loss, argnums=(0, 1, 2))(x.astype(jnp.float32), dense, bias.astype(jnp.float32))
    assert rel_err(gx, dx) < tol
    assert rel_err(gv, F.compress_like(jnp.where(dense != 0, dw, 0), sw)) < tol
    assert rel_err(gb, db) < tol


def test_transposed_dx_route_refuses_a_plain_mask_with_nan(monkeypatch):
    """A mask chosen without ``transposable`` cannot take the route: the input gradient is NaN in every input
    feature whose row of ``W^T`` holds more than 2 of some 4 output features, and right in the others; never a
    wrong number (the weight and bias gradients do not depend on it)."""
    x, sw, _, _ = make(13, "64:2:8")
    dy = jax.random.normal(jax.random.PRNGKey(14), (5, sw.shape[1]))
    dx = np.asarray(jax.jit(lambda d: ops.spmm_t(d, sw, route="transposed"))(dy))
    mask = np.asarray(F.kept_mask(sw))  # [K, R]
    overfull = (mask.reshape(sw.shape[0], -1, 4).sum(-1) > 2).any(-1)  # [K]
    assert overfull.any() and not overfull.all()  # the case is a real mix of both
    np.testing.assert_array_equal(np.isnan(dx).any(0), overfull)
    assert np.isnan(dx[:, overfull]).all()
    ref = np.asarray(dy) @ np.asarray(F.decompress(sw), np.float32).T
    np.testing.assert_allclose(dx[:, ~overfull], ref[:, ~overfull], rtol=2e-2, atol=2e-2)


def test_transpose_2_4_op_checks_before_dispatch():
    """``ops.transpose_2_4`` names the constraint it cannot take (R a multiple of 32) and what it was given."""
    w = jax.random.normal(jax.random.PRNGKey(15), (32, 16))
    sw = F.compress(w, F.select_mask(w, "2:4", transposable=True), "2:4")
    with pytest.raises(ValueError, match="R \\(output features\\) = 16 to be a multiple of 32"):
        ops.transpose_2_4(sw)
    with pytest.raises(ValueError, match="expected a jaxsparse.format.SparseWeight"):
        ops.transpose_2_4(w)
    w = jax.random.normal(jax.random.PRNGKey(16), (64, 64)).astype(jnp.bfloat16)
    sw = F.compress(w, F.select_mask(w, "2:4", transposable=True), "2:4")
    np.testing.assert_array_equal(np.asarray(F.decompress(ops.transpose_2_4(sw)), np.float32),
                                  np.asarray(F.decompress(sw), np.float32).T)


def test_sddmm_engine_setting(monkeypatch):
    from jaxsparse.ffi import calls

    monkeypatch.delenv(calls.SDDMM_ENGINE_ENV, raising=False)
    assert calls.sddmm_engine() == 0 and calls.sddmm_engine("mma") == 1 and calls.sddmm_engine("wgmma") == 2
    assert calls.sddmm_engine("tma") == 3
    monkeypatch.setenv(calls.SDDMM_ENGINE_ENV, "wgmma")
    assert calls.sddmm_engine() == 2
    monkeypatch.setenv(calls.SDDMM_ENGINE_ENV, "tensor")
    with pytest.raises(ValueError, match="JAXSPARSE_SDDMM_ENGINE"):
        calls.sddmm_engine()


@pytest.mark.parametrize("spec", ["2:4", "64:2:8", "128:2:16"])
def test_x_transposed_layer_route_gives_the_same_gradients(monkeypatch, spec):
    """JAXSPARSE_SPMM_X=col: sparse_linear keeps x^T as its residual for the SDDMM; same values and gradients."""
    from jaxsparse.ffi import calls

    x, sw, bias, _ = make(4, spec, tokens=(2, 8), dtype=jnp.bfloat16)

    def loss(x, values, bias):
        return jnp.sum(ops.sparse_linear(x, sw.replace(values=values), bias).astype(jnp.float32) ** 2)

    grads = {}
    for layout in ("row", "col"):
        monkeypatch.setenv(calls.SPMM_X_LAYOUT_ENV, layout)
        assert ops.linear_x_layout(16, sw) == layout
        grads[layout] = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, sw.values, bias)
        if ffi.available():  # the kernel branch of the col route: one transpose for both products
            text = str(jax.make_jaxpr(jax.grad(loss, argnums=1))(x, sw.values, bias))
            # row: the layer's SDDMM still takes x^T on its own where sddmm_x_layout says so (M > 4 on Hopper)
            own = layout == "row" and calls.sddmm_x_layout(16, sw) == "col"
            assert text.count("jaxsparse_transpose") == (1 if layout == "col" or own else 0)
            tma_rows = layout == "row" and calls.spmm_row_kernel(sw) == "tma"  # 2:4 on Hopper reads x as it is
            assert text.count("jaxsparse_spmm_xt") == (1 if layout == "col" or tma_rows else 0)
    for got, want in zip(grads["col"], grads["row"]):
        assert rel_err(got, want) < 1e-6
    monkeypatch.setenv(calls.SPMM_X_LAYOUT_ENV, "col")
    with pytest.raises(ValueError, match="T % 8 == 0"):
        calls.spmm_x_layout(12, sw)
    monkeypatch.setenv(calls.SPMM_X_LAYOUT_ENV, "diagonal")
    with pytest.raises(ValueError, match="JAXSPARSE_SPMM_X"):
        calls.spmm_x_layout(16, sw)
    with pytest.raises(ValueError, match="JAXSPARSE_SPMM_XT_TILE"):
        calls.spmm_xt_tile("huge")


def test_act_table_setting(monkeypatch):
    """``JAXSPARSE_ACT_TABLE``: on by default, ``off`` for the float32 formula, anything else a ValueError naming it."""
    from jaxsparse.ffi import calls

    monkeypatch.delenv(calls.ACT_TABLE_ENV, raising=False)
    assert calls.act_table() is True
    assert calls.act_table("off") is False
    monkeypatch.setenv(calls.ACT_TABLE_ENV, " OFF ")
    assert calls.act_table() is False
    monkeypatch.setenv(calls.ACT_TABLE_ENV, "sometimes")
    with pytest.raises(ValueError, match="JAXSPARSE_ACT_TABLE"):
        calls.act_table()


def test_xt_kernel_tiles_and_row_kernel_refuse_what_they_cannot_take(monkeypatch):
    """Tiles the x^T SpMM or the TMA row kernel cannot take, and the tma SDDMM engine on R % 128 != 0, raise
    ValueError before anything is launched (no GPU needed)."""
    from jaxsparse.ffi import calls

    monkeypatch.delenv(calls.SPMM_XT_TILE_ENV, raising=False)
    x8, sw8, _, _ = make(5, "64:2:8", k=512, r=128, tokens=(2, 8), dtype=jnp.bfloat16)
    x8 = x8.reshape(-1, 512)
    with pytest.raises(ValueError, match="R % 128 == 0 and V >= 128"):
        calls.spmm_from_xt(x8.T, sw8, tile="ws128x256")
    x3, sw3, _, _ = make(7, "64:2:8", k=512, r=192, tokens=(2, 8), dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="the tma engine needs R % 128 == 0"):
        calls.sddmm(x3.reshape(-1, 512), jnp.ones((16, 192), jnp.bfloat16), sw3, engine="tma")
    x24, sw24, _, _ = make(6, "2:4", k=512, r=128, tokens=(2, 8), dtype=jnp.bfloat16)
    monkeypatch.setenv(calls.SPMM_XT_TILE_ENV, "128x128")
    with pytest.raises(ValueError, match="tile auto, ws128x256, ws64x256"):
        calls.spmm(x24.reshape(-1, 512), sw24, x_layout="row", row_kernel="tma")


def test_env_scope_sets_several_and_restores_them_also_on_error(monkeypatch):
    monkeypatch.setenv("JAXSPARSE_BACKEND", "reference")
    monkeypatch.delenv("JAXSPARSE_REFERENCE_OPS", raising=False)
    monkeypatch.delenv(ops.DX_ROUTE_ENV, raising=False)
    with pytest.raises(RuntimeError, match="inside"):
        with dispatch.env_scope({"JAXSPARSE_BACKEND": "cuda", "JAXSPARSE_REFERENCE_OPS": "sddmm",
                                 ops.DX_ROUTE_ENV: None}):
            assert dispatch.backend() == "cuda" and dispatch.reference_ops() == {"sddmm"}
            assert ops.DX_ROUTE_ENV not in os.environ  # None leaves the variable as it is (absent)
            raise RuntimeError("inside")
    assert os.environ["JAXSPARSE_BACKEND"] == "reference" and "JAXSPARSE_REFERENCE_OPS" not in os.environ
    with dispatch.env_scope({"JAXSPARSE_BACKEND": "cuda", "JAXSPARSE_REFERENCE_OPS": "spmm"}, keep_set=True):
        assert dispatch.backend() == "reference"  # already set: kept
        assert dispatch.reference_ops() == {"spmm"}  # unset: set
    assert "JAXSPARSE_REFERENCE_OPS" not in os.environ


def test_dx_route_scope_sets_and_restores(monkeypatch):
    monkeypatch.setenv(ops.DX_ROUTE_ENV, "dense")
    monkeypatch.delenv(ops.DX_ROUTE_ENV)  # absent, and restored as absent after the test
    with ops.dx_route_scope("transposed"):
        assert ops.dx_route() == "transposed"
    assert ops.DX_ROUTE_ENV not in os.environ
    monkeypatch.setenv(ops.DX_ROUTE_ENV, "kernel")
    with ops.dx_route_scope("transposed", keep_set=True):
        assert ops.dx_route() == "kernel"
    with ops.dx_route_scope("transposed"):
        assert ops.dx_route() == "transposed"
    with ops.dx_route_scope(None):
        assert ops.dx_route() == "kernel"
    assert os.environ[ops.DX_ROUTE_ENV] == "kernel"
    with pytest.raises(ValueError, match="JAXSPARSE_DX"):
        with ops.dx_route_scope("sparse"):
            pass
    assert os.environ[ops.DX_ROUTE_ENV] == "kernel"


# ----------------------------------------------------------------------------- sparse_mlp


@pytest.mark.parametrize("spec", ["2:4", "64:2:8", "128:2:16"])
@pytest.mark.parametrize("activation", ops.FUSED_ACTIVATIONS)
@pytest.mark.parametrize("dx_route", ["dense", "transposed"])
def test_sparse_mlp_is_two_layers_and_the_activation(monkeypatch, spec, activation, dx_route):
    """``sparse_mlp`` (float32) equals ``sparse_linear``, the activation, ``sparse_linear``: value and every
    gradient, on the dense and the transposed dX routes, with and without the second bias."""
    monkeypatch.setenv(ops.DX_ROUTE_ENV, dx_route)
    transposable = dx_route == "transposed"
    x, sw1, b1, _ = make(21, spec, k=256, r=512, transposable=transposable)
    _, sw2, b2, _ = make(22, spec, k=512, r=128, transposable=transposable)
    act = reference.ACTIVATIONS[activation]
    target = jax.random.normal(jax.random.PRNGKey(23), (*x.shape[:-1], 128))

    def fused(x, v1, b1, v2, b2):
        y = ops.sparse_mlp(x, sw1.replace(values=v1), b1, sw2.replace(values=v2), b2, activation)
        return jnp.sum(jnp.tanh(y) * target)

    def layers(x, v1, b1, v2, b2):
        h = act(ops.sparse_linear(x, sw1.replace(values=v1), b1))
        return jnp.sum(jnp.tanh(ops.sparse_linear(h, sw2.replace(values=v2), b2)) * target)

    for bias2 in (b2, None):
        args = (x, sw1.values, b1, sw2.values, bias2)
        argnums = (0, 1, 2, 3, 4) if bias2 is not None else (0, 1, 2, 3)
        np.testing.assert_allclose(jax.jit(fused)(*args), jax.jit(layers)(*args), rtol=1e-5)
        got = jax.jit(jax.grad(fused, argnums=argnums))(*args)
        want = jax.jit(jax.grad(layers, argnums=argnums))(*args)
        for g, w in zip(got, want):
            assert rel_err(g, w) < 1e-5


@pytest.mark.parametrize("spec", ["64:2:8", "128:2:16"])
def test_sparse_mlp_transposed_hidden_gives_the_same_block(monkeypatch, spec):
    """JAXSPARSE_SPMM_X=col: the block hands h^T from its first product to the second (mlp_hidden_layout "col",
    act_mode 2 on a GPU) and keeps it for the second SDDMM; value and every gradient equal the "row" hand-over's."""
    from jaxsparse.ffi import calls

    monkeypatch.setenv(calls.SPMM_X_LAYOUT_ENV, "col")
    x, sw1, b1, _ = make(31, spec, k=256, r=512, tokens=(2, 8), dtype=jnp.bfloat16)
    _, sw2, b2, _ = make(32, spec, k=512, r=128, dtype=jnp.bfloat16)
    target = jax.random.normal(jax.random.PRNGKey(33), (2, 8, 128))

    def loss(x, v1, b1, v2, b2):
        y = ops.sparse_mlp(x, sw1.replace(values=v1), b1, sw2.replace(values=v2), b2, "gelu_erf")
        return jnp.sum(jnp.tanh(y) * target)

    args = (x, sw1.values, b1, sw2.values, b2)
    results = {}
    for layout in ("row", "col"):
        monkeypatch.setenv(ops.MLP_HIDDEN_ENV, layout)
        assert ops.mlp_hidden_layout(16, sw1, sw2) == layout
        results[layout] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))(*args)
    monkeypatch.setenv(ops.MLP_HIDDEN_ENV, "auto")
    assert ops.mlp_hidden_layout(16, sw1, sw2) == "col"  # both layers on the x^T route
    np.testing.assert_allclose(np.float32(results["col"][0]), np.float32(results["row"][0]), rtol=1e-6)
    for g, w in zip(results["col"][1], results["row"][1]):
        assert rel_err(g.astype(jnp.float32), w.astype(jnp.float32)) < 1e-6


def test_mlp_hidden_layout_rejects(monkeypatch):
    from jaxsparse.ffi import calls

    _, sw1, _, _ = make(34, "64:2:8", k=256, r=512, dtype=jnp.bfloat16)
    _, sw2, _, _ = make(35, "64:2:8", k=512, r=128, dtype=jnp.bfloat16)
    monkeypatch.setenv(calls.SPMM_X_LAYOUT_ENV, "row")
    assert ops.mlp_hidden_layout(16, sw1, sw2) == "row"
    with pytest.raises(ValueError, match="both layers on the x\\^T route"):
        ops.mlp_hidden_layout(16, sw1, sw2, "col")
    monkeypatch.setenv(calls.SPMM_X_LAYOUT_ENV, "col")
    monkeypatch.setenv(calls.SPMM_XT_TILE_ENV, "ws128x256")
    assert ops.mlp_hidden_layout(16, sw1, sw2) == "row"
    with pytest.raises(ValueError, match="a plain x\\^T tile"):
        ops.mlp_hidden_layout(16, sw1, sw2, "col")
    with pytest.raises(ValueError, match="JAXSPARSE_MLP_HIDDEN"):
        ops.mlp_hidden_layout(16, sw1, sw2, "transposed")
    monkeypatch.setenv(ops.MLP_HIDDEN_ENV, "auto")
    with ops.mlp_hidden_scope("row"):  # sets for the block, restores after
        assert ops.mlp_hidden_layout(16, sw1, sw2) == "row"
    assert os.environ[ops.MLP_HIDDEN_ENV] == "auto"
    with pytest.raises(ValueError, match="JAXSPARSE_MLP_HIDDEN"):
        with ops.mlp_hidden_scope("transposed"):
            pass
    with pytest.raises(ValueError, match="transpose_out needs"):
        ops._forward_keeping_x(jnp.zeros((16, 256), jnp.bfloat16), sw1, None, "gelu", transpose_out=True)


@pytest.mark.parametrize("activation", ops.FUSED_ACTIVATIONS)
def test_activation_derivative_is_the_gradient(activation):
    z = jnp.linspace(-6, 6, 101)
    f, df = reference.activation_with_derivative(activation, z)
    np.testing.assert_allclose(f, reference.ACTIVATIONS[activation](z), rtol=1e-6, atol=1e-7)
    want = jax.vmap(jax.grad(reference.ACTIVATIONS[activation]))(z)
    np.testing.assert_allclose(df, want, rtol=1e-5, atol=1e-6)


def test_sparse_mlp_rejects_what_it_cannot_take():
    x, sw1, b1, _ = make(27, "2:4", k=256, r=512)
    _, sw2, b2, _ = make(28, "2:4", k=512, r=128)
    with pytest.raises(ValueError, match="activation must be one of"):
        ops.sparse_mlp(x, sw1, b1, sw2, b2, "tanh")
    with pytest.raises(ValueError, match="second weight's K \\(256\\) must equal the first's output features"):
        ops.sparse_mlp(x, sw1, b1, sw1, b1)
    with pytest.raises(ValueError, match="bias must have shape"):
        ops.sparse_mlp(x, sw1, b2, sw2, b2)
    with pytest.raises(ValueError, match="both weights must share one dtype"):
        ops.sparse_mlp(x, sw1, b1, sw2.replace(values=sw2.values.astype(jnp.bfloat16)), b2)


# ----------------------------------------------------------------------------- diagonal 2:4 blocks


def _diagonal_operands(blocks=4, k=64, r=128, tokens=(3, 5)):
    kw, kx, kb = jax.random.split(jax.random.PRNGKey(blocks), 3)
    w = jax.random.normal(kw, (k, r), jnp.float32)
    sw = F.compress(w, F.select_mask(w, "2:4", transposable=True), "2:4")
    rb = r // blocks
    stacked = np.asarray(F.decompress(sw))
    dense = np.zeros((blocks * k, r), np.float32)
    for b in range(blocks):
        dense[b * k:(b + 1) * k, b * rb:(b + 1) * rb] = stacked[:, b * rb:(b + 1) * rb]
    x = jax.random.normal(kx, (*tokens, blocks * k), jnp.float32)
    return x, sw, jax.random.normal(kb, (r,), jnp.float32), jnp.asarray(dense)


@pytest.mark.parametrize("blocks", [1, 2, 4])
def test_diagonal_linear_is_the_block_diagonal_layer(blocks):
    """Forward and every gradient (the input gradient through the stacked W^T blocks) against the dense
    block-diagonal layer; the weight gradient is the dense one at the kept positions of each block."""
    x, sw, bias, dense = _diagonal_operands(blocks)
    y = ops.diagonal_linear(x, sw, blocks, bias)
    assert rel_err(y, x @ dense + bias) < 1e-5
    f = lambda x, v, b: (ops.diagonal_linear(x, sw.replace(values=v), blocks, b) ** 2).sum()
    g = lambda x, w, b: ((x @ w + b) ** 2).sum()
    dx, dv, db = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(x, sw.values, bias)
    rx, rw, rb = jax.grad(g, argnums=(0, 1, 2))(x, dense, bias)
    assert rel_err(dx, rx) < 1e-5 and rel_err(db, rb) < 1e-5
    assert rel_err(dv, F.compress_like(F.stack_diagonal_blocks(rw, blocks), sw)) < 1e-5


def test_diagonal_blocks_count_may_be_any_integer_but_not_a_bool_or_float():
    """``blocks`` as a NumPy integer (as a config array might hold it) gives the layer of the int; a bool, a float or
    a count the weight does not split into is a ``ValueError``."""
    x, sw, bias, dense = _diagonal_operands(2)
    np.testing.assert_array_equal(ops.diagonal_linear(x, sw, np.int64(2), bias), ops.diagonal_linear(x, sw, 2, bias))
    for bad in (True, 2.0, np.float32(2)):
        with pytest.raises(ValueError, match="blocks must be an integer"):
            ops.diagonal_linear(x, sw, bad, bias)
    with pytest.raises(ValueError):
        ops.diagonal_linear(x, sw, 3, bias)


def _chunked_layer(key, k: int, r: int, blocks: int):
    """A kernel masked to diagonal blocks in 64-feature chunks: (masked dense [k, r], stacked 2:4 weight, table)."""
    w = jax.random.normal(key, (k, r), jnp.float32) / np.sqrt(k / 4)
    mask = F.select_diagonal_mask(w, blocks, transposable=True, chunk=F.DIAGONAL_CHUNK)
    table = F.diagonal_chunks(mask, blocks)
    stacked = F.stack_diagonal_blocks((w * mask)[F.chunk_columns(table)], blocks)
    return w * mask, F.compress(stacked, stacked != 0, "2:4"), table


@pytest.mark.parametrize("blocks", [2, 4])
def test_diagonal_linear_with_a_chunk_table_is_the_masked_layer(blocks):
    """``chunks=``: a mask of diagonal blocks chosen in 64-feature chunks on a kernel in its own order
    (``select_diagonal_mask``), stored stacked with its table (``diagonal_chunks``), computes the masked dense layer
    from x as it is, forward and every gradient (the input gradient's chunks written back by the table), under jit."""
    k, r = 64 * 2 * blocks, 64 * blocks
    kw, kx, kb = jax.random.split(jax.random.PRNGKey(10 + blocks), 3)
    dense, sw, table = _chunked_layer(kw, k, r, blocks)
    assert table.shape == (blocks, k // blocks // 64) and sorted(table.ravel().tolist()) == list(range(k // 64))
    x = jax.random.normal(kx, (3, 5, k), jnp.float32)
    bias = jax.random.normal(kb, (r,), jnp.float32)
    assert rel_err(ops.diagonal_linear(x, sw, blocks, bias, chunks=table), x @ dense + bias) < 1e-5
    f = lambda x, v, b, t: (ops.diagonal_linear(x, sw.replace(values=v), blocks, b, chunks=t) ** 2).sum()
    g = lambda x, w, b: ((x @ w + b) ** 2).sum()
    dx, dv, db = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(x, sw.values, bias, jnp.asarray(table))
    rx, rw, rb = jax.grad(g, argnums=(0, 1, 2))(x, dense, bias)
    assert rel_err(dx, rx) < 1e-5 and rel_err(db, rb) < 1e-5
    assert rel_err(dv, F.compress_like(F.stack_diagonal_blocks(rw[F.chunk_columns(table)], blocks), sw)) < 1e-5
    with pytest.raises(ValueError, match="chunk table"):
        ops.diagonal_linear(x, sw, blocks, bias, chunks=table[:, :1])
    with pytest.raises(ValueError, match="integer"):
        ops.diagonal_linear(x, sw, blocks, bias, chunks=table.astype(np.float32))


def test_diagonal_mlp_is_the_masked_feed_forward():
    """``diagonal_mlp``: both layers diagonal blocks read through their tables, against the masked dense FFN with the
    exact GELU, forward and every gradient, under jit."""
    blocks, k, f, r = 2, 256, 512, 256
    k1, k2, kx, kb1, kb2 = jax.random.split(jax.random.PRNGKey(3), 5)
    d1, sw1, c1 = _chunked_layer(k1, k, f, blocks)
    d2, sw2, c2 = _chunked_layer(k2, f, r, blocks)
    x = jax.random.normal(kx, (4, 7, k), jnp.float32)
    b1, b2 = jax.random.normal(kb1, (f,)), jax.random.normal(kb2, (r,))
    gelu = lambda z: jax.nn.gelu(z, approximate=False)
    dense = lambda x, w1, b1, w2, b2: gelu(x @ w1 + b1) @ w2 + b2
    mlp = lambda x, v1, b1, v2, b2: ops.diagonal_mlp(x, sw1.replace(values=v1), b1, c1, sw2.replace(values=v2), b2,
                                                     c2, blocks)
    assert rel_err(mlp(x, sw1.values, b1, sw2.values, b2), dense(x, d1, b1, d2, b2)) < 1e-5
    got = jax.jit(jax.grad(lambda *a: (mlp(*a) ** 2).sum(), argnums=(0, 1, 2, 3, 4)))(x, sw1.values, b1, sw2.values, b2)
    want = jax.grad(lambda *a: (dense(*a) ** 2).sum(), argnums=(0, 1, 2, 3, 4))(x, d1, b1, d2, b2)
    assert rel_err(got[0], want[0]) < 1e-5 and rel_err(got[2], want[2]) < 1e-5 and rel_err(got[4], want[4]) < 1e-5
    for g, w, sw, c in ((got[1], want[1], sw1, c1), (got[3], want[3], sw2, c2)):
        assert rel_err(g, F.compress_like(F.stack_diagonal_blocks(w[F.chunk_columns(c)], blocks), sw)) < 1e-5
    with pytest.raises(ValueError, match="chunk table"):
        ops.diagonal_mlp(x, sw1, b1, c2, sw2, b2, c2, blocks)
    with pytest.raises(ValueError, match="activation"):
        ops.diagonal_mlp(x, sw1, b1, c1, sw2, b2, c2, blocks, activation="tanh")


def test_diagonal_linear_rejects():
    x, sw, bias, _ = _diagonal_operands(4)
    with pytest.raises(ValueError, match="last dimension"):
        ops.diagonal_linear(x[..., :128], sw, 4, bias)
    with pytest.raises(ValueError, match="dtype"):
        ops.diagonal_linear(x.astype(jnp.bfloat16), sw, 4, bias)
    with pytest.raises(ValueError, match="bias"):
        ops.diagonal_linear(x, sw, 4, bias[:8])
    with pytest.raises(ValueError, match="32"):
        ops.diagonal_linear(jnp.ones((2, 8 * 64)), sw, 8)  # 16 outputs a block
    x8, sw8, _, _ = make(0, "64:2:8")
    with pytest.raises(ValueError, match="2:4"):
        ops.diagonal_linear(x8, sw8, 1)


def test_sparse_mlp_with_a_diagonal_second_layer():
    """``sparse_mlp(..., blocks=G)``: the second layer as G diagonal 2:4 blocks, against the dense FFN."""
    blocks, k, f, r = 2, 64, 256, 64
    x1, sw1, b1, dense1 = make(3, "64:2:8", k=k, r=f, tokens=(5,))
    h_dim_x, sw2, b2, dense2 = _diagonal_operands(blocks, k=f // blocks, r=r, tokens=(5,))
    y = ops.sparse_mlp(x1, sw1, b1, sw2, b2, "gelu_erf", blocks=blocks)
    ref = jax.nn.gelu(x1 @ dense1 + b1, approximate=False) @ dense2 + b2
    assert rel_err(y, ref) < 1e-5
    f_ = lambda x, v1, v2: (ops.sparse_mlp(x, sw1.replace(values=v1), b1, sw2.replace(values=v2), b2, "gelu_erf",
                                           blocks=blocks) ** 2).sum()
    g_ = lambda x, w1, w2: ((jax.nn.gelu(x @ w1 + b1, approximate=False) @ w2 + b2) ** 2).sum()
    dx, dv1, dv2 = jax.grad(f_, argnums=(0, 1, 2))(x1, sw1.values, sw2.values)
    rx, rw1, rw2 = jax.grad(g_, argnums=(0, 1, 2))(x1, dense1, dense2)
    assert rel_err(dx, rx) < 1e-4 and rel_err(dv1, F.compress_like(rw1, sw1)) < 1e-4
    assert rel_err(dv2, F.compress_like(F.stack_diagonal_blocks(rw2, blocks), sw2)) < 1e-4
    with pytest.raises(ValueError, match="diagonal"):
        ops.sparse_mlp(x1, sw1, b1, sw2, b2, "gelu_erf", blocks=4)


# ----------------------------------------------------------------------------- layers sharing their input


def _shared_case(seed: int, spec: str, dtype, use_bias: bool, k: int = 128, r: int = 128):
    """x and three transposable layers of one input, each with its masked dense kernel (float32)."""
    layers = [make(seed + i, spec, k=k, r=r, dtype=dtype, transposable=True) for i in range(3)]
    x = layers[0][0]
    sws = [sw for _, sw, _, _ in layers]
    biases = [b if use_bias else None for _, _, b, _ in layers]
    return x, sws, biases, [d for _, _, _, d in layers]


@pytest.mark.parametrize("spec", ["2:4", "64:2:8", "128:2:16"])
@pytest.mark.parametrize("route, shared", [("transposed", "auto"), ("transposed", "off"), ("dense", "auto")])
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("use_bias", [True, False])
def test_shared_linear_is_the_layers_and_their_gradients(monkeypatch, spec, route, shared, dtype, tol, use_bias):
    """``shared_linear`` under ``jit``: each output is its layer's ``x @ W_i + b_i`` and ``jax.grad`` gives the masked
    dense gradients: dx the sum over the layers (one summed product on the transposed route unless
    ``JAXSPARSE_SHARED_DX=off``), each values' gradient gathered at its mask, each bias gradient."""
    monkeypatch.setenv(ops.DX_ROUTE_ENV, route)
    monkeypatch.setenv(ops.SHARED_DX_ENV, shared)
    x, sws, biases, dense = _shared_case(31, spec, dtype, use_bias)
    targets = jax.random.normal(jax.random.PRNGKey(32), (3, *x.shape[:-1], sws[0].shape[1]))

    def sparse_loss(x, values, biases):
        ys = ops.shared_linear(x, [sw.replace(values=v) for sw, v in zip(sws, values)], biases)
        return sum(jnp.sum(jnp.tanh(y.astype(jnp.float32)) * t) for y, t in zip(ys, targets))

    def dense_loss(x, ws, biases):
        return sum(jnp.sum(jnp.tanh(x @ w + (0 if b is None else b)) * t) for w, b, t in zip(ws, biases, targets))

    values = [sw.values for sw in sws]
    ys = jax.jit(ops.shared_linear)(x, sws, biases)
    for y, w, b in zip(ys, dense, biases):
        assert y.shape == (*x.shape[:-1], w.shape[1]) and y.dtype == dtype
        assert rel_err(y, x.astype(jnp.float32) @ w + (0 if b is None else b.astype(jnp.float32))) < tol
    gx, gv, gb = jax.jit(jax.grad(sparse_loss, argnums=(0, 1, 2)))(x, values, biases)
    b32 = [None if b is None else b.astype(jnp.float32) for b in biases]
    dx, dw, db = jax.grad(dense_loss, argnums=(0, 1, 2))(x.astype(jnp.float32), dense, b32)
    assert gx.dtype == dtype and rel_err(gx, dx) < tol
    for g, d, sw, w in zip(gv, dw, sws, dense):
        assert rel_err(g, F.compress_like(jnp.where(w != 0, d, 0), sw)) < tol
    for g, d in zip(gb, db):
        assert (g is None) if not use_bias else rel_err(g, d) < tol


def test_shared_linear_input_gradient_is_one_summed_product(monkeypatch):
    """On the transposed route, where the summed kernel can run (a Hopper GPU, here pretended), the backward's input
    gradient is one ``reference.spmm_t_sum``, i.e. one ``reference.spmm_sum`` over the three ``W^T`` views (one
    product, rounded once), on a machine without the kernel; with ``JAXSPARSE_SHARED_DX=off``, or without a Hopper
    GPU, three ``spmm_t`` products added in the dtype."""
    from jaxsparse.ffi import calls

    monkeypatch.setenv(ops.DX_ROUTE_ENV, "transposed")
    monkeypatch.setattr(calls, "hopper_gpu", lambda: True)
    x, sws, biases, _ = _shared_case(33, "64:2:8", jnp.bfloat16, True)
    calls_seen = []
    monkeypatch.setattr(reference, "spmm_sum",
                        lambda xs, ws, f=reference.spmm_sum: calls_seen.append(len(xs)) or f(xs, ws))
    dys = tuple(jax.random.normal(k, (*x.shape[:-1], 128)).astype(jnp.bfloat16)
                for k in jax.random.split(jax.random.PRNGKey(34), 3))

    def dx_of():
        return jax.vjp(lambda x: ops.shared_linear(x, sws, biases), x)[1](dys)[0]

    one = dx_of()
    assert calls_seen == [3]
    monkeypatch.setenv(ops.SHARED_DX_ENV, "off")
    three = dx_of()
    assert calls_seen == [3]
    monkeypatch.setenv(ops.SHARED_DX_ENV, "auto")
    monkeypatch.setattr(calls, "hopper_gpu", lambda: False)
    np.testing.assert_array_equal(np.asarray(dx_of(), np.float32), np.asarray(three, np.float32))
    assert calls_seen == [3]
    flat = [d.reshape(-1, 128) for d in dys]
    views = [F.transpose_2_4(sw) for sw in sws]
    want = reference.spmm_sum(flat, views).reshape(one.shape)
    np.testing.assert_array_equal(np.asarray(one, np.float32), np.asarray(want, np.float32))
    assert rel_err(three, want) < 2e-2 and one.dtype == three.dtype == jnp.bfloat16


def test_spmm_t_sum_unsupported_names_each_constraint(monkeypatch):
    """``calls.spmm_t_sum_unsupported`` (what ``shared_linear`` asks before its one product) names what it cannot
    take, and takes three transposable 2:4 weights of one shape on a Hopper GPU (here pretended)."""
    from jaxsparse.ffi import calls

    sws = [make(50 + i, "2:4", k=128, r=128, dtype=jnp.bfloat16)[1] for i in range(3)]
    monkeypatch.setattr(calls, "hopper_gpu", lambda: False)
    assert "Hopper" in calls.spmm_t_sum_unsupported(sws)
    monkeypatch.setattr(calls, "hopper_gpu", lambda: True)
    assert calls.spmm_t_sum_unsupported(sws) is None
    assert "one to 3" in calls.spmm_t_sum_unsupported(sws + sws[:1])
    other = make(53, "64:2:8", k=128, r=128, dtype=jnp.bfloat16)[1]
    assert "one shape and spec" in calls.spmm_t_sum_unsupported([sws[0], other])
    narrow = make(54, "2:4", k=128, r=96, dtype=jnp.bfloat16)[1]
    assert "K % 64" in calls.spmm_t_sum_unsupported([narrow, narrow])
    wide = sws[0].replace(values=sws[0].values.astype(jnp.float32))
    assert "bf16 or fp16" in calls.spmm_t_sum_unsupported([wide])
    with pytest.raises(ValueError, match="one to 3 weights"):  # refused before any call is built
        calls.transpose_2_4_stacked([])
    with pytest.raises(ValueError, match="one shape, spec and dtype"):
        calls.transpose_2_4_stacked([sws[0], other])


def test_shared_linear_weight_gradients_are_one_stacked_sddmm(monkeypatch):
    """Where the stacked SDDMM can run (a Hopper GPU, here pretended), ``shared_linear``'s backward takes the three
    layers' weight and bias gradients from one ``reference.sddmm_stacked`` on a machine without the kernel; with
    ``JAXSPARSE_SHARED_SDDMM=off``, or without a Hopper GPU, one SDDMM a layer; the gradients are the same."""
    from jaxsparse.ffi import calls

    monkeypatch.setattr(calls, "hopper_gpu", lambda: True)
    x, sws, biases, _ = _shared_case(36, "2:4", jnp.bfloat16, True)
    seen = []
    monkeypatch.setattr(reference, "sddmm_stacked",
                        lambda *a, f=reference.sddmm_stacked: seen.append((len(a[1]), a[3], a[4])) or f(*a))
    dys = tuple(jax.random.normal(k, (*x.shape[:-1], 128)).astype(jnp.bfloat16)
                for k in jax.random.split(jax.random.PRNGKey(37), 3))

    def grads_of():
        return jax.vjp(lambda v, b: ops.shared_linear(x, [sw.replace(values=a) for sw, a in zip(sws, v)], b),
                       [sw.values for sw in sws], biases)[1](dys)

    stacked = grads_of()
    assert seen == [(3, "row", True)]
    # As on a GPU with the kernels (the backend's auto mode): dispatch.call hands jax.lax.platform_dependent arrays only,
    # and the CPU takes the reference branch.
    from jaxsparse import dispatch

    def arrays_only(*operands, f=jax.lax.platform_dependent, **branches):  # JAX 0.11 refuses anything else
        bad = [type(a).__name__ for a in jax.tree.leaves(operands) if not isinstance(a, jax.Array)]
        assert not bad, f"platform_dependent operands that are not arrays: {bad}"
        return f(*operands, **branches)

    monkeypatch.setattr(jax.lax, "platform_dependent", arrays_only)
    monkeypatch.setattr(dispatch.ffi, "available", lambda: True)
    monkeypatch.setattr(calls, "sddmm_stacked", lambda *a: seen.append("cuda traced") or reference.sddmm_stacked(*a))
    auto = grads_of()
    assert seen.count((3, "row", True)) == 2  # the reference branch ran again ("cuda traced" if JAX traced the other)
    seen_before = list(seen)
    monkeypatch.setattr(dispatch.ffi, "available", lambda: False)
    monkeypatch.setenv(ops.SHARED_SDDMM_ENV, "off")
    per_layer = grads_of()
    monkeypatch.setenv(ops.SHARED_SDDMM_ENV, "auto")
    monkeypatch.setattr(calls, "hopper_gpu", lambda: False)
    no_hopper = grads_of()
    assert seen == seen_before  # neither ran the stacked SDDMM
    for a, b, c, d in zip(*(jax.tree.leaves(g) for g in (stacked, per_layer, no_hopper, auto))):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        np.testing.assert_array_equal(np.asarray(d, np.float32), np.asarray(b, np.float32))
        np.testing.assert_array_equal(np.asarray(b, np.float32), np.asarray(c, np.float32))


@pytest.mark.parametrize("spec", ["2:4", "128:2:16"])
def test_shared_linear_forward_is_one_stacked_product(monkeypatch, spec):
    """Where the stacked forward can run (a Hopper GPU, here pretended, with the kernels' dispatch), ``shared_linear``
    traces one ``calls.spmm_stacked`` for its three layers, from x (2:4, the TMA row kernel) or from the one x^T
    (128:2:16, the x^T route); with ``JAXSPARSE_SHARED_SPMM=off``, or without a Hopper GPU, one product a layer. The
    outputs are the same."""
    from jaxsparse import dispatch
    from jaxsparse.ffi import calls

    _, sws, biases, _ = _shared_case(80, spec, jnp.bfloat16, True)
    x = jax.random.normal(jax.random.PRNGKey(83), (4, 8, 128)).astype(jnp.bfloat16)  # T % 8 == 0: the x^T route
    seen = []

    def stacked(xin, ws, bs, layout):  # the kernel's stand-in: each layer's reference product from what it was handed
        seen.append((layout, xin.shape))
        x2 = xin.T if layout == "col" else xin
        return tuple(reference.spmm(x2, w, b) for w, b in zip(ws, bs))

    monkeypatch.setattr(calls, "hopper_gpu", lambda: True)
    monkeypatch.setattr(dispatch.ffi, "available", lambda: True)
    monkeypatch.setattr(jax.lax, "platform_dependent", lambda *ops_, cuda, default: cuda(*ops_))  # the GPU branch
    monkeypatch.setattr(calls, "spmm_stacked", stacked)
    monkeypatch.setattr(calls, "transpose", lambda a: a.T)
    one = jax.jit(ops.shared_linear)(x, sws, biases)
    layout = "col" if spec == "128:2:16" else "row"
    tokens = x.size // x.shape[-1]
    assert seen == [(layout, (128, tokens) if layout == "col" else (tokens, 128))]
    monkeypatch.undo()
    monkeypatch.setenv(ops.SHARED_SPMM_ENV, "off")
    three = ops.shared_linear(x, sws, biases)
    for a, b in zip(one, three):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("which", ["spmm", "sddmm"])
def test_stacked_unsupported_names_each_constraint(monkeypatch, which):
    """``calls.spmm_stacked_unsupported`` and ``calls.sddmm_stacked_unsupported`` (what ``shared_linear`` asks before
    its one forward product and its one SDDMM) name what they cannot take on either layout, and take three 2:4 (row)
    or 128:2:16 (col) weights of one shape on a Hopper GPU (pretended); the calls refuse bad operands before anything
    is built."""
    from jaxsparse.ffi import calls

    unsupported = calls.spmm_stacked_unsupported if which == "spmm" else calls.sddmm_stacked_unsupported
    row_kernel = "TMA row kernel" if which == "spmm" else "tma engine"  # what x rows need (M = 16 has neither)
    sws = [make(60 + i, "2:4", k=128, r=128, dtype=jnp.bfloat16)[1] for i in range(3)]
    col = [make(63 + i, "128:2:16", k=128, r=128, dtype=jnp.bfloat16)[1] for i in range(2)]
    monkeypatch.setattr(calls, "hopper_gpu", lambda: False)
    assert ("Hopper" if which == "spmm" else "tma engine") in unsupported(64, sws, "row")
    assert "Hopper" in unsupported(64, col, "col")
    monkeypatch.setattr(calls, "hopper_gpu", lambda: True)
    assert unsupported(64, sws, "row") is None
    assert unsupported(64, col, "col") is None
    assert "T % 8" in unsupported(60, col, "col")
    assert row_kernel in unsupported(64, col, "row")
    assert "one to 3" in unsupported(64, sws + sws[:1], "row")
    assert "one shape, spec and dtype" in unsupported(64, [sws[0], col[0]], "row")
    narrow = [make(66 + i, "2:4", k=128, r=64, dtype=jnp.bfloat16)[1] for i in range(2)]
    assert "R % 128" in unsupported(64, narrow, "row")
    wide = sws[0].replace(values=sws[0].values.astype(jnp.float32))
    assert "bfloat16 or float16" in unsupported(64, [wide], "row")
    with pytest.raises(ValueError, match="x_layout"):
        unsupported(64, sws, "rows")
    x = jnp.ones((64, 128), jnp.bfloat16)
    if which == "spmm":
        with pytest.raises(ValueError, match="one bias"):
            calls.spmm_stacked(x, sws, [None], "row")
        with pytest.raises(ValueError, match=r"x \(64, 128\)"):
            calls.spmm_stacked(x[:, :64], sws, None, "row")
    else:
        with pytest.raises(ValueError, match="one dy a weight"):
            calls.sddmm_stacked(x, [x, x], sws, "row")
        with pytest.raises(ValueError, match=r"every dy must be \[T, 128\]"):
            calls.sddmm_stacked(x, [x, x[:, :64]], sws[:2], "row")


def test_reference_sddmm_stacked_is_each_layers_sddmm():
    """``reference.sddmm_stacked``: each layer's ``reference.sddmm`` (x or x^T as ``x_layout`` says) and, asked for,
    its bias gradient in float32."""
    parts = [make(70 + i, "64:2:8", k=128, r=128, dtype=jnp.bfloat16) for i in range(2)]
    x = parts[0][0].reshape(-1, 128)
    dys = [jax.random.normal(jax.random.PRNGKey(72 + i), (x.shape[0], 128)).astype(jnp.bfloat16) for i in range(2)]
    sws = [sw for _, sw, _, _ in parts]
    plain = reference.sddmm_stacked(x, dys, sws, "row", False)
    both = reference.sddmm_stacked(x.T, dys, sws, "col", True)
    for p, (d, db), dy, sw in zip(plain, both, dys, sws):
        np.testing.assert_array_equal(np.asarray(p, np.float32), np.asarray(reference.sddmm(x, dy, sw), np.float32))
        np.testing.assert_array_equal(np.asarray(d, np.float32), np.asarray(p, np.float32))
        assert db.dtype == jnp.float32 and rel_err(db, dy.astype(jnp.float32).sum(0)) < 1e-6


def test_reference_spmm_sum_is_the_products_summed_in_float32():
    """``reference.spmm_sum`` accumulates every product in float32 and rounds once."""
    parts = [make(40 + i, "2:4", k=128, r=64, dtype=jnp.bfloat16) for i in range(3)]
    xs = [x.reshape(-1, 128) for x, _, _, _ in parts]
    got = reference.spmm_sum(xs, [sw for _, sw, _, _ in parts])
    want = sum(x.astype(jnp.float32) @ d for x, (_, _, _, d) in zip(xs, parts))
    assert got.dtype == jnp.bfloat16 and rel_err(got, want) < 4e-3


@pytest.mark.parametrize("setting, env", [("shared_dx", "JAXSPARSE_SHARED_DX"), ("shared_sddmm", "JAXSPARSE_SHARED_SDDMM"),
                                          ("shared_spmm", "JAXSPARSE_SHARED_SPMM")])
def test_shared_settings_refuse_unknown_values(monkeypatch, setting, env):
    """Each of ``shared_linear``'s settings reads its variable and names it when the value is not one of its choices."""
    monkeypatch.setenv(env, "sometimes")
    with pytest.raises(ValueError, match=env):
        getattr(ops, setting)()
    monkeypatch.setenv(env, "off")
    assert getattr(ops, setting)() is False
    monkeypatch.setenv(env, "on")
    assert getattr(ops, setting)() is True


def test_shared_linear_refuses_bad_input(monkeypatch):
    x, sws, biases, _ = _shared_case(35, "2:4", jnp.float32, True)
    with pytest.raises(ValueError, match="one bias"):
        ops.shared_linear(x, sws, biases[:2])
    with pytest.raises(ValueError, match="at least one weight"):
        ops.shared_linear(x, [], [])
    with pytest.raises(ValueError, match="last dimension"):
        ops.shared_linear(x[..., :64], sws, biases)
    with pytest.raises(ValueError, match="bias must have shape"):
        ops.shared_linear(x, sws, [biases[0][:5], None, None])
    with pytest.raises(ValueError, match="must be one of"):
        with ops.shared_dx_scope("never"):
            pass
