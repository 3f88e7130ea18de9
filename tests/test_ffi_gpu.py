"""The FFI plumbing end to end on a GPU: the decompress handler under jit, pmap, shard_map and vmap; the 2:4 view's
handler against its reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from gpu_common import gpu_marks
from jaxsparse import ffi, ops
from jaxsparse.ffi import calls
from jaxsparse import format as F

pytestmark = gpu_marks("jaxsparse_decompress", "jaxsparse_spmm")

CASES = [("2:4", 256, 64), ("64:2:8", 512, 128), ("128:2:16", 256, 256), ("64:2:32", 512, 192)]


def weight(seed: int, spec: str, k: int, r: int, dtype) -> F.SparseWeight:
    w = jax.random.normal(jax.random.PRNGKey(seed), (k, r), jnp.float32).astype(dtype)
    return F.compress(w, F.select_mask(w, spec), spec)


def test_targets_registered():
    ffi.register()
    assert "jaxsparse_decompress" in ffi.target_names()


@pytest.mark.parametrize("spec, k, r", CASES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_decompress_jit(spec, k, r, dtype):
    sw = weight(hash((spec, str(dtype))) % 1000, spec, k, r, dtype)
    f = jax.jit(ops.decompress)
    text = f.lower(sw).compile().as_text()
    assert "jaxsparse_decompress" in text  # the CUDA handler runs, not the reference
    out = f(sw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(F.decompress(sw)))


def test_decompress_writes_every_element():
    """Poison: the output buffer of a donated NaN-filled array must be fully overwritten."""
    sw = weight(1, "64:2:8", 512, 128, jnp.bfloat16)
    poison = jnp.full(sw.shape, jnp.nan, jnp.bfloat16)
    f = jax.jit(lambda p, s: ops.decompress(s) + 0 * jnp.nan_to_num(p), donate_argnums=0)
    out = np.asarray(f(poison, sw), np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out, np.asarray(F.decompress(sw), np.float32))


@pytest.mark.parametrize("spec, k, r", [("64:2:8", 512, 192), ("128:2:8", 768, 384), ("128:2:16", 512, 256),
                                        ("64:2:32", 1024, 320), ("128:2:32", 768, 128)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_as_2_4_kernel(spec, k, r, dtype):
    """The ``jaxsparse_as_2_4`` handler against its reference ``format.as_2_4``, bit for bit: the view's values,
    metadata and slots, on fresh random weights (rows of several V blocks, a thread grid with a tail). The
    memory of a freed NaN array of the view's size is offered to the output first, so an element the kernel
    did not write shows."""
    sw = weight(hash((spec, k, r, str(dtype))) % 1000, spec, k, r, dtype)
    jnp.full((r, k // 2), jnp.nan, dtype).block_until_ready()  # freed at once: poison for the allocator
    f = jax.jit(calls.as_2_4)
    assert "jaxsparse_as_2_4" in f.lower(sw).compile().as_text()
    sw24, slots = f(sw)
    ref24, ref_slots = F.as_2_4(sw)
    np.testing.assert_array_equal(np.asarray(sw24.values).view(np.uint8), np.asarray(ref24.values).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(sw24.metadata), np.asarray(ref24.metadata))
    np.testing.assert_array_equal(np.asarray(slots), np.asarray(ref_slots))
    assert sw24.spec == ref24.spec and sw24.shape == ref24.shape
    np.testing.assert_array_equal(np.asarray(F.decompress(sw24)), np.asarray(F.decompress(sw)))


def test_decompress_vmap():
    sws = [weight(s, "64:2:8", 256, 128, jnp.bfloat16) for s in range(3)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *sws)
    out = jax.jit(jax.vmap(ops.decompress))(stacked)
    for i, sw in enumerate(sws):
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(F.decompress(sw)))


def test_decompress_pmap():
    n = jax.local_device_count()
    sws = [weight(20 + s, "128:2:16", 256, 128, jnp.bfloat16) for s in range(n)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *sws)
    out = jax.pmap(ops.decompress)(stacked)
    for i, sw in enumerate(sws):
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(F.decompress(sw)))


def test_decompress_shard_map_has_no_all_gather():
    devices = np.array(jax.devices())
    n = len(devices)
    mesh = Mesh(devices, ("d",))
    sws = [weight(30 + s, "64:2:8", 256, 128, jnp.bfloat16) for s in range(n)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *sws)
    spec = jax.tree.map(lambda _: P("d"), stacked)
    f = jax.jit(
        jax.shard_map(lambda s: ops.decompress(jax.tree.map(lambda a: a[0], s))[None], mesh=mesh, in_specs=(spec,), out_specs=P("d"))
    )
    text = f.lower(stacked).compile().as_text()
    assert "all-gather" not in text and "jaxsparse_decompress" in text
    out = f(stacked)
    for i, sw in enumerate(sws):
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(F.decompress(sw)))


def test_handler_rejects_inconsistent_shapes():
    """A malformed call returns an ffi::Error (a Python exception), never a crash."""
    from jaxsparse.ffi import calls

    sw = weight(2, "64:2:8", 256, 128, jnp.bfloat16)
    bad = sw.replace(metadata=sw.metadata[:, :1].repeat(3, axis=1))  # wrong metadata width
    with pytest.raises(Exception, match="inconsistent shapes"):
        jax.block_until_ready(jax.jit(calls.decompress)(bad))


def test_sparse_linear_data_parallel_shard_map():
    """Tokens sharded over every GPU, the sparse weight replicated: no all-gather, kernel in the HLO."""
    devices = np.array(jax.devices())
    mesh = Mesh(devices, ("d",))
    sw = weight(40, "128:2:16", 1024, 512, jnp.bfloat16)
    x = jax.random.normal(jax.random.PRNGKey(41), (len(devices) * 96, 1024), jnp.float32).astype(jnp.bfloat16)
    replicated = jax.tree.map(lambda _: P(), sw)
    f = jax.jit(
        jax.shard_map(lambda x, s: ops.sparse_linear(x, s), mesh=mesh, in_specs=(P("d"), replicated), out_specs=P("d"))
    )
    text = f.lower(x, sw).compile().as_text()
    assert "all-gather" not in text and "jaxsparse_spmm" in text
    y = np.asarray(f(x, sw), np.float32)
    ref = np.asarray(x, np.float32) @ np.asarray(F.decompress(sw), np.float32)
    assert np.isfinite(y).all()
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-2
