"""Function-preserving channel permutations of a BERT encoder, chosen to help the V:N:M mask.

A V:2:M mask makes ``V`` consecutive output features of a kernel share 4 of every ``M`` consecutive input
features (``docs/format.md``). Which features end up side by side is an accident of training, but BERT
has exact reparametrisations that reorder them at no runtime cost:

* **FFN.** One permutation ``P`` of the intermediate dimension, applied to the output columns (and the
  bias) of ``intermediate`` and to the input rows of ``output``. It decides jointly which ``V`` units
  form a row block of the first FFN kernel and which ``M`` units form an input group of the second.
* **Attention.** One permutation of the hidden dimension that maps every head onto a head (a
  permutation of whole heads, composed with a permutation of the dimensions inside each head), applied
  to the output columns and biases of ``query``, ``key`` and ``value`` and to the input rows of the
  attention ``output`` kernel. ``q . k`` sums over the head's dimensions in any order, so scores are
  unchanged; the context vectors come out permuted as ``value`` is, and ``output`` reads them so. Whole
  heads moving decides which heads share a row block of Q/K/V (two heads of 32 per block at ``V = 64``);
  dimensions moving inside a head decides the input groups of ``output``.

:func:`search_permutations` chooses them by local search on the exact objective of
``jaxsparse.format.select_mask``: for every ``V x M`` block, the best of the ``C(M, 4)`` column sets
keeping each row's top ``N`` of those 4, summed over blocks. :func:`apply_permutations` applies them.

Example::

    perms = search_permutations(params, "64:2:8", num_heads=cfg.num_attention_heads)
    params = apply_permutations(params, perms, num_heads=cfg.num_attention_heads)   # same function
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Mapping, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import format as fmt

__all__ = [
    "LayerPermutation",
    "Permutations",
    "encoder_layer_names",
    "identity_permutations",
    "apply_permutations",
    "permutation_objective",
    "search_permutations",
]

_ATTN = ("query", "key", "value")


@dataclasses.dataclass(frozen=True)
class LayerPermutation:
    """The permutations of one encoder layer; new position ``p`` holds original index ``perm[p]``.

    Attributes:
      ffn: ``[intermediate_size]`` permutation of the FFN's intermediate units.
      attention: ``[hidden_size]`` permutation of the attention's inner dimension (Q/K/V outputs, attention
        output inputs); it must map each head's ``hidden_size / num_heads`` consecutive dimensions onto
        one head's.
    """

    ffn: np.ndarray
    attention: np.ndarray


Permutations = dict[str, LayerPermutation]
"""Encoder layer name (``"encoder_layer_0"``, ...) -> its :class:`LayerPermutation`."""


# ----------------------------------------------------------------------------- the param tree


def _layers_root(params: Mapping) -> tuple[tuple[str, ...], Mapping]:
    """``(prefix, subtree)`` holding the ``encoder_layer_*`` modules: the tree itself or its ``bert``."""
    if any(str(k).startswith("encoder_layer_") for k in params):
        return (), params
    if "bert" in params and isinstance(params["bert"], Mapping):
        return ("bert",), params["bert"]
    raise ValueError("params hold no encoder_layer_* modules (a BertModel tree, or a classifier's with 'bert')")


def encoder_layer_names(params: Mapping) -> list[str]:
    """The ``encoder_layer_*`` names of a :class:`~jaxsparse.models.bert.BertModel` (or classifier) tree, in order."""
    _, root = _layers_root(params)
    names = [k for k in root if str(k).startswith("encoder_layer_")]
    return sorted(names, key=lambda k: int(str(k).rsplit("_", 1)[1]))


def _kernel(layer: Mapping, *path: str) -> Any:
    node = layer
    for p in path:
        if not isinstance(node, Mapping) or p not in node:
            raise ValueError(f"encoder layer lacks {'/'.join(path)}: permutations need dense kernels "
                             "(master-mode params, not compressed values)")
        node = node[p]
    return node


def _layer_dims(layer: Mapping) -> tuple[int, int]:
    """``(hidden, intermediate)`` of one encoder layer, checking the kernel shapes agree."""
    hidden, inter = np.shape(_kernel(layer, "intermediate", "kernel"))
    shapes = {("attention", n): (hidden, hidden) for n in _ATTN + ("output",)}
    shapes[("output",)] = (inter, hidden)
    for path, shape in shapes.items():
        got = tuple(np.shape(_kernel(layer, *path, "kernel")))
        if got != shape:
            raise ValueError(f"{'/'.join(path)}/kernel has shape {got}, expected {shape} from intermediate/kernel")
    return hidden, inter


def _is_permutation(p: np.ndarray, n: int) -> bool:
    return p.shape == (n,) and np.issubdtype(p.dtype, np.integer) and np.array_equal(np.sort(p), np.arange(n))


def _check_head_structure(perm: np.ndarray, num_heads: int) -> None:
    d = perm.shape[0] // num_heads
    heads = perm.reshape(num_heads, d) // d
    if not (heads == heads[:, :1]).all():
        raise ValueError(f"the attention permutation must map each head's {d} dimensions onto one head "
                         f"({num_heads} heads); otherwise it changes the model's function")


def _check_num_heads(num_heads: int, hidden: int) -> None:
    if not isinstance(num_heads, (int, np.integer)) or isinstance(num_heads, bool) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive integer, got {num_heads!r}")
    if hidden % num_heads:
        raise ValueError(f"hidden size {hidden} must be a multiple of num_heads = {num_heads}")


def identity_permutations(params: Mapping) -> Permutations:
    """The identity :class:`LayerPermutation` of every encoder layer of ``params``."""
    _, root = _layers_root(params)
    out = {}
    for name in encoder_layer_names(params):
        hidden, inter = _layer_dims(root[name])
        out[name] = LayerPermutation(np.arange(inter), np.arange(hidden))
    return out


def apply_permutations(params: Mapping, perms: Mapping[str, LayerPermutation], *, num_heads: int) -> dict:
    """``params`` with each encoder layer reparametrised by ``perms`` (the model computes the same function).

    Args:
      params: a :class:`~jaxsparse.models.bert.BertModel` params tree, or a classifier's (layers under
        ``bert``), with dense (master-mode) kernels. Not modified.
      perms: layer name -> :class:`LayerPermutation`; layers not named are left as they are.
      num_heads: the model's attention heads (``BertConfig.num_attention_heads``), to check that the
        attention permutation keeps heads whole.

    Returns:
      A new tree (numpy arrays at the permuted leaves, the other leaves shared with ``params``).

    Raises:
      ValueError: an unknown layer, an array that is not a permutation of the right length, or an attention
        permutation that splits heads.
    """
    prefix, root = _layers_root(params)
    layers = set(encoder_layer_names(params))
    new_root = dict(root)
    for name, perm in perms.items():
        if name not in layers:
            raise ValueError(f"permutation for {name!r}, which is not an encoder layer of params ({sorted(layers)})")
        layer = root[name]
        hidden, inter = _layer_dims(layer)
        _check_num_heads(num_heads, hidden)
        ffn, attn = np.asarray(perm.ffn), np.asarray(perm.attention)
        if not _is_permutation(ffn, inter):
            raise ValueError(f"{name}: ffn must be a permutation of range({inter}), got shape {ffn.shape}")
        if not _is_permutation(attn, hidden):
            raise ValueError(f"{name}: attention must be a permutation of range({hidden}), got shape {attn.shape}")
        _check_head_structure(attn, num_heads)
        new = {k: v for k, v in layer.items()}
        att = dict(new["attention"])
        for n in _ATTN:
            att[n] = _permute_outputs(att[n], attn)
        att["output"] = _permute_inputs(att["output"], attn)
        new["attention"] = att
        new["intermediate"] = _permute_outputs(new["intermediate"], ffn)
        new["output"] = _permute_inputs(new["output"], ffn)
        new_root[name] = new
    if not prefix:
        return {**dict(params), **new_root}
    return {**dict(params), prefix[0]: new_root}


def _permute_outputs(module: Mapping, perm: np.ndarray) -> dict:
    out = dict(module)
    out["kernel"] = np.asarray(module["kernel"])[:, perm]
    if "bias" in module:
        out["bias"] = np.asarray(module["bias"])[perm]
    return out


def _permute_inputs(module: Mapping, perm: np.ndarray) -> dict:
    out = dict(module)
    out["kernel"] = np.asarray(module["kernel"])[perm, :]
    return out


# ----------------------------------------------------------------------------- the objective


@functools.lru_cache(maxsize=None)
def _combos(m: int) -> np.ndarray:
    """``[C(m, 4), 4]`` column sets a block may keep (one set of all 4 when ``m = 4``)."""
    return np.asarray(list(itertools.combinations(range(m), 4)), np.int32)


def _set_scores(x: jax.Array, m: int, n: int) -> jax.Array:
    """``[..., m] -> [..., C]``: a row's top-``n`` sum inside each 4-column set (``n`` in {1, 2})."""
    combos = _combos(m)
    if n == 1:
        return x[..., combos].max(-1)
    pairs = np.asarray(list(itertools.combinations(range(m), 2)), np.int32)
    index = {tuple(p): i for i, p in enumerate(pairs.tolist())}
    combo_pairs = np.asarray([[index[(int(c[a]), int(c[b]))] for a, b in itertools.combinations(range(4), 2)]
                              for c in combos], np.int32)  # [C, 6]
    ps = x[..., pairs[:, 0]] + x[..., pairs[:, 1]]
    return ps[..., combo_pairs].max(-1)


def _check_spec(spec: Union[str, fmt.VNM]) -> fmt.VNM:
    spec = fmt.VNM.parse(spec)
    if not spec.structured:
        raise ValueError(f"permutation search needs a kernel pattern V:N:M with N <= 2 (4 kept columns per block), "
                         f"got {spec}")
    return spec


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _kernel_score(s: jax.Array, v: int, m: int, n: int) -> jax.Array:
    """Exact kept score of one ``[K, R]`` score matrix (non-negative) under V:n:m."""
    k, r = s.shape
    blocks = s.T.reshape(r // v, v, k // m, m)
    return _set_scores(blocks, m, n).sum(1).max(-1).sum()


def _scores_of(layer: Mapping, score_layer: Mapping | None, power: float) -> dict[tuple[str, ...], np.ndarray]:
    out = {}
    for path in [("attention", n) for n in _ATTN + ("output",)] + [("intermediate",), ("output",)]:
        src = _kernel(score_layer, *path, "kernel") if score_layer is not None else _kernel(layer, *path, "kernel")
        s = np.abs(np.asarray(src, np.float32)) ** power
        if s.shape != np.shape(_kernel(layer, *path, "kernel")):
            raise ValueError(f"score {'/'.join(path)} has shape {s.shape}, the kernel "
                             f"{np.shape(_kernel(layer, *path, 'kernel'))}")
        out[path] = s
    return out


def _score_root(score: Mapping | None, params: Mapping) -> Mapping | None:
    if score is None:
        return None
    try:
        _, root = _layers_root(score)
    except ValueError:
        raise ValueError("score must be params-shaped (encoder_layer_* kernels, possibly under 'bert')") from None
    missing = set(encoder_layer_names(params)) - set(root)
    if missing:
        raise ValueError(f"score lacks the encoder layers {sorted(missing)}")
    return root


def permutation_objective(params: Mapping, spec: Union[str, fmt.VNM], perms: Mapping[str, LayerPermutation] | None = None,
                          *, num_heads: int, score: Mapping | None = None, power: float = 2.0) -> dict[str, float]:
    """The kept score of every encoder kernel (``sum`` of kept ``|score|**power`` under ``spec``'s exact rule).

    Args:
      params: a BertModel or classifier params tree (dense kernels).
      spec: a kernel pattern ``V:N:M`` with ``N <= 2``.
      perms: permutations to apply first (:func:`apply_permutations`); None = as is.
      num_heads: the model's attention heads.
      score: a params-shaped tree of importance scores (e.g. ``|W_jr| * ||X_j||``) at the encoder kernels;
        None = ``|W|``.
      power: the exponent on ``|score|``; 2 with ``score=None`` is the kept squared magnitude.

    Returns:
      ``{"<layer>/<module path>": kept, ..., "total": sum}``, unnormalised.
    """
    spec = _check_spec(spec)
    sroot = _score_root(score, params)
    if perms is not None:
        params = apply_permutations(params, perms, num_heads=num_heads)
        if score is not None:
            score = apply_permutations(score, perms, num_heads=num_heads)
            sroot = _score_root(score, params)
    _, root = _layers_root(params)
    out: dict[str, float] = {}
    for name in encoder_layer_names(params):
        for path, s in _scores_of(root[name], None if sroot is None else sroot[name], power).items():
            fmt.validate_shape(s.shape, spec)
            out[f"{name}/{'/'.join(path)}"] = float(_kernel_score(jnp.asarray(s), spec.v, spec.m, spec.n))
    out["total"] = float(sum(out.values()))
    return out


# ----------------------------------------------------------------------------- local search


class _Problem:
    """The kept score of kernels whose output rows and/or input columns follow one permutation.

    ``row_scores`` are ``[K, n]`` kernels whose outputs are the units, ``col_score`` an ``[n, R]`` kernel whose
    inputs are. ``rows``: ``[n, Gt, C]`` per unit, the top-N sum of each of its ``Gt`` input groups (several kernels
    concatenated along ``Gt``) inside every column set; a row block of ``v`` positions keeps
    ``sum_g max_c sum_rows``. ``cols``: ``[R, n]`` scores of a kernel whose inputs are the units (its
    ``R`` outputs in blocks of ``vo``); a group of ``m`` positions keeps, per output block, the best set.
    """

    def __init__(self, n: int, spec: fmt.VNM, row_scores: list[np.ndarray], col_score: np.ndarray | None):
        self.n, self.spec = n, spec
        self.v, self.m = spec.v, spec.m
        self.rows = None
        if row_scores and self.v > 1:
            parts = []
            for s in row_scores:  # [K, n] kernel scores: units are the outputs
                k = s.shape[0]
                x = jnp.asarray(s.T.reshape(n, k // self.m, self.m))
                parts.append(_set_scores(x, self.m, spec.n))
            self.rows = jnp.concatenate(parts, axis=1)  # [n, Gt, C]
        self.cols = None if col_score is None else jnp.asarray(col_score.T)  # [R, n]
        self.vo = self.v

    # -- full evaluation
    def total(self, perm: np.ndarray) -> float:
        return float(_total(self.rows, self.cols, jnp.asarray(perm), self.v, self.m, self.spec.n, self.vo))


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6))
def _total(rows, cols, perm, v, m, n, vo):
    out = jnp.zeros((), jnp.float32)
    if rows is not None:
        t = rows[perm]
        out += t.reshape(-1, v, *t.shape[1:]).sum(1).max(-1).sum()
    if cols is not None:
        out += _group_scores(cols, perm.reshape(-1, m), m, n, vo).sum()
    return out


def _group_scores(cols, groups, m, n, vo):
    """``groups [B, m]`` unit ids -> ``[B]`` kept score of each as one input group of ``cols [R, n]``."""
    x = cols[:, groups]  # [R, B, m]
    r = x.shape[0]
    per = _set_scores(x, m, n).reshape(r // vo, vo, groups.shape[0], -1).sum(1)  # [R/vo, B, C]
    return per.max(-1).sum(0)


@functools.partial(jax.jit, static_argnums=(7, 8, 9, 10))
def _swap_deltas(rows, blk, cols, gsc, perm, i, j, v, m, n, vo):
    """Exact objective change of swapping positions ``i[b]`` and ``j[b]`` (each alone) of ``perm``."""
    u, w = perm[i], perm[j]
    delta = jnp.zeros(i.shape, jnp.float32)
    if rows is not None:
        a, b = i // v, j // v
        f = lambda x: x.max(-1).sum(-1)  # noqa: E731  [B, Gt, C] -> [B]
        du = rows[w] - rows[u]
        d = f(blk[a] + du) + f(blk[b] - du) - f(blk[a]) - f(blk[b])
        delta += jnp.where(a == b, 0.0, d)
    if cols is not None:
        ga, gb = i // m, j // m
        groups = perm.reshape(-1, m)
        new_a = groups[ga].at[jnp.arange(i.shape[0]), i % m].set(w)
        new_b = groups[gb].at[jnp.arange(i.shape[0]), j % m].set(u)
        d = (_group_scores(cols, new_a, m, n, vo) + _group_scores(cols, new_b, m, n, vo) - gsc[ga] - gsc[gb])
        delta += jnp.where(ga == gb, 0.0, d)
    return delta


@functools.partial(jax.jit, static_argnums=(2,))
def _block_sums(rows, perm, v):
    t = rows[perm]
    return t.reshape(-1, v, *t.shape[1:]).sum(1)


def _local_search(prob: _Problem, perm: np.ndarray, span: int, rounds: int, batch: int,
                  rng: np.random.Generator) -> np.ndarray:
    """Swap search: each round scores ``batch`` random swaps (partners within the same ``span`` positions)
    exactly and applies the best improving ones that touch disjoint blocks and groups."""
    perm = perm.copy()
    v, m, n = prob.v, prob.m, prob.spec.n
    tol = 1e-7 * abs(prob.total(perm))  # float32 deltas: ignore changes at rounding level
    jp = jnp.asarray(perm)
    blk = None if prob.rows is None else _block_sums(prob.rows, jp, v)
    gsc = None if prob.cols is None else _group_scores(prob.cols, jp.reshape(-1, m), m, n, prob.vo)
    for _ in range(rounds):
        i = rng.integers(0, prob.n, batch)
        j = (i // span) * span + rng.integers(0, span, batch)
        d = np.asarray(_swap_deltas(prob.rows, blk, prob.cols, gsc, jp, jnp.asarray(i), jnp.asarray(j),
                                    v, m, n, prob.vo))
        used_b, used_g, applied = set(), set(), []
        for k in np.argsort(-d):
            if d[k] <= tol:
                break
            touched_b = {("b", i[k] // v), ("b", j[k] // v)} if prob.rows is not None else set()
            touched_g = {("g", i[k] // m), ("g", j[k] // m)} if prob.cols is not None else set()
            if touched_b & used_b or touched_g & used_g or i[k] == j[k]:
                continue
            used_b |= touched_b
            used_g |= touched_g
            perm[i[k]], perm[j[k]] = perm[j[k]], perm[i[k]]
            applied.append(k)
        if applied:
            jp = jnp.asarray(perm)
            if prob.rows is not None:
                blk = _block_sums(prob.rows, jp, v)
            if prob.cols is not None:
                gsc = _group_scores(prob.cols, jp.reshape(-1, m), m, n, prob.vo)
    return perm


def _balanced_kmeans(prob: _Problem, perm: np.ndarray, max_iters: int) -> np.ndarray:
    """Row blocks by balanced k-means on the exact row objective, from ``perm``'s blocks.

    Alternates two exact steps, so the row objective never falls: each block takes its best column set in
    every input group (``argmax`` of its summed set scores), then the units are assigned to blocks of
    ``v`` by a linear assignment maximising the kept score under those sets.
    """
    from scipy.optimize import linear_sum_assignment

    rows = np.asarray(prob.rows)  # [n, Gt, C]
    v, n, gt = prob.v, prob.n, rows.shape[1]
    best = float(np.asarray(_block_sums(prob.rows, jnp.asarray(perm), v)).max(-1).sum())
    for _ in range(max_iters):
        sets = np.asarray(_block_sums(prob.rows, jnp.asarray(perm), v)).argmax(-1)  # [blocks, Gt]
        value = np.stack([rows[:, np.arange(gt), s].sum(1) for s in sets], axis=1)  # [n, blocks]
        _, slot = linear_sum_assignment(np.repeat(value, v, axis=1), maximize=True)
        new = np.argsort(slot // v, kind="stable")
        score = float(np.asarray(_block_sums(prob.rows, jnp.asarray(new), v)).max(-1).sum())
        if score <= best * (1 + 1e-7):
            break
        best, perm = score, new
    return perm


def _deal(prob: _Problem, perm: np.ndarray, span: int) -> np.ndarray:
    """Inside every ``span`` positions, deal the units into the input groups by their column score (strongest
    unit to group 0, next to group 1, ...), so each group pairs strong inputs with weak ones; kept only if
    the objective rises."""
    if prob.cols is None or span % prob.m:
        return perm
    energy = np.asarray(prob.cols).sum(0)
    dealt = perm.reshape(-1, span).copy()
    for b, units in enumerate(dealt):
        order = units[np.argsort(-energy[units], kind="stable")]
        dealt[b] = order.reshape(-1, span // prob.m).T.reshape(-1)
    dealt = dealt.reshape(-1)
    return dealt if prob.total(dealt) > prob.total(perm) else perm


def _head_search(prob: _Problem, perm: np.ndarray, num_heads: int) -> np.ndarray:
    """Best-improvement swaps of whole heads (full objective) until none helps."""
    d = perm.shape[0] // num_heads
    best = prob.total(perm)
    for _ in range(num_heads * num_heads):
        cands = []
        for a, b in itertools.combinations(range(num_heads), 2):
            p = perm.copy()
            p[a * d:(a + 1) * d], p[b * d:(b + 1) * d] = perm[b * d:(b + 1) * d], perm[a * d:(a + 1) * d]
            cands.append((prob.total(p), p))
        value, p = max(cands, key=lambda c: c[0])
        if value <= best * (1 + 1e-7):
            break
        best, perm = value, p
    return perm


def search_permutations(params: Mapping, spec: Union[str, fmt.VNM], *, num_heads: int, score: Mapping | None = None,
                        power: float = 2.0, iters: int = 30, batch: int = 256, kmeans_iters: int = 50, seed: int = 0,
                        layers: list[str] | None = None) -> Permutations:
    """Per encoder layer, FFN and attention permutations that raise the kept score under ``spec``.

    The objective is :func:`permutation_objective` over the kernels each permutation touches: the FFN
    permutation is scored on ``intermediate`` (row blocks of ``V`` units) and ``output`` (input groups of
    ``M`` units) together; the attention permutation on ``query``/``key``/``value`` (row blocks) and the
    attention ``output`` (input groups). Attention, from the identity: whole heads are swapped while the
    best of all head swaps helps, then ``iters`` rounds of random swaps of two dimensions inside a head.
    FFN: the row blocks of ``intermediate`` by balanced k-means (exact, alternating the blocks' column
    sets and a linear assignment of units to blocks; when ``V`` is a multiple of ``M``), then inside each
    block the units are dealt into ``output``'s input groups by strength and ``iters`` rounds of random
    swaps refine the groups. Every swap is scored exactly on the affected blocks and groups and the
    improving ones that touch disjoint blocks and groups are applied. A layer whose searched objective
    is not above the identity's keeps the identity. Deterministic given ``seed``.

    Args:
      params: a BertModel or classifier params tree with dense kernels.
      spec: the pattern the masks will have, ``V:N:M`` with ``N <= 2`` (``"64:2:8"``, ``"128:2:16"``, ``"2:8"``).
      num_heads: the model's attention heads (``BertConfig.num_attention_heads``).
      score: params-shaped importance scores (e.g. ``|W_jr| * ||X_j||``); None = ``|W|``.
      power: the objective sums kept ``|score|**power`` (2: squared magnitude, the error of a dropped weight).
      iters: swap rounds per permutation (0: no random swaps; the head swaps and the FFN k-means still run).
      batch: swaps scored per round at M = 8 (scaled down by the number of column sets at larger M).
      kmeans_iters: at most this many k-means steps for the FFN's row blocks.
      seed: seeds the swap proposals.
      layers: the encoder layers to search (default all); the others get the identity.

    Returns:
      :data:`Permutations` for every encoder layer, for :func:`apply_permutations`.

    Raises:
      ValueError: a pattern that is not a V:N:M kernel pattern, kernels it does not fit, bad ``num_heads``,
        ``iters``/``batch``/``power``, or a ``score`` tree that does not match.
    """
    spec = _check_spec(spec)
    if not isinstance(iters, (int, np.integer)) or iters < 0:
        raise ValueError(f"iters must be a non-negative integer, got {iters!r}")
    if not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch!r}")
    if not power > 0:
        raise ValueError(f"power must be > 0, got {power!r}")
    if not isinstance(kmeans_iters, (int, np.integer)) or kmeans_iters < 0:
        raise ValueError(f"kmeans_iters must be a non-negative integer, got {kmeans_iters!r}")
    swaps = max(1, batch * 70 // len(_combos(spec.m)))  # the same work per round at M = 16 (1820 sets)
    _, root = _layers_root(params)
    sroot = _score_root(score, params)
    names = encoder_layer_names(params)
    if layers is not None:
        unknown = set(layers) - set(names)
        if unknown:
            raise ValueError(f"layers {sorted(unknown)} are not encoder layers of params ({names})")
    rng = np.random.default_rng(seed)
    out = identity_permutations(params)
    for name in names:
        if layers is not None and name not in layers:
            continue
        layer = root[name]
        hidden, inter = _layer_dims(layer)
        _check_num_heads(num_heads, hidden)
        for shape in ((hidden, hidden), (hidden, inter), (inter, hidden)):
            fmt.validate_shape(shape, spec)
        s = _scores_of(layer, None if sroot is None else sroot[name], power)
        d = hidden // num_heads
        # Attention: whole heads, then dimensions inside a head.
        attn = _Problem(hidden, spec, [s[("attention", q)] for q in _ATTN], s[("attention", "output")])
        perm_a = np.arange(hidden)
        if num_heads > 1:
            perm_a = _head_search(attn, perm_a, num_heads)
        perm_a = _local_search(attn, perm_a, d, iters, swaps, rng)
        # FFN: blocks of intermediate units by balanced k-means on `intermediate`, then the input groups
        # of `output` inside each block (which leaves the blocks, hence `intermediate`, unchanged).
        ffn = _Problem(inter, spec, [s[("intermediate",)]], s[("output",)])
        perm_f, span = np.arange(inter), inter
        if ffn.rows is not None and spec.v % spec.m == 0:
            perm_f, span = _balanced_kmeans(ffn, perm_f, kmeans_iters), spec.v
        perm_f = _deal(ffn, perm_f, span)
        perm_f = _local_search(ffn, perm_f, span, iters, swaps, rng)
        # Safety net: never worse than the identity (float32 deltas).
        if attn.total(perm_a) < attn.total(np.arange(hidden)):
            perm_a = np.arange(hidden)
        if ffn.total(perm_f) < ffn.total(np.arange(inter)):
            perm_f = np.arange(inter)
        out[name] = LayerPermutation(ffn=perm_f, attention=perm_a)
    return out
