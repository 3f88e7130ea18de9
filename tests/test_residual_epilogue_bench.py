"""benchmarks/residual_epilogue.py: the figures it derives, its inputs, and its refusal without a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from devdata_helpers import load_script


def test_summary_bounds_the_saving_by_the_read_cost():
    """The epilogue's read cost is the product with ``mul`` less the product alone; one block's saving is bounded by the
    block's time less that cost, and the step's by 48 of them."""
    bench = load_script("residual_epilogue", "benchmarks")
    row = bench.summarize(40.0, 47.5, 32.0)
    assert row["read_cost_us"] == pytest.approx(7.5)
    assert row["bound_saving_us"] == pytest.approx(24.5)
    assert row["per_step_ms"] == pytest.approx(24.5 * bench.BLOCKS_PER_STEP / 1e3)
    assert bench.BLOCKS_PER_STEP == 2 * 24  # attention out and FFN out in each of BERT-large's layers


def test_operands_are_fresh_and_pruned_to_the_spec():
    bench = load_script("residual_epilogue", "benchmarks")
    x, sw, bias, h, y = bench.operands(64, 256, 128, "64:2:8")
    assert x.shape == (64, 256) and h.shape == y.shape == (64, 128) and bias.shape == (128,)
    assert all(a.dtype == jnp.bfloat16 for a in (x, sw.values, bias, h, y))
    assert sw.shape == (256, 128) and str(sw.spec) == "64:2:8"
    for a in (x, h, y, sw.values):
        assert np.isfinite(np.asarray(a, np.float32)).all() and float(jnp.std(a.astype(jnp.float32))) > 0


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the refusal is what a machine without a GPU gets")
def test_without_a_gpu_it_says_so(tmp_path, capsys):
    bench = load_script("residual_epilogue", "benchmarks")
    assert bench.main(["--tokens", "64", "--out", str(tmp_path / "r.json")]) == 1
    assert "needs a GPU" in capsys.readouterr().out
    assert not (tmp_path / "r.json").exists()
