"""Shared fixtures. GPU tests carry ``@pytest.mark.gpu`` and skip with a reason without a GPU."""

from __future__ import annotations

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


def gpu_available() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (JAX sees none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng():
    """A fresh PRNG key per test, seeded from the test's name so failures reproduce."""
    import zlib

    def make(name: str = "") -> jax.Array:
        return jax.random.PRNGKey(zlib.crc32(name.encode()))

    return make
