"""The V:N:M sparse format: pattern spec, mask selection, compression and its inverse.

The byte layout is written down in ``docs/format.md``; the functions here are its executable
definition. A Flax kernel ``w`` has shape ``[K, R]`` (``K`` input features, ``R`` output features);
groups of ``M`` run along ``K`` and a V-block is ``V`` consecutive output features.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "VNM",
    "SparseWeight",
    "select_mask",
    "select_diagonal_mask",
    "diagonal_blocks",
    "takes_diagonal_blocks",
    "diagonal_sets",
    "stack_transposed_blocks",
    "stack_diagonal_blocks",
    "DIAGONAL_CHUNK",
    "takes_chunked_diagonal_blocks",
    "chunked_diagonal_blocks",
    "diagonal_chunks",
    "chunk_columns",
    "check_chunks",
    "mask_is_valid",
    "check_mask",
    "compress",
    "decompress",
    "compress_like",
    "kept_columns",
    "as_2_4",
    "validate_shape",
    "transposable_mask_is_valid",
    "kept_mask",
    "transpose_2_4",
    "check_transpose_2_4_shape",
    "condensed_dx_operands",
    "column_cap",
    "columns_are_exclusive",
    "takes_exclusive_columns",
    "check_exclusive_spec",
    "block_dx_operands",
    "resident_dx_fragments",
]

GROUPS_PER_WORD = 8  # metadata groups (4 bits each) in one uint32 word


@dataclasses.dataclass(frozen=True)
class VNM:
    """A V:N:M sparsity pattern.

    Attributes:
      v: rows (output features) per block that share their kept columns; 1 for plain N:M.
      n: non-zeros kept per row in every group of ``m`` columns.
      m: group width along the reduction dimension.
    """

    v: int
    n: int
    m: int

    def __post_init__(self) -> None:
        for name in ("v", "n", "m"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"VNM.{name} must be a positive integer, got {value!r}")
        if self.n >= self.m:
            raise ValueError(f"VNM needs n < m, got {self.n}:{self.m}")
        if self.structured and self.m < 4:
            raise ValueError(f"VNM patterns with n <= 2 need m >= 4 (4 kept columns per block), got m={self.m}")

    @classmethod
    def parse(cls, spec: Union[str, "VNM"]) -> "VNM":
        """Parses ``"N:M"`` (V = 1) or ``"V:N:M"``, e.g. ``"2:4"``, ``"64:2:8"``, ``"128:2:16"``."""
        if isinstance(spec, VNM):
            return spec
        if not isinstance(spec, str) or not re.fullmatch(r"\s*\d+\s*(:\s*\d+\s*){1,2}", spec):
            raise ValueError(f"a sparsity spec is 'N:M' or 'V:N:M' with positive integers, got {spec!r}")
        parts = [int(p) for p in spec.split(":")]
        if len(parts) == 2:
            parts = [1] + parts
        return cls(*parts)

    def __str__(self) -> str:
        return f"{self.n}:{self.m}" if self.v == 1 else f"{self.v}:{self.n}:{self.m}"

    @property
    def density(self) -> float:
        """Fraction of weights kept."""
        return self.n / self.m

    @property
    def structured(self) -> bool:
        """True when blocks keep 4 shared columns (n <= 2), the pattern the kernels run."""
        return self.n <= 2


def validate_shape(shape: tuple[int, int], spec: VNM, *, compressed: bool = False) -> None:
    """Raises ``ValueError`` if a ``[K, R]`` kernel cannot carry ``spec``."""
    if len(shape) != 2:
        raise ValueError(f"a sparse kernel is 2-D [K, R], got shape {tuple(shape)}")
    k, r = shape
    if k % spec.m:
        raise ValueError(f"K (input features) = {k} must be a multiple of M = {spec.m} for {spec}")
    if spec.structured and r % spec.v:
        raise ValueError(f"R (output features) = {r} must be a multiple of V = {spec.v} for {spec}")
    if compressed:
        if spec.n != 2:
            raise ValueError(f"the compressed format needs N = 2, got {spec}; run N != 2 stages masked-dense")
        if k % (GROUPS_PER_WORD * spec.m):
            raise ValueError(
                f"K = {k} must be a multiple of 8*M = {GROUPS_PER_WORD * spec.m} for compressed {spec}: "
                "one uint32 metadata word holds 8 groups"
            )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SparseWeight:
    """A compressed V:2:M weight (layout in ``docs/format.md``).

    Attributes:
      values: ``[R, 2*G]`` kept values, ``G = K / M``.
      columns: ``[R/V, G, 4]`` uint8 kept columns per block, ascending; ``None`` when ``M = 4``.
      metadata: ``[R, G/8]`` uint32, 4 bits per group: positions of the two values among the 4 columns.
      shape: the dense Flax kernel shape ``(K, R)``.
      spec: the pattern.
    """

    values: jax.Array
    columns: jax.Array | None
    metadata: jax.Array
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    spec: VNM = dataclasses.field(metadata=dict(static=True))

    @property
    def dtype(self):
        return self.values.dtype

    def replace(self, **kwargs) -> "SparseWeight":
        return dataclasses.replace(self, **kwargs)


def check_weight_arrays(sw: SparseWeight) -> None:
    """Raises ``ValueError`` unless ``sw``'s arrays have the shapes and dtypes its ``shape`` and ``spec`` give
    (``docs/format.md``): values ``[R, 2 K/M]``, metadata uint32 ``[R, K/(8M)]``, columns uint8 ``[R/V, K/M, 4]``
    (None exactly when ``M = 4``). Shapes are static, so this works on traced arrays too."""
    k, r = sw.shape
    spec = sw.spec
    g = k // spec.m
    want = {"values": (r, 2 * g), "metadata": (r, g // 8)}
    if spec.m != 4:
        want["columns"] = (r // spec.v, g, 4)
    for name, shape in want.items():
        got = getattr(sw, name)
        if got is None or tuple(got.shape) != shape:
            raise ValueError(f"a {spec} SparseWeight of shape {sw.shape} needs {name} of shape {shape}, got "
                             f"{None if got is None else tuple(got.shape)}")
    if spec.m == 4 and sw.columns is not None:
        raise ValueError(f"a 2:4 SparseWeight has no columns (None), got an array of shape {tuple(sw.columns.shape)}")
    if jnp.dtype(sw.metadata.dtype) != jnp.uint32:
        raise ValueError(f"SparseWeight metadata must be uint32, got {sw.metadata.dtype}")
    if sw.columns is not None and jnp.dtype(sw.columns.dtype) != jnp.uint8:
        raise ValueError(f"SparseWeight columns must be uint8, got {sw.columns.dtype}")


# ----------------------------------------------------------------------------- mask selection


def _top_n_mask(x: jax.Array, n: int) -> jax.Array:
    """Boolean mask of the ``n`` largest entries along the last axis (ties: lower index wins)."""
    order = jnp.argsort(-x, axis=-1, stable=True)
    ranks = jnp.argsort(order, axis=-1, stable=True)
    return ranks < n


def _top_n_sum(x: jax.Array, n: int) -> jax.Array:
    """Sum of the ``n`` largest entries along the last axis."""
    return jnp.sort(x, axis=-1)[..., x.shape[-1] - n :].sum(axis=-1)


def _set_score(blocks: jax.Array, cols: jax.Array, n: int) -> jax.Array:
    """Magnitude kept in each block when it keeps ``cols``; blocks ``[B, V, G, M]``, cols ``[B, G, 4]``."""
    picked = jnp.take_along_axis(blocks, cols[:, None, :, :], axis=-1)
    return _top_n_sum(picked, n).sum(axis=1)


def _exact_columns(blocks: jax.Array, n: int) -> jax.Array:
    """The best 4 columns per block by exhaustive search over all C(M, 4) sets."""
    m = blocks.shape[-1]
    combos = jnp.asarray(list(itertools.combinations(range(m), 4)), dtype=jnp.int32)
    nb, _, g, _ = blocks.shape

    def step(best, combo):
        best_score, best_idx, idx = best
        score = _top_n_sum(blocks[..., combo], n).sum(axis=1)
        better = score > best_score
        return (jnp.where(better, score, best_score), jnp.where(better, idx, best_idx), idx + 1), None

    init = (jnp.full((nb, g), -jnp.inf, blocks.dtype), jnp.zeros((nb, g), jnp.int32), jnp.int32(0))
    (_, best_idx, _), _ = jax.lax.scan(step, init, combos)
    return combos[best_idx]


def _greedy_columns(blocks: jax.Array, n: int, rounds: int) -> jax.Array:
    """4 columns per block: start from each row's top-n votes, then best-improvement swaps."""
    m = blocks.shape[-1]
    votes = jnp.where(_top_n_mask(blocks, n), blocks, 0.0).sum(axis=1)  # [B, G, M]
    votes = votes + 1e-6 * blocks.sum(axis=1)  # ties broken by total magnitude
    cols = jnp.argsort(-votes, axis=-1, stable=True)[..., :4].astype(jnp.int32)
    swaps = jnp.asarray([(i, j) for i in range(4) for j in range(m)], dtype=jnp.int32)

    def one_round(cols, _):
        def step(best, swap):
            best_score, best_cols = best
            slot, col = swap[0], swap[1]
            taken = (cols == col).any(axis=-1)
            cand = cols.at[..., slot].set(col)
            score = jnp.where(taken, -jnp.inf, _set_score(blocks, cand, n))
            better = score > best_score
            return (jnp.where(better, score, best_score), jnp.where(better[..., None], cand, best_cols)), None

        (_, new_cols), _ = jax.lax.scan(step, (_set_score(blocks, cols, n), cols), swaps)
        return new_cols, None

    cols, _ = jax.lax.scan(one_round, cols, None, length=rounds)
    return cols


EXACT_SEARCH_MAX_M = 8  # C(8, 4) = 70 candidate sets: exhaustive search is cheaper than swaps above this


def _choose_columns(blocks: jax.Array, n: int, method: str) -> jax.Array:
    if method == "auto":
        method = "exact" if blocks.shape[-1] <= EXACT_SEARCH_MAX_M else "greedy"
    if method == "exact":
        cols = _exact_columns(blocks, n)
    elif method == "greedy":
        cols = _greedy_columns(blocks, n, rounds=2)
    else:
        raise ValueError(f"column search method must be 'auto', 'exact' or 'greedy', got {method!r}")
    return jnp.sort(cols, axis=-1)


def select_mask(scores: jax.Array, spec: Union[str, VNM], *, method: str = "auto",
                transposable: bool = False, exclusive_columns: bool = False) -> jax.Array:
    """Chooses a mask of pattern ``spec`` that keeps the largest ``|scores|``.

    For ``n <= 2`` every ``V x M`` block keeps 4 columns (exact search over all ``C(M, 4)`` sets for
    ``M <= 8``, a vote-then-swap heuristic above; ``method`` forces either), then each row keeps its
    top ``n`` of those. For ``n > 2`` each row keeps its top ``n`` of every ``M``. Jit-able.

    With ``transposable`` (``n = 2`` only), the rows keep instead, for every 4 consecutive output features and
    every group, the best of the 90 ways to keep 2 of the block's 4 columns in each of the 4 rows and each column
    in 2 of the rows: the mask then also keeps at most 2 of every 4 consecutive output features in each input
    feature's column, so ``W^T`` is 2:4 sparse over the output features (:func:`transpose_2_4`) and the input
    gradient can run as a 2:4 forward product (``jaxsparse.ops.spmm_t``'s ``"transposed"`` route).

    With ``exclusive_columns`` (``n <= 2``, ``M > 4``), every input column of a group is kept by at most
    :func:`column_cap` ``= ceil(4 (R/V) / M)`` of the ``R/V`` blocks (1 at ``R/V <= M/4``: the blocks then share no
    column). The blocks' columns are chosen greedily by the rows' top-n votes, highest first, each column given to at
    most that many blocks, and a block the greedy pass leaves short takes a column from a block that can swap for a
    free one. The input gradient's work per column then falls with M (``docs/kernel-notes.md``, session 24's
    proposal); :func:`columns_are_exclusive` checks a mask.

    Args:
      scores: ``[K, R]`` importance scores, usually the kernel itself.
      spec: the pattern, e.g. ``"64:2:8"``.
      method: ``"auto"``, ``"exact"`` or ``"greedy"`` column search (not used with ``exclusive_columns``).
      transposable: also keep ``W^T`` 2:4 along the output features (needs ``n = 2``, ``R % 4 == 0`` and, for
        ``M > 4``, ``V % 4 == 0``).
      exclusive_columns: cap the blocks that keep each column of a group at :func:`column_cap`.

    Returns:
      A boolean ``[K, R]`` mask.
    """
    spec = VNM.parse(spec)
    validate_shape(scores.shape, spec)
    if method not in ("auto", "exact", "greedy"):
        raise ValueError(f"column search method must be 'auto', 'exact' or 'greedy', got {method!r}")
    if transposable:
        check_transposable_spec(scores.shape, spec)
    if exclusive_columns:
        check_exclusive_spec(spec)
    return _select_mask(scores, spec, method, bool(transposable), bool(exclusive_columns))


def takes_exclusive_columns(spec: Union[str, VNM]) -> bool:
    """Whether ``spec`` has a column choice to cap (``select_mask(..., exclusive_columns=True)``): ``N <= 2``, ``M > 4``."""
    spec = VNM.parse(spec)
    return spec.structured and spec.m > 4


def check_exclusive_spec(spec: Union[str, VNM]) -> None:
    """Raises ``ValueError`` unless :func:`takes_exclusive_columns`."""
    if not takes_exclusive_columns(spec):
        raise ValueError(f"exclusive columns need a V:N:M pattern with N <= 2 and M > 4 (blocks choosing 4 of M "
                         f"columns), got {spec}")


def column_cap(r: int, spec: Union[str, VNM]) -> int:
    """How many of a ``[K, r]`` kernel's ``r/V`` blocks may keep one input column of a group under
    ``select_mask(..., exclusive_columns=True)``: ``ceil(4 (r/V) / M)``, the fewest that still give every block its
    4 columns."""
    spec = VNM.parse(spec)
    return -(-4 * (r // spec.v) // spec.m)


def columns_are_exclusive(mask: jax.Array, spec: Union[str, VNM]) -> jax.Array:
    """A boolean scalar: does every input column of every group of ``mask`` (``[K, R]``) belong to at most
    :func:`column_cap` blocks? (The V:N:M pattern itself is :func:`mask_is_valid`'s.) Jit-able."""
    spec = VNM.parse(spec)
    validate_shape(mask.shape, spec)
    check_exclusive_spec(spec)
    k, r = mask.shape
    used = mask.T.reshape(r // spec.v, spec.v, k // spec.m, spec.m).any(axis=1)  # [B, G, M]
    return (used.sum(axis=0) <= column_cap(r, spec)).all()


def takes_diagonal_blocks(spec: Union[str, VNM]) -> bool:
    """Whether ``spec`` has a diagonal 2:4 block layout of its density (:func:`diagonal_blocks`): V:2:M, ``M >= 8``."""
    spec = VNM.parse(spec)
    return spec.structured and spec.n == 2 and spec.m >= 8


def diagonal_blocks(spec: Union[str, VNM]) -> int:
    """The number G of diagonal 2:4 blocks whose density ``1 / (2 G)`` equals ``spec``'s: ``M / 4`` for a V:2:M
    pattern with ``M >= 8`` (``select_diagonal_mask``). Raises ``ValueError`` for other patterns."""
    spec = VNM.parse(spec)
    if not takes_diagonal_blocks(spec):
        raise ValueError(f"diagonal 2:4 blocks stand for a V:2:M pattern with M >= 8 (G = M / 4 blocks), got {spec}")
    return spec.m // 4


DIAGONAL_CHUNK = 64
"""Width of the input-feature chunks a diagonal-block weight's table names (:func:`diagonal_chunks`): the kernels'
k-step, one TMA box of x a stage."""


def takes_chunked_diagonal_blocks(spec: Union[str, VNM]) -> bool:
    """Whether every layer can take ``spec``'s diagonal 2:4 blocks through chunk tables (:func:`diagonal_chunks`):
    :func:`takes_diagonal_blocks`, and V a multiple of :data:`DIAGONAL_CHUNK` (the sets come in chunks of V)."""
    return takes_diagonal_blocks(spec) and VNM.parse(spec).v % DIAGONAL_CHUNK == 0


def chunked_diagonal_blocks(spec: Union[str, VNM]) -> int:
    """:func:`diagonal_blocks` for the chunk-table layout: raises ``ValueError`` naming the constraint unless
    :func:`takes_chunked_diagonal_blocks`."""
    blocks = diagonal_blocks(spec)
    if not takes_chunked_diagonal_blocks(spec):
        raise ValueError(f"diagonal blocks through chunk tables take their input sets in chunks of V, which must be a "
                         f"multiple of {DIAGONAL_CHUNK} (the tables' width), got {VNM.parse(spec)}")
    return blocks


def check_diagonal_shape(shape: tuple[int, int], blocks: int, transposable: bool = False, chunk: int = 1) -> None:
    """Raises ``ValueError`` unless a ``[K, R]`` kernel splits into ``blocks`` diagonal 2:4 blocks of whole
    ``chunk``-feature chunks: ``blocks`` a power of two, ``K % (blocks chunk) == 0`` and ``(K / blocks) % 4 == 0``
    (``chunk`` 1, 2 or a multiple of 4), ``R % blocks == 0`` (and ``(R / blocks) % 4 == 0`` when ``transposable``)."""
    k, r = shape
    if blocks < 2 or blocks & (blocks - 1):
        raise ValueError(f"the number of diagonal blocks must be a power of two >= 2, got {blocks}")
    if chunk < 1 or (chunk > 2 and chunk % 4):
        raise ValueError(f"chunk must be 1, 2 or a multiple of 4, got {chunk}")
    if k % (blocks * chunk) or (k // blocks) % 4 or r % blocks or (transposable and (r // blocks) % 4):
        raise ValueError(f"a [{k}, {r}] kernel does not split into {blocks} diagonal 2:4 blocks of {chunk}-feature "
                         f"chunks: need K % ({blocks} * {chunk}) == 0, (K / {blocks}) % 4 == 0 and R % {blocks} == 0"
                         + (f" and (R / {blocks}) % 4 == 0 (transposable)" if transposable else ""))


def select_diagonal_mask(scores: jax.Array, blocks: int, *, transposable: bool = False, chunk: int = 1) -> jax.Array:
    """A ``[K, R]`` mask that is ``blocks`` diagonal 2:4 blocks once the input features are relabelled.

    The R output features are cut into ``blocks`` contiguous ranges; the K input features are partitioned into as
    many sets of ``K / blocks`` (each set read by one range only), in whole chunks of ``chunk`` consecutive features,
    by recursive bisection on each chunk's ``sum scores^2`` over the ranges; inside each (set, range) block, taken
    with its set in ascending order, each output row keeps 2 of every 4 consecutive input features
    (``select_mask(..., "2:4")``, ``transposable`` as there). Density ``1 / (2 blocks)``: a V:2:M pattern's at
    ``blocks = M / 4`` (:func:`diagonal_blocks`).

    Relabelling the input features set by set turns the layer into ``blocks`` 2:4 layers of ``1 / blocks`` the size
    on contiguous slices: where the input features are produced in any order one likes (the FFN's hidden features),
    that costs nothing at run time (docs/kernel-notes.md, session 31). The producing layer's output features are
    relabelled with them: with ``chunk`` equal to its V (a V:2:M layer), whole V blocks move and its mask stays valid.
    Such a mask is in general not a V:2:M mask of the original feature order. Jit-able; :func:`diagonal_sets`
    recovers the sets.
    """
    check_diagonal_shape(scores.shape, blocks, transposable, chunk)
    return _select_diagonal_mask(scores, blocks, bool(transposable), int(chunk))


def _diagonal_sets(scores: jax.Array, blocks: int, chunk: int = 1) -> jax.Array:
    """``[blocks, K / blocks]`` input features per block (ascending), by recursive bisection of the ``chunk``-feature
    chunks on their squared scores over the blocks' output ranges."""
    k0, r = scores.shape
    k = k0 // chunk  # the bisection runs on chunks
    a = jnp.square(scores.astype(jnp.float32)).reshape(k, chunk, blocks, r // blocks).sum(axis=(1, 3))  # [K/c, blocks]
    order = jnp.arange(k)[None]  # [segments, K / segments]
    segments = 1
    while segments < blocks:
        width = blocks // segments  # output ranges per segment; the first half of them against the second
        aff = a[order].reshape(segments, k // segments, segments, width)
        aff = jnp.take_along_axis(aff, jnp.arange(segments)[:, None, None, None], axis=2)[:, :, 0]  # own ranges
        d = aff[..., :width // 2].sum(-1) - aff[..., width // 2:].sum(-1)
        order = jnp.take_along_axis(order, jnp.argsort(-d, axis=1, stable=True), axis=1)
        segments *= 2
        order = order.reshape(segments, k // segments)
    order = jnp.sort(order, axis=1)
    return (order[..., None] * chunk + jnp.arange(chunk)).reshape(blocks, k0 // blocks)


def diagonal_sets(mask: jax.Array, blocks: int, chunk: int = 1) -> jax.Array:
    """The input-feature sets of a :func:`select_diagonal_mask` mask, ``[blocks, K / blocks]`` ascending, in whole
    ``chunk``-feature chunks: each chunk goes to the block whose outputs keep its features, and the chunks no block
    keeps fill the sets left short, in ascending order. Raises ``ValueError`` (concrete masks) where a chunk is kept
    by two blocks' outputs."""
    k0, r = mask.shape
    check_diagonal_shape(mask.shape, blocks, chunk=chunk)
    k = k0 // chunk
    used = np.asarray(mask).reshape(k, chunk, blocks, r // blocks).any(axis=(1, 3))  # [K/c, blocks]
    if (used.sum(axis=1) > 1).any():
        raise ValueError("diagonal_sets: an input feature chunk is kept by the outputs of more than one block")
    owner = np.where(used.any(axis=1), used.argmax(axis=1), -1)
    size = k // blocks
    free = iter(np.flatnonzero(owner < 0))
    for b in range(blocks):
        for _ in range(size - int((owner == b).sum())):
            owner[next(free)] = b
    sets = np.stack([np.flatnonzero(owner == b) for b in range(blocks)])  # chunks
    return jnp.asarray((sets[..., None] * chunk + np.arange(chunk)).reshape(blocks, k0 // blocks))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _select_diagonal_mask(scores: jax.Array, blocks: int, transposable: bool, chunk: int = 1) -> jax.Array:
    k, r = scores.shape
    kb, rb = k // blocks, r // blocks
    sets = _diagonal_sets(scores, blocks, chunk)  # [blocks, kb]
    sub = jnp.abs(scores.astype(jnp.float32))[sets].reshape(blocks, kb, blocks, rb)
    sub = jnp.take_along_axis(sub, jnp.arange(blocks)[:, None, None, None], axis=2)[:, :, 0]  # [blocks, kb, rb]
    spec = VNM.parse("2:4")
    keep = jax.vmap(lambda s: _select_mask(s, spec, "auto", transposable))(sub)  # [blocks, kb, rb]
    rows = sets[:, :, None]
    cols = (jnp.arange(blocks)[:, None, None] * rb + jnp.arange(rb)[None, None])
    return jnp.zeros((k, r), jnp.bool_).at[rows, cols].set(keep)


def _capped_columns(blocks: jax.Array, n: int, cap: int) -> jax.Array:
    """4 columns per block ``[B, V, G, M] -> [B, G, 4]``, each column of a group kept by at most ``cap`` blocks."""
    nb, _, g, m = blocks.shape
    votes = jnp.where(_top_n_mask(blocks, n), blocks, 0.0).sum(axis=1)  # [B, G, M], as _greedy_columns
    votes = (votes + 1e-6 * blocks.sum(axis=1)).transpose(1, 0, 2)  # [G, B, M]
    order = jnp.argsort(-votes.reshape(g, nb * m), axis=-1, stable=True).astype(jnp.int32)  # (block, column) pairs
    gi = jnp.arange(g)

    def take(state, pair):  # every group offers its next-best pair
        need, left, chosen = state
        b, c = pair // m, pair % m
        ok = (need[gi, b] > 0) & (left[gi, c] > 0)
        return (need.at[gi, b].add(-ok.astype(jnp.int32)), left.at[gi, c].add(-ok.astype(jnp.int32)),
                chosen.at[gi, b, c].set(chosen[gi, b, c] | ok)), None

    init = (jnp.full((g, nb), 4, jnp.int32), jnp.full((g, m), cap, jnp.int32), jnp.zeros((g, nb, m), bool))
    state, _ = jax.lax.scan(take, init, order.T)

    def short(carry):
        (need, _, _), steps = carry
        return (need > 0).any() & (steps < 4 * nb)

    def repair(carry):
        # The first short block of each group takes its best free column (capacity left, not yet its own); if every
        # column with capacity is already its own (f), a block b2 that holds a column x it lacks, and not f, hands x
        # over and takes f.
        (need, left, chosen), steps = carry
        has = (need > 0).any(axis=-1)
        blk = jnp.argmax(need > 0, axis=-1)
        mine = chosen[gi, blk]  # [G, M]
        free = (left > 0) & ~mine
        direct = has & free.any(axis=-1)
        fd = jnp.argmax(jnp.where(free, votes[gi, blk], -jnp.inf), axis=-1)
        f = jnp.argmax(left > 0, axis=-1)
        cand = chosen & ~mine[:, None, :] & ~chosen[gi, :, f][:, :, None]  # [G, B2, X]
        pick = jnp.argmax(cand.reshape(g, -1), axis=-1)
        b2, x = pick // m, pick % m
        swap = has & ~direct & cand.reshape(g, -1).any(axis=-1)
        chosen = chosen.at[gi, blk, fd].set(chosen[gi, blk, fd] | direct)
        left = left.at[gi, fd].add(-direct.astype(jnp.int32))
        chosen = chosen.at[gi, b2, x].set(chosen[gi, b2, x] & ~swap)
        chosen = chosen.at[gi, b2, f].set(chosen[gi, b2, f] | swap)
        left = left.at[gi, f].add(-swap.astype(jnp.int32))
        chosen = chosen.at[gi, blk, x].set(chosen[gi, blk, x] | swap)
        need = need.at[gi, blk].add(-(direct | swap).astype(jnp.int32))
        return (need, left, chosen), steps + 1

    (_, _, chosen), _ = jax.lax.while_loop(short, repair, (state, jnp.int32(0)))
    # A block still short (never seen in tests; columns_are_exclusive would then say False) keeps its best
    # columns beyond the cap, so the mask stays a valid V:N:M mask.
    top = jnp.argsort(-jnp.where(chosen, jnp.inf, votes), axis=-1, stable=True)[..., :4]  # [G, B, 4]
    return jnp.sort(top, axis=-1).transpose(1, 0, 2).astype(jnp.int32)


def check_transposable_spec(shape: tuple[int, int], spec: VNM) -> None:
    """Raises ``ValueError`` unless a ``[K, R]`` kernel can take a transposable ``spec`` mask (``select_mask``)."""
    if spec.n != 2:
        raise ValueError(f"a transposable mask keeps 2 per group: N must be 2, got {spec}")
    if shape[1] % 4:
        raise ValueError(f"a transposable mask needs R (output features) = {shape[1]} to be a multiple of 4")
    if spec.m > 4 and spec.v % 4:
        raise ValueError(f"a transposable {spec} mask needs V to be a multiple of 4 (4 rows sharing their columns)")


@functools.lru_cache(maxsize=None)
def _two_by_two_patterns() -> np.ndarray:
    """The 90 ``[4, 4]`` boolean patterns with 2 kept in every row and in every column."""
    pairs = list(itertools.combinations(range(4), 2))
    out = []
    for rows in itertools.product(pairs, repeat=4):
        p = np.zeros((4, 4), bool)
        for i, cols in enumerate(rows):
            p[i, list(cols)] = True
        if (p.sum(axis=0) == 2).all():
            out.append(p)
    return np.stack(out)


def _transposable_keep(picked: jax.Array) -> jax.Array:
    """``picked [C, 4, G, 4]`` (4-row chunks, row, group, kept column) -> the best 2-per-row-and-column pattern's
    keep mask of the same shape."""
    patterns = jnp.asarray(_two_by_two_patterns())  # [90, 4, 4]
    gain = jnp.einsum("cigj,pij->cgp", picked, patterns.astype(picked.dtype))
    best = patterns[jnp.argmax(gain, axis=-1)]  # [C, G, 4, 4]
    return best.transpose(0, 2, 1, 3)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _select_mask(scores: jax.Array, spec: VNM, method: str, transposable: bool = False,
                 exclusive_columns: bool = False) -> jax.Array:
    k, r = scores.shape
    g = k // spec.m
    a = jnp.abs(scores.astype(jnp.float32)).T  # [R, K]
    if not spec.structured:
        return _top_n_mask(a.reshape(r, g, spec.m), spec.n).reshape(r, k).T
    if spec.m == 4:
        if transposable:
            return _transposable_keep(a.reshape(r // 4, 4, g, 4)).reshape(r, k).T
        return _top_n_mask(a.reshape(r // spec.v, spec.v, g, spec.m), spec.n).reshape(r, k).T
    blocks = a.reshape(r // spec.v, spec.v, g, spec.m)
    if exclusive_columns:
        cols = _capped_columns(blocks, spec.n, column_cap(r, spec))  # [B, G, 4]
    else:
        cols = _choose_columns(blocks, spec.n, method)
    picked = jnp.take_along_axis(blocks, cols[:, None], axis=-1)
    if transposable:
        keep = _transposable_keep(picked.reshape(r // 4, 4, g, 4)).reshape(picked.shape)
    else:
        keep = _top_n_mask(picked, spec.n)  # [B, V, G, 4]
    onehot = jax.nn.one_hot(cols, spec.m, dtype=jnp.bool_)  # [B, G, 4, M]
    mask = (keep[..., None] & onehot[:, None]).any(axis=-2)
    return mask.reshape(r, k).T


def mask_is_valid(mask: jax.Array, spec: Union[str, VNM]) -> jax.Array:
    """A boolean scalar: does ``mask`` (``[K, R]``; a nonzero entry is kept, as :func:`compress` reads it) obey
    ``spec``? Jit-able."""
    spec = VNM.parse(spec)
    validate_shape(mask.shape, spec)
    return _mask_is_valid(mask, spec)


@functools.partial(jax.jit, static_argnums=1)
def _mask_is_valid(mask: jax.Array, spec: VNM) -> jax.Array:
    k, r = mask.shape
    g = k // spec.m
    rows = (mask != 0).astype(jnp.int32).T.reshape(r, g, spec.m)  # nonzero is kept, as compress reads it
    ok = (rows.sum(axis=-1) <= spec.n).all()
    if spec.structured:
        used = rows.reshape(r // spec.v, spec.v, g, spec.m).max(axis=1)
        ok = ok & (used.sum(axis=-1) <= 4).all()
    return ok


def check_mask(mask: jax.Array, spec: Union[str, VNM]) -> bool:
    """True when a concrete ``mask`` obeys ``spec`` (see ``mask_is_valid``)."""
    return bool(mask_is_valid(mask, spec))


# ----------------------------------------------------------------------------- compression


def _pack_metadata(p0: jax.Array, p1: jax.Array) -> jax.Array:
    """``[R, G]`` positions -> ``[R, G/8]`` uint32 words, 4 bits per group, low group first."""
    r, g = p0.shape
    nibbles = (p0 | (p1 << 2)).astype(jnp.uint32).reshape(r, g // GROUPS_PER_WORD, GROUPS_PER_WORD)
    shifts = jnp.arange(GROUPS_PER_WORD, dtype=jnp.uint32) * 4
    return (nibbles << shifts).sum(axis=-1, dtype=jnp.uint32)


def _unpack_metadata(metadata: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse of ``_pack_metadata``: ``[R, G/8]`` words -> two ``[R, G]`` int32 position arrays."""
    r, words = metadata.shape
    shifts = jnp.arange(GROUPS_PER_WORD, dtype=jnp.uint32) * 4
    nibbles = ((metadata[..., None] >> shifts) & 0xF).reshape(r, words * GROUPS_PER_WORD).astype(jnp.int32)
    return nibbles & 3, nibbles >> 2


def kept_columns(sw: SparseWeight) -> jax.Array:
    """``[R, G, 2]`` int32: the column (within its group, in ``[0, M)``) of every stored value."""
    p0, p1 = _unpack_metadata(sw.metadata)
    pos = jnp.stack([p0, p1], axis=-1)  # [R, G, 2] positions among the 4 kept columns
    if sw.columns is None:
        return pos
    cols = jnp.repeat(sw.columns.astype(jnp.int32), sw.spec.v, axis=0)  # [R, G, 4]
    return jnp.take_along_axis(cols, pos, axis=-1)


@jax.jit
def as_2_4(sw: SparseWeight) -> tuple[SparseWeight, jax.Array]:
    """The same matrix as a 2:4 ``SparseWeight`` over the full ``K``, and where each of ``sw``'s values went.

    A V:2:M row keeps 2 values per group of ``M`` columns. Split the group into ``M/4`` quads of 4
    consecutive columns: each quad holds at most 2 of them, so the matrix is also 2:4 sparse over ``K``,
    with zeros stored for the quads' missing values. The 2:4 kernels that read ``x [T, K]`` as XLA holds it
    (TMA, nothing gathered) then run a V:2:M weight on dense-rate work over ``K`` (``M/4`` times the work of
    its condensed reduction), with no transpose of ``x`` (docs/format.md, "The 2:4 view").

    Args:
      sw: a compressed weight (any ``M``; at ``M = 4`` it is returned as it is).

    Returns:
      ``(sw24, slots)``: ``sw24`` a 2:4 weight with ``decompress(sw24) == decompress(sw)``, values
      ``[R, K/2]`` and metadata ``[R, K/32]``; ``slots`` ``[R, 2G]`` int32, the index in ``sw24.values``'s
      row of each entry of ``sw.values``, so ``take_along_axis(sw24.values, slots, 1) == sw.values`` and a
      gradient with respect to ``sw24.values`` maps back the same way.
    """
    k, r = sw.shape
    m = sw.spec.m
    g = k // m
    if m == 4:
        return sw, jnp.broadcast_to(jnp.arange(2 * g, dtype=jnp.int32), (r, 2 * g))
    nq = m // 4  # quads per group
    cols = kept_columns(sw)  # [R, G, 2], ascending
    quad, at = cols // 4, cols % 4  # the quad of each stored value and its column in the quad
    same = quad[..., 0] == quad[..., 1]  # [R, G]: both values in one quad
    # A quad holding both values stores them at (at0, at1); one value alone sits at (0, at) in slot 1, or at
    # (0, 1) in slot 0 when it is column 0; an empty quad stores two zeros at (0, 1).
    slot = jnp.where(same[..., None], jnp.arange(2), (at > 0).astype(jnp.int32))  # [R, G, 2]
    slots = (jnp.arange(g)[None, :, None] * nq + quad) * 2 + slot
    qs = jnp.arange(nq)[None, None, :]  # [1, 1, nq]
    in0 = quad[..., :1] == qs  # [R, G, nq]: quad holds value 0
    in1 = quad[..., 1:] == qs
    both = in0 & same[..., None]
    p0 = jnp.where(both, at[..., :1], 0)
    p1 = jnp.where(both, at[..., 1:],
                   jnp.where(in0 & (at[..., :1] > 0), at[..., :1], jnp.where(in1 & (at[..., 1:] > 0), at[..., 1:], 1)))
    vals = sw.values.reshape(r, g, 1, 2)
    zero = jnp.zeros((), sw.values.dtype)
    slot0 = slot[..., :1]  # [R, G, 1]
    slot1 = slot[..., 1:]
    v24 = jnp.stack([
        jnp.where(in0 & (slot0 == 0), vals[..., 0], jnp.where(in1 & (slot1 == 0), vals[..., 1], zero)),
        jnp.where(in0 & (slot0 == 1), vals[..., 0], jnp.where(in1 & (slot1 == 1), vals[..., 1], zero)),
    ], axis=-1)  # [R, G, nq, 2]
    sw24 = SparseWeight(
        values=v24.reshape(r, k // 2),
        columns=None,
        metadata=_pack_metadata(p0.reshape(r, k // 4), p1.reshape(r, k // 4)),
        shape=(k, r),
        spec=VNM(1, 2, 4),
    )
    return sw24, slots.reshape(r, 2 * g).astype(jnp.int32)


def compress(w: jax.Array, mask: jax.Array, spec: Union[str, VNM]) -> SparseWeight:
    """Packs the masked kernel ``w * mask`` (both ``[K, R]``) into a ``SparseWeight``.

    The mask must obey ``spec`` with ``n = 2`` (rows may keep fewer than 2 per group; missing values
    are stored as zeros). A concrete invalid mask raises ``ValueError``; under ``jit`` the mask is
    trusted, so check it with ``mask_is_valid`` where it comes from outside ``select_mask``.
    """
    spec = VNM.parse(spec)
    validate_shape(w.shape, spec, compressed=True)
    if mask.shape != w.shape:
        raise ValueError(f"mask shape {mask.shape} must equal the kernel shape {w.shape}")
    if not isinstance(mask, jax.core.Tracer) and not check_mask(mask, spec):
        raise ValueError(f"mask does not obey {spec}: more than 2 per row per group or more than 4 columns per block")
    return _compress(w, mask, spec)


def _first_two(a: jax.Array, m: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The positions ``[..., 2]`` (int32) and values ``[..., 2]`` of the first two kept entries of each group of 4
    (last axis of ``a`` and its boolean mask ``m``). Kept positions come first, ascending; a group with fewer than
    two kept entries pads with its lowest free positions and a zero value (a stable sort of ``~m``, written as
    elementwise rank arithmetic so that XLA fuses it instead of launching a sort)."""
    lower = jnp.tril(jnp.ones((4, 4), jnp.int32), -1)  # lower[i, j]: j comes before i
    kept_before = (m[..., None, :].astype(jnp.int32) * lower).sum(-1)
    free_before = jnp.arange(4) - kept_before  # entry i has i entries before it
    rank = jnp.where(m, kept_before, m.astype(jnp.int32).sum(-1, keepdims=True) + free_before)  # [..., 4]
    hit = rank[..., None, :] == jnp.arange(2)[:, None]  # [..., 2, 4]: entry i is the s-th
    pos = (hit * jnp.arange(4)).sum(-1).astype(jnp.int32)
    vals = jnp.where(hit & m[..., None, :], a[..., None, :], jnp.zeros((), a.dtype)).sum(-1).astype(a.dtype)
    return pos, vals


@functools.partial(jax.jit, static_argnums=2)
def _compress(w: jax.Array, mask: jax.Array, spec: VNM) -> SparseWeight:
    k, r = w.shape
    g = k // spec.m
    a = w.T.reshape(r // spec.v, spec.v, g, spec.m)
    mk = mask.astype(jnp.bool_).T.reshape(r // spec.v, spec.v, g, spec.m)
    if spec.m == 4:
        cols = None
        picked_a, picked_m = a, mk
    else:
        used = mk.any(axis=1)  # [B, G, M]
        key = jnp.where(used, 0, spec.m) + jnp.arange(spec.m)  # used columns first, then lowest index
        cols = jnp.sort(jnp.argsort(key, axis=-1)[..., :4], axis=-1).astype(jnp.int32)
        picked_a = jnp.take_along_axis(a, cols[:, None], axis=-1)
        picked_m = jnp.take_along_axis(mk, cols[:, None], axis=-1)
    pos, vals = _first_two(picked_a, picked_m)
    pos = pos.reshape(r, g, 2)
    return SparseWeight(
        values=vals.reshape(r, 2 * g).astype(w.dtype),
        columns=None if cols is None else cols.astype(jnp.uint8),
        metadata=_pack_metadata(pos[..., 0], pos[..., 1]),
        shape=(k, r),
        spec=spec,
    )


@jax.jit
def decompress(sw: SparseWeight) -> jax.Array:
    """The dense ``[K, R]`` kernel of ``sw`` (pure JAX; ``jaxsparse.ops.decompress`` dispatches)."""
    k, r = sw.shape
    m = sw.spec.m
    g = k // m
    cols = kept_columns(sw)  # [R, G, 2]
    vals = sw.values.reshape(r, g, 2)
    dense = (jax.nn.one_hot(cols, m, dtype=sw.values.dtype) * vals[..., None]).sum(axis=-2)  # [R, G, M]
    return dense.reshape(r, k).T


def transposable_mask_is_valid(mask: jax.Array) -> jax.Array:
    """A boolean scalar: does ``mask`` (``[K, R]``) keep at most 2 of every 4 consecutive output features in each
    input feature's row, i.e. is ``W^T`` 2:4 sparse along ``R``? Jit-able."""
    k, r = mask.shape
    if r % 4:
        raise ValueError(f"R (output features) = {r} must be a multiple of 4 for a transposable mask")
    return (mask.astype(jnp.int32).reshape(k, r // 4, 4).sum(axis=-1) <= 2).all()


def kept_mask(sw: SparseWeight) -> jax.Array:
    """The boolean ``[K, R]`` mask of ``sw``'s stored positions (a stored value may itself be 0)."""
    return decompress(SparseWeight(jnp.ones(sw.values.shape, jnp.float32), sw.columns, sw.metadata, sw.shape,
                                   sw.spec)) > 0


def check_transpose_2_4_shape(shape: tuple[int, int]) -> None:
    """Raises ``ValueError`` unless :func:`transpose_2_4` can take a weight of Flax shape ``(K, R)``."""
    if shape[1] % (4 * GROUPS_PER_WORD):
        raise ValueError(f"transpose_2_4 needs R (output features) = {shape[1]} to be a multiple of 32: W^T's "
                         "metadata word holds 8 groups of 4 along R")


@jax.jit
def transpose_2_4(sw: SparseWeight) -> SparseWeight:
    """``W^T`` as a 2:4 ``SparseWeight`` (Flax kernel shape ``(R, K)``), for a weight with a transposable mask.

    With ``select_mask(..., transposable=True)`` every input feature keeps at most 2 of every 4 consecutive output
    features, so ``W^T``'s rows (one per input feature) are 2:4 sparse along ``R``, and the input gradient
    ``dy @ W^T`` is the forward product ``spmm(dy, transpose_2_4(sw))``. Per quad of 4 output features the stored
    values come first, ascending; a quad with fewer than 2 pads with its lowest free positions and zeros (as
    :func:`compress`). A quad that holds more than 2 stored values (the mask is not transposable there) gets NaN
    in both slots, so a product with ``W^T`` is NaN exactly where it would otherwise be wrong
    (:func:`transposable_mask_is_valid` tells beforehand).

    This is the reference of the CUDA handler ``jaxsparse_transpose_2_4`` (``jaxsparse.ops.transpose_2_4``
    dispatches). It is built from the compressed arrays alone, with no dense ``[K, R]`` intermediate and no sort:
    for input feature ``k`` (group ``k // M``, column ``k % M``) and output features ``4j .. 4j+3``, each row's
    two stored columns either hold ``k % M`` or not (jit-able).
    """
    check_transpose_2_4_shape(sw.shape)
    k, r = sw.shape
    m = sw.spec.m
    g = k // m
    # [G, 1, R/4, 4, 2]: the two stored columns (within the group) and values of output feature 4j + i.
    cols = kept_columns(sw).transpose(1, 0, 2).reshape(g, 1, r // 4, 4, 2)
    vals = sw.values.reshape(r, g, 2).transpose(1, 0, 2).reshape(g, 1, r // 4, 4, 2)
    hit = cols == jnp.arange(m).reshape(1, m, 1, 1, 1)  # [G, M, R/4, 4, 2]; the two columns differ: <= 1 hit
    stored = hit.any(-1)  # [G, M, R/4, 4]: W^T's row g*M + c keeps output feature 4j + i
    dense = jnp.where(hit, vals, jnp.zeros((), vals.dtype)).sum(-1).astype(vals.dtype)
    pos, values_t = _first_two(dense, stored)  # [G, M, R/4, 2]
    overfull = stored.astype(jnp.int32).sum(-1, keepdims=True) > 2
    values_t = jnp.where(overfull, jnp.asarray(jnp.nan, values_t.dtype), values_t)
    pos = pos.reshape(k, r // 4, 2)
    return SparseWeight(values=values_t.reshape(k, r // 2), columns=None,
                        metadata=_pack_metadata(pos[..., 0], pos[..., 1]), shape=(r, k), spec=VNM(1, 2, 4))


def check_blocks_shape(shape: tuple[int, int], blocks: int) -> None:
    """Raises ``ValueError`` unless a stacked weight of Flax shape ``(K, R)`` splits into ``blocks`` diagonal 2:4
    blocks whose transposes stack too: ``blocks >= 1``, ``R % (32 blocks) == 0`` (whole metadata words per block)."""
    k, r = shape
    if blocks < 1 or r % (32 * blocks):
        raise ValueError(f"a stacked weight {shape} of {blocks} diagonal blocks needs blocks >= 1 and R % (32 * "
                         f"{blocks}) == 0")


def stack_diagonal_blocks(w: jax.Array, blocks: int) -> jax.Array:
    """The diagonal blocks of a block-diagonal ``[blocks K, R]`` matrix side by side, ``[K, R]``: block ``b`` is
    ``w[b K:(b + 1) K, b R/blocks:(b + 1) R/blocks]`` (the stacked layout of ``jaxsparse.ops.diagonal_linear``, whose
    2:4 compression is the layer's weight). The entries off the diagonal blocks are dropped."""
    k, r = w.shape
    if blocks < 1 or k % blocks or r % blocks:
        raise ValueError(f"a [{k}, {r}] matrix does not split into {blocks} diagonal blocks")
    kb, rb = k // blocks, r // blocks
    return jnp.concatenate([w[b * kb:(b + 1) * kb, b * rb:(b + 1) * rb] for b in range(blocks)], axis=1)


def diagonal_chunks(mask: jax.Array, blocks: int) -> np.ndarray:
    """The chunk table of a :func:`select_diagonal_mask` mask chosen in chunks of :data:`DIAGONAL_CHUNK` features:
    ``int32 [blocks, K / (blocks 64)]``, row ``b`` the 64-feature chunks (index ``c``: features ``64 c .. 64 c + 63``)
    that block ``b`` reads, ascending (:func:`diagonal_sets`). With it a layer needs no relabelling of its inputs:
    ``jaxsparse.ops.diagonal_linear(x, stack_diagonal_blocks(w[chunk_columns(table)], blocks), blocks,
    chunks=table)`` computes ``x @ (w * mask)`` from ``x`` as it is."""
    sets = np.asarray(diagonal_sets(mask, blocks, chunk=DIAGONAL_CHUNK))
    return (sets[:, ::DIAGONAL_CHUNK] // DIAGONAL_CHUNK).astype(np.int32)


def chunk_columns(chunks: jax.Array) -> jax.Array:
    """The input features a chunk table (:func:`diagonal_chunks`) reads, block by block: ``[blocks K]``, the order
    in which the stacked weight's rows (and the kernels' x loads) take them."""
    c = jnp.asarray(chunks, jnp.int32)
    return (c[..., None] * DIAGONAL_CHUNK + jnp.arange(DIAGONAL_CHUNK, dtype=jnp.int32)).reshape(-1)


def check_chunks(chunks, blocks: int, k: int, width: int) -> None:
    """Raises ``ValueError`` unless ``chunks`` is a chunk table (int32 ``[blocks, K / 64]``) of a stacked weight of
    ``K`` rows (``K % 64 == 0``) over an input of ``width`` features. The entries are not read (they may be traced):
    a table must be a permutation of ``0 .. width / 64 - 1`` (:func:`diagonal_chunks` makes one)."""
    shape = tuple(getattr(chunks, "shape", ()))
    if k % DIAGONAL_CHUNK or shape != (blocks, k // DIAGONAL_CHUNK) or width != blocks * k:
        raise ValueError(f"a chunk table of {blocks} diagonal blocks of K = {k} input features needs K % "
                         f"{DIAGONAL_CHUNK} == 0, shape ({blocks}, K/{DIAGONAL_CHUNK}) and an input of {blocks} * K "
                         f"features, got shape {shape} and {width} features")
    if not jnp.issubdtype(getattr(chunks, "dtype", np.float32), jnp.integer):
        raise ValueError(f"a chunk table must be integer, got {getattr(chunks, 'dtype', None)}")


def stack_transposed_blocks(wt: SparseWeight, blocks: int) -> SparseWeight:
    """The transposed blocks of a weight of ``blocks`` diagonal 2:4 blocks, stacked as that weight is.

    A stacked weight ``sw`` (a 2:4 weight of Flax shape ``(K, R)``; output feature ``r`` belongs to block
    ``r // (R / blocks)`` and reads that block's ``K`` input features: ``jaxsparse.ops.diagonal_linear``) stands for
    the block-diagonal ``[blocks K, R]`` kernel. Its transpose is block-diagonal too, ``blocks`` blocks of
    ``(R / blocks, K)``; stacked along their outputs, a 2:4 weight of Flax shape ``(R / blocks, blocks K)``. ``wt`` is
    :func:`transpose_2_4` of ``sw`` (``(R, K)``: row ``k`` of its values holds column ``k`` of every block side by
    side), so this is a reordering of its rows, no arithmetic. The input gradient of the layer is then the same
    blocked forward product on ``dy``."""
    r, k = wt.shape
    check_blocks_shape((k, r), blocks)
    rb = r // blocks
    values = wt.values.reshape(k, blocks, rb // 2).transpose(1, 0, 2).reshape(blocks * k, rb // 2)
    metadata = wt.metadata.reshape(k, blocks, rb // 32).transpose(1, 0, 2).reshape(blocks * k, rb // 32)
    return SparseWeight(values=values, columns=None, metadata=metadata, shape=(rb, blocks * k), spec=wt.spec)


def compress_like(dense: jax.Array, sw: SparseWeight) -> jax.Array:
    """Gathers a dense ``[K, R]`` matrix at ``sw``'s kept positions into the layout of ``sw.values``."""
    k, r = sw.shape
    if dense.shape != (k, r):
        raise ValueError(f"dense shape {dense.shape} must equal the sparse weight's shape {(k, r)}")
    g = k // sw.spec.m
    picked = jnp.take_along_axis(dense.T.reshape(r, g, sw.spec.m), kept_columns(sw), axis=-1)
    return picked.reshape(r, 2 * g)


@jax.jit
def condensed_dx_operands(sw: SparseWeight) -> tuple[jax.Array, jax.Array]:
    """The two operands of the condensed input gradient (``jaxsparse_spmm_t_condensed``), in the values' dtype.

    ``wc [R, 4G]``: ``A = W^T`` over each V block's 4 kept columns per group (``wc[r, 4g + p]`` is row ``r``'s value
    at the block's ``p``-th kept column of group ``g``, 0 where the row's 2:4 choice drops it). ``scatter
    [(R/V) * (G/4) * 16, 4M]``: per block ``b`` and chunk ``q`` of 4 groups, the one-hot ``16 x 4M`` matrix with
    ``scatter[(b * G/4 + q) * 16 + 4j + p, j*M + columns[b, 4q + j, p]] = 1``. Then
    ``dy @ W^T = concat_q sum_b (dy[:, block b] @ wc[block b, chunk q's 16 columns]) @ scatter[b, q]``
    (docs/format.md). Needs ``M > 4`` (a ``columns`` array) and ``G % 4 == 0``.
    """
    k, r = sw.shape
    spec = sw.spec
    if sw.columns is None or spec.n != 2:
        raise ValueError(f"condensed_dx_operands needs a V:2:M weight with M > 4, got {spec}")
    g = k // spec.m
    if g % 4:
        raise ValueError(f"condensed_dx_operands needs G = K/M divisible by 4, got G = {g}")
    wc = _kept_column_values(sw)
    blocks = r // spec.v
    onehot = (sw.columns.astype(jnp.int32)[..., None] == jnp.arange(spec.m, dtype=jnp.int32))  # [B, G, 4, M]
    onehot = onehot.reshape(blocks, g // 4, 4, 4, spec.m)  # [B, G/4, j, p, M]
    eye = jnp.eye(4, dtype=bool)  # [j, j'] puts group j's columns in its own M-wide slice
    scatter = (onehot[:, :, :, :, None, :] & eye[None, None, :, None, :, None]).astype(sw.values.dtype)
    return wc, scatter.reshape(blocks * (g // 4) * 16, 4 * spec.m)


def _kept_column_values(sw: SparseWeight) -> jax.Array:
    """``[R, 4G]``: row ``r``'s value at its block's ``p``-th kept column of group ``g`` at ``4g + p``, 0 where the
    row's 2:4 choice drops that column (``A = W^T`` over each block's kept columns)."""
    k, r = sw.shape
    g = k // sw.spec.m
    p0, p1 = _unpack_metadata(sw.metadata)  # [R, G] positions among the 4 kept columns
    vals = sw.values.reshape(r, g, 2)
    slot = jnp.arange(4, dtype=jnp.int32)
    zero = jnp.zeros((), sw.values.dtype)
    return (jnp.where(slot == p0[..., None], vals[..., :1], zero) +
            jnp.where(slot == p1[..., None], vals[..., 1:], zero)).reshape(r, 4 * g)


def block_dx_operands(sw: SparseWeight, terms: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The operands of the input gradient by V blocks (``jaxsparse.ops.spmm_t``'s ``"blocks"`` route).

    ``wc [R/V, V, 4G]``: each block's rows of :func:`condensed_dx_operands`' ``wc``, so that
    ``P = concat_b (dy[:, block b] @ wc[b])`` (``[T, (R/V) 4G]``, column ``b 4G + 4g + p`` the block's product at its
    ``p``-th kept column of group ``g``). ``sources [terms, K]`` int32: for each input column, the columns of ``P``
    that hold the blocks keeping it, in block order, so that ``dy @ W^T = sum_i P'[:, sources[i]]`` with
    ``P' = [P, 0, NaN]``: a column kept by fewer than ``terms`` blocks points its spare terms at the zero column
    (index ``(R/V) 4G``), and a column kept by more than ``terms`` blocks points its first term at the NaN column
    (index ``(R/V) 4G + 1``), so that its dx is NaN, never wrong. ``terms`` defaults to :func:`column_cap`, which
    masks chosen with ``select_mask(..., exclusive_columns=True)`` keep (``columns_are_exclusive``). Needs ``N = 2``
    and ``M > 4`` (a ``columns`` array)."""
    k, r = sw.shape
    spec = sw.spec
    if sw.columns is None or spec.n != 2:
        raise ValueError(f"block_dx_operands needs a V:2:M weight with M > 4, got {spec}")
    g, blocks = k // spec.m, r // spec.v
    terms = column_cap(r, spec) if terms is None else int(terms)
    if not 1 <= terms <= blocks:
        raise ValueError(f"block_dx_operands: terms must be in [1, R/V = {blocks}], got {terms}")
    wc = _kept_column_values(sw).reshape(blocks, spec.v, 4 * g)
    hits = sw.columns.astype(jnp.int32)[..., None] == jnp.arange(spec.m, dtype=jnp.int32)  # [B, G, 4, M]
    hits = hits.transpose(1, 3, 0, 2).reshape(g, spec.m, blocks * 4)  # [G, M, (b, p)]
    order = jnp.argsort(~hits, axis=-1, stable=True)[..., :terms]  # the kept (b, p) first, in block order
    count = hits.sum(axis=-1)  # [G, M] blocks keeping each column
    b, p = order // 4, order % 4
    source = b * 4 * g + 4 * jnp.arange(g, dtype=jnp.int32)[:, None, None] + p  # [G, M, terms]
    zero_col = blocks * 4 * g
    source = jnp.where(jnp.arange(terms) < count[..., None], source, zero_col)
    source = source.at[..., 0].set(jnp.where(count > terms, zero_col + 1, source[..., 0]))
    return wc, source.reshape(k, terms).T.astype(jnp.int32)


# The resident dX kernel's tiles (cuda/dx_resident.cu): 16 groups (64 condensed columns) per wgmma, 16 rows of R a step.
RESIDENT_DX_GROUPS = 16


def resident_dx_fragments(sw: SparseWeight) -> jax.Array:
    """The weight operand of the resident input gradient (``jaxsparse_spmm_t_resident``): :func:`condensed_dx_operands`'
    ``wc [R, 4G]`` reordered so that each thread of the kernel reads its wgmma A fragments as contiguous 16-byte words.

    ``A = wc^T`` per V block ``b`` and chunk ``j`` of 16 groups is a ``[64 c, V r]`` matrix; warp ``w`` of a warpgroup
    holds its rows ``16w .. 16w + 15`` and lane ``4 gid + tig`` per k16 step ``s`` the words ``(h, q) = (0, 0), (1, 0),
    (0, 1), (1, 1)``, each the pair of elements ``(c, r) = (16w + gid + 8h, 16s + 8q + 2 tig + e)``, ``e = 0, 1`` (the
    mma.m16n8k16 A layout). Returned flat, ``[R * 4G]`` in the values' dtype, ordered
    ``[j, b, w, s, gid, tig, q, h, e]``: per warp and k16 step its 32 lanes' words are 512 contiguous bytes, so one
    warp load is 4 cache lines. Needs ``M > 4``, ``G % 16 == 0`` and ``V % 16 == 0``."""
    k, r = sw.shape
    spec = sw.spec
    if sw.columns is None or spec.n != 2:
        raise ValueError(f"resident_dx_fragments needs a V:2:M weight with M > 4, got {spec}")
    g = k // spec.m
    if g % RESIDENT_DX_GROUPS:
        raise ValueError(f"resident_dx_fragments needs G = K/M divisible by {RESIDENT_DX_GROUPS}, got G = {g}")
    if spec.v % 16:
        raise ValueError(f"resident_dx_fragments needs V % 16 == 0 (k16 steps over a block's rows), got {spec}")
    wc = _kept_column_values(sw)  # [R, 4G]; r = b V + 16 s + 8 q + 2 tig + e, c = 64 j + 16 w + 8 h + gid
    blocks, steps, chunks = r // spec.v, spec.v // 16, g // RESIDENT_DX_GROUPS
    a = wc.reshape(blocks, steps, 2, 4, 2, chunks, 4, 2, 8)  # [b, s, q, tig, e, j, w, h, gid]
    return a.transpose(5, 0, 6, 1, 8, 3, 2, 7, 4).reshape(-1)  # [j, b, w, s, gid, tig, q, h, e]


def exact_column_fraction(w: np.ndarray, spec: Union[str, VNM]) -> float:
    """Magnitude kept by ``select_mask`` over the magnitude kept by exhaustive column search (<= 1)."""
    spec = VNM.parse(spec)
    heuristic = float(jnp.abs(jnp.where(select_mask(w, spec, method="greedy"), w, 0)).sum())
    exact = float(jnp.abs(jnp.where(select_mask(w, spec, method="exact"), w, 0)).sum())
    return heuristic / exact if exact else 1.0


