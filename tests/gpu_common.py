"""What the GPU kernel tests share: the skip marks, the kernel patterns and dtypes, the tolerances."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxsparse.ffi as jffi

SPECS = ["2:4", "64:2:8", "128:2:8", "64:2:16", "128:2:16", "64:2:32", "128:2:32"]
DTYPES = [jnp.bfloat16, jnp.float16]
TOL = {jnp.bfloat16: 1e-2, jnp.float16: 3e-3}  # relative error against the float32 reference


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
