"""benchmarks/qkv_fusion.py times Q, K and V as three layers against one fused layer."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import pytest
from devdata_helpers import load_script


def test_the_fused_layer_is_the_three_and_a_wrong_one_is_refused():
    """The fused sparse weight (the three masks side by side) gives the three layers' y, dx, dW and db; with its parts
    in another order the check refuses to time it."""
    bench = load_script("qkv_fusion", "benchmarks")
    h = 64
    w = (jax.random.normal(jax.random.key(0), (h, 3 * h), jnp.float32) / 8).astype(jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (3 * h,), jnp.float32).astype(jnp.bfloat16)
    fns = bench.layers(w, b, "64:2:8")  # runs check_fused on fresh inputs
    three, split = fns["three"][0], fns["fused, split"][0]
    sw, parts = bench.sparse_weights(w, "64:2:8")
    err = bench.check_fused(three, split, parts, sw, h)
    assert set(err) == {"y", "dx", "dw", "db"} and max(err.values()) < 2e-2
    with pytest.raises(SystemExit, match="not the three"):
        bench.check_fused(three, split, parts[::-1], sw, h)


def test_the_file_has_every_variant_with_its_floor(tmp_path, capsys, monkeypatch):
    """Six rows (dense and sparse, three variants each) with times, ratios to the three layers and floors; the fused
    layer's floor is below the three layers' (x read once). The routes it sets are its own: the environment is as it
    was after it (a leaked JAXSPARSE_DX=transposed gave later tests' non-transposable layers NaN gradients)."""
    bench = load_script("qkv_fusion", "benchmarks")
    out = tmp_path / "qkv_fusion.json"
    monkeypatch.setenv("JAXSPARSE_BACKEND", "auto")
    monkeypatch.delenv("JAXSPARSE_DX", raising=False)
    assert bench.main(["--tokens", "128", "--hidden", "128", "--out", str(out)]) == 0
    assert os.environ.get("JAXSPARSE_DX") is None and os.environ["JAXSPARSE_BACKEND"] == "auto"
    assert "over its floor" in capsys.readouterr().out
    d = json.loads(out.read_text())
    assert (d["tokens"], d["hidden"], d["parts"], d["sparsity"]) == (128, 128, 3, "64:2:8")
    want = ([("dense", variant) for variant in bench.VARIANTS]
            + [("64:2:8", variant) for variant in bench.SPARSE_VARIANTS])
    assert [(r["impl"], r["variant"]) for r in d["rows"]] == want
    for r in d["rows"]:
        assert r["ms"] > 0 and r["floor_ms"] > 0 and r["over_floor"] == pytest.approx(r["ms"] / r["floor_ms"])
    three = {r["impl"]: r for r in d["rows"] if r["variant"] == "three"}
    for r in d["rows"]:
        assert r["vs_three"] == pytest.approx(three[r["impl"]]["ms"] / r["ms"])
        if r["variant"] != "three":
            assert r["floor_ms"] < three[r["impl"]]["floor_ms"]
