"""GPU tests of the resident input-gradient kernel ``jaxsparse_spmm_t_resident`` (``calls.spmm_t_resident``,
``JAXSPARSE_DX=resident``; M = 16, R <= 1024 on Hopper).

Every check draws fresh random inputs, poisons the output memory with NaN first, and compares against the float32
reference ``dy @ decompress(W)^T``; the shapes cut every tile: token counts 1, 17, 200 and 1000 against 64-token
CTAs, 1, 2 and 3 chunks of 16 groups, one V block (the second warpgroup idle), an odd number of blocks and the
largest R, both V, plain masks (blocks share columns: the shared-memory sums are exercised).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpu_common import (DTYPES, HIGHEST, TOL, check_dx, check_grads_on_dx_route, compare, cuda_ready,
                        dy_and_weight, gpu_marks, key)
from jaxsparse import format as F

pytestmark = gpu_marks("jaxsparse_spmm_t_resident")

if cuda_ready("jaxsparse_spmm_t_resident"):
    from jaxsparse import ops
    from jaxsparse.ffi import calls

SPECS16 = ["64:2:16", "128:2:16"]


@pytest.fixture(autouse=True)
def _needs_hopper():
    if not calls.hopper_gpu():
        pytest.skip("the resident dX kernel runs on Hopper (wgmma) only")


def _check(dy, sw, tol):
    return check_dx(calls.spmm_t_resident, dy, sw, tol, "spmm_t_resident")


@pytest.mark.parametrize("spec", SPECS16)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("t", [1, 17, 200, 1000])
def test_spmm_t_resident_edge_tiles(spec, dtype, t):
    k, r = 48 * 16, 384  # three chunks of 16 groups; 3 (V = 128) or 6 (V = 64) blocks
    dy, sw = dy_and_weight(key("dxr", spec, str(dtype), t), t, k, r, spec, dtype)
    _check(dy, sw, TOL[dtype])


@pytest.mark.parametrize("spec,k,r", [("128:2:16", 256, 128), ("64:2:16", 512, 64), ("128:2:16", 1024, 1024),
                                      ("64:2:16", 4096, 1024)])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_spmm_t_resident_shapes(spec, k, r, dtype):
    """One block (the second warpgroup has none), R = 1024 (128 KB of dy per CTA), BERT-large's FFN out."""
    dy, sw = dy_and_weight(key("dxr-shape", spec, k, r, str(dtype)), 333, k, r, spec, dtype)
    _check(dy, sw, TOL[dtype])


def test_spmm_t_resident_repeatable():
    """Same inputs twice give bit-identical outputs (the blocks are summed in block order, the warpgroups taking turns)."""
    dy, sw = dy_and_weight(key("dxr-rep"), 517, 1024, 1024, "128:2:16", jnp.bfloat16)
    a = _check(dy, sw, TOL[jnp.bfloat16])
    b = _check(dy, sw, TOL[jnp.bfloat16])
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("spec,k,r,dtype,what", [
    ("64:2:8", 512, 256, jnp.bfloat16, "M = 16"), ("128:2:16", 512, 2048, jnp.bfloat16, "R <= 1024"),
    ("128:2:16", 128 * 3, 256, jnp.bfloat16, "divisible by 16"), ("128:2:16", 512, 256, jnp.float32, "bfloat16 or float16")])
def test_spmm_t_resident_rejects(spec, k, r, dtype, what):
    dy, sw = dy_and_weight(key("dxr-rej", spec), 16, k, r, spec, dtype)
    with pytest.raises(ValueError, match=what):
        calls.spmm_t_resident(dy, sw)


@pytest.mark.parametrize("spec", SPECS16)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("t", [17, 1000])
def test_sparse_linear_grad_on_the_resident_route(monkeypatch, spec, dtype, t):
    """``jax.grad`` of ``sparse_linear`` under ``jit`` with ``JAXSPARSE_DX=resident``: gradients right, the resident
    kernel called once with no transpose or copy in front of dy (``gpu_common.check_grads_on_dx_route``)."""
    kx, kb = jax.random.split(key("dxr-grad", spec, str(dtype), t))
    dy, sw = dy_and_weight(kx, t, 512, 384, spec, dtype)
    check_grads_on_dx_route(monkeypatch, "resident", "jaxsparse_spmm_t_resident", dy, sw, kb, TOL[dtype])


def test_resident_route_falls_back_to_the_transposed_route(monkeypatch):
    """Where the kernel does not apply (R > 1024: BERT-large's FFN in), ``JAXSPARSE_DX=resident`` takes the transposed
    route: with a transposable mask the gradient is right, and no resident kernel is called."""
    monkeypatch.setenv("JAXSPARSE_BACKEND", "cuda")
    monkeypatch.setenv("JAXSPARSE_DX", "resident")
    dy, sw = dy_and_weight(key("dxr-fallback"), 100, 512, 2048, "128:2:16", jnp.bfloat16, transposable=True)
    f = jax.jit(lambda dy: ops.spmm_t(dy, sw))
    compare(f(dy), jnp.dot(dy.astype(jnp.float32), F.decompress(sw).astype(jnp.float32).T, precision=HIGHEST),
            TOL[jnp.bfloat16], "fallback dx")
    assert "jaxsparse_spmm_t_resident" not in f.lower(dy).compile().as_text()
