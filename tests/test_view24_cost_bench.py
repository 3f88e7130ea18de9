"""benchmarks/view24_cost.py adds up one BERT-large step's weight builds from its per-build rows."""

from __future__ import annotations

import pytest
from devdata_helpers import load_script


def _load():
    return load_script("view24_cost", "benchmarks")


def _rows(bench, transpose_us: float, view_us: float) -> list[dict]:
    rows = []
    for k, r, spec in bench.CASES:
        rows.append(dict(K=k, R=r, spec=spec, build="transpose_2_4", kernel_us=transpose_us * (k * r) / 2**20))
        if spec != "2:4":
            rows.append(dict(K=k, R=r, spec=spec, build="as_2_4", kernel_us=view_us * (k * r) / 2**20))
    return rows


def test_step_totals_count_every_build_of_a_layer():
    """Times proportional to the weight's size (1 us / 2 us per 1024 x 1024 for W^T / the view): a 64:2:8 layer is
    four 1024^2 weights, FFN in (4x) and FFN out's stacked 2:4 blocks, one 2048 x 1024 weight (2x); 128:2:16's is one
    1024^2 weight. Only V:2:M weights have a 2:4 view. These are builds of weights: 144 W^T and 120 views a step, in
    96 and 72 launches since Q, K and V's are stacked by one call each (sessions 55 and 59)."""
    bench = _load()
    steps = bench.step_totals(_rows(bench, 1.0, 2.0), layers=24)
    assert set(steps) == {"64:2:8", "128:2:16"}
    t, v = steps["64:2:8"]["transpose_2_4"], steps["64:2:8"]["as_2_4"]
    assert t["us_per_layer"] == pytest.approx(4 + 4 + 2) and t["builds_per_step"] == 24 * 6 == 144
    assert v["us_per_layer"] == pytest.approx(2 * (4 + 4)) and v["builds_per_step"] == 24 * 5 == 120
    assert t["ms_per_step"] == pytest.approx(24 * 10 / 1e3)
    t, v = steps["128:2:16"]["transpose_2_4"], steps["128:2:16"]["as_2_4"]
    assert t["us_per_layer"] == pytest.approx(4 + 4 + 1) and t["builds_per_step"] == 24 * 6
    assert v["us_per_layer"] == pytest.approx(2 * (4 + 4)) and v["builds_per_step"] == 24 * 5


def test_step_totals_name_a_missing_shape():
    bench = _load()
    rows = [r for r in _rows(bench, 1.0, 2.0) if (r["K"], r["R"], r["spec"]) != (2048, 1024, "2:4")]
    with pytest.raises(KeyError, match="2048"):
        bench.step_totals(rows)
