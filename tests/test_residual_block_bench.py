"""benchmarks/residual_block.py times LayerNorm(dropout(y) + residual) with each dropout."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from devdata_helpers import load_script


def test_blocks_agree_where_they_should_and_the_file_adds_up(tmp_path, capsys):
    """Without dropout the block is flax's LayerNorm of the sum, and its gradients JAX's; a dropout changes the output
    and zeroes the gradient of the dropped inputs; the result file's sums are 49 x the block times against flax's
    dropout, flax's dropout bytes 11 an element; a bad variant or rate is an error."""
    bench = load_script("residual_block", "benchmarks")
    y, r, dz = (jax.random.normal(jax.random.key(i), (8, 64), jnp.float32) for i in range(3))
    scale, bias, key = jnp.full((64,), 1.1), jnp.full((64,), 0.1), jax.random.key(5, impl="rbg")
    ref = bench.block("none", 0.1)(y, r, dz, scale, bias, key)

    def norm(x, s, b):
        c = x - x.mean(-1, keepdims=True)
        return c / jnp.sqrt((c * c).mean(-1, keepdims=True) + bench.EPS) * s + b

    z, vjp = jax.vjp(lambda y, r, s, b: norm(y + r, s, b), y, r, scale, bias)
    for a, b in zip(ref, (z, *vjp(dz))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    for dropout in ("flax", "hash"):
        z, dy = bench.block(dropout, 0.1)(y, r, dz, scale, bias, key)[:2]
        assert np.isfinite(np.asarray(z)).all() and not np.allclose(z, ref[0])
        assert 0 < float((dy == 0).mean()) < 0.3  # the dropped elements get no gradient
    with pytest.raises(ValueError, match="dropout must be one of"):
        bench.block("philox", 0.1)

    out = tmp_path / "residual_block.json"
    assert bench.main(["--tokens", "64", "--hidden", "128", "--out", str(out)]) == 0
    assert "x 49 a step" in capsys.readouterr().out
    d = json.loads(out.read_text())
    assert d["benchmark"] == "residual_block" and d["elements"] == 64 * 128 and d["blocks_per_step"] == 49
    assert set(d["ms"]) == set(bench.DROPOUTS)
    base = d["ms"]["flax"]
    for k, v in d["ms"].items():
        assert v > 0 and d["per_step_ms"][k] == pytest.approx(49 * v)
        assert d["saved_per_step_ms"][k] == pytest.approx(49 * (base - v))
    assert d["flax_dropout_extra_bytes"] == 11 * 64 * 128
    with pytest.raises(SystemExit):
        bench.main(["--rate", "1.0"])
