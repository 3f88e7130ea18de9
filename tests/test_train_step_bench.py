"""benchmarks/train_step.py --quick writes a well-formed result file."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    spec = importlib.util.spec_from_file_location("train_step_bench", os.path.join(ROOT, "benchmarks", "train_step.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quick_writes_json(tmp_path, capsys):
    bench = _load()
    out = tmp_path / "train_step.json"
    rc = bench.main(["--quick", "--sparsities", "dense,64:2:8", "--steps", "2", "--warmup", "1", "--batch-size", "2", "--in-process",
                     "--out", str(out)])
    assert rc == 0
    assert "compressed" in capsys.readouterr().out
    d = json.loads(out.read_text())
    assert d["benchmark"] == "train_step" and d["quick"] is True and d["complete"] is True
    rows = {r["sparsity"]: r for r in d["rows"]}
    assert set(rows) == {"dense", "64:2:8"}
    assert [rows[s]["mode"] for s in ("dense", "64:2:8")] == ["dense", "compressed"]
    for r in rows.values():
        assert r["model"] == "tiny" and r["tokens"] == r["batch_size"] * r["seq_len"] == 2 * 128
        assert r["step_ms"] > 0 and r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_ms"] * 1e3)
        assert math.isfinite(r["loss_last"])
    assert rows["dense"]["speedup_vs_dense"] == 1.0
    assert rows["64:2:8"]["speedup_vs_dense"] == pytest.approx(rows["dense"]["step_ms"] / rows["64:2:8"]["step_ms"])
    # steps back to back with one sync: its own time and speedup
    assert all(r["step_ms_pipelined"] > 0 for r in rows.values())
    assert rows["64:2:8"]["speedup_vs_dense_pipelined"] == pytest.approx(
        rows["dense"]["step_ms_pipelined"] / rows["64:2:8"]["step_ms_pipelined"])


def test_a_run_cut_short_leaves_what_it_measured(tmp_path, monkeypatch):
    """One configuration at a time: after each but the last, ``<out>.partial`` holds every row measured so far
    (``complete`` false), so a run stopped by a time limit keeps them; the complete file replaces it."""
    bench = _load()
    done = []

    def fake_run(cfg, turn=None):
        if len(done) == 2 and cfg.get("fail"):
            raise RuntimeError("cut short")
        done.append(cfg["sparsity"])
        return {**cfg, "mode": "dense" if cfg["sparsity"] == "dense" else "compressed", "step_ms": 10.0 + len(done),
                "step_ms_pipelined": 9.0 + len(done), "tokens_per_s": 1.0, "peak_bytes": 100, "platform": "cpu",
                "device_kind": "cpu"}

    monkeypatch.setattr(bench, "run_config", fake_run)
    out = tmp_path / "train_step.json"
    argv = ["--quick", "--sparsities", "dense,2:4,64:2:8", "--in-process", "--out", str(out)]
    assert bench.main(argv) == 0
    d = json.loads(out.read_text())
    assert d["complete"] is True and d["configurations"] == 3 and len(d["rows"]) == 3
    assert not (tmp_path / "train_step.json.partial").exists()
    out.unlink()
    done.clear()
    monkeypatch.setattr(bench, "run_config", lambda cfg, turn=None: fake_run({**cfg, "fail": True}))
    with pytest.raises(RuntimeError, match="cut short"):
        bench.main(argv)
    partial = json.loads((tmp_path / "train_step.json.partial").read_text())
    assert not out.exists() and partial["complete"] is False and partial["configurations"] == 3
    assert [r["sparsity"] for r in partial["rows"]] == ["dense", "2:4"]
    assert partial["rows"][1]["speedup_vs_dense"] == pytest.approx(11.0 / 12.0)


def test_mlp_hidden_both_runs_each_fused_sparse_row_both_ways(tmp_path, monkeypatch, capsys):
    """--mlp-hidden both: the sparse configuration twice, once with JAXSPARSE_MLP_HIDDEN=row (labelled in the table),
    the dense one once; the variable is set only while its row runs."""
    from jaxsparse import ops

    monkeypatch.delenv(ops.MLP_HIDDEN_ENV, raising=False)
    bench = _load()
    seen = []
    time_step = bench._time_step
    monkeypatch.setattr(bench, "_time_step", lambda step_cfg, cfg, turn: (
        seen.append(os.environ.get(ops.MLP_HIDDEN_ENV)), time_step(step_cfg, cfg, turn))[1])
    out = tmp_path / "train_step.json"
    rc = bench.main(["--quick", "--sparsities", "dense,64:2:8", "--steps", "1", "--warmup", "1", "--batch-size", "2",
                     "--in-process", "--mlp-hidden", "both", "--out", str(out)])
    assert rc == 0 and "fused, h row" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [(r["sparsity"], r.get("mlp_hidden")) for r in rows] == [("dense", None), ("64:2:8", None), ("64:2:8", "row")]
    assert seen == [None, None, "row"] and ops.MLP_HIDDEN_ENV not in os.environ


def test_mode_falls_back_to_masked_dense_with_the_reason():
    from jaxsparse.models import bert
    from jaxsparse.trainstep import sparse_mode

    tiny, large = bert.BertConfig.preset("tiny"), bert.BertConfig.preset("large")
    mode, why = sparse_mode(tiny, "128:2:32")  # hidden 128 is not a multiple of 8 * 32
    assert mode == "masked" and "8*M" in why
    assert sparse_mode(large, "128:2:32") == ("compressed", "")
    assert sparse_mode(large, "64:2:8", compressed=False)[0] == "masked"
    with pytest.raises(ValueError, match="compressed mode impossible"):
        sparse_mode(tiny, "128:2:32", compressed=True)


def test_concurrent_workers_take_turns(tmp_path):
    """--concurrent: separate processes compile at once, but their warm-up + timing windows never overlap."""
    bench = _load()
    out = tmp_path / "train_step.json"
    rc = bench.main(["--quick", "--concurrent", "--sparsities", "dense,2:4,64:2:8", "--steps", "2", "--warmup", "1",
                     "--batch-size", "2", "--worker-timeout", "600", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rc == 0, [r.get("error") for r in rows]
    assert [r["sparsity"] for r in rows] == ["dense", "2:4", "64:2:8"]
    windows = sorted(r["gpu_window"] for r in rows)
    for (_, end), (start, _) in zip(windows, windows[1:]):
        assert end <= start, windows
    assert all(r["compile_s"] > 0 and r["step_ms"] > 0 for r in rows)


def test_transposable_step_runs_the_transposed_dx_route(tmp_path):
    """--transposable: the sparse row records the transposed dX route and a finite loss (a mask that were not
    transposable would give NaN); the dense row is untouched, and the route does not leak out of the run."""
    from jaxsparse import ops
    from jaxsparse.trainstep import StepConfig

    bench = _load()
    out = tmp_path / "train_step.json"
    before = os.environ.get(ops.DX_ROUTE_ENV)
    assert bench.main(["--quick", "--sparsities", "dense,2:4", "--steps", "2", "--warmup", "1", "--batch-size", "2",
                       "--in-process", "--transposable", "--out", str(out)]) == 0
    rows = {r["sparsity"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["2:4"]["transposable"] and rows["2:4"]["routes"]["dx"] == "transposed"
    assert "transposable" not in rows["dense"] and rows["dense"]["routes"]["dx"] == ops.dx_route()
    assert math.isfinite(rows["2:4"]["loss_last"])
    assert all(isinstance(r["gemm_configs"], dict) for r in rows.values())  # XLA's GEMM picks (none on a CPU)
    assert os.environ.get(ops.DX_ROUTE_ENV) == before
    with pytest.raises(ValueError, match="sparse pattern"):
        StepConfig(sparsity="dense", transposable=True)


def test_exclusive_columns_step_runs_the_blocks_dx_route(tmp_path):
    """--exclusive-columns: the sparse row records the blocks dX route and a finite loss (a column over the cap would
    give NaN), the route does not leak out of the run, and patterns without a column choice are refused."""
    from jaxsparse import ops
    from jaxsparse.trainstep import StepConfig

    bench = _load()
    out = tmp_path / "train_step.json"
    before = os.environ.get(ops.DX_ROUTE_ENV)
    assert bench.main(["--quick", "--sparsities", "16:2:8", "--steps", "2", "--warmup", "1", "--batch-size", "2",
                       "--in-process", "--exclusive-columns", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["exclusive_columns"] and row["routes"]["dx"] == "blocks"
    assert math.isfinite(row["loss_last"])
    assert os.environ.get(ops.DX_ROUTE_ENV) == before
    assert StepConfig(sparsity="16:2:8", exclusive_columns=True, transposable=True).dx_route() == "blocks"
    for sparsity in ("dense", "2:4", "16:4:8"):
        with pytest.raises(ValueError, match="M > 4"):
            StepConfig(sparsity=sparsity, exclusive_columns=True)


def test_replot_draws_from_a_results_file_and_runs_nothing(tmp_path, capsys):
    """--replot redraws the plot from an earlier run's rows (synced and back-to-back speedups) without running a step."""
    bench = _load()
    rows = [{"model": "large", "seq_len": 512, "batch_size": 32, "sparsity": s, "mode": m, "speedup_vs_dense": sp,
             "speedup_vs_dense_pipelined": pp, "memory_vs_dense": mem, "device_kind": "test GPU"}
            for s, m, sp, pp, mem in (("dense", "dense", 1.0, 1.0, 1.0), ("64:2:8", "compressed", 1.07, 1.13, 0.63))]
    src = tmp_path / "rows.json"
    src.write_text(json.dumps({"rows": rows}))
    with pytest.raises(SystemExit):
        bench.main(["--replot", str(src)])  # needs --plot
    pytest.importorskip("matplotlib")
    png = tmp_path / "plot.png"
    assert bench.main(["--replot", str(src), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote" in capsys.readouterr().out


def test_chunked_diagonal_steps_run_compressed_with_chunk_tables(tmp_path):
    """--diagonal-ffn --diagonal-all: a 64:2:8 run adds a row with the FFN's kernels and one with every encoder
    kernel as diagonal blocks read through chunk tables (compressed, finite loss) beside the plain one; patterns
    and combinations the layouts cannot take are refused by StepConfig."""
    from jaxsparse.trainstep import StepConfig

    bench = _load()
    out = tmp_path / "train_step.json"
    assert bench.main(["--quick", "--sparsities", "64:2:8", "--steps", "2", "--warmup", "1", "--batch-size", "2",
                       "--in-process", "--transposable", "--diagonal-ffn", "--diagonal-all", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(bool(r.get("diagonal_ffn")), bool(r.get("diagonal_all"))) for r in rows] == [
        (False, False), (True, False), (False, True)]
    for r in rows[1:]:
        assert r["mode"] == "compressed" and math.isfinite(r["loss_last"])
    for field in ("diagonal_all", "diagonal_ffn"):
        for kwargs in (dict(sparsity="dense"), dict(sparsity="2:4"), dict(sparsity="32:2:8"),
                       dict(sparsity="64:2:8", diagonal_ffn_out=True)):
            with pytest.raises(ValueError):
                StepConfig(**{field: True}, **kwargs)
    with pytest.raises(ValueError):
        StepConfig(sparsity="64:2:8", diagonal_all=True, diagonal_ffn=True)


def test_devices_runs_data_parallel_rows_beside_their_one_device_twin(tmp_path, monkeypatch):
    """--devices 1,2: each configuration also runs over 2 devices at the same batch per device, and that row
    reports its time over the one-device row."""
    bench = _load()
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")  # the workers' 2 host devices
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    out = tmp_path / "train_step.json"
    rc = bench.main(["--quick", "--sparsities", "64:2:8", "--devices", "1,2", "--steps", "2", "--warmup", "1",
                     "--batch-size", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rc == 0, [r.get("error") for r in rows]
    one, two = rows
    assert (one.get("devices", 1), one["batch_size"]) == (1, 2)
    assert (two["devices"], two["batch_size"], two["tokens"]) == (2, 4, 4 * 128)
    assert one["mode"] == two["mode"] == "compressed"
    assert one["data_parallel_overhead_ms"] is None
    assert two["data_parallel_overhead_ms"] == pytest.approx(two["step_ms"] - one["step_ms"])
    assert two["data_parallel_overhead_ms_pipelined"] == pytest.approx(two["step_ms_pipelined"] - one["step_ms_pipelined"])
    assert two["speedup_vs_dense"] is None  # no dense row on 2 devices to compare with
    assert math.isfinite(two["loss_last"])


def test_devices_must_divide_the_global_batch():
    from jaxsparse.trainstep import StepConfig

    with pytest.raises(ValueError, match="divide batch_size"):
        StepConfig(batch_size=6, devices=4)
    with pytest.raises(ValueError, match="devices must be >= 1"):
        StepConfig(devices=0)
    with pytest.raises(SystemExit):
        _load().main(["--quick", "--devices", "1,x"])


def test_dropout_both_pairs_each_row_with_the_dense_row_of_its_dropout(tmp_path, monkeypatch, capsys):
    """--dropout both: every configuration with flax's and the hash dropout; a row's speedup is over the dense row of
    the same dropout (the rows timed by a stand-in: tests/test_dropout.py runs the model with either). A row without
    a dropout key ran flax's (the results before the hash became the default). The StepConfig field reaches
    BertConfig; an unknown name is an error."""
    from jaxsparse.trainstep import StepConfig

    bench = _load()
    step_ms = {("dense", "rng"): 10.0, ("dense", "hash"): 9.0, ("64:2:8", "rng"): 8.0, ("64:2:8", "hash"): 6.0}

    def fake_run(cfg, turn=None):
        ms = step_ms[(cfg["sparsity"], cfg.get("dropout", "rng"))]
        StepConfig(cfg["model"], cfg["sparsity"], dropout=cfg.get("dropout", "rng"))  # the worker's validation
        return {**cfg, "mode": "dense" if cfg["sparsity"] == "dense" else "compressed", "step_ms": ms,
                "step_ms_pipelined": ms, "tokens_per_s": 1.0, "platform": "cpu", "device_kind": "cpu"}

    monkeypatch.setattr(bench, "run_config", fake_run)
    out = tmp_path / "train_step.json"
    assert bench.main(["--quick", "--sparsities", "dense,64:2:8", "--in-process", "--dropout", "both",
                       "--out", str(out)]) == 0
    assert "hash" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [(r["sparsity"], r.get("dropout", "rng")) for r in rows] == list(step_ms)
    speedups = {(r["sparsity"], r.get("dropout", "rng")): r["speedup_vs_dense"] for r in rows}
    assert speedups[("64:2:8", "rng")] == pytest.approx(10 / 8) and speedups[("64:2:8", "hash")] == pytest.approx(9 / 6)
    assert bench.main(["--quick", "--sparsities", "dense", "--in-process", "--out", str(out)]) == 0
    assert [r["dropout"] for r in json.loads(out.read_text())["rows"]] == ["hash"]  # the benchmark's default
    assert StepConfig(dropout="rng").bert_config().dropout_impl == "rng"
    assert StepConfig().bert_config().dropout_impl == "hash"
    with pytest.raises(ValueError, match="dropout must be one of"):
        StepConfig(dropout="philox")
