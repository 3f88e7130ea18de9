"""Gradual magnitude pruning (GMP) through a ladder of V:N:M patterns, as an optax transform.

**Where the mask lives.** The optimizer state of :func:`gmp_prune` is the single source of truth:
``GMPState.masks`` is a params-shaped tree with a bool ``[K, R]`` mask at every pruned kernel (None
elsewhere). The model reads it through :func:`model_variables` / :func:`sparsity_collection`, which
build the ``"sparsity"`` collection of :class:`jaxsparse.nn.NMDense` from the state on every step; the
model stores no copy. Checkpointing the optimizer state checkpoints the masks.

**Schedule.** The cubic schedule of Zhu & Gupta (2017) gives a target sparsity
``s(t) = s_f * (1 - (1 - (t - t0) / (t1 - t0))^3)`` for ``t0 <= t <= t1`` (0 before, ``s_f`` after), with
``s_f`` the sparsity of the last ladder stage. Stage ``i`` of the ladder is entered at the first step of
the pruning grid (``t0, t0 + frequency, ...``, and ``t1``) where ``s(t)`` reaches that stage's sparsity,
so the realized sparsity is a staircase under the cubic curve. The entry steps are known when the
transform is built; masks are recomputed (``jaxsparse.format.select_mask`` on ``|params + updates|``)
only at those steps, inside ``lax.cond``.

**Exact zeros.** Put ``gmp_prune`` last in the chain: it rewrites the update of every pruned weight to
``-param``, so ``optax.apply_updates`` leaves exactly 0 there whatever the earlier transforms (momentum,
weight decay) produced, and a newly pruned weight becomes 0 on the step its mask appears.

**Learned masks (``regrow_every > 0``).** From the last stage's entry step up to ``regrow_until``, the
pruned weights are not zeroed: the dense master keeps training them (the model must see the masked
weights and hand back dense gradients, as :func:`straight_through` does; ``jaxsparse.train`` uses it),
each step they shrink by ``regrow_decay`` of their value on top of their update (SR-STE's decay of the
pruned weights, Zhou et al. 2021, decoupled), and every ``regrow_every`` steps (and at ``regrow_until``)
the masks of the last pattern are chosen again from the master. At ``regrow_until`` the masks become
final and the pruned weights exactly 0; ``tx.final_step`` is that step (the last stage's entry step
without regrowth).

Example::

    tx = optax.chain(optax.adamw(1e-4), gmp_prune(ladder=("2:4", "64:2:8"), begin_step=0, end_step=1000))
    state = tx.init(params)
    logits = model.apply(model_variables(params, state), x)      # masks from the optimizer state
    updates, state = tx.update(grads, state, params)             # params are required
    params = optax.apply_updates(params, updates)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util

from jaxsparse import format as fmt
from jaxsparse.nn import SPARSITY, compress_tree, compress_variables

__all__ = [
    "GMPSchedule",
    "GMPState",
    "gmp_prune",
    "default_ladder",
    "PUBLISHED_LADDER",
    "SCORES",
    "input_norms_tree",
    "path_filter",
    "encoder_kernels",
    "find_state",
    "any_of",
    "mask_change",
    "masks_of",
    "sparsity_collection",
    "model_variables",
    "oneshot_masks",
    "attention_kernels",
    "ffn_kernels",
    "ffn_out_kernels",
    "diagonal_mask",
    "sparsity_of",
    "straight_through",
    "to_compressed",
]

SCORES = ("magnitude", "activation")
"""Mask selection scores of :func:`gmp_prune`."""

PUBLISHED_LADDER = ("64:6:8", "64:4:8", "64:2:8")
"""The ladder of the published V:N:M GMP recipe (its N > 2 stages run masked-dense)."""

FilterFn = Callable[[tuple[str, ...], jax.Array], bool]


def default_ladder(final: str | fmt.VNM) -> tuple[fmt.VNM, ...]:
    """A ladder whose every stage runs on the sparse kernels, ending at ``final``.

    ``V:2:M`` gives ``2:4, V:2:8, V:2:16, ..., V:2:M`` (M doubling); ``2:4`` gives just ``(2:4,)``; an
    ``N > 2`` target gives ``(final,)``.
    """
    final = fmt.VNM.parse(final)
    if final.n != 2 or final.m == 4:
        return (final,)
    stages, m = [fmt.VNM(1, 2, 4)], 8
    while m < final.m:
        stages.append(fmt.VNM(final.v, 2, m))
        m *= 2
    return tuple(stages) + (final,)


@dataclasses.dataclass(frozen=True)
class GMPSchedule:
    """When each ladder stage starts. Steps count optimizer updates from 0.

    Attributes:
      ladder: patterns of strictly decreasing density.
      begin_step: first step of the cubic ramp ``t0``.
      end_step: last step ``t1`` (>= ``begin_step``); the last stage is in place from then on.
      frequency: spacing of the steps at which a stage may start.
    """

    ladder: tuple[fmt.VNM, ...]
    begin_step: int
    end_step: int
    frequency: int = 1

    def __post_init__(self) -> None:
        ladder = tuple(fmt.VNM.parse(s) for s in self.ladder)
        object.__setattr__(self, "ladder", ladder)
        if not ladder:
            raise ValueError("the GMP ladder needs at least one pattern")
        dens = [s.density for s in ladder]
        if any(b >= a for a, b in zip(dens, dens[1:])):
            raise ValueError(f"ladder densities must strictly decrease, got {[str(s) for s in ladder]}")
        if not 0 <= self.begin_step <= self.end_step:
            raise ValueError(f"need 0 <= begin_step <= end_step, got {self.begin_step}, {self.end_step}")
        if self.frequency < 1:
            raise ValueError(f"frequency must be >= 1, got {self.frequency}")

    @property
    def final_sparsity(self) -> float:
        return 1.0 - self.ladder[-1].density

    def target_sparsity(self, step: int) -> float:
        """The cubic target ``s(step)``."""
        if step < self.begin_step:
            return 0.0
        if step >= self.end_step:
            return self.final_sparsity
        frac = (step - self.begin_step) / (self.end_step - self.begin_step)
        return self.final_sparsity * (1.0 - (1.0 - frac) ** 3)

    @property
    def stage_steps(self) -> tuple[int, ...]:
        """The step at which each ladder stage starts (non-decreasing; equal steps: the later stage wins)."""
        grid = list(range(self.begin_step, self.end_step, self.frequency)) + [self.end_step]
        out = []
        for spec in self.ladder:
            need = 1.0 - spec.density - 1e-9
            out.append(next(t for t in grid if self.target_sparsity(t) >= need))
        return tuple(out)

    def stage_at(self, step: int) -> int:
        """0 before the first stage, else ``i`` when ``ladder[i - 1]`` is in force at ``step``."""
        return int(np.searchsorted(np.asarray(self.stage_steps), step, side="right"))

    def sparsity_at(self, step: int) -> float:
        """The sparsity the masks have after the update of ``step``."""
        stage = self.stage_at(step)
        return 0.0 if stage == 0 else 1.0 - self.ladder[stage - 1].density


class GMPState(NamedTuple):
    """State of :func:`gmp_prune`: the step count, the ladder stage (0 = dense), the masks, and with
    ``fade_steps > 0`` the next stage's mask while its pruned weights fade out (``()`` otherwise)."""

    count: jax.Array
    stage: jax.Array
    masks: Any
    target: Any = ()


def _path_names(path) -> tuple[str, ...]:
    """A pytree key path's names (``("encoder", "layer_0", "kernel")``); a Flax NNX Variable's ``.value`` step (the
    last key of a leaf in ``nnx.state(model)``) is dropped, so linen and NNX trees name a kernel alike."""
    names = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value":
            continue
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                names.append(str(getattr(k, attr)))
                break
        else:
            names.append(str(k))
    return tuple(names)


def path_filter(include: Sequence[str] = ("encoder",),
                exclude: Sequence[str] = ("embed", "classifier", "pooler", "head"),
                leaf: str = "kernel") -> FilterFn:
    """A layer filter: 2-D leaves named ``leaf`` whose path has a component containing one of
    ``include`` (all paths when empty) and none containing one of ``exclude``."""

    def keep(path: tuple[str, ...], x) -> bool:
        if not path or path[-1] != leaf or getattr(x, "ndim", 0) != 2:
            return False
        if any(e in p for p in path for e in exclude):
            return False
        return not include or any(i in p for p in path for i in include)

    return keep


encoder_kernels = path_filter()
"""The default filter: kernels under an ``encoder`` module; not embeddings, pooler or classifier."""


def _selected(params, filter_fn: FilterFn):
    """A params-shaped tree of True (pruned) / None (left dense)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: True if filter_fn(_path_names(p), x) else None, params)


def _map_selected(fn, selected, *trees):
    """``fn`` over the leaves of ``trees`` that ``selected`` marks; None elsewhere."""
    return jax.tree_util.tree_map(lambda s, *xs: None if s is None else fn(*xs), selected, *trees,
                                  is_leaf=lambda x: x is None)


def _select_all(params, selected, spec: fmt.VNM, input_sq=None, transposable: bool = False,
                exclusive_columns: bool = False, diagonal_fn: FilterFn | None = None):
    """Masks of ``spec`` by ``|W|``, or by ``|W_jr| * ||X_j||`` where ``input_sq`` (params-shaped, ``[K]``
    sums of squared inputs per kernel) is given; ``transposable`` masks (``select_mask``'s option) for the
    patterns that keep 2 per group, ``exclusive_columns`` ones for the V:2:M patterns with M > 4, plain ones for the
    ladder's other stages. The kernels ``diagonal_fn`` selects take, at V:2:M patterns with M >= 8,
    ``select_diagonal_mask``'s ``M / 4`` diagonal 2:4 blocks instead (the same density; transposable, their input
    features in chunks of V, so that relabelling them moves whole V blocks of the layer that produces them)."""
    opts = dict(transposable=transposable and spec.structured and spec.n == 2,
                exclusive_columns=exclusive_columns and fmt.takes_exclusive_columns(spec))
    none = jax.tree_util.tree_map(lambda _: None, selected, is_leaf=lambda x: x is None)
    marked = _selected(params, diagonal_fn) if diagonal_fn is not None and fmt.takes_diagonal_blocks(spec) else none
    sq = input_sq if input_sq is not None else none

    def one(p, q, d):
        score = p if q is None else jnp.abs(p) * jnp.sqrt(q)[:, None]
        return diagonal_mask(score, spec) if d else fmt.select_mask(score, spec, **opts)

    return jax.tree_util.tree_map(lambda s, p, q, d: None if s is None else one(p, q, d), selected, params, sq,
                                  marked, is_leaf=lambda x: x is None)


def diagonal_mask(scores: jax.Array, spec: str | fmt.VNM) -> jax.Array:
    """The diagonal 2:4 block mask that stands for ``spec`` (``jaxsparse.format.select_diagonal_mask`` with
    ``diagonal_blocks(spec)`` blocks): transposable, since the layout's input gradient runs on the blocks' ``W^T``,
    and its input sets in whole chunks of V, so that relabelling them moves whole V blocks of the V:2:M layer that
    produces them (:func:`to_compressed`)."""
    spec = fmt.VNM.parse(spec)
    return fmt.select_diagonal_mask(scores, fmt.diagonal_blocks(spec), transposable=True, chunk=spec.v)


def ffn_out_kernels(path: tuple[str, ...], x) -> bool:
    """A filter for ``diagonal_fn``: the FFN's second kernel of each BERT encoder layer
    (``encoder_layer_<i>/output/kernel``, not the attention's ``output``), whose input features (the FFN's hidden
    units) can be relabelled at no cost."""
    return (len(path) >= 3 and path[-1] == "kernel" and path[-2] == "output" and path[-3].startswith("encoder_layer_")
            and getattr(x, "ndim", 0) == 2)


def ffn_kernels(path: tuple[str, ...], x) -> bool:
    """A filter for ``diagonal_fn``: both FFN kernels of each BERT encoder layer (``encoder_layer_<i>/intermediate/
    kernel`` and ``encoder_layer_<i>/output/kernel``), the attention's four kernels left out: the layers that
    ``BertConfig.diagonal_ffn`` stores as diagonal blocks read through chunk tables."""
    return ffn_out_kernels(path, x) or (len(path) >= 3 and path[-1] == "kernel" and path[-2] == "intermediate"
                                        and path[-3].startswith("encoder_layer_") and getattr(x, "ndim", 0) == 2)


def attention_kernels(path: tuple[str, ...], x) -> bool:
    """A filter for ``diagonal_fn``: the four attention kernels of each BERT encoder layer
    (``encoder_layer_<i>/attention/{query,key,value,output}/kernel``)."""
    return (len(path) >= 4 and path[-1] == "kernel" and path[-2] in ("query", "key", "value", "output")
            and path[-3] == "attention" and path[-4].startswith("encoder_layer_") and getattr(x, "ndim", 0) == 2)


def any_of(*filters: FilterFn) -> FilterFn:
    """The filter that keeps what any of ``filters`` keeps."""
    return lambda path, x: any(f(path, x) for f in filters)


def input_norms_tree(stats, params) -> Any:
    """Params-shaped tree of ``[K]`` input sums of squares (at each ``.../module/kernel``; None elsewhere)
    from the :data:`jaxsparse.nn.INPUT_STATS` collection (``.../module/sq``)."""
    flat = traverse_util.flatten_dict(dict(stats))
    by_module = {p[:-1]: v for p, v in flat.items() if p[-1] == "sq"}
    return jax.tree_util.tree_map_with_path(
        lambda path, x: by_module.get(_path_names(path)[:-1]) if _path_names(path)[-1] == "kernel" else None, params)


def gmp_prune(
    ladder: Sequence[str | fmt.VNM] | str = "64:2:8",
    begin_step: int = 0,
    end_step: int = 1000,
    frequency: int = 1,
    filter_fn: FilterFn = encoder_kernels,
    fade_steps: int = 0,
    score: str = "magnitude",
    regrow_every: int = 0,
    regrow_until: int | None = None,
    regrow_decay: float = 0.0,
    transposable: bool = False,
    exclusive_columns: bool = False,
    diagonal_fn: FilterFn | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Gradual magnitude pruning through ``ladder`` on the cubic schedule (see the module doc).

    Args:
      ladder: the patterns in order, or one final pattern string expanded by :func:`default_ladder`
        (``"128:2:16"`` -> ``2:4, 128:2:8, 128:2:16``). Use :data:`PUBLISHED_LADDER` for the published one.
      begin_step, end_step, frequency: see :class:`GMPSchedule`. ``begin_step == end_step`` prunes once
        (one-shot) to the last stage at that step.
      filter_fn: ``(path_names, leaf) -> bool`` choosing the kernels to prune.
      fade_steps: soften each stage change. ``fade_steps`` updates before a stage starts (not before the
        previous stage's start), its mask is chosen once from the weights of that step, and the weights
        it will prune shrink over those updates (each update scales them by ``r / (r + 1)`` with ``r``
        updates left, so they decay linearly to ``1 / (fade_steps + 1)`` of their value) before the
        stage cuts them. Large jumps (``2:4 -> 64:2:8`` drops about half of the weight magnitude) then
        reach the network gradually. 0 (default): masks change at once.
      score: ``"magnitude"`` (``|W|``) or ``"activation"`` (``|W_jr| * ||X_j||``, each weight scaled by the
        norm of its input feature, as Wanda does). ``"activation"`` needs the extra argument
        ``input_sq`` in ``update`` (a params-shaped tree of ``[K]`` sums of squared inputs:
        :func:`input_norms_tree` of the model's :data:`jaxsparse.nn.INPUT_STATS` collection);
        :func:`jaxsparse.train.make_step` passes it.
      regrow_every: learned masks (see the module doc): reselect the last pattern's masks every this many
        steps after its entry step, while the pruned weights keep training. 0 (default): masks change only
        at stage entries and pruned weights are zeroed at once.
      regrow_until: with ``regrow_every > 0``, the step at which the masks become final (``>= end_step``).
      regrow_decay: with ``regrow_every > 0``, the fraction in ``[0, 1)`` of its value that a pruned weight
        loses each step of the window, on top of its optimizer update.
      transposable: choose the 2-per-group stages' masks with ``select_mask(..., transposable=True)``, so that the
        input gradient can take ``jaxsparse.ops.spmm_t``'s ``"transposed"`` route: trace the compressed step
        inside ``jaxsparse.ops.dx_route_scope("transposed")`` (or set ``JAXSPARSE_DX=transposed``), as
        ``jaxsparse-train --transposable-masks`` does. The recommended setting at 64:2:8 (docs/results.md,
        session 20: no accuracy cost measured; dX 1.0-1.23x over dense on an H100).
      exclusive_columns: choose the V:2:M stages' masks (M > 4) with ``select_mask(..., exclusive_columns=True)``:
        each input column of a group kept by at most ``jaxsparse.format.column_cap`` blocks (an accuracy study
        for a cheaper input gradient at high M; ``jaxsparse-train --exclusive-columns``).
      diagonal_fn: the kernels (a filter like ``filter_fn``, e.g. :func:`ffn_out_kernels`) whose V:2:M stages with
        M >= 8 take ``jaxsparse.format.select_diagonal_mask``'s ``M / 4`` diagonal 2:4 blocks instead, at the same
        density (an accuracy study for a faster FFN; ``jaxsparse-train --diagonal-ffn-out``). None: none.

    Returns:
      A transform whose ``update(updates, state, params)`` requires ``params``; chain it last. Its
      attributes ``schedule``, ``score``, ``regrow`` (whether masks are learned) and ``final_step`` (the
      step whose update fixes the final masks) are read by the trainer.
    """
    if isinstance(ladder, (str, fmt.VNM)):
        ladder = default_ladder(ladder)
    schedule = GMPSchedule(tuple(ladder), begin_step, end_step, frequency)
    entries = jnp.asarray(schedule.stage_steps, jnp.int32)
    if fade_steps < 0:
        raise ValueError(f"fade_steps must be >= 0, got {fade_steps}")
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    regrow = regrow_every > 0
    if regrow_every < 0:
        raise ValueError(f"regrow_every must be >= 0, got {regrow_every}")
    if regrow and (regrow_until is None or regrow_until < end_step):
        raise ValueError(f"regrow_every > 0 needs regrow_until >= end_step ({end_step}), got {regrow_until}")
    if not 0.0 <= regrow_decay < 1.0:
        raise ValueError(f"regrow_decay must be in [0, 1), got {regrow_decay}")
    last_entry = schedule.stage_steps[-1]
    final_step = regrow_until if regrow else last_entry
    starts = (0,) + schedule.stage_steps[:-1]
    fade_starts = jnp.asarray([max(e - fade_steps, s) for e, s in zip(schedule.stage_steps, starts)], jnp.int32)
    n_stages = len(schedule.ladder)

    def init(params):
        selected = _selected(params, filter_fn)
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        n_sel = 0
        for (path, x), s in zip(flat, jax.tree_util.tree_leaves(selected, is_leaf=lambda x: x is None)):
            if s is None:
                continue
            n_sel += 1
            for spec in schedule.ladder:
                try:
                    fmt.validate_shape(x.shape, spec)
                    if transposable and spec.structured and spec.n == 2:  # the stages _select_all makes transposable
                        fmt.check_transposable_spec(x.shape, spec)
                    if (diagonal_fn is not None and diagonal_fn(_path_names(path), x)
                            and fmt.takes_diagonal_blocks(spec)):
                        fmt.check_diagonal_shape(x.shape, fmt.diagonal_blocks(spec), True, spec.v)
                except ValueError as e:
                    raise ValueError(f"gmp_prune: layer {'/'.join(_path_names(path))}: {e}") from None
        if n_sel == 0:
            raise ValueError("gmp_prune: filter_fn selected no 2-D kernel to prune")
        masks = _map_selected(lambda p: jnp.ones(p.shape, jnp.bool_), selected, params)
        target = masks if fade_steps > 0 else ()
        return GMPState(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32), masks, target)

    def update(updates, state: GMPState, params=None, input_sq=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError("gmp_prune needs params: call tx.update(grads, state, params)")
        if score == "activation" and input_sq is None:
            raise ValueError("gmp_prune(score='activation') needs input_sq: tx.update(grads, state, params, "
                             "input_sq=input_norms_tree(stats, params)) (jaxsparse.train.make_step does this)")
        sq = input_sq if score == "activation" else None
        selected = _selected(params, filter_fn)
        updates_in = updates
        stage = jnp.sum(entries <= state.count).astype(jnp.int32)
        new_params = _map_selected(lambda p, u: p + u, selected, params, updates)

        def recompute(_):
            branches = [lambda np_, spec=spec: _select_all(np_, selected, spec, sq, transposable, exclusive_columns,
                                                           diagonal_fn)
                        for spec in schedule.ladder]
            return jax.lax.switch(stage - 1, branches, new_params)

        change = stage != state.stage
        if regrow:  # the last pattern, chosen again from the master every regrow_every steps of the window
            since = state.count - last_entry
            change |= (since > 0) & (state.count <= final_step) & ((since % regrow_every == 0) |
                                                                    (state.count == final_step))
        masks = jax.lax.cond(change, recompute, lambda _: state.masks, None)
        target = state.target
        if fade_steps > 0:
            # The next stage (index `stage` of the ladder) fades in over [fade_start, entry).
            nxt = jnp.minimum(stage, n_stages - 1)
            entry, start = entries[nxt], fade_starts[nxt]
            fading = (stage < n_stages) & (state.count >= start) & (state.count < entry)

            def choose(_):
                branches = [lambda np_, spec=spec: _select_all(np_, selected, spec, sq, transposable, exclusive_columns,
                                                           diagonal_fn)
                            for spec in schedule.ladder]
                return jax.lax.switch(nxt, branches, new_params)

            target = jax.lax.cond(fading & (state.count == start), choose, lambda _: state.target, None)
            left = (entry - state.count).astype(jnp.float32)
            scale = jnp.where(fading, left / (left + 1.0), 1.0)
            new_params = _map_selected(
                lambda q, t: jnp.where(t, q, (q * scale).astype(q.dtype)), selected, new_params, target)
            updates = _map_selected(lambda q, p: q - p, selected, new_params, params)  # the faded step
            updates = jax.tree_util.tree_map(lambda s, u, f: u if s is None else f, selected, updates_in, updates,
                                             is_leaf=lambda x: x is None)
        learning = regrow and (state.count >= last_entry) & (state.count < final_step)

        def pruned_update(u, p):  # zeroed, or (in the learned-mask window) trained and decayed
            if not regrow:
                return -p
            return jnp.where(learning, u - regrow_decay * p, -p)

        updates = jax.tree_util.tree_map(
            lambda s, u, p, m: u if s is None else jnp.where(m, u, pruned_update(u, p)).astype(u.dtype),
            selected, updates, params, _fill(masks, selected), is_leaf=lambda x: x is None)
        return updates, GMPState(state.count + 1, stage, masks, target)

    tx = optax.GradientTransformationExtraArgs(init, update)
    tx.schedule = schedule  # type: ignore[attr-defined]  # read by tests and the trainer
    tx.score = score  # type: ignore[attr-defined]  # the trainer collects input statistics for "activation"
    tx.regrow = regrow  # type: ignore[attr-defined]  # the trainer hands back dense gradients (straight_through)
    tx.final_step = final_step  # type: ignore[attr-defined]  # the trainer compresses after it
    return tx


def straight_through(params, masks) -> Any:
    """``params`` with every masked kernel's pruned entries read as 0, while the gradient passes to all.

    The value at a leaf with a mask is ``where(mask, p, 0)``; its gradient with respect to ``p`` is the
    identity (the straight-through estimator), so a model applied to these params without masks computes
    the masked product and hands back the dense gradient that :func:`gmp_prune`'s learned masks train the
    pruned weights with. Leaves whose mask is None pass unchanged.
    """
    return jax.tree_util.tree_map(
        lambda m, p: p if m is None else p + jax.lax.stop_gradient(jnp.where(m, p, jnp.zeros((), p.dtype)) - p),
        masks, params, is_leaf=lambda x: x is None)


def _fill(masks, selected):
    """``masks`` with None leaves replaced by a placeholder so it zips with full params trees."""
    return jax.tree_util.tree_map(lambda s, m: False if s is None else m, selected, masks,
                                  is_leaf=lambda x: x is None)


def find_state(opt_state) -> GMPState:
    """The :class:`GMPState` inside a (possibly chained / nested) optimizer state."""
    if isinstance(opt_state, GMPState):
        return opt_state
    if isinstance(opt_state, (tuple, list)):
        for s in opt_state:
            try:
                return find_state(s)
            except LookupError:
                pass
    if isinstance(opt_state, dict):
        for s in opt_state.values():
            try:
                return find_state(s)
            except LookupError:
                pass
    for field in ("inner_state", "inner_states", "inner_opt_state"):
        if hasattr(opt_state, field):
            return find_state(getattr(opt_state, field))
    raise LookupError("no GMPState in this optimizer state: was gmp_prune in the chain?")


def masks_of(opt_state) -> Any:
    """The params-shaped mask tree (None at unpruned leaves) held by the optimizer state."""
    return find_state(opt_state).masks


def sparsity_collection(masks) -> dict:
    """The ``"sparsity"`` collection for :class:`~jaxsparse.nn.NMDense` from a params-shaped mask tree:
    the mask of ``.../module/kernel`` becomes ``.../module/mask``."""
    flat = traverse_util.flatten_dict(dict(masks))
    out = {p[:-1] + ("mask",): m for p, m in flat.items() if m is not None}
    return traverse_util.unflatten_dict(out)


def model_variables(params, opt_state=None, masks=None, **collections) -> dict:
    """``{"params": params, "sparsity": masks}`` for ``model.apply``, masks read from ``opt_state``
    (or given directly as a params-shaped tree); extra collections are passed through."""
    if masks is None and opt_state is not None:
        masks = masks_of(opt_state)
    out = {"params": params, **collections}
    if masks is not None:
        out[SPARSITY] = sparsity_collection(masks)
    return out


def oneshot_masks(params, spec: str | fmt.VNM, filter_fn: FilterFn = encoder_kernels, input_sq=None,
                  transposable: bool = False, exclusive_columns: bool = False,
                  diagonal_fn: FilterFn | None = None) -> Any:
    """Masks of pattern ``spec`` for the kernels ``filter_fn`` selects (None elsewhere): by magnitude, or by
    ``|W_jr| * ||X_j||`` with ``input_sq`` (see :func:`gmp_prune`'s ``score="activation"``); ``transposable``,
    ``exclusive_columns`` and ``diagonal_fn`` as in :func:`gmp_prune`."""
    spec = fmt.VNM.parse(spec)
    selected = _selected(params, filter_fn)
    if all(s is None for s in jax.tree_util.tree_leaves(selected, is_leaf=lambda x: x is None)):
        raise ValueError("oneshot_masks: filter_fn selected no 2-D kernel to prune")
    return _select_all(params, selected, spec, input_sq, transposable, exclusive_columns,
                       diagonal_fn)


def mask_change(before, after) -> float:
    """Share of the kept entries of ``after`` (a params-shaped mask tree) that ``before`` did not keep."""
    new = kept = 0
    for b, a in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after)):
        a = np.asarray(a, bool)
        new += int((a & ~np.asarray(b, bool)).sum())
        kept += int(a.sum())
    if kept == 0:
        raise ValueError("mask_change: no kept entry in `after`")
    return new / kept


def sparsity_of(params, masks) -> float:
    """Fraction of exact zeros over the masked kernels of ``params``."""
    zeros = total = 0
    for s, p in zip(jax.tree_util.tree_leaves(masks, is_leaf=lambda x: x is None),
                    jax.tree_util.tree_leaves(params)):
        if s is not None:
            zeros += int((np.asarray(p) == 0).sum())
            total += p.size
    if total == 0:
        raise ValueError("sparsity_of: no masked kernel")
    return zeros / total


def _diagonal_relabelling(masks_flat: dict, spec: fmt.VNM, diagonal_fn: FilterFn | None) -> dict:
    """``{kernel path: permutation}`` of the diagonal-block kernels among ``masks_flat`` (a flat params-shaped mask
    tree): the order of their input features, set by set (``jaxsparse.format.diagonal_sets`` in chunks of V)."""
    if diagonal_fn is None or not fmt.takes_diagonal_blocks(spec):
        return {}
    out = {}
    for path, m in masks_flat.items():
        if m is None or path[-1] != "kernel" or not diagonal_fn(_path_names(path), m):
            continue
        producer = path[:-2] + ("intermediate", "kernel")
        if masks_flat.get(producer) is None:
            raise ValueError(f"to_compressed: the diagonal blocks of {'/'.join(map(str, path))} relabel the outputs "
                             f"of {'/'.join(map(str, producer))}, which must be pruned with them")
        out[path] = np.asarray(fmt.diagonal_sets(m, fmt.diagonal_blocks(spec), chunk=spec.v)).reshape(-1)
    return out


def _relabel(tree, perms: dict):
    """A params-shaped ``tree`` with each diagonal kernel's input features (its rows) and its producer's outputs (the
    ``intermediate`` kernel's columns and bias) in the order ``perms`` gives: the same function."""
    flat = dict(traverse_util.flatten_dict(dict(tree)))
    for path, perm in perms.items():
        producer = path[:-2] + ("intermediate",)
        if flat.get(path) is not None:
            flat[path] = flat[path][perm]
        if flat.get(producer + ("kernel",)) is not None:
            flat[producer + ("kernel",)] = flat[producer + ("kernel",)][:, perm]
        if flat.get(producer + ("bias",)) is not None:
            flat[producer + ("bias",)] = flat[producer + ("bias",)][perm]
    return traverse_util.unflatten_dict(flat)


def to_compressed(params, masks, spec: str | fmt.VNM, opt_state=None, diagonal_fn: FilterFn | None = None,
                  diagonal_chunks: bool = False):
    """Switch training to compressed mode once the final N = 2 masks are in place.

    Args:
      params: master-mode params (dense kernels).
      masks: a params-shaped mask tree (:func:`masks_of`) or a ``"sparsity"`` collection.
      spec: the N = 2 pattern the masks obey.
      opt_state: optional state of the optimizer *without* ``gmp_prune`` (e.g. ``opt_state[0]`` of
        ``optax.chain(adamw, gmp_prune(...))``); every params-shaped subtree in it (Adam's ``mu``,
        ``nu``, ...) is gathered into the values layout, so the same optimizer continues seamlessly.
      diagonal_fn: the kernels whose masks are diagonal 2:4 blocks (``gmp_prune``'s option; a params-shaped mask
        tree then). Each one's input features, and the outputs of the ``intermediate`` kernel beside it that
        produces them (its columns, bias and their optimizer state), are relabelled set by set, which changes no
        output; the kernel is then stored as its stacked blocks (``jaxsparse.format.stack_diagonal_blocks``,
        compressed 2:4), for the model built with ``BertConfig.diagonal_ffn_out``.
      diagonal_chunks: keep every diagonal kernel's inputs where they are and store its chunk table instead (the
        ``"sparsity"`` entry ``chunks``, :func:`jaxsparse.format.diagonal_chunks`; its rows are stacked in the
        table's order): any layer, no relabelling, for the model built with ``BertConfig.diagonal_all``. The masks'
        input sets must be whole 64-feature chunks (``chunk = V`` with V a multiple of 64).

    Returns:
      ``(params, sparsity)`` -- or ``(params, sparsity, opt_state)`` when ``opt_state`` is given -- for
      the model built with ``compressed=True``.
    """
    spec = fmt.VNM.parse(spec)
    flat = dict(traverse_util.flatten_dict(dict(masks)))
    diagonal_masks = {}  # kernel path -> its stacked blocks' mask
    orders = {}  # kernel path -> the order of its rows in the stacked blocks (diagonal_chunks)
    tables = {}  # kernel path -> its chunk table (diagonal_chunks)
    if diagonal_chunks and diagonal_fn is None:
        raise ValueError("to_compressed: diagonal_chunks stores the tables of the kernels diagonal_fn selects: give "
                         "diagonal_fn")
    if diagonal_chunks and any(p[-1] == "kernel" for p in flat):
        g = fmt.diagonal_blocks(spec)
        for path, m in list(flat.items()):
            if m is None or path[-1] != "kernel" or not diagonal_fn(_path_names(path), m):
                continue
            tables[path] = fmt.diagonal_chunks(m, g)
            orders[path] = np.asarray(fmt.chunk_columns(tables[path]))
            diagonal_masks[path] = fmt.stack_diagonal_blocks(flat.pop(path)[orders[path]], g)
        masks = sparsity_collection(traverse_util.unflatten_dict(flat))
    elif any(p[-1] == "kernel" for p in flat):  # a params-shaped mask tree
        perms = _diagonal_relabelling(flat, spec, diagonal_fn)
        if perms:
            params = _relabel(params, perms)
            opt_state = None if opt_state is None else _map_params_like(lambda n: _relabel(n, perms), opt_state, params)
            flat = dict(traverse_util.flatten_dict(dict(_relabel(masks, perms))))
            diagonal_masks = {p: fmt.stack_diagonal_blocks(flat.pop(p), fmt.diagonal_blocks(spec)) for p in perms}
        masks = sparsity_collection(traverse_util.unflatten_dict(flat))
    elif diagonal_fn is not None:
        raise ValueError("to_compressed: diagonal_fn needs a params-shaped mask tree (masks_of), not a sparsity "
                         "collection")

    def stack(tree):
        """A (relabelled, otherwise compressed) params-shaped tree with its diagonal kernels as stacked 2:4 values,
        and the ``"sparsity"`` entries (metadata) of those."""
        flat_t, pattern = dict(traverse_util.flatten_dict(dict(tree))), {}
        for path, mask in diagonal_masks.items():
            w = flat_t.pop(path)
            w = w[orders[path]] if path in orders else w
            sw = fmt.compress(fmt.stack_diagonal_blocks(w, fmt.diagonal_blocks(spec)), mask, "2:4")
            flat_t[path[:-1] + ("values",)] = sw.values
            pattern[path[:-1] + ("metadata",)] = sw.metadata
            if path in tables:
                pattern[path[:-1] + ("chunks",)] = jnp.asarray(tables[path])
        return traverse_util.unflatten_dict(flat_t), pattern

    c_params, pattern = compress_variables(params, masks, spec)
    c_params, diagonal_pattern = stack(c_params)
    pattern = traverse_util.unflatten_dict({**traverse_util.flatten_dict(dict(pattern)), **diagonal_pattern})
    if opt_state is None:
        return c_params, pattern
    c_state = _map_params_like(lambda n: stack(compress_tree(n, masks, spec))[0], opt_state, params)
    return c_params, pattern, c_state


def _map_params_like(fn, tree, params):
    """``fn`` over every subtree of ``tree`` shaped like ``params`` (Adam's ``mu``, ``nu``, ...)."""
    structure = jax.tree_util.tree_structure(params)

    def params_like(node) -> bool:
        return jax.tree_util.tree_structure(node) == structure

    return jax.tree_util.tree_map(lambda n: fn(n) if params_like(n) else n, tree, is_leaf=params_like)
