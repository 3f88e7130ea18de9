"""``jaxsparse-train``: fine-tune a (sparse) BERT on Rotten Tomatoes or TREC-6.

The default (``jaxsparse-train``) fine-tunes pretrained MiniLM-L6 on a 2,000-sentence Rotten Tomatoes
subset, pruned one-shot to 2:4, for one epoch, and reports dev/test accuracy: a few minutes on a 2-core
CPU. Full runs: ``jaxsparse-train --max-train 0 --max-eval 0 --epochs 5 --prune gmp --sparsity 64:2:8
--dtype bfloat16`` on a GPU.

Writes ``<out>/metrics.json`` and an orbax checkpoint ``<out>/checkpoint`` (params and the
``"sparsity"`` collection: masks in master mode, the fixed pattern in compressed mode).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxsparse import data as data_lib
from jaxsparse import parallel
from jaxsparse import format as fmt
from jaxsparse import ops, pruning
from jaxsparse.distill import (attention_distill_loss, augment_tokens, hidden_distill_loss, loss_fn, soft_distill_loss,
                               token_neighbors)
from jaxsparse.models import bert
from jaxsparse.nn import INPUT_STATS, SPARSITY

__all__ = ["main", "parse_args", "run", "fit", "load_data", "load_model", "TaskTokens", "JitCache",
           "save_checkpoint", "load_checkpoint", "make_step", "predict_logits", "fit_teacher", "teacher_args",
           "add_recipe_arguments", "check_recipe_arguments"]

INITS = ("pretrained", "teacher")
REFIT_RULE = "--refit needs --prune oneshot (it refits the one-shot masks before training)"
REFIT_DAMP = 0.01
"""Relative Hessian damping of ``--refit`` (``jaxsparse.obs.damp_hessian``)."""
MODELS = ("minilm",) + tuple(n for n in bert.PRESETS if n != "minilm")


def add_recipe_arguments(p: argparse.ArgumentParser) -> None:
    """The sparse fine-tuning recipe options shared by ``jaxsparse-train`` and ``benchmarks/accuracy.py``:
    ``--fade``, ``--score``, ``--distill``, ``--temperature``, ``--distill-hidden``, ``--distill-attention``,
    ``--distill-augment``, ``--augment-neighbors``, ``--student-epochs``, ``--student-lr``, ``--init``, ``--refit``,
    ``--refit-batches``, ``--refit-selection``, ``--regrow-every``, ``--regrow-until``, ``--regrow-decay``, ``--transposable-masks``,
    ``--exclusive-columns``, ``--diagonal-ffn-out``, ``--diagonal-ffn``, ``--diagonal-all``,
    ``--diagonal-attention``."""
    p.add_argument("--fade", type=float, default=0.0,
                   help="GMP: before each stage, fade the weights it will prune to zero over this fraction of all "
                        "steps (0 = masks change at once; see jaxsparse.pruning.gmp_prune fade_steps)")
    p.add_argument("--score", default="magnitude", choices=pruning.SCORES,
                   help="GMP mask score: |W|, or |W| times the norm of each input feature (Wanda's score)")
    p.add_argument("--distill", type=float, default=0.0,
                   help="knowledge distillation weight in [0, 1): sparse runs learn from a dense teacher fine-tuned "
                        "with the same settings, on (1 - w) * cross-entropy + w * T^2 * KL(teacher || student)")
    p.add_argument("--temperature", type=float, default=2.0, help="distillation temperature T")
    p.add_argument("--distill-hidden", type=float, default=0.0,
                   help="hidden-state distillation weight >= 0: sparse runs add this times the mean over encoder "
                        "layers of the squared difference between their layer outputs and the dense teacher's "
                        "(per hidden unit, over real tokens; hidden_distill_loss); the teacher runs in every step")
    p.add_argument("--distill-attention", type=float, default=0.0,
                   help="attention distillation weight >= 0: sparse runs add this times the mean over encoder layers "
                        "of KL(teacher || student) between their attention distributions (per head and real query "
                        "token; attention_distill_loss); the teacher runs in every step")
    p.add_argument("--distill-augment", type=float, default=0.0,
                   help="token replacement probability in [0, 1) of a corrupted copy of every batch that sparse runs "
                        "also distil on (needs --distill; augment_tokens): the teacher runs on the copy in every step "
                        "and the loss adds the --distill, --distill-hidden and --distill-attention terms on it (no "
                        "labels)")
    p.add_argument("--augment-neighbors", type=int, default=0,
                   help="with --distill-augment: replace each chosen token by one of its K nearest word pieces "
                        "(cosine of the teacher's input word embeddings, among the training set's word pieces; "
                        "token_neighbors) instead of a token drawn from the batch (0 = the batch)")
    p.add_argument("--student-epochs", type=int, default=0,
                   help="sparse runs train this many epochs (0 = --epochs); the dense teacher keeps --epochs")
    p.add_argument("--student-lr", type=float, default=0.0,
                   help="sparse runs' peak learning rate (0 = --lr); the dense teacher keeps --lr")
    p.add_argument("--student-dropout", type=float, default=-1.0,
                   help="sparse runs' dropout probability, on the hidden states and (where the model has it) the "
                        "attention probabilities; -1 = the model config's (0.1 for MiniLM); the dense teacher keeps "
                        "the config's")
    p.add_argument("--init", default="pretrained", choices=INITS,
                   help="where sparse runs start: the pretrained weights, or the dense teacher fine-tuned with the "
                        "same settings (prune a fine-tuned model, as oBERT's downstream pruning does)")
    p.add_argument("--refit", action="store_true",
                   help="with --prune oneshot only: before training, choose each sparse kernel's mask (same --score) "
                        "and refit its kept weights by least squares to its input Hessian over calibration batches, "
                        "layer by layer in forward order (jaxsparse.obs.oneshot_refit)")
    p.add_argument("--refit-batches", type=int, default=8,
                   help="--refit calibration: the first N training batches (of --batch-size, --max-len)")
    p.add_argument("--refit-selection", default="score", choices=("score", "sparsegpt"),
                   help="how --refit chooses the one-shot masks: by --score, or group by group on the weights that the "
                        "OBS updates of the groups before left (jaxsparse.obs.sparsegpt_mask)")
    p.add_argument("--regrow-every", type=int, default=0,
                   help="learned masks (SR-STE): once the final pattern is in, keep training the pruned weights with "
                        "straight-through gradients and choose the masks again (same --score) every N steps, until "
                        "--regrow-until; 0 = masks fixed at the final pattern "
                        "(jaxsparse.pruning.gmp_prune regrow_every)")
    p.add_argument("--regrow-until", type=float, default=0.5,
                   help="with --regrow-every: fraction of the run's steps at which the masks become final (then the "
                        "pruned weights are zeroed and, with --compress, the compressed values train)")
    p.add_argument("--regrow-decay", type=float, default=0.0,
                   help="with --regrow-every: fraction of its value a pruned weight loses each step, on top of its "
                        "update (SR-STE's decay of the pruned weights, decoupled)")
    p.add_argument("--transposable-masks", action="store_true",
                   help="choose masks that also keep W^T 2:4 along the output features "
                        "(jaxsparse.format.select_mask transposable=True), and run the input gradient as the 2:4 "
                        "forward product of W^T (JAXSPARSE_DX=transposed, unless JAXSPARSE_DX is set)")
    p.add_argument("--average-from", type=float, default=0.0,
                   help="evaluate and save the mean of the params over the run's last steps: those from this fraction "
                        "of the run (and from the final masks) to its end; 0 = off. The metrics' test and dev "
                        "accuracies are then the averaged model's, last_test_accuracy and last_dev_accuracy the last "
                        "step's (a paired comparison on the same run)")
    p.add_argument("--diagonal-ffn-out", action="store_true",
                   help="give each encoder layer's FFN out kernel, in place of its V:2:M mask (M >= 8), M/4 diagonal "
                        "2:4 blocks of the same density once its input (hidden) features are relabelled "
                        "(jaxsparse.format.select_diagonal_mask, in chunks of V); with --compress the hidden units "
                        "are relabelled when the masks are final and the blocks train as "
                        "jaxsparse.ops.diagonal_linear (docs/kernel-notes.md, session 31)")
    p.add_argument("--diagonal-all", action="store_true",
                   help="as --diagonal-ffn-out, for every pruned encoder kernel (Q, K, V, attention out, FFN in and "
                        "out), each with its own input sets in chunks of V (a multiple of 64) and no relabelling; "
                        "with --compress the blocks train as jaxsparse.ops.diagonal_linear / diagonal_mlp reading x "
                        "through chunk tables (docs/kernel-notes.md, session 32)")
    p.add_argument("--diagonal-ffn", action="store_true",
                   help="as --diagonal-all, for the FFN's two kernels only (FFN in and out, chunk tables, no "
                        "relabelling); the attention's kernels keep their V:2:M masks (docs/kernel-notes.md, "
                        "session 33)")
    p.add_argument("--diagonal-attention", action="store_true",
                   help="as --diagonal-all, for the attention's four kernels only (Q, K, V, attention out; input sets "
                        "in chunks of V); with --diagonal-ffn-out, FFN out too. Masked-dense only: its compressed "
                        "layout is not built, so --compress auto runs masked-dense and --compress on is refused")
    p.add_argument("--exclusive-columns", action="store_true",
                   help="choose V:2:M masks (M > 4) whose every input column is kept by at most ceil(4 (R/V) / M) "
                        "of a kernel's R/V blocks in each group (jaxsparse.format.select_mask exclusive_columns=True): "
                        "the accuracy side of a cheaper input gradient at high M (docs/kernel-notes.md)")


def check_recipe_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``p.error`` for recipe options out of range (see :func:`add_recipe_arguments`)."""
    if not 0.0 <= args.fade < 1.0:
        p.error("need 0 <= --fade < 1")
    if not 0.0 <= args.distill < 1.0 or args.temperature <= 0:
        p.error("need 0 <= --distill < 1 and --temperature > 0")
    if not args.distill_hidden >= 0.0:
        p.error("need --distill-hidden >= 0")
    if args.distill_hidden > 0 and getattr(args, "sparsity", None) == "dense":
        p.error("--distill-hidden trains a sparse student from a dense teacher: give a --sparsity pattern")
    if not args.distill_attention >= 0.0:
        p.error("need --distill-attention >= 0")
    if args.distill_attention > 0 and getattr(args, "sparsity", None) == "dense":
        p.error("--distill-attention trains a sparse student from a dense teacher: give a --sparsity pattern")
    if not 0.0 <= args.distill_augment < 1.0:
        p.error("need 0 <= --distill-augment < 1")
    if args.distill_augment > 0 and args.distill == 0:
        p.error("--distill-augment distils on a corrupted copy of each batch: it needs --distill > 0")
    if args.augment_neighbors < 0:
        p.error("need --augment-neighbors >= 0")
    if args.augment_neighbors > 0 and args.distill_augment == 0:
        p.error("--augment-neighbors chooses the replacements of --distill-augment: give --distill-augment > 0")
    if args.student_epochs < 0:
        p.error("need --student-epochs >= 0")
    if args.student_epochs > 0 and getattr(args, "sparsity", None) == "dense":
        p.error("--student-epochs sets a sparse run's epochs: give a --sparsity pattern (dense runs take --epochs)")
    if not args.student_lr >= 0.0:
        p.error("need --student-lr >= 0")
    if args.student_lr > 0 and getattr(args, "sparsity", None) == "dense":
        p.error("--student-lr sets a sparse run's learning rate: give a --sparsity pattern (dense runs take --lr)")
    if not (args.student_dropout == -1.0 or 0.0 <= args.student_dropout < 1.0):
        p.error(f"need --student-dropout in [0, 1), or -1 for the model config's; got {args.student_dropout}")
    if args.student_dropout >= 0 and getattr(args, "sparsity", None) == "dense":
        p.error("--student-dropout sets a sparse run's dropout: give a --sparsity pattern (dense runs keep the "
                "model config's)")
    if args.init == "teacher" and getattr(args, "sparsity", None) == "dense":
        p.error("--init teacher starts a sparse run from a dense teacher: give a --sparsity pattern")
    if args.refit and args.prune != "oneshot":
        p.error(REFIT_RULE)
    if args.refit_batches < 1:
        p.error("--refit-batches must be >= 1")
    if args.refit_selection != "score" and not args.refit:
        p.error("--refit-selection chooses --refit's masks: give --refit (with --prune oneshot)")
    if args.regrow_every < 0:
        p.error("need --regrow-every >= 0")
    if args.regrow_every > 0:
        if getattr(args, "sparsity", None) == "dense" or args.prune not in ("gmp", "oneshot"):
            p.error("--regrow-every learns a sparse run's masks: give a --sparsity pattern and --prune gmp or oneshot")
        ramp_end = args.prune_end if args.prune == "gmp" else 0.0
        if not ramp_end < args.regrow_until < 1.0:
            p.error("need --prune-end (gmp; 0 for oneshot) < --regrow-until < 1: the masks become final inside the run")
        if not 0.0 <= args.regrow_decay < 1.0:
            p.error("need 0 <= --regrow-decay < 1")
    elif args.regrow_decay != 0.0:
        p.error("--regrow-decay acts on learned masks: give --regrow-every > 0")
    if not 0.0 <= args.average_from < 1.0:
        p.error("need 0 <= --average-from < 1 (0: no averaging)")
    if args.transposable_masks and (getattr(args, "sparsity", None) == "dense" or args.prune not in ("gmp", "oneshot")):
        p.error("--transposable-masks chooses a sparse run's masks: give a --sparsity pattern and --prune gmp or oneshot")
    if getattr(args, "diagonal_ffn_out", False):
        _check_mask_option(p, args, "--diagonal-ffn-out", fmt.diagonal_blocks)
    chunked = [f for f in ("--diagonal-ffn", "--diagonal-all") if getattr(args, f[2:].replace("-", "_"), False)]
    for flag in chunked:
        _check_mask_option(p, args, flag, fmt.chunked_diagonal_blocks)
    if len(chunked) + bool(getattr(args, "diagonal_ffn_out", False)) > 1:
        p.error("--diagonal-ffn-out, --diagonal-ffn and --diagonal-all each give FFN out diagonal blocks: give one")
    if getattr(args, "diagonal_attention", False):
        _check_mask_option(p, args, "--diagonal-attention", fmt.chunked_diagonal_blocks)
        if chunked:
            p.error("--diagonal-attention with --diagonal-ffn is --diagonal-all, and --diagonal-all includes it: "
                    "give --diagonal-all alone")
        if getattr(args, "compress", "auto") == "on":
            p.error("--diagonal-attention trains masked-dense only (its compressed layout is not built): "
                    "give --compress off or auto")
    if args.exclusive_columns:
        _check_mask_option(p, args, "--exclusive-columns", fmt.check_exclusive_spec)


def parser_check(p: argparse.ArgumentParser, flag: str, check, value) -> None:
    """``check(value)``, its ``ValueError`` (naming the constraint) turned into ``p.error`` naming ``flag``."""
    try:
        check(value)
    except ValueError as e:
        p.error(f"{flag}: {e}")


def _check_mask_option(p: argparse.ArgumentParser, args: argparse.Namespace, flag: str, check_spec) -> None:
    """A mask-rule option (``flag``) needs a sparse run that chooses masks (``--prune gmp`` or ``oneshot``) and a
    pattern ``check_spec`` accepts (it raises ``ValueError`` naming the constraint); ``p.error`` otherwise."""
    sparsity = getattr(args, "sparsity", None)
    if sparsity == "dense" or args.prune not in ("gmp", "oneshot"):
        p.error(f"{flag} chooses a sparse run's masks: give a --sparsity pattern and --prune gmp or oneshot")
    if sparsity is not None:
        parser_check(p, flag, check_spec, sparsity)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line (see ``jaxsparse-train --help``)."""
    p = argparse.ArgumentParser(prog="jaxsparse-train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="minilm", choices=MODELS,
                   help="minilm = pretrained all-MiniLM-L6-v2; the others are randomly initialised sizes")
    p.add_argument("--task", default="rt", choices=sorted(data_lib.TASKS))
    p.add_argument("--sparsity", default="2:4", help="'dense' or a final pattern: 2:4, 64:2:8, 128:2:16, 64:2:8 ...")
    p.add_argument("--prune", default=None, choices=("gmp", "oneshot", "none"),
                   help="how masks are reached (default: oneshot when sparse, none when dense)")
    p.add_argument("--ladder", default=None,
                   help="comma-separated GMP stages, e.g. 64:6:8,64:4:8,64:2:8 (default: kernel-eligible ladder)")
    p.add_argument("--prune-begin", type=float, default=0.0, help="GMP ramp start, fraction of all steps")
    p.add_argument("--prune-end", type=float, default=0.5, help="GMP ramp end, fraction of all steps")
    p.add_argument("--compress", default="auto", choices=("auto", "on", "off"),
                   help="after the final N=2 mask: train the compressed values (auto: on when the CUDA kernels run)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup", type=float, default=0.1, help="linear warm-up, fraction of all steps")
    add_recipe_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-train", type=int, default=2000, help="training examples (0 = all)")
    p.add_argument("--max-eval", type=int, default=0, help="dev/test examples (0 = all)")
    p.add_argument("--max-len", type=int, default=48, help="tokens per example, [CLS] and [SEP] included")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="compute dtype (params stay float32); auto: bfloat16 on a GPU, where the sparse kernels take "
                        "it (float32 runs their pure-JAX references), float32 elsewhere")
    p.add_argument("--dropout-impl", default="hash", choices=bert.DROPOUT_IMPLS,
                   help="jaxsparse.dropout.HashDropout (hash, the default: keep bits hashed from each element's index "
                        "inside the kernels that use them, no random words in memory) or flax's dropout (rng: a "
                        "different random draw at the same rate, every run before session 43); "
                        "BertConfig.dropout_impl")
    p.add_argument("--devices", default="1",
                   help="data parallel over N local devices or 'all' (gradients averaged; the batch is split); "
                        "with --coordinator, 'all' is every device of every process")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="many hosts: run one jaxsparse-train per host with the same options and this one, "
                        "--num-processes and --process-id (jax.distributed.initialize); each process feeds its "
                        "rows of every batch, process 0 writes the outputs")
    p.add_argument("--num-processes", type=int, default=None, help="with --coordinator: the processes in all")
    p.add_argument("--process-id", type=int, default=None, help="with --coordinator: this process, 0 .. N-1")
    p.add_argument("--out", default="runs/latest", help="output folder (metrics.json, checkpoint/)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    patterns = [("--sparsity", args.sparsity)] if args.sparsity != "dense" else []
    patterns += [("--ladder", stage) for stage in (args.ladder.split(",") if args.ladder else [])]
    for flag, pattern in patterns:
        parser_check(p, flag, fmt.VNM.parse, pattern)
    if args.ladder and args.sparsity == "dense":
        p.error("--ladder is a GMP ladder: give a --sparsity pattern")
    if args.prune is None:
        args.prune = "none" if args.sparsity == "dense" else "oneshot"
    if args.sparsity == "dense" and args.prune != "none":
        p.error(f"--prune {args.prune} needs a --sparsity pattern, not dense")
    if args.sparsity != "dense" and args.prune == "none":
        p.error("--prune none trains dense: use --sparsity dense")
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_len < 2:
        p.error(f"--max-len must be >= 2 ([CLS] and [SEP] take two tokens), got {args.max_len}")
    for name in ("max_train", "max_eval"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0 (0 = all), got {getattr(args, name)}")
    if not args.lr > 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    if not args.weight_decay >= 0:
        p.error(f"--weight-decay must be >= 0, got {args.weight_decay}")
    if not 0.0 <= args.warmup < 1.0:
        p.error(f"--warmup is a fraction of all steps: need 0 <= --warmup < 1, got {args.warmup}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out {args.out} exists and is not a folder")
    if args.devices != "all":
        try:
            args.devices = int(args.devices)
        except ValueError:
            p.error(f"--devices must be an int or 'all', got {args.devices!r}")
        if args.devices < 1:
            p.error("--devices must be >= 1")
    given = [args.coordinator is not None, args.num_processes is not None, args.process_id is not None]
    if any(given) and not all(given):
        p.error("--coordinator, --num-processes and --process-id go together")
    if args.coordinator is not None:
        if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
            p.error(f"need --num-processes >= 1 and 0 <= --process-id < --num-processes, got "
                    f"{args.num_processes} and {args.process_id}")
        if args.devices != "all":
            p.error("--coordinator trains over every process's devices: give --devices all")
    if not 0.0 <= args.prune_begin <= args.prune_end <= 1.0:
        p.error("need 0 <= --prune-begin <= --prune-end <= 1")
    check_recipe_arguments(p, args)
    if args.distill > 0 and args.sparsity == "dense":
        p.error("--distill trains a sparse student from a dense teacher: give a --sparsity pattern")
    return args


def _batches(n: int, size: int, rng: np.random.Generator | None):
    order = rng.permutation(n) if rng is not None else np.arange(n)
    for lo in range(0, n - size + 1, size):
        yield order[lo:lo + size]


def _kernel_path() -> bool:
    from jaxsparse import ffi

    return jax.default_backend() == "gpu" and ffi.available()


def _use_compressed(mode: str, spec: fmt.VNM | None, cfg: bert.BertConfig) -> bool:
    """Whether to switch to compressed training after the final mask (``--compress``)."""
    if mode == "off" or spec is None:
        return False
    problem = cfg.compressed_problem(spec)
    if problem:
        if mode == "on":
            raise ValueError(f"--compress on: {problem}")
        return False
    return mode == "on" or _kernel_path()


def _arrays(b: data_lib.Batch, idx) -> tuple:
    return b.input_ids[idx], b.token_type_ids[idx], b.attention_mask[idx], b.labels[idx]


class _Evaluator:
    """Accuracy and loss on a tokenized split; examples sorted by length, batches cut to 16-token buckets."""

    def __init__(self, batch: data_lib.Batch, size: int):
        self.batch, self.size = batch, size
        lengths = batch.attention_mask.sum(1)
        self.order = np.argsort(lengths, kind="stable")
        self.lengths = lengths[self.order]

    def __call__(self, logits_fn, variables) -> dict[str, float]:
        correct, loss, n = 0, 0.0, len(self.batch)
        for lo in range(0, n, self.size):
            idx = self.order[lo:lo + self.size]
            t = min(self.batch.input_ids.shape[1], int(math.ceil(self.lengths[lo:lo + self.size].max() / 16) * 16))
            pad = self.size - len(idx)
            ids, types, mask, labels = (np.pad(a[idx][:, :t] if a.ndim == 2 else a[idx], [(0, pad)] + [(0, 0)] * (a.ndim - 1))
                                        for a in (self.batch.input_ids, self.batch.token_type_ids,
                                                  self.batch.attention_mask, self.batch.labels))
            logits = np.asarray(logits_fn(variables, ids, types, mask))[: len(idx)]
            labels = labels[: len(idx)]
            correct += int((logits.argmax(-1) == labels).sum())
            shifted = logits - logits.max(-1, keepdims=True)
            logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
            loss -= float(logp[np.arange(len(idx)), labels].sum())
        return {"accuracy": correct / n, "loss": loss / n}


@dataclasses.dataclass(frozen=True)
class TaskTokens:
    """A task and its tokenized train/dev/test splits (see :func:`load_data`)."""

    task: data_lib.TaskData
    train: data_lib.Batch
    dev: data_lib.Batch
    test: data_lib.Batch


def load_data(task: str, max_train: int = 0, max_eval: int = 0, max_len: int = 48,
              tokenizer=None) -> TaskTokens:
    """Load ``task`` and tokenize its splits to ``max_len`` tokens.

    Args:
      task: a name of :data:`jaxsparse.data.TASKS`.
      max_train: keep the first ``max_train`` training examples (0 = all).
      max_eval: keep the first ``max_eval`` dev and test examples (0 = all).
      max_len: tokens per example, ``[CLS]`` and ``[SEP]`` included.
      tokenizer: a ``tokenizers.Tokenizer``; MiniLM's (:func:`jaxsparse.data.load_tokenizer`) by default.
    """
    data = data_lib.load_task(task)
    tok = tokenizer if tokenizer is not None else data_lib.load_tokenizer()
    take = lambda s, n: s.take(n or None)  # noqa: E731
    return TaskTokens(data, *(data_lib.tokenize(tok, take(split, n), max_len)
                              for split, n in ((data.train, max_train), (data.dev, max_eval), (data.test, max_eval))))


def load_model(name: str, num_layers: int | None = None) -> tuple[bert.BertConfig, dict | None]:
    """``(config, pretrained BertModel params or None)`` of ``--model`` ``name``.

    ``minilm`` loads the pretrained all-MiniLM-L6-v2 (:func:`jaxsparse.models.bert.load_minilm`); the other
    names are randomly initialised presets. ``num_layers`` keeps only the first encoder layers (smoke tests).
    """
    if name == "minilm":
        cfg, pretrained = bert.load_minilm()
    else:
        cfg, pretrained = bert.BertConfig.preset(name), None
    if num_layers is not None:
        if not 1 <= num_layers <= cfg.num_hidden_layers:
            raise ValueError(f"num_layers must be in [1, {cfg.num_hidden_layers}], got {num_layers}")
        cfg = dataclasses.replace(cfg, num_hidden_layers=num_layers)
        if pretrained is not None:
            kept = {f"encoder_layer_{i}" for i in range(num_layers)}
            pretrained = {k: v for k, v in pretrained.items() if not k.startswith("encoder_layer_") or k in kept}
    return cfg, pretrained


class JitCache:
    """Jitted functions shared by runs whose model, optimizer and shapes agree (e.g. the seeds of a study).

    A jitted function is compiled once per input structure, but only as long as the *same* function
    object is called: :func:`fit` builds its step, init and logits functions through this cache, keyed
    by everything they close over, so a second run with the same key reuses the compiled executables.

    Attributes:
      built: how many functions were built, by kind (``init``, ``step``, ``logits``).
    """

    def __init__(self) -> None:
        self._fns: dict[tuple, Callable] = {}
        self.built: dict[str, int] = {}

    def get(self, kind: str, key: tuple, build: Callable[[], Callable]) -> Callable:
        """The function cached under ``(kind, key)``; ``build()`` makes it the first time."""
        full = (kind,) + key
        if full not in self._fns:
            self._fns[full] = build()
            self.built[kind] = self.built.get(kind, 0) + 1
        return self._fns[full]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


OPTIMIZER_SCOPE = "optimizer"
"""Named scope of the optimizer update in the training step (read by ``jaxsparse-profile``)."""


@jax.jit
def running_mean(mean: Any, params: Any, count: jax.Array) -> Any:
    """The mean of ``count`` snapshots given the mean of the first ``count - 1`` and the last one: leaf by leaf
    ``mean + (params - mean) / count``, in each leaf's dtype (:func:`fit` takes the first snapshot as it is)."""
    return jax.tree_util.tree_map(lambda m, p: (m + (p - m) / count.astype(p.dtype)).astype(p.dtype), mean, params)


def _student_setting(args: argparse.Namespace, name: str):
    """``args.student_<name>`` for a sparse run that sets it (> 0), else ``args.<name>``: the ``--student-*`` rule."""
    student = getattr(args, f"student_{name}", 0) or 0
    return student if student > 0 and args.sparsity != "dense" else getattr(args, name)


def run_epochs(args: argparse.Namespace) -> int:
    """The epochs a run of ``args`` trains: ``--student-epochs`` for a sparse run that sets it, else ``--epochs``."""
    return int(_student_setting(args, "epochs"))


def run_lr(args: argparse.Namespace) -> float:
    """The peak learning rate of a run of ``args``: ``--student-lr`` for a sparse run that sets it, else ``--lr``."""
    return float(_student_setting(args, "lr"))


def in_step_distillation(args: argparse.Namespace) -> tuple[float, float, float]:
    """``(distill_hidden, distill_attention, distill_augment)`` of a run: the weights of the distillation terms
    whose dense teacher runs inside every training step, each 0 where it does not apply (hidden-state or
    attention distillation to a dense run, distillation on corrupted copies without ``--distill``)."""
    sparse = args.sparsity != "dense"
    hidden = float(getattr(args, "distill_hidden", 0.0)) if sparse else 0.0
    attention = float(getattr(args, "distill_attention", 0.0)) if sparse else 0.0
    augment = float(getattr(args, "distill_augment", 0.0)) if getattr(args, "distill", 0.0) > 0 else 0.0
    return hidden, attention, augment


def teacher_in_step(args: argparse.Namespace) -> bool:
    """Whether the dense teacher runs inside every training step of ``args`` (:func:`in_step_distillation`), so
    that :func:`fit` needs its params."""
    return any(w > 0 for w in in_step_distillation(args))


TEACHER = "teacher"
"""Key of ``extra`` under which :func:`make_step` with ``distill_hidden``, ``distill_attention`` or
``distill_augment > 0`` takes the teacher's params."""
NEIGHBORS = "augment_neighbors"
"""Key of ``extra`` under which :func:`make_step` with ``distill_augment > 0`` may take a
:func:`token_neighbors` table; the corrupted copy then replaces tokens by their neighbours."""


def make_step(model, tx: optax.GradientTransformation, with_masks: bool, mesh: jax.sharding.Mesh | None = None,
              axis: str = parallel.DATA_AXIS, donate: bool = False, distill: float = 0.0,
              temperature: float = 2.0, mask_score: str = "magnitude", distill_hidden: float = 0.0,
              teacher_model=None, distill_augment: float = 0.0, distill_attention: float = 0.0,
              straight_through: bool = False) -> Callable:
    """The jitted training step ``(params, opt_state, extra, batch, rng) -> (params, opt_state, loss)``.

    Args:
      model: the Flax classifier (master or compressed mode).
      tx: the optimizer; with ``with_masks`` it holds ``gmp_prune``, whose masks reach the model
        through :func:`jaxsparse.pruning.model_variables` (otherwise ``extra`` holds the collections,
        e.g. the compressed ``"sparsity"`` pattern).
      mesh: None = one device (plain :func:`jax.jit`); a 1-D mesh = data parallel over it
        (:func:`jaxsparse.parallel.data_parallel`): ``batch`` is split along its leading axis, each
        device draws its own dropout masks, gradients and loss are averaged over ``axis`` before the
        update (compressed values in compressed mode, dense kernels in master mode).
      donate: donate ``params`` and ``opt_state`` to the step (the caller must not reuse them).
      distill, temperature: with ``distill > 0`` the batch carries a fifth array, the teacher's logits
        ``[B, labels]``, and the loss is :func:`loss_fn`'s distillation loss.
      mask_score: the ``score`` of the ``gmp_prune`` in ``tx``; with ``"activation"`` the forward collects
        the sparse layers' input statistics (:data:`jaxsparse.nn.INPUT_STATS`) and hands them to the
        optimizer update as ``input_sq``.
      distill_hidden, teacher_model: with ``distill_hidden > 0`` the dense ``teacher_model`` runs on the batch
        (no dropout) with the params in ``extra[TEACHER]``, and the loss adds ``distill_hidden`` times
        :func:`hidden_distill_loss` of the encoder layers' outputs (:data:`jaxsparse.models.bert.HIDDEN_STATES`).
      distill_attention: with a weight ``> 0`` the teacher runs as for ``distill_hidden`` and the loss adds
        ``distill_attention`` times :func:`attention_distill_loss` of the encoder layers' attention logits
        (:data:`jaxsparse.models.bert.ATTENTION_LOGITS`; both models need the ``"softmax"`` attention).
      distill_augment: with a rate ``> 0`` (and ``distill > 0``) each step also distils on a copy of the batch
        corrupted by :func:`augment_tokens` (its key split from ``rng``; by the neighbours in
        ``extra[NEIGHBORS]`` when that is there, else by in-batch tokens): student and ``teacher_model`` run on
        the clean batch and the copy together (one forward of twice the batch each), and the loss adds, on the
        copy, ``distill`` times :func:`soft_distill_loss` against the teacher's logits there, plus the
        ``distill_hidden`` and ``distill_attention`` terms when those are on. The clean half's loss is unchanged
        (its soft targets are still the batch's fifth array). With the activation score the input statistics
        include the copy's tokens.

      straight_through: with ``with_masks``, the model gets the masked kernels as its params
        (:func:`jaxsparse.pruning.straight_through`) instead of the masks, so the forward is the same masked
        product and the gradient of every kernel is dense: ``gmp_prune``'s learned masks (``regrow_every``)
        train the pruned weights with it.

    The optimizer update runs in the named scope ``OPTIMIZER_SCOPE``, so ``jaxsparse-profile`` can
    attribute its kernels.
    """
    dp = axis if mesh is not None else None
    with_stats = with_masks and mask_score == "activation"
    teacher_runs = distill_hidden > 0 or distill_attention > 0 or distill_augment > 0
    if teacher_runs and teacher_model is None:
        raise ValueError("make_step: distill_hidden, distill_attention or distill_augment > 0 needs the teacher_model")
    if distill_augment > 0 and distill <= 0:
        raise ValueError("make_step: distill_augment > 0 needs distill > 0")
    if distill_attention > 0:
        for m in (model, teacher_model):
            if m.config.attention_impl != "softmax":
                raise ValueError(f"make_step: distill_attention needs attention_impl 'softmax' (the attention logits), "
                                 f"got {m.config.attention_impl!r}")
    sown = ([bert.HIDDEN_STATES] if distill_hidden > 0 else []) + (
        [bert.ATTENTION_LOGITS] if distill_attention > 0 else [])
    mutable = ([INPUT_STATS] if with_stats else []) + sown

    def step(params, opt_state, extra, batch, rng):
        variables = pruning.model_variables(params, opt_state) if with_masks else dict(extra)
        dropped = ("params", TEACHER, NEIGHBORS) + ((SPARSITY,) if straight_through else ())
        variables = {k: v for k, v in variables.items() if k not in dropped}
        if dp is not None:
            rng = jax.random.fold_in(rng, jax.lax.axis_index(dp))
        inputs, n = tuple(batch[:3]), batch[0].shape[0]
        if distill_augment > 0:  # the clean batch and its corrupted copy, stacked: [2B, T]
            rng, k_aug = jax.random.split(rng)
            copy = (augment_tokens(k_aug, batch[0], batch[2], distill_augment, extra.get(NEIGHBORS)),) + inputs[1:]
            inputs = tuple(jnp.concatenate([a, b]) for a, b in zip(inputs, copy))
        if teacher_runs:
            t_logits, t_state = teacher_model.apply({"params": extra[TEACHER]}, *inputs, deterministic=True,
                                                    mutable=sown)
            t_hidden = t_state[bert.HIDDEN_STATES]["bert"]["layers"] if distill_hidden > 0 else ()
            t_att = (bert.sown_attention_logits(t_state[bert.ATTENTION_LOGITS], teacher_model.config.num_hidden_layers)
                     if distill_attention > 0 else ())

        def lf(p):
            if straight_through:  # masked values, dense gradients (the masks are not passed to the model)
                p = pruning.straight_through(p, pruning.masks_of(opt_state))
            out = model.apply({**variables, "params": p}, *inputs, deterministic=False,
                              rngs={"dropout": rng}, mutable=mutable or False)
            logits, stats = out if mutable else (out, {})
            teacher = batch[4] if distill > 0 else None
            loss = loss_fn(logits[:n], batch[3], teacher, distill, temperature)
            s_hidden = stats[bert.HIDDEN_STATES]["bert"]["layers"] if distill_hidden > 0 else ()
            s_att = (bert.sown_attention_logits(stats[bert.ATTENTION_LOGITS], model.config.num_hidden_layers)
                     if distill_attention > 0 else ())

            def layer_terms(half):  # the hidden-state and attention terms on rows `half` of the (stacked) batch
                out = 0.0
                if distill_hidden > 0:
                    out += distill_hidden * hidden_distill_loss(
                        [h[half] for h in s_hidden], [h[half] for h in t_hidden], batch[2])
                if distill_attention > 0:
                    out += distill_attention * attention_distill_loss(
                        [a[half] for a in s_att], [a[half] for a in t_att], batch[2])
                return out

            loss += layer_terms(slice(None, n))
            if distill_augment > 0:
                loss += distill * soft_distill_loss(logits[n:], t_logits[n:], temperature)
                loss += layer_terms(slice(n, None))
            return loss, stats

        (loss, stats), grads = jax.value_and_grad(lf, has_aux=True)(params)
        grads, loss = parallel.pmean_grads((grads, loss), dp)
        extra_args = {}
        if with_stats:  # the activation-weighted mask score: input sums of squares of this batch (all devices)
            extra_args["input_sq"] = parallel.pmean_grads(pruning.input_norms_tree(stats[INPUT_STATS], params), dp)
        with jax.named_scope(OPTIMIZER_SCOPE):
            updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
            params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    donated = (0, 1) if donate else ()
    if mesh is None:
        return jax.jit(step, donate_argnums=donated)
    return parallel.data_parallel(step, mesh, batch_argnums=(3,), axis=axis, donate_argnums=donated)


def fit(args: argparse.Namespace, data: TaskTokens, cfg: bert.BertConfig, pretrained: dict | None, *,
        cache: JitCache | None = None, on_step: Callable[[int, jax.Array], None] | None = None,
        log: Callable[[str], None] = _stderr, teacher_logits: np.ndarray | None = None,
        init_params: dict | None = None, teacher_params: dict | None = None) -> tuple[dict[str, Any], dict]:
    """Fine-tune and evaluate as ``args`` (from :func:`parse_args`) says, on tokenized ``data``.

    Args:
      args: hyper-parameters (``sparsity``, ``prune``, ``epochs``, ``batch_size``, ``lr``, ``seed``, ...).
      data: the task's tokenized splits (:func:`load_data`).
      cfg: the model architecture (its ``dropout_impl`` replaced by ``args.dropout_impl`` where ``args`` has one);
        ``pretrained``: its BertModel params, or None for a random init.
      cache: share jitted functions with other runs (see :class:`JitCache`); a private one by default.
      on_step: called after every optimizer step with ``(global_step, loss)`` (loss not synced); when
        given, no per-epoch progress bars are drawn.
      log: where the per-epoch lines go (stderr by default).
      teacher_logits: ``[train examples, labels]`` logits of a teacher (:func:`predict_logits`), needed
        when ``args.distill > 0``.
      init_params: the whole classifier's starting params (``--init teacher``: the teacher's fine-tuned
        params); ``pretrained`` is ignored then.
      teacher_params: the dense teacher's classifier params, needed when :func:`teacher_in_step` (hidden-state,
        attention or augmented-copy distillation: the teacher then runs inside every step).

    With ``args.refit`` (``--prune oneshot`` only) the starting params are first pruned and refit by
    :func:`jaxsparse.obs.oneshot_refit` (sequential: each kernel's input Hessian is measured on the model
    already pruned and refit before it) over the first ``args.refit_batches`` training batches, masks chosen
    with ``args.score`` (the activation score from the same calibration inputs); training then proceeds as
    ``--prune oneshot``, whose step-0 masks are the refit's.

    Returns:
      ``(metrics, variables)``: the metrics of ``metrics.json`` (without ``seconds`` of loading) and the
      final ``{"params": ..., "sparsity": ...}``.
    """
    t_start = time.time()
    cfg = dataclasses.replace(cfg, dropout_impl=getattr(args, "dropout_impl", cfg.dropout_impl))
    cache = cache if cache is not None else JitCache()
    train, dev, test, task = data.train, data.dev, data.test, data.task
    if len(train) < args.batch_size:
        raise ValueError(f"--batch-size {args.batch_size} exceeds the {len(train)} training examples")

    distill, temperature = getattr(args, "distill", 0.0), getattr(args, "temperature", 2.0)
    if distill > 0 and (teacher_logits is None or len(teacher_logits) != len(train)):
        raise ValueError(f"--distill {distill} needs teacher logits for the {len(train)} training examples "
                         f"(got {None if teacher_logits is None else np.shape(teacher_logits)})")
    kd = (distill, temperature) if distill > 0 else (0.0, temperature)
    hidden, attention, augment = in_step_distillation(args)
    in_step = teacher_in_step(args)
    if in_step and teacher_params is None:
        raise ValueError(f"the teacher runs in every step (--distill-hidden {hidden}, --distill-attention {attention}, "
                         f"--distill-augment {augment}): fit needs the teacher's params (teacher_params)")

    devices = getattr(args, "devices", 1)
    multi = jax.process_count() > 1 and devices == "all"
    mesh = parallel.global_mesh() if multi else parallel.local_mesh(devices) if devices != 1 else None
    n_dev = 1 if mesh is None else mesh.size
    if args.batch_size % n_dev:
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by the {n_dev} devices (--devices {devices})")
    # this process's rows of every batch: all of them in a single process
    rows = parallel.process_rows(args.batch_size, mesh) if mesh is not None else slice(None)

    def batch_of(idx):
        idx = idx[rows]
        return _arrays(train, idx) + ((teacher_logits[idx],) if distill > 0 else ())

    dtype = jnp.dtype(resolve_dtype(args))
    sparse = args.sparsity != "dense"
    if sparse and getattr(args, "student_dropout", -1.0) >= 0:
        cfg = student_dropout_config(cfg, args.student_dropout)
    spec = fmt.VNM.parse(args.sparsity) if sparse else None
    diagonal = bool(getattr(args, "diagonal_ffn_out", False)) and sparse
    diagonal_all = bool(getattr(args, "diagonal_all", False)) and sparse
    diagonal_ffn = bool(getattr(args, "diagonal_ffn", False)) and sparse
    diagonal_attention = bool(getattr(args, "diagonal_attention", False)) and sparse
    compressed_cfg = dataclasses.replace(cfg, diagonal_all=diagonal_all, diagonal_ffn=diagonal_ffn,
                                         diagonal_ffn_out=diagonal)
    make_model = lambda compressed: bert.BertForSequenceClassification(  # noqa: E731
        compressed_cfg if compressed else cfg, sparsity=args.sparsity if sparse else None, compressed=compressed,
        dtype=dtype, num_labels=task.num_labels)
    # Master mode: NMDense applies whatever mask it is passed, so one dense-spec model initialises and
    # evaluates every sparsity (fewer compilations); the spec only matters in compressed mode.
    master_key = (cfg, task.num_labels, dtype.name)
    master = bert.BertForSequenceClassification(cfg, dtype=dtype, num_labels=task.num_labels)
    model = make_model(False)
    key = jax.random.key(args.seed)
    key, k_init = jax.random.split(key)
    init = cache.get("init", master_key, lambda: jax.jit(master.init))
    params = init(k_init, *(a[:1] for a in _arrays(train, slice(None))[:3]))["params"]
    if init_params is not None:
        shapes = lambda tree: jax.tree_util.tree_map(lambda a: (a.shape, jnp.dtype(a.dtype)), tree)  # noqa: E731
        if shapes(init_params) != shapes(params):
            raise ValueError("init_params does not match the model's parameter tree (shapes or dtypes differ)")
        params = jax.tree_util.tree_map(jnp.asarray, init_params)
    elif pretrained is not None:
        params = bert.merge_params(params, pretrained)
    transposable = bool(getattr(args, "transposable_masks", False))
    exclusive = bool(getattr(args, "exclusive_columns", False))
    diagonal_fn, diagonal_chunks = compressed_cfg.diagonal_kernels()
    if diagonal_attention:
        diagonal_fn = (pruning.attention_kernels if diagonal_fn is None
                       else pruning.any_of(pruning.attention_kernels, diagonal_fn))
    refit = bool(getattr(args, "refit", False))
    if refit:
        if args.prune != "oneshot":
            raise ValueError(REFIT_RULE)
        from jaxsparse import obs

        n_cal = min(getattr(args, "refit_batches", 8), len(train) // args.batch_size)
        calib = [_arrays(train, slice(i * args.batch_size, (i + 1) * args.batch_size))[:3] for i in range(n_cal)]
        t_refit = time.time()
        selection = getattr(args, "refit_selection", "score")
        params, _ = obs.oneshot_refit(master, params, calib, spec,
                                      "sparsegpt" if selection == "sparsegpt" else getattr(args, "score", "magnitude"),
                                      damp=REFIT_DAMP, transposable=transposable, exclusive_columns=exclusive,
                                      diagonal_fn=diagonal_fn)
        # The one-shot prune below selects its masks at step 0 from these params (the warm-up's learning rate
        # is 0 there, so the update is 0): the refit kernels are zero exactly off their masks, so it picks them again.
        log(f"refit: {n_cal} calibration batches, {time.time() - t_refit:.0f} s")

    steps_per_epoch = len(train) // args.batch_size
    epochs = run_epochs(args)
    total = steps_per_epoch * epochs
    warmup = max(1, int(args.warmup * total))
    peak_lr = run_lr(args)
    lr = optax.warmup_cosine_decay_schedule(0.0, peak_lr, warmup, max(total, 2), 0.0)
    base = optax.adamw(lr, weight_decay=args.weight_decay, mask=lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p))
    base_key = (peak_lr, args.weight_decay, warmup, max(total, 2))
    prune = None
    score = getattr(args, "score", "magnitude")
    fade_steps = int(getattr(args, "fade", 0.0) * total)
    regrow_every = int(getattr(args, "regrow_every", 0))
    regrow = dict(regrow_every=regrow_every, regrow_until=int(args.regrow_until * total),
                  regrow_decay=float(args.regrow_decay)) if regrow_every > 0 else {}
    if args.prune == "gmp":
        ladder = args.ladder.split(",") if args.ladder else args.sparsity
        begin, end = int(args.prune_begin * total), int(args.prune_end * total)
        prune = pruning.gmp_prune(ladder, begin, end, frequency=max(1, (end - begin) // 20),
                                  fade_steps=fade_steps, score=score, transposable=transposable,
                                  exclusive_columns=exclusive, diagonal_fn=diagonal_fn, **regrow)
    elif args.prune == "oneshot":
        prune = pruning.gmp_prune([spec], 0, 0, score=score, transposable=transposable, exclusive_columns=exclusive,
                                  diagonal_fn=diagonal_fn, **regrow)
    if prune is not None and str(prune.schedule.ladder[-1]) != str(spec):
        raise ValueError(f"the ladder must end at --sparsity {spec}, got {prune.schedule.ladder[-1]}")
    tx = optax.chain(base, prune) if prune is not None else base
    tx_key = base_key + ((prune.schedule, fade_steps, score, tuple(regrow.items()), transposable, exclusive,
                          (diagonal, diagonal_ffn, diagonal_all, diagonal_attention))
                         if prune is not None else ())
    opt_state = tx.init(params)
    # --diagonal-attention has no compressed layout yet: it trains masked-dense (parse_args refuses --compress on).
    compress = _use_compressed(args.compress, spec, compressed_cfg) and not diagonal_attention
    switch_step = prune.final_step + 1 if prune is not None else None
    # --average-from: the params after steps average_start + 1 .. total are averaged (masks final by then).
    average_from = float(getattr(args, "average_from", 0.0))
    average_start = max(int(average_from * total), switch_step or 0) if average_from > 0 else None
    if average_start is not None and average_start >= total:
        raise ValueError(f"--average-from {average_from} leaves no step to average: the average would start after "
                         f"step {average_start} of {total} (the masks become final after step {switch_step or 0})")
    mean_params = None

    def make_logits(model):
        return jax.jit(lambda variables, *a: model.apply(variables, *a))

    # With --distill-hidden, --distill-attention or --distill-augment the teacher (the dense master model) runs
    # inside the step on ``extra[TEACHER]``.
    hd = dict(distill_hidden=hidden, distill_attention=attention, teacher_model=master,
              distill_augment=augment) if in_step else {}
    teacher_extra = {TEACHER: jax.tree_util.tree_map(jnp.asarray, teacher_params)} if in_step else {}
    n_neighbors = int(getattr(args, "augment_neighbors", 0)) if augment > 0 else 0
    if n_neighbors:
        t_nb = time.time()
        emb = teacher_params["bert"]["embeddings_word_embeddings"]["embedding"]
        teacher_extra[NEIGHBORS] = jnp.asarray(token_neighbors(emb, train.input_ids, train.attention_mask, n_neighbors))
        log(f"augmentation: {n_neighbors} nearest word pieces per token ({time.time() - t_nb:.0f} s)")
    step = cache.get("step", (model, tx_key, prune is not None, mesh, kd, hidden, attention, augment),
                     lambda: make_step(model, tx, prune is not None, mesh, distill=kd[0], temperature=kd[1],
                                       mask_score=score, straight_through=bool(regrow), **hd))
    logits_fn = cache.get("logits", master_key, lambda: make_logits(master))
    extra: dict = {}

    def placed(tree):  # the step's constant arguments, on every device of the mesh once (not copied every step)
        return parallel.replicate(tree, mesh) if mesh is not None else tree

    step_extra = placed(teacher_extra)
    evaluate_dev, evaluate_test = _Evaluator(dev, args.batch_size), _Evaluator(test, args.batch_size)

    def variables_of(p):
        if "sparsity" in extra:
            return {"params": p, **extra}
        return pruning.model_variables(p, opt_state) if (prune is not None and not compressed) else {"params": p}

    def variables_now():
        return variables_of(params)

    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        tqdm = None
    bars = tqdm is not None and not args.no_progress and on_step is None and jax.process_index() == 0
    history, compressed, global_step = [], False, 0
    # Dropout masks from the RngBitGenerator: about 3x cheaper than threefry on a CPU, same on a GPU.
    drop_key = jax.random.key(args.seed + 1, impl="rbg")
    data_rng = np.random.default_rng(args.seed)
    log(data_lib.describe(task))
    for epoch in range(epochs):
        t0, losses = time.time(), []
        batches = _batches(len(train), args.batch_size, data_rng)
        bar = tqdm(batches, total=steps_per_epoch, desc=f"epoch {epoch + 1}/{epochs}",
                   file=sys.stderr) if bars else batches
        for idx in bar:
            if compress and not compressed and global_step == switch_step:
                params, pattern, base_state = pruning.to_compressed(params, pruning.masks_of(opt_state), spec,
                                                                    opt_state[0], diagonal_fn=diagonal_fn,
                                                                    diagonal_chunks=diagonal_chunks)
                opt_state, extra, compressed = base_state, {"sparsity": pattern}, True
                step_extra = placed({**extra, **teacher_extra})
                model = make_model(True)
                step = cache.get("step", (model, base_key, False, mesh, kd, hidden, attention, augment),
                                 lambda: make_step(model, base, False, mesh, distill=kd[0], temperature=kd[1], **hd))
                logits_fn = cache.get("logits", (model,), lambda: make_logits(model))
            drop_key, k_drop = jax.random.split(drop_key)
            params, opt_state, loss = step(params, opt_state, step_extra, batch_of(idx), k_drop)
            losses.append(loss)
            global_step += 1
            if average_start is not None and global_step > average_start:
                n_mean = global_step - average_start
                mean_params = params if n_mean == 1 else running_mean(mean_params, params, jnp.float32(n_mean))
            # Learned masks: the final pattern's first masks, and its final ones (fixed from final_step on).
            if regrow and global_step == prune.schedule.stage_steps[-1] + 1:
                first_masks = jax.device_get(pruning.masks_of(opt_state))
            if regrow and global_step == prune.final_step + 1:
                final_masks = jax.device_get(pruning.masks_of(opt_state))
            if on_step is not None:
                on_step(global_step, loss)
            elif global_step % 10 == 0 and bars:
                bar.set_postfix(loss=f"{float(np.mean(jax.device_get(losses[-10:]))):.3f}")
        train_loss = float(np.mean(jax.device_get(losses))) if losses else float("nan")
        dev_metrics = evaluate_dev(logits_fn, variables_now())
        history.append({"epoch": epoch + 1, "train_loss": train_loss, "first_loss": float(losses[0]),
                        "dev_accuracy": dev_metrics["accuracy"], "dev_loss": dev_metrics["loss"],
                        "seconds": time.time() - t0})
        log(f"epoch {epoch + 1}: train loss {train_loss:.4f}  dev acc {dev_metrics['accuracy']:.4f}  "
            f"({time.time() - t0:.0f} s)")

    test_metrics = evaluate_test(logits_fn, variables_now())
    final = variables_now()
    averaged = {}
    if average_start is not None:  # the averaged model is the run's result; the last step's stays beside it
        final = variables_of(mean_params)
        dev_last, test_last = history[-1]["dev_accuracy"], test_metrics
        dev_avg, test_metrics = evaluate_dev(logits_fn, final), evaluate_test(logits_fn, final)
        averaged = {"average_from": average_from, "average_start_step": average_start,
                    "averaged_steps": global_step - average_start, "dev_accuracy": dev_avg["accuracy"],
                    "last_dev_accuracy": dev_last, "last_test_accuracy": test_last["accuracy"],
                    "last_test_loss": test_last["loss"]}
        log(f"averaged params of steps {average_start + 1}-{global_step}: dev acc {dev_avg['accuracy']:.4f} "
            f"(last step {dev_last:.4f})")
    if prune is not None and not compressed:
        achieved = pruning.sparsity_of(params, pruning.masks_of(opt_state))
    elif compressed:  # a values array [R, 2K/M] stands for a dense [K, R] kernel
        vals = [np.asarray(v) for p, v in _flat(params) if p[-1] == "values"]
        achieved = 1.0 - sum(np.count_nonzero(v) for v in vals) / sum(v.size * spec.m / 2 for v in vals)
    else:
        achieved = 0.0
    metrics = {
        "model": args.model, "task": args.task, "sparsity": args.sparsity, "prune": args.prune,
        "ladder": [str(s) for s in prune.schedule.ladder] if prune is not None else [],
        "stage_steps": list(prune.schedule.stage_steps) if prune is not None else [],
        "compressed_training": compressed, "seed": args.seed, "epochs": epochs,
        "batch_size": args.batch_size, "lr": peak_lr, "max_len": args.max_len, "dtype": args.dtype,
        "dropout": cfg.hidden_dropout_prob, "dropout_impl": cfg.dropout_impl,
        "distill": distill, "temperature": temperature if distill > 0 else None,
        "distill_hidden": hidden,
        "distill_attention": attention, "distill_augment": augment, "augment_neighbors": n_neighbors,
        "refit": refit, "refit_batches": n_cal if refit else None,
        "refit_selection": getattr(args, "refit_selection", "score") if refit else None,
        **({"regrow_every": regrow_every, "regrow_until": regrow["regrow_until"],
            "regrow_decay": regrow["regrow_decay"], "regrow_mask_change": pruning.mask_change(first_masks, final_masks)}
           if regrow else {}),
        **({"transposable_masks": True, "dx_route": ops.dx_route()} if transposable else {}),
        **({"exclusive_columns": True} if exclusive else {}),
        **({"diagonal_all": True} if diagonal_all else {"diagonal_ffn": True} if diagonal_ffn
           else {"diagonal_ffn_out": True} if diagonal else {}),
        **({"diagonal_attention": True} if diagonal_attention else {}),
        "train_examples": len(train), "dev_examples": len(dev), "test_examples": len(test), "steps": global_step,
        "history": history, "dev_accuracy": history[-1]["dev_accuracy"], "test_accuracy": test_metrics["accuracy"],
        "test_loss": test_metrics["loss"], **averaged, "weight_sparsity": achieved,
        "device": str(jax.devices()[0].device_kind), "devices": n_dev, "processes": jax.process_count(),
        "seconds": time.time() - t_start,
    }
    return metrics, final


def predict_logits(cfg: bert.BertConfig, variables: dict, batch: data_lib.Batch, num_labels: int, dtype,
                   batch_size: int = 64, sparsity: str | None = None) -> np.ndarray:
    """Float32 logits ``[len(batch), num_labels]`` of a classifier, in example order, no dropout.

    ``variables`` are a master-mode model's (dense kernels, with or without masks in ``"sparsity"``), or, with
    ``sparsity`` (the pattern, e.g. ``"2:4"``), a compressed model's (``values`` in place of the sparse kernels, as
    ``jaxsparse-train`` checkpoints a run that trained the compressed values). Raises ``ValueError`` for
    compressed variables without ``sparsity``.
    """
    compressed = any(path[-1] == "values" for path, _ in _flat(variables["params"]))
    if compressed and sparsity is None:
        raise ValueError("predict_logits: these params are compressed (`values` in place of the sparse kernels): "
                         "give their pattern as sparsity=")
    if compressed and fmt.VNM.parse(sparsity).m > 4 and not (cfg.diagonal_ffn_out or cfg.diagonal_all
                                                             or cfg.diagonal_ffn):
        pattern = dict(_flat(variables.get("sparsity", {})))
        # Layers stored as diagonal 2:4 blocks carry chunk tables (--diagonal-all in every kernel, --diagonal-ffn in
        # the FFN's), or, in FFN out alone (--diagonal-ffn-out), no column sets.
        ffn_out = [p for p, m in pattern.items()
                   if p[-1] == "metadata" and pruning.ffn_out_kernels(p[:-1] + ("kernel",), m)]
        chunked = [p[:-1] for p in pattern if p[-1] == "chunks"]
        if any(not pruning.ffn_kernels(p + ("kernel",), pattern[p + ("metadata",)]) for p in chunked):
            cfg = dataclasses.replace(cfg, diagonal_all=True)
        elif chunked:
            cfg = dataclasses.replace(cfg, diagonal_ffn=True)
        elif ffn_out and not any(p[:-1] + ("columns",) in pattern for p in ffn_out):
            cfg = dataclasses.replace(cfg, diagonal_ffn_out=True)
    model = bert.BertForSequenceClassification(cfg, sparsity=sparsity if compressed else None, compressed=compressed,
                                               dtype=jnp.dtype(dtype), num_labels=num_labels)
    apply = jax.jit(lambda v, *a: model.apply(v, *a).astype(jnp.float32))
    n = len(batch)
    out = []
    for lo in range(0, n, batch_size):
        idx = np.arange(lo, min(lo + batch_size, n))
        pad = np.concatenate([idx, np.full(batch_size - len(idx), idx[-1])])  # one compiled shape
        out.append(np.asarray(apply(variables, *_arrays(batch, pad)[:3]))[: len(idx)])
    return np.concatenate(out)


def student_dropout_config(cfg: bert.BertConfig, rate: float) -> bert.BertConfig:
    """``cfg`` with dropout ``rate`` on the hidden states, and on the attention probabilities where ``cfg`` has
    dropout there (the fused attention has none)."""
    return dataclasses.replace(cfg, hidden_dropout_prob=rate,
                               attention_probs_dropout_prob=rate if cfg.attention_probs_dropout_prob else 0.0)


def teacher_args(args: argparse.Namespace) -> argparse.Namespace:
    """The dense teacher's run: ``args`` with no sparsity, no pruning, no distillation."""
    return argparse.Namespace(**{**vars(args), "sparsity": "dense", "prune": "none", "distill": 0.0, "distill_hidden": 0.0,
                                 "distill_attention": 0.0, "distill_augment": 0.0, "augment_neighbors": 0, "student_epochs": 0, "student_lr": 0.0, "student_dropout": -1.0, "ladder": None,
                                 "init": "pretrained", "regrow_every": 0, "regrow_decay": 0.0})


def fit_teacher(args: argparse.Namespace, data: TaskTokens, cfg: bert.BertConfig, pretrained: dict | None,
                **fit_kwargs) -> tuple[np.ndarray, dict, dict]:
    """Fine-tune the dense teacher of ``args`` (:func:`teacher_args`); returns its training-set logits, its
    metrics and its params."""
    metrics, variables = fit(teacher_args(args), data, cfg, pretrained, **fit_kwargs)
    logits = predict_logits(cfg, variables, data.train, data.task.num_labels, metrics["dtype"], args.batch_size)
    return logits, metrics, variables["params"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train and evaluate as ``args`` says; returns the metrics that are also written to ``metrics.json``.

    With ``--transposable-masks`` the input gradient takes the ``"transposed"`` route for this run (``JAXSPARSE_DX``
    is set while it runs, unless it is set already: the route is read when the sparse layers are traced)."""
    with ops.dx_route_scope("transposed" if getattr(args, "transposable_masks", False) else None, keep_set=True):
        return _run(args)


def resolve_dtype(args: argparse.Namespace) -> str:
    """``args.dtype``, with ``"auto"`` replaced (in ``args`` too) by ``"bfloat16"`` where JAX's default backend is a
    GPU and ``"float32"`` elsewhere."""
    if args.dtype == "auto":
        args.dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    return args.dtype


def _run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.time()
    devices = getattr(args, "devices", 1)
    if devices != "all" and devices > jax.local_device_count():  # said before any data is read
        raise ValueError(f"--devices {devices}: this process has {jax.local_device_count()} local device(s)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = load_data(args.task, args.max_train, args.max_eval, args.max_len)
    cfg, pretrained = load_model(args.model)
    teacher = teacher_params = None
    init = getattr(args, "init", "pretrained")
    if (args.distill > 0 or teacher_in_step(args) or init == "teacher") and args.sparsity != "dense":
        hidden, attention, _ = in_step_distillation(args)
        _stderr(f"--distill {args.distill} --distill-hidden {hidden} --distill-attention {attention} --init {init}: "
                "fine-tuning the dense teacher first")
        teacher, teacher_metrics, teacher_params = fit_teacher(args, data, cfg, pretrained)
        _stderr(f"teacher: dev acc {teacher_metrics['dev_accuracy']:.4f}, test acc {teacher_metrics['test_accuracy']:.4f}")
    metrics, final = fit(args, data, cfg, pretrained, teacher_logits=teacher if args.distill > 0 else None,
                         init_params=teacher_params if init == "teacher" else None,
                         teacher_params=teacher_params if teacher_in_step(args) else None)
    metrics["init"] = init
    if teacher is not None:
        metrics["teacher"] = {k: teacher_metrics[k] for k in ("dev_accuracy", "test_accuracy", "steps", "lr", "dropout",
                                                                  "dropout_impl")}
    metrics["seconds"] = time.time() - t_start
    save_checkpoint(out / "checkpoint", final)  # every process takes part; process 0 writes it
    if jax.process_index() != 0:
        return metrics
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"jaxsparse-train: {args.model} {args.task} {args.sparsity} ({args.prune}) | "
          f"dev acc {metrics['dev_accuracy']:.4f} | test acc {metrics['test_accuracy']:.4f} | "
          f"sparsity {metrics['weight_sparsity']:.3f} | {metrics['steps']} steps | {metrics['seconds']:.0f} s | {out}")
    return metrics


def _flat(tree: dict):
    from flax import traverse_util

    return traverse_util.flatten_dict(dict(tree)).items()


def save_checkpoint(path: Path, variables: dict) -> None:
    """Save ``{"params": ..., "sparsity": ...}`` with orbax (overwrites ``path``)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if path.exists() and jax.process_index() == 0:
        import shutil

        shutil.rmtree(path)
    if jax.process_count() > 1:  # several processes (--coordinator) save together, once process 0 has cleared path
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"jaxsparse save_checkpoint {path}")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, jax.device_get(variables))


def load_checkpoint(path: str | Path) -> dict:
    """Restore what :func:`save_checkpoint` wrote (as numpy arrays)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(Path(path).absolute())


def init_distributed(args: argparse.Namespace) -> None:
    """``jax.distributed.initialize`` for ``--coordinator`` (nothing without it); on a CPU the processes' collectives
    run on gloo. Call it before anything else touches JAX's devices."""
    if getattr(args, "coordinator", None) is None:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``jaxsparse-train``."""
    args = parse_args(argv)
    init_distributed(args)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
