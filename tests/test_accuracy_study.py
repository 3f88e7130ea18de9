"""benchmarks/accuracy.py: a --quick grid from a packed data folder alone, its json, the docs table."""

from __future__ import annotations

import json
import statistics

import pytest

from devdata_helpers import block_packages, load_script, packed_dir  # noqa: F401 - fixture
from jaxsparse import data


@pytest.fixture(scope="module")
def acc():
    return load_script("accuracy", "benchmarks")


def test_summary_verdicts_follow_the_targets(acc):
    runs = [{"task": "rt", "sparsity": s, "seed": i, "test_accuracy": a} for s, accs in {
        "dense": [0.80, 0.82], "2:4": [0.806, 0.808], "64:2:8": [0.795, 0.795], "128:2:16": [0.70, 0.72]}.items()
        for i, a in enumerate(accs)]
    rows = {r["sparsity"]: r for r in acc.summarize(runs, ["rt"], ["dense", "2:4", "64:2:8", "128:2:16"], 2)}
    assert rows["dense"]["mean"] == pytest.approx(81.0) and rows["dense"]["std"] == pytest.approx(statistics.stdev([80, 82]))
    assert rows["2:4"]["delta"] == pytest.approx(-0.3) and rows["2:4"]["verdict"] == "pass"
    assert rows["64:2:8"]["delta"] == pytest.approx(-1.5) and rows["64:2:8"]["verdict"] == "fail"
    assert rows["128:2:16"]["verdict"] is None and rows["128:2:16"]["delta"] == pytest.approx(-10.0)
    one = acc.summarize(runs[:1], ["rt"], ["dense", "2:4"], 3)
    assert one[0]["std"] is None and one[1]["mean"] is None and one[1]["verdict"] is None


def test_quick_grid_from_the_data_dir_alone(acc, packed_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(data.DATA_DIR_ENV, str(packed_dir))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    block_packages(monkeypatch)  # the installed packages cannot serve anything
    out = tmp_path / "acc"
    argv = ["--quick", "--tasks", "trec", "--sparsities", "dense,2:4", "--seeds", "2", "--max-train", "16",
            "--out-dir", str(out), "--no-progress"]
    assert acc.main(argv) == 0
    payload = json.loads((out / "accuracy.json").read_text())
    assert json.loads((tmp_path / "out" / "accuracy.json").read_text()) == payload
    assert payload["benchmark"] == "accuracy" and payload["finished"] and not payload["stopped_early"]
    env, hp = payload["environment"], payload["hyperparameters"]
    assert env["data_dir"] == str(packed_dir)
    assert all(path.startswith(str(packed_dir)) for path in env["data_files"].values()), env["data_files"]
    assert env["versions"]["jax"] and env["device"]
    assert hp["quick"] and hp["layers"] == 1 and hp["max_train"] == 16 and hp["dtype"] == "float32"
    runs = payload["runs"]
    assert sorted((r["sparsity"], r["seed"]) for r in runs) == [("2:4", 0), ("2:4", 1), ("dense", 0), ("dense", 1)]
    for r in runs:
        assert 0.0 <= r["test_accuracy"] <= 1.0 and r["steps"] == 2 and r["task"] == "trec"
        assert r["weight_sparsity"] == (0.5 if r["sparsity"] == "2:4" else 0.0)
    assert all(r["compilations"] == 0 for r in runs if r["seed"] == 1), "seed 1 should reuse seed 0's compilations"
    assert payload["jit_functions_built"]["step"] == 2
    rows = {r["sparsity"]: r for r in payload["summary"]}
    for s, row in rows.items():
        accs = [100 * r["test_accuracy"] for r in runs if r["sparsity"] == s]
        assert row["n"] == 2 and row["mean"] == pytest.approx(statistics.fmean(accs))
    assert rows["2:4"]["delta"] == pytest.approx(rows["2:4"]["mean"] - rows["dense"]["mean"])

    docs = tmp_path / "results.md"
    docs.write_text("# Results\n\nKept paragraph.\n")
    for _ in range(2):  # a second render replaces the block
        assert acc.main(["--render-docs", "--json", str(out / "accuracy.json"), "--docs", str(docs)]) == 0
    text = docs.read_text()
    assert "Kept paragraph." in text and text.count(acc.DOCS_BEGIN) == 1
    r = rows["2:4"]
    line = next(x for x in text.splitlines() if x.startswith("| trec | 2:4 |"))
    assert f"{r['mean']:.2f} ± {r['std']:.2f}" in line and f"{r['delta']:+.2f}" in line
    assert r["verdict"] in line and "within 0.5" in line
    assert "quick smoke run" in text


def test_resume_refuses_other_hyperparameters(acc, tmp_path):
    out = tmp_path / "acc"
    out.mkdir()
    (out / "accuracy.json").write_text(json.dumps({"hyperparameters": {"lr": 1.0}, "runs": []}))
    args = acc.parse_args(["--quick", "--resume", "--out-dir", str(out)])
    with pytest.raises(SystemExit, match="other hyper-parameters"):
        acc.study(args, log=lambda line: None)


def _payload(acc, task, sparsities, accs, **hp_changes):
    runs = [{"task": task, "sparsity": s, "seed": i, "test_accuracy": a, "compressed_training": s != "dense"}
            for s in sparsities for i, a in enumerate(accs[s])]
    return {"benchmark": "accuracy", "schema": 1, "hyperparameters": {**acc.hyperparameters(acc.parse_args(["--quick"])), **hp_changes},
            "environment": {"device": "cpu", "platform": "cpu", "versions": {}, "kernels": {"extension": False}},
            "grid": {"tasks": [task], "sparsities": sparsities, "seeds": [0, 1]}, "runs": runs,
            "train_examples": {task: 10}, "test_examples": {task: 5}, "wall_seconds": 3.0, "compilations": 2}


def test_merge_joins_side_by_side_runs(acc, tmp_path):
    accs = {"dense": [0.9, 0.92], "2:4": [0.9, 0.9]}
    files = []
    for i, (task, sp) in enumerate([("rt", ["dense"]), ("rt", ["2:4"]), ("trec", ["dense", "2:4"])]):
        files.append(tmp_path / f"part{i}.json")
        files[-1].write_text(json.dumps(_payload(acc, task, sp, accs)))
    out = tmp_path / "merged"
    assert acc.main(["--merge", *map(str, files), "--out-dir", str(out)]) == 0
    merged = json.loads((out / "accuracy.json").read_text())
    assert merged["finished"] and len(merged["runs"]) == 8 and merged["compilations"] == 6
    assert merged["grid"] == {"tasks": ["rt", "trec"], "sparsities": ["dense", "2:4"], "seeds": [0, 1]}
    row = next(r for r in merged["summary"] if r["task"] == "rt" and r["sparsity"] == "2:4")
    assert row["delta"] == pytest.approx(90.0 - 91.0) and row["verdict"] == "fail"
    assert "compressed values trained on the pure-JAX reference" in (out / "accuracy.md").read_text()

    files[1].write_text(json.dumps(_payload(acc, "rt", ["dense"], accs)))  # the same runs twice
    with pytest.raises(ValueError, match="appears twice"):
        acc.merge(files, out)
    files[1].write_text(json.dumps(_payload(acc, "rt", ["2:4"], accs, lr=1.0)))
    with pytest.raises(ValueError, match="other hyper-parameters"):
        acc.merge(files, out)


def test_merge_takes_an_option_written_off_as_absent(acc, tmp_path):
    """A file written before an option existed (no key) merges with one that writes it off (None or False), as
    session 5's 2:4 runs (no ``refit`` key) with session 39's (``refit: False``); a value that is a setting (0 for
    ``student_dropout``, or the option on) does not."""
    accs = {"dense": [0.9, 0.92], "2:4": [0.9, 0.9]}
    old = _payload(acc, "rt", ["2:4"], accs)
    for key in ("refit", "refit_batches"):
        old["hyperparameters"].pop(key)
    new = _payload(acc, "trec", ["2:4"], accs)
    assert new["hyperparameters"]["refit"] is False and new["hyperparameters"]["refit_batches"] is None
    files = [tmp_path / "old.json", tmp_path / "new.json"]
    files[0].write_text(json.dumps(old))
    files[1].write_text(json.dumps(new))
    merged = acc.merge(files, tmp_path / "m")
    assert len(merged["runs"]) == 4
    for changes in ({"refit": True, "refit_batches": 32}, {"student_dropout": 0.0}):
        files[1].write_text(json.dumps(_payload(acc, "trec", ["2:4"], accs, **changes)))
        with pytest.raises(ValueError, match="other hyper-parameters"):
            acc.merge(files, tmp_path / "m")


def test_seed_slices_share_one_teacher_and_merge(acc, tmp_path, monkeypatch):
    """Side-by-side slices (--seed-list) with --teacher-dir: one teacher trained, the other slice loads it."""
    from jaxsparse import train

    common = ["--quick", "--tasks", "trec", "--sparsities", "2:4", "--distill", "0.5", "--fade", "0.2",
              "--teacher-dir", str(tmp_path / "teachers"), "--no-progress"]
    assert acc.main(common + ["--seed-list", "0", "--out-dir", str(tmp_path / "s0")]) == 0
    assert (tmp_path / "teachers" / "teacher-trec.npz").exists()
    monkeypatch.setattr(train, "fit_teacher", lambda *a, **k: pytest.fail("the saved teacher should be loaded"))
    assert acc.main(common + ["--seed-list", "1", "--out-dir", str(tmp_path / "s1")]) == 0
    parts = [json.loads((tmp_path / d / "accuracy.json").read_text()) for d in ("s0", "s1")]
    assert parts[0]["teachers"]["trec"]["test_accuracy"] == parts[1]["teachers"]["trec"]["test_accuracy"]
    assert [r["seed"] for r in parts[1]["runs"]] == [1] and parts[1]["hyperparameters"]["fade"] == 0.2
    merged = acc.merge([tmp_path / "s0" / "accuracy.json", tmp_path / "s1" / "accuracy.json"], tmp_path / "m")
    assert merged["grid"]["seeds"] == [0, 1] and merged["finished"] and len(merged["runs"]) == 2
    assert "sparse runs distil from a dense teacher" in (tmp_path / "m" / "accuracy.md").read_text()


def test_teacher_seeds_average_the_soft_labels(acc, tmp_path, monkeypatch):
    """--teacher-seeds 2: two dense teachers (seeds 0 and 1, saved apart), the sparse runs' soft labels are the mean of
    their train logits, the study records both and names it; rejected without --distill."""
    import numpy as np

    from jaxsparse import train

    common = ["--quick", "--tasks", "trec", "--sparsities", "2:4", "--seeds", "1", "--distill", "0.5",
              "--teacher-seeds", "2", "--teacher-dir", str(tmp_path / "teachers"), "--no-progress"]
    assert acc.main(common + ["--out-dir", str(tmp_path / "a")]) == 0
    saved = [np.load(tmp_path / "teachers" / f"teacher-trec{sfx}.npz")["logits"] for sfx in ("", "-s1")]
    assert not np.allclose(saved[0], saved[1])  # two seeds, two teachers
    seen = []
    real_fit = train.fit
    monkeypatch.setattr(train, "fit_teacher", lambda *a, **k: pytest.fail("the saved teachers should be loaded"))
    monkeypatch.setattr(train, "fit", lambda *a, teacher_logits=None, **k: (
        seen.append(teacher_logits), real_fit(*a, teacher_logits=teacher_logits, **k))[1])
    assert acc.main(common + ["--out-dir", str(tmp_path / "b")]) == 0
    assert len(seen) == 1 and np.allclose(seen[0], (saved[0] + saved[1]) / 2)
    payload = json.loads((tmp_path / "b" / "accuracy.json").read_text())
    assert payload["hyperparameters"]["teacher_seeds"] == 2 and "teacher_seeds" in acc.SPARSE_ONLY_HYPERPARAMETERS
    assert payload["teachers"]["trec"]["soft_label_seeds"] == [0, 1]
    assert len(payload["teachers"]["trec"]["member_test_accuracy"]) == 2
    assert "mean logits of 2 dense teachers" in acc.section(payload)
    with pytest.raises(SystemExit):
        acc.parse_args(["--quick", "--teacher-seeds", "2"])


def test_saved_teacher_serves_studies_that_differ_only_in_sparse_settings(acc, tmp_path, monkeypatch):
    """The teacher is a dense run: a study with another pruning recipe loads it, one with another lr refuses it."""
    from jaxsparse import train

    common = ["--quick", "--tasks", "trec", "--sparsities", "2:4", "--seeds", "1", "--distill", "0.5",
              "--teacher-dir", str(tmp_path / "teachers"), "--no-progress"]
    assert acc.main(common + ["--out-dir", str(tmp_path / "a")]) == 0
    monkeypatch.setattr(train, "fit_teacher", lambda *a, **k: pytest.fail("the saved teacher should be loaded"))
    assert acc.main(common + ["--prune", "oneshot", "--fade", "0.1", "--out-dir", str(tmp_path / "b")]) == 0
    with pytest.raises(SystemExit, match="other hyper-parameters"):
        acc.main(common + ["--lr", "0.5", "--out-dir", str(tmp_path / "c")])


def test_init_teacher_loads_the_saved_teacher_params(acc, tmp_path, monkeypatch):
    """--init teacher with --teacher-dir: the saved teacher's params start the sparse runs of another process."""
    from jaxsparse import train

    common = ["--quick", "--tasks", "trec", "--sparsities", "2:4", "--init", "teacher",
              "--teacher-dir", str(tmp_path / "teachers"), "--no-progress"]
    assert acc.main(common + ["--seed-list", "0", "--out-dir", str(tmp_path / "s0")]) == 0
    starts = []
    real_fit = train.fit
    monkeypatch.setattr(train, "fit_teacher", lambda *a, **k: pytest.fail("the saved teacher should be loaded"))
    monkeypatch.setattr(train, "fit", lambda *a, init_params=None, **k: (starts.append(init_params),
                                                                          real_fit(*a, init_params=init_params, **k))[1])
    assert acc.main(common + ["--seed-list", "1", "--out-dir", str(tmp_path / "s1")]) == 0
    assert len(starts) == 1 and starts[0] is not None and "classifier" in starts[0]
    payload = json.loads((tmp_path / "s1" / "accuracy.json").read_text())
    assert payload["hyperparameters"]["init"] == "teacher"
    assert "start from the dense teacher" in acc.section(payload)


def test_merge_takes_dense_baselines_from_another_recipe(acc, tmp_path):
    """Dense runs do not depend on the pruning recipe: --dense-from reuses them, and nothing else."""
    accs = {"dense": [0.9, 0.92], "2:4": [0.9, 0.9]}
    study = tmp_path / "study.json"
    study.write_text(json.dumps(_payload(acc, "rt", ["2:4"], accs, score="activation", fade=0.1)))
    old = tmp_path / "old.json"
    old.write_text(json.dumps(_payload(acc, "rt", ["dense", "2:4"], accs)))  # its 2:4 runs must not come along
    out = tmp_path / "merged"
    assert acc.main(["--merge", str(study), "--dense-from", str(old), "--out-dir", str(out)]) == 0
    merged = json.loads((out / "accuracy.json").read_text())
    assert sorted((r["sparsity"], r["seed"]) for r in merged["runs"]) == [("2:4", 0), ("2:4", 1), ("dense", 0), ("dense", 1)]
    assert merged["hyperparameters"]["score"] == "activation" and merged["dense_runs_from"] == [str(old)]
    row = next(r for r in merged["summary"] if r["sparsity"] == "2:4")
    assert row["delta"] == pytest.approx(90.0 - 91.0)
    # A merged study re-merged with other dense runs: those replace the dense rows it holds.
    more = tmp_path / "more.json"
    more.write_text(json.dumps(_payload(acc, "rt", ["dense"], {"dense": [0.8, 0.84]})))
    again = acc.merge([out / "accuracy.json"], tmp_path / "again", dense_from=[more])
    assert sorted((r["sparsity"], r["test_accuracy"]) for r in again["runs"]) == [
        ("2:4", 0.9), ("2:4", 0.9), ("dense", 0.8), ("dense", 0.84)]
    assert again["dense_runs_replaced"] == 2 and again["dense_runs_from"] == [str(more)]
    # A baseline with more seeds than the study keeps the study's seed count (and its completeness).
    six = tmp_path / "six.json"
    six.write_text(json.dumps(dict(_payload(acc, "rt", ["dense"], {"dense": [0.8] * 6}),
                                   grid={"tasks": ["rt"], "sparsities": ["dense"], "seeds": list(range(6))})))
    wide = acc.merge([study], tmp_path / "wide", dense_from=[six])
    assert wide["grid"]["seeds"] == [0, 1] and wide["finished"]
    assert "| rt | dense | 6 |" in acc.table(wide) and "| rt | 2:4 | 2 |" in acc.table(wide)
    row = next(r for r in again["summary"] if r["sparsity"] == "2:4")
    assert row["delta"] == pytest.approx(90.0 - 82.0)
    old.write_text(json.dumps(_payload(acc, "rt", ["dense"], accs, lr=1.0)))  # dense settings differ: refused
    with pytest.raises(ValueError, match="other settings"):
        acc.merge([study], out, dense_from=[old])


def test_refit_is_passed_through(acc):
    """--prune oneshot --refit reaches the sparse runs' jaxsparse-train arguments and the hyper-parameters."""
    args = acc.parse_args(["--quick", "--prune", "oneshot", "--refit", "--refit-batches", "3"])
    sparse, dense = acc.run_args(args, "trec", "2:4", 0), acc.run_args(args, "trec", "dense", 0)
    assert (sparse.prune, sparse.refit, sparse.refit_batches) == ("oneshot", True, 3)
    assert (dense.prune, dense.refit) == ("none", False)
    hp = acc.hyperparameters(args)
    assert hp["refit"] is True and hp["refit_batches"] == 3 and hp["prune"] == "oneshot"
    default = acc.hyperparameters(acc.parse_args(["--quick"]))
    assert default["refit"] is False and default["prune"] == "gmp" and not acc.run_args(
        acc.parse_args(["--quick"]), "trec", "2:4", 0).refit
    payload = _payload(acc, "trec", ["dense", "2:4"], {"dense": [0.9, 0.9], "2:4": [0.8, 0.8]},
                       prune="oneshot", refit=True, refit_batches=3)
    payload["summary"] = []
    assert "least-squares refit" in acc.section(payload)
    with pytest.raises(SystemExit, match="2"):
        acc.parse_args(["--quick", "--refit"])  # GMP runs cannot be refit
    # --refit-selection sparsegpt: passed to the sparse runs, recorded only when not the default, described
    args = acc.parse_args(["--quick", "--prune", "oneshot", "--refit", "--refit-selection", "sparsegpt"])
    assert acc.run_args(args, "trec", "64:2:8", 0).refit_selection == "sparsegpt"
    assert acc.hyperparameters(args)["refit_selection"] == "sparsegpt" and "refit_selection" not in hp
    payload = _payload(acc, "trec", ["dense", "64:2:8"], {"dense": [0.9, 0.9], "64:2:8": [0.8, 0.8]},
                       prune="oneshot", refit=True, refit_batches=3, refit_selection="sparsegpt")
    payload["summary"] = []
    assert "`--refit-selection sparsegpt`" in acc.section(payload)


def test_section_describes_fade_only_where_it_applies(acc):
    """--fade shapes GMP stages; one-shot masks are set at step 0, so a one-shot study's text omits it."""
    accs = {"dense": [0.9, 0.92], "64:2:8": [0.8, 0.82]}

    def text(**hp):
        payload = _payload(acc, "trec", ["dense", "64:2:8"], accs, **hp)
        payload["summary"] = acc.summarize(payload["runs"], ["trec"], ["dense", "64:2:8"], 2)
        return acc.section(payload)

    gmp, oneshot = text(prune="gmp", fade=0.15), text(prune="oneshot", fade=0.15, refit=True)
    assert "faded in over 0.15" in gmp and "fade 0.15" in gmp
    assert "faded in" not in oneshot and "fade 0.15" not in oneshot and "least-squares refit" in oneshot


def test_student_epochs_and_neighbors_are_passed_through(acc):
    """--student-epochs, --student-lr, --augment-neighbors and --distill-attention reach the sparse runs only, are
    recorded only when set (older result files still --resume and --merge), and the section names them."""
    args = acc.parse_args(["--quick", "--prune", "oneshot", "--distill", "0.5", "--distill-augment", "0.3",
                           "--augment-neighbors", "8", "--student-epochs", "3", "--init", "teacher",
                           "--distill-attention", "2", "--student-lr", "2e-4", "--regrow-every", "20",
                           "--regrow-until", "0.4", "--regrow-decay", "2e-3"])
    sparse, dense = acc.run_args(args, "trec", "64:2:8", 0), acc.run_args(args, "trec", "dense", 0)
    assert (sparse.student_epochs, sparse.augment_neighbors, sparse.distill_attention, sparse.epochs) == (3, 8, 2.0, 1)
    assert (dense.student_epochs, dense.augment_neighbors, dense.distill_attention) == (0, 0, 0.0)
    assert (sparse.student_lr, sparse.lr, dense.student_lr, dense.lr) == (2e-4, 1e-4, 0.0, 1e-4)
    assert (sparse.regrow_every, sparse.regrow_until, sparse.regrow_decay) == (20, 0.4, 2e-3)
    assert (dense.regrow_every, dense.regrow_decay) == (0, 0.0)
    hp = acc.hyperparameters(args)
    assert (hp["regrow_every"], hp["regrow_until"], hp["regrow_decay"]) == (20, 0.4, 2e-3)
    assert hp["student_epochs"] == 3 and hp["augment_neighbors"] == 8 and hp["distill_attention"] == 2.0
    assert hp["student_lr"] == 2e-4
    quick = acc.hyperparameters(acc.parse_args(["--quick"]))
    assert "student_epochs" not in quick and "distill_attention" not in quick and "student_lr" not in quick
    assert "regrow_every" not in quick
    assert {"student_epochs", "student_lr", "augment_neighbors", "distill_attention", "regrow_every"} <= set(
        acc.SPARSE_ONLY_HYPERPARAMETERS)
    payload = _payload(acc, "trec", ["dense", "64:2:8"], {"dense": [0.9, 0.9], "64:2:8": [0.8, 0.8]}, **hp)
    payload["summary"] = []
    text = acc.section(payload)
    assert "1 epochs (sparse runs 3)" in text and "1 + 3 epochs in all" in text and "8 nearest word pieces" in text
    assert "lr 0.0001 (sparse runs 0.0002)" in text and "student lr 0.0002" in text
    assert "learned masks (every 20 steps to 0.4, decay 0.002)" in text
    assert "masks are chosen again every 20 steps until 0.4 of the run" in text
    assert "attention distillation 2" in text and "KL(teacher || student) of the attention distributions" in text


def test_transposable_masks_are_passed_through(acc):
    """--transposable-masks reaches the sparse runs only, is recorded only when set and named in the section."""
    args = acc.parse_args(["--quick", "--prune", "oneshot", "--transposable-masks"])
    assert acc.run_args(args, "trec", "64:2:8", 0).transposable_masks
    assert not acc.run_args(args, "trec", "dense", 0).transposable_masks
    hp = acc.hyperparameters(args)
    assert hp["transposable_masks"] is True and "transposable_masks" in acc.SPARSE_ONLY_HYPERPARAMETERS
    assert "transposable_masks" not in acc.hyperparameters(acc.parse_args(["--quick"]))
    payload = _payload(acc, "trec", ["dense", "64:2:8"], {"dense": [0.9, 0.9], "64:2:8": [0.8, 0.8]}, **hp)
    payload["summary"] = []
    assert "transposable masks" in acc.section(payload)


def test_dropout_impl_reaches_every_run(acc):
    """The hash dropout (the default) reaches dense and sparse runs alike and --dropout-impl rng flax's; the dropout is
    recorded only when it is the hash (so studies written with flax's before the option still --resume and --merge as
    rng), is not a sparse-only setting (dense baselines must share it) and the hash is named in the section."""
    args = acc.parse_args(["--quick"])
    assert acc.run_args(args, "trec", "64:2:8", 0).dropout_impl == "hash"
    assert acc.run_args(args, "trec", "dense", 0).dropout_impl == "hash"
    rng = acc.parse_args(["--quick", "--dropout-impl", "rng"])
    assert acc.run_args(rng, "trec", "dense", 0).dropout_impl == "rng"
    assert acc.run_args(rng, "trec", "64:2:8", 0).dropout_impl == "rng"
    hp = acc.hyperparameters(args)
    assert hp["dropout_impl"] == "hash" and "dropout_impl" not in acc.SPARSE_ONLY_HYPERPARAMETERS
    assert "dropout_impl" not in acc.hyperparameters(rng)
    payload = _payload(acc, "trec", ["dense", "64:2:8"], {"dense": [0.9, 0.9], "64:2:8": [0.8, 0.8]}, **hp)
    payload["summary"] = []
    assert "hash dropout" in acc.section(payload)
    dense_only = _payload(acc, "trec", ["dense"], {"dense": [0.9, 0.9]}, **hp)
    dense_only["summary"] = []
    assert "hash dropout" in acc.section(dense_only)


def test_average_from_reaches_the_sparse_runs_and_reports_the_paired_gain(acc):
    """--average-from reaches the sparse runs only, is recorded only when set, and the section names it and gives the
    averaged-minus-last-step difference, paired per run."""
    args = acc.parse_args(["--quick", "--prune", "oneshot", "--average-from", "0.75"])
    assert acc.run_args(args, "trec", "64:2:8", 0).average_from == 0.75
    assert acc.run_args(args, "trec", "dense", 0).average_from == 0.0
    hp = acc.hyperparameters(args)
    assert hp["average_from"] == 0.75 and "average_from" in acc.SPARSE_ONLY_HYPERPARAMETERS
    assert "average_from" not in acc.hyperparameters(acc.parse_args(["--quick"]))
    payload = _payload(acc, "trec", ["dense", "64:2:8"], {"dense": [0.9, 0.92], "64:2:8": [0.81, 0.83]}, **hp)
    for run, last in zip([r for r in payload["runs"] if r["sparsity"] == "64:2:8"], (0.80, 0.81)):
        run["last_test_accuracy"] = last
    payload["summary"] = acc.summarize(payload["runs"], ["trec"], ["dense", "64:2:8"], 2)
    row = payload["summary"][1]
    assert row["averaging_gain"] == pytest.approx(1.5) and row["averaging_gain_se"] == pytest.approx(0.5)
    assert "averaging_gain" not in payload["summary"][0]
    text = acc.section(payload)
    assert "weights averaged from 0.75" in text and "trec 64:2:8 +1.50 ± 0.50" in text
