"""Layer-wise second-order (OBS / least-squares) pieces for one-shot pruning of a linear layer.

For a linear layer ``y = x @ W`` with kernel ``W`` of shape ``[K, R]`` (``K`` input features, ``R``
output features: the Flax convention of ``jaxsparse.format``) and calibration inputs ``X`` (``[n, K]``,
one row per token), pruning output ``r`` to a kept set ``S`` and changing its kept weights costs

    E_r(w'_r) = ||X w_r - X w'_r||^2 / n = (w_r - w'_r)^T H (w_r - w'_r),    H = X^T X / n.

Everything here works from ``H`` (:func:`input_hessian`, damped by :func:`damp_hessian`):

* :func:`obs_scores` -- the Optimal Brain Surgeon saliency ``w_kr^2 / [H^-1]_kk`` of every weight (the
  error of removing that weight alone when the others are re-solved), a score tree for
  ``jaxsparse.format.select_mask`` (higher = keep);
* :func:`refit` -- given a mask, the kept weights that minimise ``E_r`` for every output:
  ``w'_S = (H_SS)^-1 H_S: w_r`` (zero off the mask);
* :func:`sparsegpt_mask` -- a mask chosen one input group at a time on the weights that the OBS updates of the
  groups before it left (SparseGPT's order), instead of on the original weights;
* :func:`oneshot_refit` -- a whole model: every sparse kernel in forward order gets its mask (and with
  ``refit``, refit kept weights) from its input ``H`` over calibration batches (:func:`input_hessians`),
  measured on the model already pruned and refit before it. ``benchmarks/oneshot_proxy.py`` and
  ``jaxsparse-train --prune oneshot --refit`` both use it.

In V:2:M every row of a V-block shares the block's 4 of every M inputs but keeps its own 2 of them, so
the kept set differs from row to row: :func:`refit` solves one ``|S| x |S|`` system per output row,
batched (rows of equal kept count are solved together in chunks; a row keeping fewer is padded with
identity rows).

Example::

    h = damp_hessian(input_hessian(x), 0.01)                  # x: [tokens, K] layer inputs
    scores = obs_scores(w, hessian_inverse_diag(h))
    mask = format.select_mask(scores, "64:2:8")
    w_new = refit(w, mask, h, damp=0.0)                     # h already damped
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from jaxsparse import format as F
from jaxsparse import pruning
from jaxsparse.nn import NMDense

__all__ = [
    "input_hessian",
    "damp_hessian",
    "hessian_inverse_diag",
    "obs_scores",
    "refit",
    "sparsegpt_mask",
    "reconstruction_error",
    "CRITERIA",
    "mask_score",
    "kernel_stages",
    "input_hessians",
    "oneshot_refit",
]

ArrayLike = Any  # np.ndarray | jax.Array


def _as_np(x: ArrayLike, name: str) -> np.ndarray:
    try:
        return np.asarray(x)
    except Exception as e:  # pragma: no cover - defensive
        raise ValueError(f"{name} must be an array, got {type(x).__name__}") from e


def input_hessian(x: ArrayLike, weights: ArrayLike | None = None) -> jax.Array:
    """``H = X^T X / n``: the second moment of one linear layer's inputs over calibration tokens.

    Args:
      x: ``[..., K]`` layer inputs (e.g. ``[batch, tokens, K]``); every leading index is a token.
      weights: optional ``x.shape[:-1]`` token weights (e.g. the attention mask, 0 for padding); ``n``
        is then their sum and each token's outer product is scaled by its weight.

    Returns:
      ``[K, K]`` float32 ``H`` (symmetric, positive semi-definite).
    """
    x = jnp.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"input_hessian needs x of shape [..., K] with at least one token axis, got {x.shape}")
    k = x.shape[-1]
    x2 = x.reshape(-1, k).astype(jnp.float32)
    if weights is None:
        n = x2.shape[0]
        if n == 0:
            raise ValueError("input_hessian needs at least one token (n > 0)")
        return (x2.T @ x2) / n
    weights = jnp.asarray(weights, jnp.float32)
    if weights.shape != x.shape[:-1]:
        raise ValueError(f"weights must have shape x.shape[:-1] = {x.shape[:-1]}, got {weights.shape}")
    wt = weights.reshape(-1)
    n = jnp.sum(wt)
    if not isinstance(n, jax.core.Tracer) and float(n) <= 0:
        raise ValueError("input_hessian needs the token weights to sum to n > 0")
    return (x2.T @ (x2 * wt[:, None])) / n


def _check_hessian(h: np.ndarray, k: int | None = None) -> None:
    if h.ndim != 2 or h.shape[0] != h.shape[1]:
        raise ValueError(f"H must be a square [K, K] matrix, got shape {h.shape}")
    if k is not None and h.shape[0] != k:
        raise ValueError(f"H must be [K, K] with K = {k} (the kernel's input features), got {h.shape}")


def damp_hessian(h: ArrayLike, damp: float = 0.01) -> jax.Array:
    """``H + damp * mean(diag H) * I`` (float32): makes ``H`` invertible where inputs are degenerate.

    ``damp`` must be >= 0; an all-zero ``H`` is damped with ``damp * I`` instead (mean of the diagonal 1).
    """
    if not np.isfinite(damp) or damp < 0:
        raise ValueError(f"damp must be a finite number >= 0, got {damp}")
    h = jnp.asarray(h, jnp.float32)
    _check_hessian(h)
    mean = jnp.mean(jnp.diag(h))
    mean = jnp.where(mean > 0, mean, 1.0)
    return h + damp * mean * jnp.eye(h.shape[0], dtype=jnp.float32)


def hessian_inverse_diag(h: ArrayLike, damp: float = 0.0) -> jax.Array:
    """``diag((H + damp * mean(diag H) * I)^-1)`` as ``[K]`` float32 (computed in float64 with numpy)."""
    hd = np.asarray(damp_hessian(h, damp) if damp else jnp.asarray(h, jnp.float32), np.float64)
    _check_hessian(hd)
    try:
        c = np.linalg.cholesky(hd)
    except np.linalg.LinAlgError:
        raise ValueError("H must be positive definite: damp it (damp_hessian or damp > 0)") from None
    c_inv = np.linalg.inv(c)  # H^-1 = C^-T C^-1, so [H^-1]_kk = sum_i (C^-1)_ik^2
    return jnp.asarray(np.sum(c_inv * c_inv, axis=0), jnp.float32)


def obs_scores(w: ArrayLike, h_inv_diag: ArrayLike) -> jax.Array:
    """The OBS saliency ``w_kr^2 / [H^-1]_kk`` of every weight of a ``[K, R]`` kernel (higher = keep).

    It is the layer error of removing ``w_kr`` alone while the row's other weights are re-solved; with
    ``H = I`` it ranks exactly as ``|w|``. Feed it to ``jaxsparse.format.select_mask`` (which sums the
    scores a mask keeps per row and V-block).

    Args:
      w: ``[K, R]`` kernel.
      h_inv_diag: ``[K]`` positive diagonal of ``H^-1`` (:func:`hessian_inverse_diag`).

    Returns:
      ``[K, R]`` float32 scores.
    """
    w = jnp.asarray(w)
    d = jnp.asarray(h_inv_diag, jnp.float32)
    if w.ndim != 2:
        raise ValueError(f"obs_scores needs a 2-D kernel [K, R], got shape {w.shape}")
    if d.shape != (w.shape[0],):
        raise ValueError(f"h_inv_diag must have shape [K] = ({w.shape[0]},) (the kernel's input features), got {d.shape}")
    if not bool(jnp.all(d > 0)):
        raise ValueError("h_inv_diag must be > 0 everywhere (the diagonal of a positive definite H^-1)")
    w32 = w.astype(jnp.float32)
    return (w32 * w32) / d[:, None]


def reconstruction_error(w: ArrayLike, w_new: ArrayLike, h: ArrayLike) -> float:
    """``sum_r (w_r - w'_r)^T H (w_r - w'_r)``: the layer's squared output error per token, summed over outputs."""
    d = np.asarray(w, np.float64) - np.asarray(w_new, np.float64)
    h = np.asarray(h, np.float64)
    _check_hessian(h, d.shape[0])
    return float(np.sum(d * (h @ d)))


def refit(w: ArrayLike, mask: ArrayLike, h: ArrayLike, damp: float = 0.01, *, chunk: int = 64) -> jax.Array:
    """Least-squares optimal kept weights for a fixed mask: ``w'_S = (H_SS)^-1 H_S: w_r`` per output ``r``.

    Minimises ``(w_r - w'_r)^T H_d (w_r - w'_r)`` with ``H_d = damp_hessian(H, damp)`` over ``w'_r`` zero
    off ``S = mask[:, r]``; with ``damp = 0`` that is ``||X w_r - X w'_r||^2`` (``H = X^T X / n``), the
    layer's output error, and a positive ``damp`` adds ``damp * mean(diag H) * ||w_r - w'_r||^2`` (keeps
    the kept weights near their old values where the inputs say little). Each output row has its own kept
    set (V:2:M rows of one block keep different 2 of the block's 4 columns), so one system is solved per
    row, ``chunk`` rows at a time, in float64 with numpy.

    Args:
      w: ``[K, R]`` kernel (inputs ``K``, outputs ``R``).
      mask: ``[K, R]`` boolean, True where a weight is kept.
      h: ``[K, K]`` input second moment (:func:`input_hessian`); must be positive definite after damping.
      damp: relative damping, >= 0.
      chunk: rows solved per batched call (memory ``chunk * |S|^2 * 8`` bytes).

    Returns:
      ``[K, R]`` refit kernel in ``w``'s dtype, exactly zero where ``mask`` is False.
    """
    w_in = w
    wn = _as_np(w, "w")
    mk = _as_np(mask, "mask")
    if wn.ndim != 2:
        raise ValueError(f"refit needs a 2-D kernel [K, R], got shape {wn.shape}")
    if mk.shape != wn.shape:
        raise ValueError(f"mask shape {mk.shape} must equal the kernel shape {wn.shape}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    k, r = wn.shape
    hn = np.asarray(damp_hessian(h, damp) if damp else h, np.float64)
    _check_hessian(hn, k)
    mk = mk.astype(bool)
    w64 = wn.astype(np.float64)
    target = hn @ w64  # [K, R]: column r is H w_r
    out = np.zeros((k, r), np.float64)
    counts = mk.sum(axis=0)
    for s in np.unique(counts):
        if s == 0:
            continue
        rows = np.nonzero(counts == s)[0]
        for start in range(0, len(rows), chunk):
            rr = rows[start:start + chunk]
            # Kept input indices of each row, ascending: [c, s].
            idx = np.sort(np.argsort(~mk[:, rr].T, axis=1, kind="stable")[:, :s], axis=1)
            a = hn[idx[:, :, None], idx[:, None, :]]  # [c, s, s]
            b = np.take_along_axis(target[:, rr].T, idx, axis=1)  # [c, s]
            try:
                sol = np.linalg.solve(a, b[..., None])[..., 0]
            except np.linalg.LinAlgError:
                raise ValueError("H restricted to a row's kept inputs is singular: use damp > 0") from None
            out[idx, rr[:, None]] = sol
    out = np.where(mk, out, 0.0)
    dtype = getattr(w_in, "dtype", wn.dtype)
    return jnp.asarray(out.astype(np.float32), dtype=dtype)


CRITERIA = ("magnitude", "activation", "obs", "sparsegpt")
"""Mask criteria of :func:`oneshot_refit`: the scores of :func:`mask_score`, or ``sparsegpt``
(:func:`sparsegpt_mask`, a selection made jointly with the updates it implies)."""


@functools.partial(jax.jit, static_argnames=("spec", "transposable", "exclusive_columns"))
def _select_group(scores: jax.Array, spec: str, transposable: bool, exclusive_columns: bool) -> jax.Array:
    return F.select_mask(scores, spec, transposable=transposable, exclusive_columns=exclusive_columns)


def sparsegpt_mask(w: ArrayLike, h: ArrayLike, spec, damp: float = 0.01, *, transposable: bool = False,
                   exclusive_columns: bool = False) -> jax.Array:
    """A V:N:M mask chosen one input group at a time, each on the weights that the Optimal Brain Surgeon updates
    of the groups before it left (the order of SparseGPT, Frantar and Alistarh 2023).

    With ``H^-1 = U^T U`` (``U`` upper triangular, of the damped ``H``), the ``M`` input features of group ``g`` are
    masked by ``jaxsparse.format.select_mask`` on the saliencies ``w_jr^2 / U_jj^2`` of the current weights, then
    pruned one feature ``j`` at a time: its removed weights' error ``e_r = w_jr / U_jj`` moves onto the features
    after it (``w_{j:} -= U_{j, j:}^T e``), so the later groups are chosen on weights that already make up for the
    earlier cuts. :func:`score <mask_score>` + ``select_mask`` chooses every group on the original weights instead.
    Only the mask is returned; :func:`refit` then gives the kept weights that are optimal for it.

    Args:
      w: ``[K, R]`` kernel.
      h: ``[K, K]`` input second moment (:func:`input_hessian`).
      spec: the V:N:M pattern (``K % M == 0``, ``R % V == 0``).
      damp: relative damping of ``H`` (:func:`damp_hessian`).
      transposable, exclusive_columns: ``select_mask``'s options (both decided within a group).

    Returns:
      ``[K, R]`` boolean mask of pattern ``spec``.
    """
    spec = F.VNM.parse(spec)
    wn = _as_np(w, "w").astype(np.float64)
    if wn.ndim != 2:
        raise ValueError(f"sparsegpt_mask needs a 2-D kernel [K, R], got shape {wn.shape}")
    F.validate_shape(wn.shape, spec)
    k, r = wn.shape
    hd = np.asarray(damp_hessian(h, damp) if damp else jnp.asarray(h, jnp.float32), np.float64)
    _check_hessian(hd, k)
    try:
        h_inv = np.linalg.inv(np.linalg.cholesky(hd))
        u = np.linalg.cholesky(h_inv.T @ h_inv).T  # H^-1 = U^T U
    except np.linalg.LinAlgError:
        raise ValueError("H must be positive definite: damp it (damp > 0)") from None
    diag = np.diag(u)
    mask = np.zeros((k, r), bool)
    for g0 in range(0, k, spec.m):
        sl = slice(g0, g0 + spec.m)
        sal = wn[sl] ** 2 / diag[sl, None] ** 2
        mask[sl] = np.asarray(_select_group(jnp.asarray(sal, jnp.float32), str(spec), bool(transposable),
                                            bool(exclusive_columns)))
        for j in range(g0, g0 + spec.m):
            err = np.where(mask[j], 0.0, wn[j]) / u[j, j]
            wn[j:] -= np.outer(u[j, j:], err)
    return jnp.asarray(mask)


def mask_score(criterion: str, w: ArrayLike, h: ArrayLike, damp: float = 0.01) -> jax.Array:
    """The ``select_mask`` score of kernel ``w`` ``[K, R]`` under ``criterion``, from its input ``H``:

    ``magnitude``: ``w`` itself (``|W|``); ``activation``: ``|W_jr| * sqrt(H_jj)`` (Wanda's ``|W_jr| * ||X_j||``
    up to a constant, the ``score="activation"`` of :func:`jaxsparse.pruning.gmp_prune`); ``obs``:
    :func:`obs_scores` with ``H`` damped by ``damp``; ``sparsegpt``: the ``obs`` score too (what
    :func:`oneshot_refit` selects by where :func:`sparsegpt_mask` does not apply: diagonal blocks).
    """
    if criterion == "magnitude":
        return w
    if criterion == "activation":
        return jnp.abs(w) * jnp.sqrt(jnp.maximum(jnp.asarray(np.diag(np.asarray(h))), 0.0))[:, None]
    if criterion in ("obs", "sparsegpt"):  # sparsegpt is a selection; where it does not apply it takes this score
        return obs_scores(w, hessian_inverse_diag(h, damp))
    raise ValueError(f"criterion must be one of {CRITERIA}, got {criterion!r}")


_LAYER_ORDER = (("attention", "query"), ("attention", "key"), ("attention", "value"), ("attention", "output"),
                ("intermediate",), ("output",))


def kernel_stages(params, filter_fn: pruning.FilterFn = pruning.encoder_kernels) -> list[list[tuple]]:
    """Module paths of the kernels ``filter_fn`` selects (the encoder kernels of a BERT, at any prefix, e.g.
    ``bert/encoder_layer_0/...`` in a classifier), in forward order, grouped by shared input: per
    ``encoder_layer_<i>`` (by ``i``) Q/K/V together, then the attention output, ``intermediate``, ``output``.
    A selected kernel outside that layout is a ``ValueError``."""
    flat = traverse_util.flatten_dict(dict(params))
    chosen = [p[:-1] for p, x in flat.items() if filter_fn(tuple(map(str, p)), x)]
    layers: dict[tuple, dict[tuple, tuple]] = {}
    for path in chosen:
        at = next((i for i, c in enumerate(path) if c.startswith("encoder_layer_")), None)
        rest = path[at + 1:] if at is not None else None
        if rest not in _LAYER_ORDER:
            raise ValueError(f"kernel_stages: {'/'.join(path)} is not a BERT encoder kernel "
                             f"(encoder_layer_<i>/{{{', '.join('/'.join(r) for r in _LAYER_ORDER)}}})")
        layers.setdefault(path[:at + 1], {})[rest] = path
    out = []
    for prefix in sorted(layers, key=lambda p: (p[:-1], int(p[-1].rsplit("_", 1)[1]))):
        have = layers[prefix]
        qkv = [have[r] for r in _LAYER_ORDER[:3] if r in have]
        out += ([qkv] if qkv else []) + [[have[r]] for r in _LAYER_ORDER[3:] if r in have]
    return out


class _Stop(Exception):
    """Raised inside the forward once every wanted kernel input is recorded (skips the rest of the model)."""


def input_hessians(model: nn.Module, params, batches: Sequence[tuple], masks=None, want=None) -> dict:
    """``{module path: H = X^T X / n}`` (float32 numpy ``[K, K]``) of each :class:`~jaxsparse.nn.NMDense`
    input over the unpadded tokens of ``batches`` (each ``(input_ids, token_type_ids, attention_mask, ...)``;
    ``n`` counts the tokens of all of them), on the model with ``masks`` (params-shaped) applied.

    Only the paths in ``want`` (all when None) are recorded, each forward stopping once they are. Q/K/V
    (one input) share one ``H``. The forward runs eagerly (``model.apply`` without jit, deterministic)."""
    sums: dict[tuple, np.ndarray] = {}
    counts: dict[tuple, int] = {}
    keys: dict[tuple, tuple] = {}
    variables = pruning.model_variables(params, masks=masks)
    for batch in batches:
        ids, types, mask = batch[:3]
        keep = np.asarray(mask).reshape(-1) > 0
        keep_dev, n_keep = jnp.asarray(keep, jnp.float32), int(keep.sum())
        seen: set = set()

        def record(next_fun, args, kwargs, context):
            if isinstance(context.module, NMDense) and context.method_name == "__call__":
                path = tuple(context.module.path)
                if want is None or path in want:
                    key = path[:-1] + ("qkv",) if path[-1] in ("query", "key", "value") else path
                    keys[path] = key
                    if key not in seen:
                        seen.add(key)
                        x = jnp.asarray(args[0], jnp.float32)
                        x = x.reshape(-1, x.shape[-1])
                        xtx = _masked_gram(x, keep_dev)  # on the device the model runs on
                        sums[key] = xtx if key not in sums else sums[key] + xtx
                        counts[key] = counts.get(key, 0) + n_keep
                    if want is not None and set(want) <= {p for p, k in keys.items() if k in seen}:
                        raise _Stop
            return next_fun(*args, **kwargs)

        try:
            with nn.intercept_methods(record):
                model.apply(variables, ids, types, mask)
        except _Stop:
            pass
    hs = {key: np.asarray(s, np.float32) / counts[key] for key, s in sums.items()}
    return {path: hs[key] for path, key in keys.items()}


@jax.jit
def _masked_gram(x: jax.Array, keep: jax.Array) -> jax.Array:
    """``sum_t keep_t x_t x_t^T`` (``[K, K]``, float32 accumulation at full precision) of ``x [n, K]``."""
    return jnp.dot((x * keep[:, None]).T, x, precision=jax.lax.Precision.HIGHEST)


def oneshot_refit(model: nn.Module, params, batches: Sequence[tuple], spec, score: str = "magnitude", *,
                  damp: float = 0.01, refit: bool = True, sequential: bool = True,
                  filter_fn: pruning.FilterFn = pruning.encoder_kernels, transposable: bool = False,
                  exclusive_columns: bool = False, diagonal_fn: pruning.FilterFn | None = None) -> tuple[Any, Any]:
    """One-shot masks of pattern ``spec`` for a BERT's sparse kernels, with least-squares refit.

    The kernels of :func:`kernel_stages` are processed in forward order. With ``sequential`` (the default)
    each stage's input ``H`` (:func:`input_hessians` over the calibration ``batches``) is measured on the
    model whose earlier kernels are already pruned (and refit), so later layers are fit to the inputs
    they will see; otherwise every ``H`` comes from the dense model. Each kernel's mask is
    ``select_mask(mask_score(score, W, H, damp), spec)`` (``score="sparsegpt"``: :func:`sparsegpt_mask`) and, with
    ``refit``, its kernel becomes
    ``refit(W, mask, H, damp)`` (exactly zero off the mask; biases are left as they are).

    Args:
      model: a Flax BERT (``BertModel`` or ``BertForSequenceClassification``, master mode) whose
        ``apply(variables, input_ids, token_type_ids, attention_mask)`` runs the forward.
      params: its params (dense kernels).
      batches: calibration batches ``(input_ids, token_type_ids, attention_mask, ...)``.
      spec: the V:N:M pattern.
      score: one of :data:`CRITERIA`.
      damp: relative Hessian damping (:func:`damp_hessian`) of the refit and the ``obs`` score.
      refit: refit the kept weights (False: masks only, params unchanged).
      sequential: see above.
      filter_fn: the kernels to prune (:func:`jaxsparse.pruning.encoder_kernels`, as ``gmp_prune``).
      transposable: transposable masks (``jaxsparse.format.select_mask``'s option), for the input gradient's
        ``"transposed"`` route.
      exclusive_columns: column-capped masks (``select_mask``'s option; ``M > 4`` only).
      diagonal_fn: the kernels that take ``select_diagonal_mask``'s ``M / 4`` diagonal 2:4 blocks instead
        (``jaxsparse.pruning.gmp_prune``'s option; V:2:M with ``M >= 8`` only).

    Returns:
      ``(params, masks)``: the (refit) params and a params-shaped mask tree (None off the pruned kernels).
    """
    if score not in CRITERIA:
        raise ValueError(f"score must be one of {CRITERIA}, got {score!r}")
    if not batches:
        raise ValueError("oneshot_refit needs at least one calibration batch")
    flat = dict(traverse_util.flatten_dict(dict(params)))
    masks_flat = {p: None for p in flat}
    stages = kernel_stages(params, filter_fn)
    if not stages:
        raise ValueError("oneshot_refit: filter_fn selected no kernel")
    dense_h = None if sequential else input_hessians(model, params, batches)
    for stage in stages:
        if sequential:
            cur_p = traverse_util.unflatten_dict(flat)
            cur_m = traverse_util.unflatten_dict(masks_flat)
            hs = input_hessians(model, cur_p, batches, masks=cur_m, want=set(stage))
        else:
            hs = dense_h
        for path in stage:
            kp = path + ("kernel",)
            w, h = flat[kp], hs[path]
            if diagonal_fn is not None and diagonal_fn(tuple(map(str, kp)), w):
                m = pruning.diagonal_mask(mask_score(score, w, h, damp), spec)
            elif score == "sparsegpt":  # chooses its own mask: no score to compute
                m = sparsegpt_mask(w, h, spec, damp, transposable=transposable, exclusive_columns=exclusive_columns)
            else:
                m = F.select_mask(mask_score(score, w, h, damp), spec, transposable=transposable,
                                  exclusive_columns=exclusive_columns)
            masks_flat[kp] = m
            if refit:
                flat[kp] = refit_kernel(w, m, h, damp=damp)
    return traverse_util.unflatten_dict(flat), traverse_util.unflatten_dict(masks_flat)


refit_kernel = refit  # `refit` is also oneshot_refit's flag name
