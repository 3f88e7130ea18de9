"""benchmarks/dropout_cost.py times the residual LayerNorm block without, with flax's and with the hash dropout."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from devdata_helpers import load_script


def test_blocks_agree_where_they_should_and_the_file_adds_up(tmp_path, capsys):
    """The three blocks compute the same LayerNorm (equal without dropout's zeros: the dropped rows differ), the hash
    block's gradient is zero exactly where its forward dropped; the result file's per-step sums are 49 x the extra
    time and the flax bytes 11 an element."""
    bench = load_script("dropout_cost", "benchmarks")
    y, r, dz = (jax.random.normal(jax.random.key(i), (8, 64), jnp.float32) for i in range(3))
    key = jax.random.key(5, impl="rbg")
    z0, dy0, dr0 = bench.block("none", 0.1)(y, r, dz, key)
    for variant in ("flax", "hash"):
        z, dy, dr = bench.block(variant, 0.1)(y, r, dz, key)
        assert np.isfinite(np.asarray(z)).all() and not np.allclose(z, z0)
        assert 0 < float((dy == 0).mean()) < 0.3  # the dropped elements get no gradient
    z, dy, _ = bench.block("hash", 0.0)(y, r, dz, key)
    np.testing.assert_allclose(z, z0, rtol=1e-6)
    np.testing.assert_allclose(dy, dy0, rtol=1e-5, atol=1e-6)

    out = tmp_path / "dropout_cost.json"
    assert bench.main(["--tokens", "64", "--hidden", "128", "--out", str(out)]) == 0
    assert "x 49 a step" in capsys.readouterr().out
    d = json.loads(out.read_text())
    assert d["benchmark"] == "dropout_cost" and d["elements"] == 64 * 128 and d["dropouts_per_step"] == 49
    assert all(d["ms"][v] > 0 for v in bench.VARIANTS)
    for v in ("flax", "hash"):
        assert d["extra_ms"][v] == pytest.approx(d["ms"][v] - d["ms"]["none"])
        assert d["per_step_ms"][v] == pytest.approx(49 * d["extra_ms"][v])
    assert d["flax_extra_bytes"] == 11 * 64 * 128
    with pytest.raises(SystemExit):
        bench.main(["--rate", "1.0"])
