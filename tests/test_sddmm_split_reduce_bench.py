"""benchmarks/sddmm_split_reduce.py: the figures it derives, its inputs, and its refusal without a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from devdata_helpers import load_script


def test_summary_and_floor():
    """The saving is the planes' time less the cluster's; the floor is 2 T K R a layer at the dense tensor rate."""
    bench = load_script("sddmm_split_reduce", "benchmarks")
    floor = bench.floor_us(16384, 1024, 1024, 3)
    assert floor == pytest.approx(2 * 16384 * 1024 * 1024 * 3 / (bench.common.DENSE_TFLOPS * 1e6))
    row = bench.summarize(160.0, 150.0, floor)
    assert row["saved_us"] == pytest.approx(10.0) and row["speedup"] == pytest.approx(160 / 150, rel=1e-4)
    assert row["cluster_over_floor"] == pytest.approx(150.0 / floor, rel=1e-3)


def test_operands_are_fresh_and_pruned_to_the_spec():
    bench = load_script("sddmm_split_reduce", "benchmarks")
    x, dys, sws = bench.operands(64, 256, 128, "64:2:8", 3)
    assert x.shape == (64, 256) and len(dys) == len(sws) == 3
    assert all(d.shape == (64, 128) and d.dtype == jnp.bfloat16 for d in dys)
    assert all(sw.shape == (256, 128) and str(sw.spec) == "64:2:8" for sw in sws)
    for a in (x, *dys, *(sw.values for sw in sws)):
        assert np.isfinite(np.asarray(a, np.float32)).all() and float(jnp.std(a.astype(jnp.float32))) > 0
    assert not np.array_equal(np.asarray(sws[0].values, np.float32), np.asarray(sws[1].values, np.float32))


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the refusal is what a machine without a GPU gets")
def test_without_a_gpu_it_says_so(tmp_path, capsys):
    bench = load_script("sddmm_split_reduce", "benchmarks")
    assert bench.main(["--tokens", "64", "--out", str(tmp_path / "r.json")]) == 1
    assert "needs a GPU" in capsys.readouterr().out
    assert not (tmp_path / "r.json").exists()
