"""GPU tests of the condensed input-gradient kernel ``jaxsparse_spmm_t_condensed`` (``calls.spmm_t_condensed``,
``JAXSPARSE_DX=condensed``; M = 16 on Hopper).

Every check draws fresh random inputs, poisons the output memory with NaN first, and compares against the float32
reference ``dy @ decompress(W)^T``; the shapes cut every tile: token counts 1, 17, 200 and 1000 against 128-token
CTAs, G = 40 groups against 16-group CTAs (a partial output tile), and both V.
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

pytestmark = gpu_marks("jaxsparse_spmm_t_condensed")

if cuda_ready("jaxsparse_spmm_t_condensed"):
    from jaxsparse import ops
    from jaxsparse.ffi import calls

HIGHEST = jax.lax.Precision.HIGHEST
SPECS16 = ["64:2:16", "128:2:16"]


@pytest.fixture(autouse=True)
def _needs_hopper():
    if not calls.hopper_gpu():
        pytest.skip("the condensed dX kernel runs on Hopper (wgmma) only")


def _make(rng, t: int, k: int, r: int, spec: str, dtype):
    kd, kw = jax.random.split(rng)
    dy = jax.random.normal(kd, (t, r), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, r), jnp.float32) / np.sqrt(k / 4)).astype(dtype)
    return dy, F.compress(w, F.select_mask(w, spec), spec)


def _check(dy, sw, tol):
    t, k = dy.shape[0], sw.shape[0]
    poison((t, k), dy.dtype)
    out = jax.jit(calls.spmm_t_condensed)(dy, sw)
    assert out.shape == (t, k) and out.dtype == dy.dtype
    compare(out, jnp.dot(dy.astype(jnp.float32), F.decompress(sw).astype(jnp.float32).T, precision=HIGHEST), tol,
            "spmm_t_condensed")
    return np.asarray(out.astype(jnp.float32))


@pytest.mark.parametrize("spec", SPECS16)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("t", [1, 17, 200, 1000])
def test_spmm_t_condensed_edge_tiles(spec, dtype, t):
    k, r = 40 * 16, (384 if spec.startswith("128") else 192)  # G = 40: 2.5 output tiles; 3 V blocks
    dy, sw = _make(key("dxc", spec, str(dtype), t), t, k, r, spec, dtype)
    _check(dy, sw, TOL[dtype])


@pytest.mark.parametrize("spec", SPECS16)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_spmm_t_condensed_large(spec, dtype):
    dy, sw = _make(key("dxc-large", spec, str(dtype)), 1000, 1024, 2176, spec, dtype)  # 17 blocks of 128
    _check(dy, sw, TOL[dtype])


def test_spmm_t_condensed_repeatable():
    """Same inputs twice give bit-identical outputs (no race between the pipeline's stages)."""
    dy, sw = _make(key("dxc-rep"), 517, 1024, 1024, "128:2:16", jnp.bfloat16)
    a = _check(dy, sw, TOL[jnp.bfloat16])
    b = _check(dy, sw, TOL[jnp.bfloat16])
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("spec,dtype,what", [("64:2:8", jnp.bfloat16, "M = 16"), ("128:2:32", jnp.bfloat16, "M = 16"),
                                             ("128:2:16", jnp.float32, "bfloat16 or float16")])
def test_spmm_t_condensed_rejects(spec, dtype, what):
    dy, sw = _make(key("dxc-rej", spec), 16, 512, 256, spec, dtype)
    with pytest.raises(ValueError, match=what):
        calls.spmm_t_condensed(dy, sw)


@pytest.mark.parametrize("spec", SPECS16)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("t", [17, 1000])
def test_sparse_linear_grad_on_the_condensed_route(monkeypatch, spec, dtype, t):
    """``jax.grad`` of ``sparse_linear`` under ``jit`` with ``JAXSPARSE_DX=condensed`` (every product on its kernel):
    dx, dvalues and dbias match the float32 references, and the compiled step calls the condensed kernel with no
    transpose or copy around it."""
    monkeypatch.setenv("JAXSPARSE_BACKEND", "cuda")
    monkeypatch.setenv("JAXSPARSE_DX", "condensed")
    monkeypatch.delenv("JAXSPARSE_REFERENCE_OPS", raising=False)
    k, r = 640, 384
    kx, kb, kt = jax.random.split(key("dxc-grad", spec, str(dtype), t), 3)
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
    ref_x = jnp.dot(target, dense.T, precision=HIGHEST)
    ref_v = F.compress_like(jnp.dot(x.astype(jnp.float32).T, target, precision=HIGHEST), sw)
    compare(gx, ref_x, TOL[dtype], "dx")
    compare(gv, ref_v, TOL[dtype], "dvalues")
    text = grad.lower(x, sw.values, bias).compile().as_text()
    calls_ = [line for line in text.splitlines() if 'custom_call_target="jaxsparse_spmm_t_condensed"' in line]
    assert len(calls_) == 1, calls_
    # dy reaches the kernel as XLA holds it: its producer is neither a transpose nor a copy, nor fuses one.
    dy_name = re.search(r"custom-call\(([^,)]*)", calls_[0]).group(1).split()[-1].lstrip("%")
    producer = parse_hlo(text)[dy_name]
    assert producer.opcode not in ("transpose", "copy") and not {"transpose", "copy"} & set(producer.fused_opcodes), (
        dy_name, producer)
