"""GPU tests of the resident input-gradient kernel ``jaxsparse_spmm_t_resident`` (``calls.spmm_t_resident``,
``JAXSPARSE_DX=resident``; M = 16, R <= 1024 on Hopper).

Every check draws fresh random inputs, poisons the output memory with NaN first, and compares against the float32
reference ``dy @ decompress(W)^T``; the shapes cut every tile: token counts 1, 17, 200 and 1000 against 64-token
CTAs, 1, 2 and 3 chunks of 16 groups, one V block (the second warpgroup idle), an odd number of blocks and the
largest R, both V, plain masks (blocks share columns: the shared-memory sums are exercised).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpu_common import DTYPES, TOL, compare, cuda_ready, gpu_marks, key, poison
from jaxsparse import format as F
from jaxsparse.profile import parse_hlo

pytestmark = gpu_marks("jaxsparse_spmm_t_resident")

if cuda_ready("jaxsparse_spmm_t_resident"):
    from jaxsparse import ops
    from jaxsparse.ffi import calls

HIGHEST = jax.lax.Precision.HIGHEST
SPECS16 = ["64:2:16", "128:2:16"]


@pytest.fixture(autouse=True)
def _needs_hopper():
    if not calls.hopper_gpu():
        pytest.skip("the resident dX kernel runs on Hopper (wgmma) only")


def _make(rng, t: int, k: int, r: int, spec: str, dtype, transposable: bool = False):
    kd, kw = jax.random.split(rng)
    dy = jax.random.normal(kd, (t, r), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, r), jnp.float32) / np.sqrt(k / 4)).astype(dtype)
    return dy, F.compress(w, F.select_mask(w, spec, transposable=transposable), spec)


def _check(dy, sw, tol):
    t, k = dy.shape[0], sw.shape[0]
    poison((t, k), dy.dtype)
    out = jax.jit(calls.spmm_t_resident)(dy, sw)
    assert out.shape == (t, k) and out.dtype == dy.dtype
    compare(out, jnp.dot(dy.astype(jnp.float32), F.decompress(sw).astype(jnp.float32).T, precision=HIGHEST), tol,
            "spmm_t_resident")
    return np.asarray(out.astype(jnp.float32))


@pytest.mark.parametrize("spec", SPECS16)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("t", [1, 17, 200, 1000])
def test_spmm_t_resident_edge_tiles(spec, dtype, t):
    k, r = 48 * 16, 384  # three chunks of 16 groups; 3 (V = 128) or 6 (V = 64) blocks
    dy, sw = _make(key("dxr", spec, str(dtype), t), t, k, r, spec, dtype)
    _check(dy, sw, TOL[dtype])


@pytest.mark.parametrize("spec,k,r", [("128:2:16", 256, 128), ("64:2:16", 512, 64), ("128:2:16", 1024, 1024),
                                      ("64:2:16", 4096, 1024)])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_spmm_t_resident_shapes(spec, k, r, dtype):
    """One block (the second warpgroup has none), R = 1024 (128 KB of dy per CTA), BERT-large's FFN out."""
    dy, sw = _make(key("dxr-shape", spec, k, r, str(dtype)), 333, k, r, spec, dtype)
    _check(dy, sw, TOL[dtype])


def test_spmm_t_resident_repeatable():
    """Same inputs twice give bit-identical outputs (the blocks are summed in block order, the warpgroups taking turns)."""
    dy, sw = _make(key("dxr-rep"), 517, 1024, 1024, "128:2:16", jnp.bfloat16)
    a = _check(dy, sw, TOL[jnp.bfloat16])
    b = _check(dy, sw, TOL[jnp.bfloat16])
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("spec,k,r,dtype,what", [
    ("64:2:8", 512, 256, jnp.bfloat16, "M = 16"), ("128:2:16", 512, 2048, jnp.bfloat16, "R <= 1024"),
    ("128:2:16", 128 * 3, 256, jnp.bfloat16, "divisible by 16"), ("128:2:16", 512, 256, jnp.float32, "bfloat16 or float16")])
def test_spmm_t_resident_rejects(spec, k, r, dtype, what):
    dy, sw = _make(key("dxr-rej", spec), 16, k, r, spec, dtype)
    with pytest.raises(ValueError, match=what):
        calls.spmm_t_resident(dy, sw)


@pytest.mark.parametrize("spec", SPECS16)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("t", [17, 1000])
def test_sparse_linear_grad_on_the_resident_route(monkeypatch, spec, dtype, t):
    """``jax.grad`` of ``sparse_linear`` under ``jit`` with ``JAXSPARSE_DX=resident`` (every product on its kernel):
    dx, dvalues and dbias match the float32 references, and the compiled step calls the resident kernel with no
    transpose or copy in front of dy."""
    monkeypatch.setenv("JAXSPARSE_BACKEND", "cuda")
    monkeypatch.setenv("JAXSPARSE_DX", "resident")
    monkeypatch.delenv("JAXSPARSE_REFERENCE_OPS", raising=False)
    k, r = 512, 384
    kx, kb = jax.random.split(key("dxr-grad", spec, str(dtype), t))
    dy, sw = _make(kx, t, k, r, spec, dtype)
    x = jax.random.normal(kb, (t, k), jnp.float32).astype(dtype)
    bias = jnp.zeros((r,), dtype)
    target = dy.astype(jnp.float32)

    def loss(x, values, bias):
        return jnp.sum(ops.sparse_linear(x, sw.replace(values=values), bias).astype(jnp.float32) * target)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    poison(x.shape, dtype)
    gx, gv, _ = grad(x, sw.values, bias)
    dense = F.decompress(sw).astype(jnp.float32)
    compare(gx, jnp.dot(target, dense.T, precision=HIGHEST), TOL[dtype], "dx")
    compare(gv, F.compress_like(jnp.dot(x.astype(jnp.float32).T, target, precision=HIGHEST), sw), TOL[dtype], "dvalues")
    text = grad.lower(x, sw.values, bias).compile().as_text()
    calls_ = [line for line in text.splitlines() if 'custom_call_target="jaxsparse_spmm_t_resident"' in line]
    assert len(calls_) == 1, calls_
    dy_name = re.search(r"custom-call\(([^,)]*)", calls_[0]).group(1).split()[-1].lstrip("%")
    producer = parse_hlo(text)[dy_name]
    assert producer.opcode not in ("transpose", "copy") and not {"transpose", "copy"} & set(producer.fused_opcodes), (
        dy_name, producer)


def test_resident_route_falls_back_to_the_transposed_route(monkeypatch):
    """Where the kernel does not apply (R > 1024: BERT-large's FFN in), ``JAXSPARSE_DX=resident`` takes the transposed
    route: with a transposable mask the gradient is right, and no resident kernel is called."""
    monkeypatch.setenv("JAXSPARSE_BACKEND", "cuda")
    monkeypatch.setenv("JAXSPARSE_DX", "resident")
    dy, sw = _make(key("dxr-fallback"), 100, 512, 2048, "128:2:16", jnp.bfloat16, transposable=True)
    f = jax.jit(lambda dy: ops.spmm_t(dy, sw))
    compare(f(dy), jnp.dot(dy.astype(jnp.float32), F.decompress(sw).astype(jnp.float32).T, precision=HIGHEST),
            TOL[jnp.bfloat16], "fallback dx")
    assert "jaxsparse_spmm_t_resident" not in f.lower(dy).compile().as_text()
