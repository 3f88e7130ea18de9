"""Shared fixtures. GPU tests carry ``@pytest.mark.gpu`` and skip with a reason without a GPU."""

from __future__ import annotations

import os

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


def gpu_available() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def _shard(config, items) -> None:
    """``JAXSPARSE_TEST_SHARD=i/n`` keeps every n-th test from the i-th: n processes share one GPU run."""
    spec = os.environ.get("JAXSPARSE_TEST_SHARD")
    if not spec:
        return
    try:
        i, n = (int(v) for v in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"JAXSPARSE_TEST_SHARD must look like 0/3, got {spec!r}") from None
    if not 0 <= i < n:
        raise pytest.UsageError(f"JAXSPARSE_TEST_SHARD {spec!r}: need 0 <= i < n")
    config.hook.pytest_deselected(items=[item for k, item in enumerate(items) if k % n != i])
    items[:] = [item for k, item in enumerate(items) if k % n == i]


def pytest_collection_modifyitems(config, items):
    _shard(config, items)
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
