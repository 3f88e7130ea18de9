"""GPU tests of the condensed input-gradient kernel ``jaxsparse_spmm_t_condensed`` (``calls.spmm_t_condensed``,
``JAXSPARSE_DX=condensed``; M = 16 on Hopper).

Every check draws fresh random inputs, poisons the output memory with NaN first, and compares against the float32
reference ``dy @ decompress(W)^T``; the shapes cut every tile: token counts 1, 17, 200 and 1000 against 128-token
CTAs, G = 40 groups against 16-group CTAs (a partial output tile), and both V.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpu_common import DTYPES, TOL, check_dx, check_grads_on_dx_route, cuda_ready, dy_and_weight, gpu_marks, key

pytestmark = gpu_marks("jaxsparse_spmm_t_condensed")

if cuda_ready("jaxsparse_spmm_t_condensed"):
    from jaxsparse.ffi import calls

SPECS16 = ["64:2:16", "128:2:16"]


@pytest.fixture(autouse=True)
def _needs_hopper():
    if not calls.hopper_gpu():
        pytest.skip("the condensed dX kernel runs on Hopper (wgmma) only")


def _check(dy, sw, tol):
    return check_dx(calls.spmm_t_condensed, dy, sw, tol, "spmm_t_condensed")


@pytest.mark.parametrize("spec", SPECS16)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("t", [1, 17, 200, 1000])
def test_spmm_t_condensed_edge_tiles(spec, dtype, t):
    k, r = 40 * 16, (384 if spec.startswith("128") else 192)  # G = 40: 2.5 output tiles; 3 V blocks
    dy, sw = dy_and_weight(key("dxc", spec, str(dtype), t), t, k, r, spec, dtype)
    _check(dy, sw, TOL[dtype])


@pytest.mark.parametrize("spec", SPECS16)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_spmm_t_condensed_large(spec, dtype):
    dy, sw = dy_and_weight(key("dxc-large", spec, str(dtype)), 1000, 1024, 2176, spec, dtype)  # 17 blocks of 128
    _check(dy, sw, TOL[dtype])


def test_spmm_t_condensed_repeatable():
    """Same inputs twice give bit-identical outputs (no race between the pipeline's stages)."""
    dy, sw = dy_and_weight(key("dxc-rep"), 517, 1024, 1024, "128:2:16", jnp.bfloat16)
    a = _check(dy, sw, TOL[jnp.bfloat16])
    b = _check(dy, sw, TOL[jnp.bfloat16])
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("spec,dtype,what", [("64:2:8", jnp.bfloat16, "M = 16"), ("128:2:32", jnp.bfloat16, "M = 16"),
                                             ("128:2:16", jnp.float32, "bfloat16 or float16")])
def test_spmm_t_condensed_rejects(spec, dtype, what):
    dy, sw = dy_and_weight(key("dxc-rej", spec), 16, 512, 256, spec, dtype)
    with pytest.raises(ValueError, match=what):
        calls.spmm_t_condensed(dy, sw)


@pytest.mark.parametrize("spec", SPECS16)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("t", [17, 1000])
def test_sparse_linear_grad_on_the_condensed_route(monkeypatch, spec, dtype, t):
    """``jax.grad`` of ``sparse_linear`` under ``jit`` with ``JAXSPARSE_DX=condensed``: gradients right, the condensed
    kernel called once with no transpose or copy in front of dy (``gpu_common.check_grads_on_dx_route``)."""
    kx, kb = jax.random.split(key("dxc-grad", spec, str(dtype), t))
    dy, sw = dy_and_weight(kx, t, 640, 384, spec, dtype)
    check_grads_on_dx_route(monkeypatch, "condensed", "jaxsparse_spmm_t_condensed", dy, sw, kb, TOL[dtype])
