"""What the GPU kernel tests share: the skip marks, the kernel patterns and dtypes, the tolerances."""

from __future__ import annotations

import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsparse.ffi as jffi
from jaxsparse import format as F
from jaxsparse.profile import parse_hlo

SPECS = ["2:4", "64:2:8", "128:2:8", "64:2:16", "128:2:16", "64:2:32", "128:2:32"]
DTYPES = [jnp.bfloat16, jnp.float16]
TOL = {jnp.bfloat16: 1e-2, jnp.float16: 3e-3}  # relative error against the float32 reference

# (K, R, spec, dtype, what is wrong) of weights every kernel wrapper must refuse with a ValueError.
REJECT_CASES = [  # (K, R, spec, dtype, what the ValueError must say)
    (512, 96, "2:4", jnp.bfloat16, "multiple of 64"),
    (512, 128, "2:4", jnp.float32, "bfloat16 or float16"),
    (512, 128, "2:2:8", jnp.bfloat16, "V in"),
]

select_mask = jax.jit(F.select_mask, static_argnums=1)


def key(*parts) -> jax.Array:
    """A PRNG key derived from ``parts``: fresh inputs per case, reproducible across runs."""
    return jax.random.PRNGKey(zlib.crc32(repr(parts).encode()))


def poison(shape, dtype, value=jnp.nan) -> None:
    """Fill and free a buffer of the output's size with ``value`` (NaN), so a kernel that skips elements reads it."""
    junk = jnp.full(shape, value, dtype)
    junk.block_until_ready()
    junk.delete()


def compare(out, ref, tol: float, what: str) -> float:
    """``out`` against the float32 ``ref``: same shape, every element finite, relative error (Frobenius) under ``tol``
    and every row's under ``4 * tol`` (the tile edges too, not just on average); returns the relative error."""
    out32 = np.asarray(jnp.asarray(out).astype(jnp.float32))
    ref = np.asarray(ref, np.float32)
    assert out32.shape == ref.shape, (out32.shape, ref.shape)
    assert np.isfinite(out32).all(), f"{what}: non-finite outputs at {np.argwhere(~np.isfinite(out32))[:5]}"
    err = np.linalg.norm(out32 - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err < tol, f"{what}: relative error {err:.3e} >= {tol}"
    row_err = np.linalg.norm(out32 - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-30)
    assert row_err.max() < 4 * tol, f"{what}: worst row error {row_err.max():.3e} (row {row_err.argmax()})"
    return float(err)


def cuda_ready(*targets: str) -> bool:
    """A GPU is visible and the built extension provides every FFI target in ``targets``."""
    try:
        return bool(jax.devices("gpu")) and jffi.available() and set(targets) <= set(jffi.target_names())
    except RuntimeError:
        return False


def gpu_marks(*targets: str) -> list:
    """``pytestmark`` of a GPU test module: marked ``gpu``, skipped with a reason without the targets."""
    return [
        pytest.mark.gpu,
        pytest.mark.skipif(not cuda_ready(*targets), reason="needs an NVIDIA GPU and the built jaxsparse CUDA extension"),
    ]


def layout_moves(hlo_text: str) -> list[str]:
    """Instructions of an optimized HLO module that transpose or copy data (``name:opcode``), fused or not.

    Reads opcodes, not text: JAX's AD names its backward ops ``transpose(jvp(...))`` in the metadata,
    which a substring test would mistake for a transpose.
    """
    moves = ("transpose", "copy")
    return sorted(f"{name}:{info.opcode}" for name, info in parse_hlo(hlo_text).items()
                  if info.opcode in moves or any(op in moves for op in info.fused_opcodes))


def _entry_instructions(hlo_text: str) -> list[str]:
    """Names of the instructions of the module's ENTRY computation (what runs; fused bodies are not in it)."""
    names, inside = [], False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY "):
            inside = True
        elif inside and line.startswith("}"):
            break
        elif inside:
            m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
            if m:
                names.append(m.group(1))
    return names


_PURE_MOVE_OPS = {"parameter", "transpose", "copy", "bitcast", "reshape", "tuple", "get-tuple-element"}


def standalone_layout_moves(hlo_text: str) -> list[str]:
    """The layout moves that run as kernels of their own: a top-level transpose or copy, or a fusion that only
    moves data. A producer fusion that also computes (and writes its result in the layout a call asked
    for) is not one: that is the layout change folded into work XLA does anyway.
    """
    out = []
    infos = parse_hlo(hlo_text)
    for name in _entry_instructions(hlo_text):
        info = infos.get(name)
        if info is None and name.startswith("tuple"):  # a tuple of tuples, which parse_hlo does not read: no kernel
            continue
        info = infos[name]
        if info.opcode in ("transpose", "copy"):
            out.append(f"{name}:{info.opcode}")
        elif info.opcode == "fusion" and info.fused_opcodes and set(info.fused_opcodes) <= _PURE_MOVE_OPS and (
                {"transpose", "copy"} & set(info.fused_opcodes)):
            out.append(f"{name}:fusion")
    return sorted(out)


HIGHEST = jax.lax.Precision.HIGHEST


def dy_and_weight(rng, t: int, k: int, r: int, spec: str, dtype, transposable: bool = False):
    """Fresh ``dy [t, r]`` and a ``[k, r]`` weight compressed to ``spec`` (scaled so that dx stays of order 1): the
    inputs of the input-gradient kernels' tests."""
    kd, kw = jax.random.split(rng)
    dy = jax.random.normal(kd, (t, r), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, r), jnp.float32) / np.sqrt(k / 4)).astype(dtype)
    return dy, F.compress(w, F.select_mask(w, spec, transposable=transposable), spec)


def check_dx(fn, dy, sw, tol: float, what: str) -> np.ndarray:
    """``jit(fn)(dy, sw)`` into poisoned memory against the float32 ``dy @ decompress(W)^T``; the output in float32."""
    t, k = dy.shape[0], sw.shape[0]
    poison((t, k), dy.dtype)
    out = jax.jit(fn)(dy, sw)
    assert out.shape == (t, k) and out.dtype == dy.dtype
    compare(out, jnp.dot(dy.astype(jnp.float32), F.decompress(sw).astype(jnp.float32).T, precision=HIGHEST), tol, what)
    return np.asarray(out.astype(jnp.float32))


def check_grads_on_dx_route(monkeypatch, route: str, target: str, dy, sw, x_key, tol: float) -> None:
    """``jax.grad`` of ``sparse_linear`` under ``jit`` with ``JAXSPARSE_DX=route`` (every product on its kernel): dx
    and dvalues match the float32 references, and the compiled step calls ``target`` once, with dy reaching it as XLA
    holds it (its producer neither a transpose nor a copy, nor fusing one)."""
    from jaxsparse import ops

    monkeypatch.setenv("JAXSPARSE_BACKEND", "cuda")
    monkeypatch.setenv("JAXSPARSE_DX", route)
    monkeypatch.delenv("JAXSPARSE_REFERENCE_OPS", raising=False)
    (t, r), k, dtype = dy.shape, sw.shape[0], dy.dtype
    x = jax.random.normal(x_key, (t, k), jnp.float32).astype(dtype)
    bias = jnp.zeros((r,), dtype)
    target_dy = dy.astype(jnp.float32)

    def loss(x, values, bias):
        return jnp.sum(ops.sparse_linear(x, sw.replace(values=values), bias).astype(jnp.float32) * target_dy)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    poison(x.shape, dtype)
    gx, gv, _ = grad(x, sw.values, bias)
    dense = F.decompress(sw).astype(jnp.float32)
    compare(gx, jnp.dot(target_dy, dense.T, precision=HIGHEST), tol, "dx")
    compare(gv, F.compress_like(jnp.dot(x.astype(jnp.float32).T, target_dy, precision=HIGHEST), sw), tol, "dvalues")
    text = grad.lower(x, sw.values, bias).compile().as_text()
    found = [line for line in text.splitlines() if f'custom_call_target="{target}"' in line]
    assert len(found) == 1, found
    dy_name = re.search(r"custom-call\(([^,)]*)", found[0]).group(1).split()[-1].lstrip("%")
    producer = parse_hlo(text)[dy_name]
    assert producer.opcode not in ("transpose", "copy") and not {"transpose", "copy"} & set(producer.fused_opcodes), (
        dy_name, producer)
