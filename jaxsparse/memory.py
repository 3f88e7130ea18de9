"""Training-state bytes per parameter, measured from the pytrees, against SAMO's formula.

The state of one training step is what lives across steps plus the gradient: float32 master weights
(the ``params`` tree), the gradient tree (``jax.grad`` of the loss, float32 like the params), the
optax AdamW state (``mu``, ``nu``, the count) and, for sparse layers, the integer pattern (compressed
mode: the ``"sparsity"`` collection's ``metadata`` and ``columns``; masked-dense: the bool masks in the
``gmp_prune`` state). Every number is a sum of leaf ``nbytes`` of those trees (with ``abstract=True``
the trees come from ``jax.eval_shape`` and a leaf's bytes are ``size * itemsize``: the same count without
allocating). The bf16 compute copy of the weights is transient inside the step; it is reported in its own
column (``compute_copy``, 2 bytes per stored weight in bf16) so the totals compare with SAMO's.

Bytes are divided by the *dense* parameter count of the same layers (``K * R`` for a kernel), so a
compressed layer's figure is comparable with the dense one: SAMO's mixed-precision Adam is 20 bytes per
parameter dense and ``24 (1 - p) + 2`` compressed at sparsity ``p``.

Run ``python -m jaxsparse.memory --model base`` for the table.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxsparse import format as fmt
from jaxsparse import pruning
from jaxsparse.models import bert
from jaxsparse.trainstep import adamw, sparse_mode

__all__ = ["LAYER_TYPES", "SPARSE_TYPES", "layer_type", "leaf_nbytes", "samo_bytes_per_param", "training_state",
           "memory_report", "format_report", "main"]

LAYER_TYPES = ("attention.qkv", "attention.output", "ffn.intermediate", "ffn.output", "embeddings", "norms",
               "head", "scalars")
SPARSE_TYPES = ("attention.qkv", "attention.output", "ffn.intermediate", "ffn.output")
"""The encoder projections: the layers that are pruned."""

COMPONENTS = ("weights", "grads", "optimizer", "pattern")


def layer_type(path: Sequence[str]) -> str:
    """The layer type of a leaf from its path names (params, gradient, optimizer state or pattern)."""
    names = [str(p) for p in path]
    if any("LayerNorm" in n for n in names):
        return "norms"
    if any(n.startswith("embeddings") for n in names):
        return "embeddings"
    if any(n in ("classifier", "pooler") for n in names):
        return "head"
    for i, n in enumerate(names):
        if n == "attention" and i + 1 < len(names):
            return "attention.qkv" if names[i + 1] in ("query", "key", "value") else "attention.output"
        if n == "intermediate":
            return "ffn.intermediate"
        if n == "output" and i > 0 and names[i - 1].startswith("encoder_layer"):
            return "ffn.output"
    return "scalars"


def leaf_nbytes(x: Any) -> int:
    """Bytes of an array leaf (``nbytes``), or ``size * itemsize`` of an abstract ``ShapeDtypeStruct``."""
    if hasattr(x, "nbytes"):
        return int(x.nbytes)
    return int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize


def samo_bytes_per_param(sparsity: float) -> float:
    """SAMO's training-state bytes per dense parameter: 20 dense, ``24 (1 - p) + 2`` compressed."""
    return 20.0 if sparsity == 0 else 24.0 * (1.0 - sparsity) + 2.0


def _tally(tree: Any, component: str, out: dict) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = pruning._path_names(path)  # noqa: SLF001 - the shared path naming of the library
        t = layer_type(names)
        out.setdefault(t, dict.fromkeys(COMPONENTS + ("compute_copy",), 0))
        out[t][component] += leaf_nbytes(leaf)


def _dense_counts(params: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        t = layer_type(pruning._path_names(path))  # noqa: SLF001
        counts[t] = counts.get(t, 0) + int(np.prod(leaf.shape))
    return counts


def training_state(model: str = "tiny", sparsity: str = "dense", *, compressed: bool | None = True,
                   abstract: bool = False, compute_dtype: str = "bfloat16", seq_len: int = 8) -> dict:
    """Measured bytes of the training state of a BERT preset, per layer type and component.

    Args:
      model: a BERT preset.
      sparsity: ``"dense"`` or a pattern of the encoder projections.
      compressed: True = compressed mode (``ValueError`` when the shapes forbid it), False = masked
        dense (dense kernels, masks in the ``gmp_prune`` state), None = compressed where possible.
      abstract: build the trees with ``jax.eval_shape`` (no allocation; for base/large on a laptop).
      compute_dtype: the dtype of the transient weight copy (``compute_copy`` column).
      seq_len: tokens of the dummy batch used to take the gradient.

    Returns:
      ``{"mode", "types": {type: {weights, grads, optimizer, pattern, compute_copy, dense_params}}}``.
    """
    cfg = bert.BertConfig.preset(model)
    mode, reason = sparse_mode(cfg, sparsity, compressed)
    make = lambda c: bert.BertForSequenceClassification(  # noqa: E731
        cfg, sparsity=None if mode == "dense" else sparsity, compressed=c, dtype=jnp.dtype(compute_dtype))
    ids = jnp.ones((1, seq_len), jnp.int32)
    labels = jnp.zeros((1,), jnp.int32)
    run = jax.eval_shape if abstract else (lambda f, *a: jax.jit(f)(*a))
    dense_params = run(lambda k: make(False).init(k, ids)["params"], jax.random.key(0))
    pattern: Any = {}
    if mode == "compressed":
        variables = run(lambda k: make(True).init(k, ids), jax.random.key(0))
        params, pattern = variables["params"], variables[pruning.SPARSITY]
        tx: optax.GradientTransformation = adamw()
        model_obj = make(True)
    elif mode == "masked":
        params, model_obj = dense_params, make(False)
        tx = optax.chain(adamw(), pruning.gmp_prune([sparsity], 0, 0))
    else:
        params, model_obj, tx = dense_params, make(False), adamw()
    opt_state = run(tx.init, params)

    def grad_fn(p, opt_state, pattern):
        variables = pruning.model_variables(p, opt_state) if mode == "masked" else {"params": p}
        if mode == "compressed":
            variables[pruning.SPARSITY] = pattern
        variables = {k: v for k, v in variables.items() if k != "params"}

        def loss(p):
            logits = model_obj.apply({**variables, "params": p}, ids)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        return jax.grad(loss)(p)

    grads = run(grad_fn, params, opt_state, pattern)
    types: dict[str, dict] = {}
    _tally(params, "weights", types)
    _tally(grads, "grads", types)
    if mode == "masked":  # the masks sit in the gmp_prune state: count them as the pattern
        _tally(opt_state[0], "optimizer", types)
        _tally(pruning.find_state(opt_state).masks, "pattern", types)
        _tally((pruning.find_state(opt_state).count, pruning.find_state(opt_state).stage), "optimizer", types)
    else:
        _tally(opt_state, "optimizer", types)
    _tally(pattern, "pattern", types)
    copy = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(compute_dtype)), params)
    _tally(copy, "compute_copy", types)
    for t, n in _dense_counts(dense_params).items():
        types.setdefault(t, dict.fromkeys(COMPONENTS + ("compute_copy",), 0))["dense_params"] = n
    for t in types:
        types[t].setdefault("dense_params", 0)
    return {"model": model, "sparsity": sparsity, "mode": mode, "mode_reason": reason, "types": types}


def _group(types: dict, names: Sequence[str]) -> dict:
    keys = COMPONENTS + ("compute_copy", "dense_params")
    return {k: sum(types[t][k] for t in names if t in types) for k in keys}


def _per_param(g: dict, sparsity: float) -> dict:
    n = g["dense_params"]
    state = sum(g[c] for c in COMPONENTS)
    return {"bytes": state, "dense_params": n, "bytes_per_param": state / n if n else float("nan"),
            "bytes_per_param_with_copy": (state + g["compute_copy"]) / n if n else float("nan"),
            "samo_bytes_per_param": samo_bytes_per_param(sparsity),
            **{f"{c}_bytes": g[c] for c in COMPONENTS + ("compute_copy",)}}


def memory_report(model: str = "tiny", sparsities: Sequence[str] = ("dense", "2:4", "64:2:8", "128:2:16", "128:2:32"),
                  *, abstract: bool = False, masked: bool = False) -> dict:
    """Training-state bytes for dense and each sparsity (compressed where the shapes allow it).

    Returns ``{"model", "rows": [...]}``; each row has the mode, per-layer-type figures, the sparse
    layers together (``sparse_layers``) and the whole model (``model``), each with ``bytes``,
    ``bytes_per_param`` (per dense parameter), ``bytes_per_param_with_copy`` (with the bf16 compute
    copy), SAMO's figure, and the fraction of the dense run's bytes (``fraction_of_dense``).
    """
    rows = []
    for s in sparsities:
        modes = [None] + ([False] if masked and s != "dense" else [])
        for c in modes:
            st = training_state(model, s, compressed=c, abstract=abstract)
            if c is False and rows and rows[-1]["sparsity"] == s and rows[-1]["mode"] == "masked":
                continue  # the format already forced masked-dense for this sparsity
            p = 0.0 if s == "dense" else 1.0 - fmt.VNM.parse(s).density
            row = {"sparsity": s, "mode": st["mode"], "mode_reason": st["mode_reason"],
                   "types": {t: _per_param(v, p if t in SPARSE_TYPES else 0.0) for t, v in st["types"].items()},
                   "sparse_layers": _per_param(_group(st["types"], SPARSE_TYPES), p),
                   "model": _per_param(_group(st["types"], list(st["types"])), p)}
            rows.append(row)
    dense = next((r for r in rows if r["sparsity"] == "dense"), None)
    if dense is not None:
        for r in rows:
            for key in ("sparse_layers", "model"):
                r[key]["fraction_of_dense"] = r[key]["bytes"] / dense[key]["bytes"]
            for t, v in r["types"].items():
                d = dense["types"].get(t)
                v["fraction_of_dense"] = v["bytes"] / d["bytes"] if d and d["bytes"] else float("nan")
    return {"model": model, "abstract": abstract, "rows": rows}


def format_report(rep: dict) -> str:
    """The printed table: sparse layers, whole model, and bytes/param per layer type."""
    out = [f"training state of BERT-{rep['model']}: f32 master weights + f32 grads + AdamW mu/nu (+ pattern); "
           "bytes per dense parameter (B/p), measured from the pytrees' leaves",
           f"{'sparsity':<9} {'mode':<10} {'sparse B/p':>10} {'+bf16 copy':>10} {'SAMO':>6} {'of dense':>8} "
           f"{'model B/p':>9} {'model MiB':>9} {'of dense':>8}"]
    for r in rep["rows"]:
        s, m = r["sparse_layers"], r["model"]
        out.append(f"{r['sparsity']:<9} {r['mode']:<10} {s['bytes_per_param']:10.2f} {s['bytes_per_param_with_copy']:10.2f} "
                   f"{s['samo_bytes_per_param']:6.1f} {100 * s.get('fraction_of_dense', float('nan')):7.1f}% "
                   f"{m['bytes_per_param']:9.2f} {m['bytes'] / 2**20:9.1f} {100 * m.get('fraction_of_dense', float('nan')):7.1f}%")
    types = [t for t in LAYER_TYPES if t in rep["rows"][0]["types"]]
    out.append("bytes per dense parameter by layer type:")
    out.append(f"{'sparsity':<9} {'mode':<10} " + " ".join(f"{t:>16}" for t in types))
    for r in rep["rows"]:
        cells = []
        for t in types:
            v = r["types"].get(t)
            cells.append(f"{v['bytes_per_param']:16.2f}" if v and v["dense_params"] else f"{'-':>16}")
        out.append(f"{r['sparsity']:<9} {r['mode']:<10} " + " ".join(cells))
    for r in rep["rows"]:
        if r["mode"] == "masked" and r["mode_reason"] != "asked for masked-dense":
            out.append(f"note: {r['sparsity']} runs masked-dense (the compressed format cannot take it): {r['mode_reason']}")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jaxsparse.memory``: print the table (and write JSON with ``--json``)."""
    import json

    p = argparse.ArgumentParser(prog="python -m jaxsparse.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", choices=tuple(bert.PRESETS))
    p.add_argument("--sparsities", default="dense,2:4,64:2:8,128:2:16,128:2:32")
    p.add_argument("--masked", action="store_true", help="also the masked-dense mode of each sparsity")
    p.add_argument("--concrete", action="store_true", help="allocate the trees (default: jax.eval_shape)")
    p.add_argument("--json", default=None, metavar="PATH")
    a = p.parse_args(argv)
    rep = memory_report(a.model, a.sparsities.split(","), abstract=not a.concrete, masked=a.masked)
    print(format_report(rep))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
