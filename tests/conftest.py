"""Shared fixtures. GPU tests carry ``@pytest.mark.gpu`` and skip with a reason without a GPU."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


def _compilation_cache() -> None:
    """Many CPU tests compile the same tiny models' steps (the training runs of test_train.py and the CLI tests,
    several of them in subprocesses): one compilation cache for this pytest run, in a fresh temporary folder removed
    at exit, shared with subprocesses through the environment. A cache the caller set (JAX_COMPILATION_CACHE_DIR) is
    used as it is; ``JAXSPARSE_TEST_COMPILE_CACHE=0`` turns it off."""
    if os.environ.get("JAXSPARSE_TEST_COMPILE_CACHE", "1") == "0":
        return
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        folder = tempfile.mkdtemp(prefix="jaxsparse-test-xla-cache-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
    # Cache every compilation, not only those over jax's default thresholds (1 s, small entries excluded).
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_compilation_cache()

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `pytest -n N`: N processes share the GPU, so none may take most of its memory at start (jax's default).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


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


@pytest.fixture(autouse=True)
def _routes_do_not_leak():
    """A test leaves the JAXSPARSE_* settings as it found them (monkeypatch's changes are undone before this
    check): the layers read their routes from the environment when they are traced, so a route left set changes the
    tests that run after it in the same process (session 43: a leaked JAXSPARSE_DX=transposed gave later tests'
    non-transposable layers NaN gradients)."""
    from jaxsparse.dispatch import settings  # (imported here: the package loads after this file's setup)

    before = settings()
    yield
    after = settings()
    if after != before:
        changed = {k: (before.get(k), after.get(k)) for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
        os.environ.update(before)
        for k in after.keys() - before.keys():
            del os.environ[k]
        pytest.fail(f"the test left JAXSPARSE_* settings changed (before, after): {changed}")


@pytest.fixture
def rng():
    """A fresh PRNG key per test, seeded from the test's name so failures reproduce."""
    import zlib

    def make(name: str = "") -> jax.Array:
        return jax.random.PRNGKey(zlib.crc32(name.encode()))

    return make
