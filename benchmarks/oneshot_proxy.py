"""How well one-shot masks preserve the pretrained MiniLM: magnitude against activation-weighted scores.

A cheap, CPU-sized proxy for the accuracy study (issue 5): the encoder's linear kernels of pretrained
all-MiniLM-L6-v2 are pruned once to each pattern, and the pruned model's token states and mean-pooled
sentence embeddings are compared with the dense model's on held-out Rotten Tomatoes sentences. Two
selection scores feed ``jaxsparse.format.select_mask``:

* ``magnitude``: ``|W|`` (what ``gmp_prune`` uses);
* ``activation``: ``|W_jr| * ||X_j||``, each input feature's weight scaled by the norm of that feature
  over calibration tokens (the score of Wanda, Sun et al. 2023): for V:2:M this changes which 4 columns
  a block keeps, the step that loses most (``benchmarks/mask_energy.py``).

With ``--permute``, each V:N:M pattern is also run after ``jaxsparse.permute.search_permutations``
reorders the FFN units and attention dimensions of every layer (function-preserving: the dense model's
states are unchanged) for that pattern and score (the activation score's permutations are searched on
``|W_jr| * ||X_j||``, then the input norms are measured again on the permuted model). Those rows carry
``"permuted": true``.

Second-order criteria (``jaxsparse.obs``), from each kernel's input second moment ``H = X^T X / n`` over
the calibration tokens (padding excluded), damped by ``--damp * mean(diag H)``:

* ``obs``: the OBS saliency ``W_jr^2 / [H^-1]_jj`` as the ``select_mask`` score;
* ``sparsegpt``: ``jaxsparse.obs.sparsegpt_mask``, the mask chosen one input group at a time on the weights that the
  OBS updates of the groups before it left (SparseGPT's order); its rows without refit keep the original weights;
* ``--refit``: after a layer's mask is chosen, its kept weights are re-solved by least squares
  (``jaxsparse.obs.refit``: per output row, ``w_S = H_SS^-1 H_S: w``; biases are left as they are).
  Refit rows are **sequential** (``jaxsparse.obs.oneshot_refit``, which ``jaxsparse-train --refit`` uses too):
  the kernels are processed in forward order (layer by layer; inside a
  layer Q/K/V together, then the attention output, ``intermediate``, ``output``), and each one's ``H`` is
  measured on the model whose earlier kernels are already pruned and refit, so later layers are fit to
  the inputs they will see; the mask score of that row uses the same ``H`` (activation:
  ``|W_jr| * sqrt(H_jj)``). Rows without refit measure everything on the dense model.
  ``--refit-independent`` adds refit rows whose ``H`` (mask and refit) all come from the dense model.

Calibration and evaluation use disjoint sentences. Writes ``benchmarks/results/cpu/oneshot_proxy.json``.

    python benchmarks/oneshot_proxy.py [--calibration 256 --evaluation 256] [--permute --patterns 64:2:8]
    python benchmarks/oneshot_proxy.py --criteria activation,obs --refit --out benchmarks/results/cpu/oneshot_proxy_obs.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from jaxsparse import format as F
from jaxsparse import obs, permute, pruning, train
from jaxsparse.models import bert
from jaxsparse.nn import NMDense

PATTERNS = ["2:4", "64:2:8", "128:2:16"]
CRITERIA = list(obs.CRITERIA)


def input_sq(model: bert.BertModel, params: dict, batch: tuple) -> dict:
    """Params-shaped tree of each sparse kernel's input sums of squares over the unpadded tokens."""
    ids, types, mask = batch
    weight = mask[..., None].astype(jnp.float32)
    sums: dict[tuple, jax.Array] = {}

    def record(next_fun, args, kwargs, context):
        if isinstance(context.module, NMDense) and context.method_name == "__call__":
            x = args[0].astype(jnp.float32)
            sums[context.module.path + ("sq",)] = sums.get(context.module.path + ("sq",), 0.0) + jnp.sum(
                x * x * weight, axis=(0, 1))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        model.apply({"params": params}, ids, types, mask)
    return pruning.input_norms_tree(traverse_util.unflatten_dict(sums), params)


def second_order_prune(model, params, pattern, criterion, calib, damp, refit, sequential, transposable=False):
    """Masks (params-shaped, None off the encoder kernels) and params for one criterion, optionally refit:
    :func:`jaxsparse.obs.oneshot_refit` on the one calibration batch ``calib`` (``sequential``: each
    stage's ``H`` is measured on the model pruned and refit so far; else all ``H`` come from the dense model)."""
    return obs.oneshot_refit(model, params, [calib], pattern, criterion, damp=damp, refit=refit,
                             sequential=sequential, transposable=transposable)


def compare(model, params, masks, batch, dense_h) -> dict[str, float]:
    ids, types, mask = batch
    variables = pruning.model_variables(params, masks=masks)
    h, _ = jax.jit(lambda v: model.apply(v, ids, types, mask))(variables)
    m = mask[..., None].astype(jnp.float32)
    rel = float(jnp.sqrt(jnp.sum(((h - dense_h) * m) ** 2) / jnp.sum((dense_h * m) ** 2)))
    e, d = bert.mean_pool(h, mask), bert.mean_pool(dense_h, mask)
    cos = jnp.sum(e * d, -1) / (jnp.linalg.norm(e, axis=-1) * jnp.linalg.norm(d, axis=-1))
    return {"token_state_rel_error": rel, "embedding_cosine_mean": float(cos.mean()), "embedding_cosine_min": float(cos.min())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=int, default=256, help="sentences for the input norms")
    parser.add_argument("--evaluation", type=int, default=256, help="held-out sentences compared with dense")
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--patterns", default=",".join(PATTERNS))
    parser.add_argument("--permute", action="store_true",
                        help="also prune after searched channel permutations (V:N:M patterns with V > 1)")
    parser.add_argument("--permute-iters", type=int, default=30, help="search_permutations iters")
    parser.add_argument("--criteria", default=",".join(CRITERIA), help=f"subset of {CRITERIA}")
    parser.add_argument("--refit", action="store_true",
                        help="also rows with least-squares refit of the kept weights (sequential, see above)")
    parser.add_argument("--refit-independent", action="store_true",
                        help="also refit rows with every H from the dense model (layer-independent)")
    parser.add_argument("--damp", type=float, default=0.01, help="relative Hessian damping for obs and refit")
    parser.add_argument("--transposable", action="store_true",
                        help="transposable masks (select_mask's option, as --transposable-masks trains with)")
    parser.add_argument("--out", default="benchmarks/results/cpu/oneshot_proxy.json")
    args = parser.parse_args()
    t0 = time.time()
    cfg, params = bert.load_minilm()
    data = train.load_data("rt", args.calibration + args.evaluation, 16, args.max_len).train
    arrays = (data.input_ids, data.token_type_ids, data.attention_mask)
    calib = tuple(jnp.asarray(a[: args.calibration]) for a in arrays)
    evalb = tuple(jnp.asarray(a[args.calibration:]) for a in arrays)
    model = bert.BertModel(cfg, add_pooler=False)
    sq = input_sq(model, params, calib)
    dense_h, _ = jax.jit(lambda p: model.apply({"params": p}, *evalb))(params)
    rows = []
    print(f"{'pattern':>9} {'criterion':>10} {'token-state rel. error':>23} {'embedding cos (mean, min)':>27}")
    heads = cfg.num_attention_heads
    criteria = args.criteria.split(",")
    for c in criteria:
        if c not in CRITERIA:
            raise SystemExit(f"--criteria: {c!r} is not one of {CRITERIA}")
    refit_modes = ([("sequential", True)] if args.refit else []) + ([("dense", False)] if args.refit_independent else [])
    for pattern in args.patterns.split(","):
        for criterion in criteria:
            variants = [False] + ([True] if args.permute and F.VNM.parse(pattern).v > 1 else [])
            for permuted in variants:
                p, q, extra = params, sq, {}
                if permuted:
                    score = None
                    if criterion == "activation":  # |W_jr| * ||X_j|| at every encoder kernel
                        score = jax.tree_util.tree_map(lambda w, s: None if s is None else jnp.abs(w) * jnp.sqrt(s)[:, None],
                                                       params, sq, is_leaf=lambda x: x is None)
                        score = jax.tree_util.tree_map(lambda w, s: w if s is None else s, params, score,
                                                       is_leaf=lambda x: x is None)
                    t1 = time.time()
                    perms = permute.search_permutations(params, pattern, num_heads=heads, score=score,
                                                        iters=args.permute_iters)
                    extra = {"permute_seconds": time.time() - t1}
                    p = jax.tree_util.tree_map(jnp.asarray, permute.apply_permutations(params, perms, num_heads=heads))
                    q = input_sq(model, p, calib)
                    same, _ = jax.jit(lambda v: model.apply({"params": v}, *evalb))(p)
                    extra["dense_max_abs_change"] = float(jnp.abs(same - dense_h).max())
                if criterion in ("obs", "sparsegpt"):
                    _, masks = second_order_prune(model, p, pattern, criterion, calib, args.damp, False, False,
                                                  args.transposable)
                    extra["damp"] = args.damp
                else:
                    masks = pruning.oneshot_masks(p, pattern, input_sq=q if criterion == "activation" else None,
                                                  transposable=args.transposable)
                assert all(F.check_mask(m, pattern) for m in jax.tree_util.tree_leaves(masks))
                r = {"pattern": pattern, "criterion": criterion, "permuted": permuted, "refit": False,
                     **compare(model, p, masks, evalb, dense_h), **extra}
                rows.append(r)
                print(f"{pattern:>9} {criterion + ('+perm' if permuted else ''):>15} {r['token_state_rel_error']:18.4f} "
                      f"{r['embedding_cosine_mean']:14.4f} ({r['embedding_cosine_min']:.4f})", flush=True)
            for mode, sequential in refit_modes:
                t1 = time.time()
                p, masks = second_order_prune(model, params, pattern, criterion, calib, args.damp, True, sequential,
                                              args.transposable)
                assert all(F.check_mask(m, pattern) for m in jax.tree_util.tree_leaves(masks))
                r = {"pattern": pattern, "criterion": criterion, "permuted": False, "refit": True, "hessian": mode,
                     "damp": args.damp, **compare(model, p, masks, evalb, dense_h), "seconds": time.time() - t1}
                rows.append(r)
                print(f"{pattern:>9} {criterion + '+refit(' + mode + ')':>15} {r['token_state_rel_error']:18.4f} "
                      f"{r['embedding_cosine_mean']:14.4f} ({r['embedding_cosine_min']:.4f})", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(jax=jax.__version__, python=platform.python_version(), model="all-MiniLM-L6-v2",
                                   calibration_sentences=args.calibration, evaluation_sentences=len(evalb[0]),
                                   max_len=args.max_len, criteria=criteria, damp=args.damp, transposable=args.transposable,
                                   permute_iters=args.permute_iters if args.permute else None, rows=rows, seconds=time.time() - t0), indent=1))
    print(f"wrote {out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
