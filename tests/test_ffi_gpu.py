"""The FFI plumbing end to end on a GPU: the decompress handler under jit, pmap, shard_map and vmap; the 2:4 view's
handler against its reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from gpu_common import gpu_marks, key, poison
from jaxsparse import ffi, ops
from jaxsparse.ffi import calls
from jaxsparse import format as F

pytestmark = gpu_marks("jaxsparse_decompress", "jaxsparse_spmm")

CASES = [("2:4", 256, 64), ("64:2:8", 512, 128), ("128:2:16", 256, 256), ("64:2:32", 512, 192)]


def weight(spec: str, k: int, r: int, dtype, *salt) -> F.SparseWeight:
    """A fresh random compressed weight, reproducible across runs (its key derives from the arguments)."""
    w = jax.random.normal(key("weight", spec, k, r, str(dtype), *salt), (k, r), jnp.float32).astype(dtype)
    return F.compress(w, F.select_mask(w, spec), spec)


def test_targets_registered():
    ffi.register()
    assert "jaxsparse_decompress" in ffi.target_names()


@pytest.mark.parametrize("spec, k, r", CASES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_decompress_jit(spec, k, r, dtype):
    """The handler under jit, bit for bit against the reference; the memory of a freed NaN array of the output's size
    is offered to the output just before the call, so an element the kernel did not write (most are zeros) shows."""
    sw = weight(spec, k, r, dtype)
    f = jax.jit(ops.decompress).lower(sw).compile()
    assert 'custom_call_target="jaxsparse_decompress"' in f.as_text()  # the handler runs, not the reference
    poison(sw.shape, dtype)
    out = np.asarray(f(sw), np.float32)
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
    sw = weight(spec, k, r, dtype, "as_2_4")
    f = jax.jit(calls.as_2_4).lower(sw).compile()
    assert 'custom_call_target="jaxsparse_as_2_4"' in f.as_text()
    poison((r, k // 2), dtype)
    sw24, slots = f(sw)
    ref24, ref_slots = F.as_2_4(sw)
    np.testing.assert_array_equal(np.asarray(sw24.values).view(np.uint8), np.asarray(ref24.values).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(sw24.metadata), np.asarray(ref24.metadata))
    np.testing.assert_array_equal(np.asarray(slots), np.asarray(ref_slots))
    assert sw24.spec == ref24.spec and sw24.shape == ref24.shape
    np.testing.assert_array_equal(np.asarray(F.decompress(sw24)), np.asarray(F.decompress(sw)))


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("spec, k, r", [("64:2:8", 512, 192), ("128:2:16", 768, 384), ("64:2:32", 1024, 320)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_as_2_4_stacked_kernel(parts, spec, k, r, dtype):
    """``calls.as_2_4_stacked``: one ``jaxsparse_as_2_4`` call builds the 2:4 views of 2 or 3 weights (each its own
    mask), bit for bit the references concatenated along R (values, metadata and each layer's own slots), the views'
    values poisoned first; and nothing else runs (no concatenation)."""
    sws = [weight(spec, k, r, dtype, "as_2_4_stacked", i) for i in range(parts)]
    f = jax.jit(calls.as_2_4_stacked).lower(sws).compile()
    text = f.as_text()
    assert text.count('custom_call_target="jaxsparse_as_2_4"') == 1 and "concatenate" not in text
    poison((parts * r, k // 2), dtype)
    view, slots = f(sws)
    refs = [F.as_2_4(sw) for sw in sws]
    assert view.shape == (k, parts * r) and view.spec == F.VNM(1, 2, 4) and view.values.dtype == dtype
    cat = lambda arrays: np.concatenate([np.asarray(a) for a in arrays], axis=0)
    np.testing.assert_array_equal(np.asarray(view.values).view(np.uint8), cat(v.values for v, _ in refs).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(view.metadata), cat(v.metadata for v, _ in refs))
    np.testing.assert_array_equal(np.asarray(slots), cat(s for _, s in refs))


def test_as_2_4_stacked_refuses_mismatched_weights():
    sw = weight("64:2:8", 512, 192, jnp.bfloat16, "as_2_4_bad")
    wide = weight("64:2:8", 512, 384, jnp.bfloat16, "as_2_4_bad_wide")
    with pytest.raises(ValueError, match="one shape, spec and dtype"):
        calls.as_2_4_stacked([sw, wide])
    with pytest.raises(ValueError, match="one to 3 weights"):
        calls.as_2_4_stacked([sw] * 4)


@pytest.mark.parametrize("spec, k, r", [("2:4", 256, 96), ("64:2:8", 512, 192), ("128:2:16", 768, 384),
                                        ("64:2:32", 1024, 320), ("128:2:32", 512, 128)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("transposable", [True, False], ids=["transposable", "plain"])
def test_transpose_2_4_kernel(spec, k, r, dtype, transposable):
    """The ``jaxsparse_transpose_2_4`` handler against its reference ``format.transpose_2_4``, bit for bit (values,
    NaN included, and metadata), on fresh random weights: several V blocks, every M, grids of 3 to 12 chunks of 32
    output features by 2 to 8 tiles of 8 groups (the kernel's CTA).
    A plain mask is not transposable: the NaN quads must match too. The memory of a freed array of W^T's size is
    offered to the output first (NaN for transposable masks, whose W^T holds none; a finite value never drawn for
    plain ones), so an element the kernel did not write shows."""
    w = jax.random.normal(key("transpose_2_4", spec, k, r, str(dtype), transposable), (k, r)).astype(dtype)
    sw = F.compress(w, F.select_mask(w, spec, transposable=transposable), spec)
    f = jax.jit(ops.transpose_2_4).lower(sw).compile()
    assert 'custom_call_target="jaxsparse_transpose_2_4"' in f.as_text()
    ref = F.transpose_2_4(sw)
    poison((k, r // 2), dtype, jnp.nan if transposable else 12345.0)
    out = f(sw)
    assert out.shape == ref.shape == (r, k) and out.spec == ref.spec == F.VNM(1, 2, 4) and out.values.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out.values).view(np.uint16), np.asarray(ref.values).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(out.metadata), np.asarray(ref.metadata))
    assert np.isnan(np.asarray(out.values, np.float32)).any() == (not transposable)  # plain: some quad overfull
    if transposable:
        np.testing.assert_array_equal(np.asarray(F.decompress(out), np.float32),
                                      np.asarray(F.decompress(sw), np.float32).T)


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("spec, k, r", [("2:4", 256, 96), ("128:2:16", 768, 384), ("64:2:32", 1024, 320)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("transposable", [True, False], ids=["transposable", "plain"])
def test_transpose_2_4_stacked_kernel(parts, spec, k, r, dtype, transposable):
    """``calls.transpose_2_4_stacked``: one ``jaxsparse_transpose_2_4`` call builds the W^T of 2 or 3 weights (each
    its own mask), bit for bit the references concatenated along the views' reduction, output poisoned."""
    sws = []
    for i in range(parts):
        w = jax.random.normal(key("transpose_2_4_stacked", spec, k, r, str(dtype), transposable, i), (k, r))
        w = w.astype(dtype)
        sws.append(F.compress(w, F.select_mask(w, spec, transposable=transposable), spec))
    f = jax.jit(calls.transpose_2_4_stacked).lower(sws).compile()
    assert f.as_text().count('custom_call_target="jaxsparse_transpose_2_4"') == 1
    refs = [F.transpose_2_4(sw) for sw in sws]
    poison((k, parts * r // 2), dtype, jnp.nan if transposable else 12345.0)
    out = f(sws)
    assert out.shape == (parts * r, k) and out.spec == F.VNM(1, 2, 4) and out.values.dtype == dtype
    want_values = np.concatenate([np.asarray(ref.values).view(np.uint16) for ref in refs], axis=1)
    np.testing.assert_array_equal(np.asarray(out.values).view(np.uint16), want_values)
    np.testing.assert_array_equal(np.asarray(out.metadata), np.concatenate([np.asarray(ref.metadata) for ref in refs],
                                                                           axis=1))


def test_transpose_2_4_stacked_refuses_mismatched_weights():
    w = jax.random.normal(jax.random.PRNGKey(4), (256, 64)).astype(jnp.bfloat16)
    sw = F.compress(w, F.select_mask(w, "2:4", transposable=True), "2:4")
    wide = F.compress(jnp.tile(w, (1, 2)), F.select_mask(jnp.tile(w, (1, 2)), "2:4", transposable=True), "2:4")
    with pytest.raises(ValueError, match="one shape, spec and dtype"):
        calls.transpose_2_4_stacked([sw, wide])
    with pytest.raises(ValueError, match="one to 3 weights"):
        calls.transpose_2_4_stacked([sw] * 4)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        calls.transpose_2_4_stacked([sw.replace(values=sw.values.astype(jnp.float32))] * 2)


@pytest.mark.filterwarnings("ignore:jaxsparse.transpose_2_4 runs its pure-JAX reference")
def test_transpose_2_4_float32_takes_the_reference():
    """The handler takes 16-bit values only: float32 weights build ``W^T`` with the reference, same result."""
    w = jax.random.normal(jax.random.PRNGKey(3), (256, 64))
    sw = F.compress(w, F.select_mask(w, "2:4", transposable=True), "2:4")
    f = jax.jit(ops.transpose_2_4)
    assert "jaxsparse_transpose_2_4" not in f.lower(sw).compile().as_text()
    np.testing.assert_array_equal(np.asarray(F.decompress(f(sw))), np.asarray(F.decompress(sw)).T)


def test_decompress_vmap():
    sws = [weight("64:2:8", 256, 128, jnp.bfloat16, s) for s in range(3)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *sws)
    out = jax.jit(jax.vmap(ops.decompress))(stacked)
    for i, sw in enumerate(sws):
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(F.decompress(sw)))


def test_decompress_pmap():
    n = jax.local_device_count()
    sws = [weight("128:2:16", 256, 128, jnp.bfloat16, 20 + s) for s in range(n)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *sws)
    out = jax.pmap(ops.decompress)(stacked)
    for i, sw in enumerate(sws):
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(F.decompress(sw)))


def test_decompress_shard_map_has_no_all_gather():
    devices = np.array(jax.devices())
    n = len(devices)
    mesh = Mesh(devices, ("d",))
    sws = [weight("64:2:8", 256, 128, jnp.bfloat16, 30 + s) for s in range(n)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *sws)
    spec = jax.tree.map(lambda _: P("d"), stacked)
    f = jax.jit(
        jax.shard_map(lambda s: ops.decompress(jax.tree.map(lambda a: a[0], s))[None], mesh=mesh, in_specs=(spec,), out_specs=P("d"))
    )
    text = f.lower(stacked).compile().as_text()
    assert "all-gather" not in text and 'custom_call_target="jaxsparse_decompress"' in text
    out = f(stacked)
    for i, sw in enumerate(sws):
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(F.decompress(sw)))


def test_handler_rejects_inconsistent_shapes():
    """A malformed call returns an ffi::Error (a Python exception), never a crash."""
    from jaxsparse.ffi import calls

    sw = weight("64:2:8", 256, 128, jnp.bfloat16, 2)
    bad = sw.replace(metadata=sw.metadata[:, :1].repeat(3, axis=1))  # wrong metadata width
    with pytest.raises(Exception, match="inconsistent shapes"):
        jax.block_until_ready(jax.jit(calls.decompress)(bad))


def test_sparse_linear_data_parallel_shard_map():
    """Tokens sharded over every GPU, the sparse weight replicated: no all-gather, kernel in the HLO."""
    devices = np.array(jax.devices())
    mesh = Mesh(devices, ("d",))
    sw = weight("128:2:16", 1024, 512, jnp.bfloat16, 40)
    x = jax.random.normal(jax.random.PRNGKey(41), (len(devices) * 96, 1024), jnp.float32).astype(jnp.bfloat16)
    replicated = jax.tree.map(lambda _: P(), sw)
    f = jax.jit(
        jax.shard_map(lambda x, s: ops.sparse_linear(x, s), mesh=mesh, in_specs=(P("d"), replicated), out_specs=P("d"))
    )
    text = f.lower(x, sw).compile().as_text()
    assert "all-gather" not in text and 'custom_call_target="jaxsparse_spmm' in text  # (a kernel, not a scope)
    y = np.asarray(f(x, sw), np.float32)
    ref = np.asarray(x, np.float32) @ np.asarray(F.decompress(sw), np.float32)
    assert np.isfinite(y).all()
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-2
