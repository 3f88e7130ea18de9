"""``jax.ffi.ffi_call`` wrappers, one per CUDA target. Callers validate shapes first (``jaxsparse.ops``)."""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import reference
from jaxsparse.ffi import register
from jaxsparse.format import VNM, SparseWeight, check_chunks
from jaxsparse.format import as_2_4 as format_as_2_4
from jaxsparse.format import RESIDENT_DX_GROUPS, condensed_dx_operands, resident_dx_fragments

# vmap of any call runs the kernel once per batch element: a correct, if slow, batching rule.
_VMAP = "sequential"


KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
KERNEL_M = (4, 8, 16, 32)
KERNEL_V = (64, 128)
KERNEL_ROW_TILE = 64  # output features per kernel tile (cuda/spmm.cu)


def spmm_unsupported(sw: SparseWeight) -> str | None:
    """Why the CUDA SpMM cannot take ``sw`` (None when it can): the kernels' one list of constraints."""
    spec = sw.spec
    if jnp.dtype(sw.values.dtype) not in KERNEL_DTYPES:
        return f"the kernels take bfloat16 or float16, got {sw.values.dtype}"
    if spec.n != 2 or spec.m not in KERNEL_M:
        return f"the kernels take 2:4 and V:2:M with M in {KERNEL_M}, got {spec}"
    if spec.m == 4 and spec.v != 1:
        return f"the kernels take M = 4 as plain 2:4 (V = 1), got {spec}"
    if spec.m > 4 and spec.v not in KERNEL_V:
        return f"the kernels take V in {KERNEL_V} for M > 4, got {spec}"
    if sw.shape[1] % KERNEL_ROW_TILE:
        return f"the kernels need R (output features) to be a multiple of {KERNEL_ROW_TILE}, got {sw.shape[1]}"
    if sw.shape[0] % (8 * spec.m):
        return f"the kernels need K % (8*M) == 0, got K = {sw.shape[0]}, M = {spec.m}"
    return None


def sddmm_unsupported(sw: SparseWeight) -> str | None:
    """Why the CUDA SDDMM (``jaxsparse_sddmm``) cannot take ``sw`` (None when it can).

    Its tiles are 64 rows inside one V block by whole metadata words of groups, so it shares the SpMM's
    list: bf16/fp16, 2:4 or V:2:M with V in {64, 128} and M in {8, 16, 32}, R % 64 == 0, K % (8*M) == 0.
    """
    return spmm_unsupported(sw)


def spmm_t_unsupported(sw: SparseWeight) -> str | None:
    """Why the CUDA input-gradient product (``jaxsparse_spmm_t``) cannot take ``sw`` (None when it can).

    It reduces over R in 32-row stages inside V blocks and writes whole metadata words of groups: the
    SpMM's list again.
    """
    return spmm_unsupported(sw)


def _optional_operand(a: jax.Array | None, dtype) -> jax.Array:
    """An optional operand as the handlers take it: ``a``, or an empty ``[0]`` array of ``dtype`` for none."""
    return a if a is not None else jnp.zeros((0,), dtype)


def _columns_operand(sw: SparseWeight) -> jax.Array:
    """The columns array, or an empty placeholder for M = 4 (the kernels ignore it then)."""
    return _optional_operand(sw.columns, jnp.uint8)


def _setting(value, env: str, default: str = "auto"):
    """``value``, or when it is None the environment variable ``env`` (trimmed, lower case; ``default`` when
    unset or empty). Each setting checks the result against its own choices."""
    if value is None:
        value = os.environ.get(env, default).strip().lower() or default
    return value


def _xt_shape_problem(tokens: int, sw: SparseWeight) -> str | None:
    """The constraint a ``T``-token x misses for the x^T kernels (16-byte rows of x^T, 128-feature CTAs),
    or None when it meets them."""
    if tokens % 8:
        return f"T % 8 == 0 (16-byte rows of x^T), got T = {tokens}"
    if sw.shape[1] % COL_MAJOR_ROW_TILE:
        return f"R % {COL_MAJOR_ROW_TILE} == 0, got R = {sw.shape[1]}"
    return None


def _varying_axes(a: jax.Array) -> frozenset:
    """Manual mesh axes ``a`` varies over inside ``shard_map`` (empty outside it)."""
    aval = jax.typeof(a)
    mat = getattr(aval, "mat", None)  # JAX 0.10: ManualAxisType; later versions may expose .vma
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def _call(target: str, shape: tuple[int, ...], dtype, *operands: jax.Array, **attrs) -> jax.Array:
    """One ``ffi_call`` with a single result ``shape``/``dtype`` (:func:`_call_results`)."""
    return _call_results(target, [(shape, dtype)], *operands, **attrs)[0]


def _call_results(target: str, results: list[tuple[tuple[int, ...], Any]], *operands: jax.Array,
                  **attrs) -> list[jax.Array]:
    """One ``ffi_call`` with the given ``(shape, dtype)`` results.

    Inside ``shard_map`` the operands may vary over different mesh axes (tokens sharded, weights
    replicated); XLA custom calls need them to agree, so every operand is cast to vary over the union,
    and the results vary over it too. The call itself runs per shard: nothing is gathered.
    """
    register()
    axes = frozenset().union(*(_varying_axes(a) for a in operands))
    structs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in results]
    if axes:
        operands = tuple(
            a if _varying_axes(a) == axes else jax.lax.pcast(a, tuple(sorted(axes - _varying_axes(a))), to="varying")
            for a in operands
        )
        structs = [jax.typeof(operands[0]).update(shape=shape, dtype=jnp.dtype(dtype)) for shape, dtype in results]
    return list(jax.ffi.ffi_call(target, structs, vmap_method=_VMAP)(*operands, **attrs))


def as_2_4(sw: SparseWeight) -> tuple[SparseWeight, jax.Array]:
    """:func:`jaxsparse.format.as_2_4` (the 2:4 view of a V:2:M weight and where each value went) by the CUDA
    handler ``jaxsparse_as_2_4`` in one pass; a 2:4 weight is returned as it is, and an ``M`` outside {8, 16, 32}
    takes the reference."""
    return as_2_4_stacked((sw,))


def as_2_4_stacked(sws: Sequence[SparseWeight]) -> tuple[SparseWeight, jax.Array]:
    """The 2:4 views (:func:`as_2_4`) of up to :data:`SPMM_STACKED_MAX` V:2:M weights of one shape ``(K, R)``, spec and
    dtype, stacked along the output features: a 2:4 weight of shape ``(K, n R)`` whose values ``[n R, K/2]`` and
    metadata ``[n R, K/32]`` hold the i-th view in rows ``[i R, (i+1) R)``, and the slots ``[n R, 2G]`` likewise (each
    layer's own positions). One ``jaxsparse_as_2_4`` call (further weights as extra operands), so neither a launch per
    weight nor a concatenation follows; the stacked forward (:func:`spmm_stacked`) and the stacked SDDMM
    (:func:`sddmm_stacked`) read the same result, which XLA then computes once. 2:4 weights are concatenated as they
    are (slots ``arange(2G)``), and an ``M`` outside {8, 16, 32} takes the reference."""
    _check_stack("as_2_4_stacked", sws, SPMM_STACKED_MAX)
    first = sws[0]
    k, r = first.shape
    n, m = len(sws), first.spec.m
    if m not in (8, 16, 32):
        views = [format_as_2_4(sw) for sw in sws]
        if n == 1:
            return views[0]
        return _rows_stacked([w for w, _ in views]), jnp.concatenate([s for _, s in views], axis=0)
    results = [((n * r, k // 2), first.values.dtype), ((n * r, k // 32), jnp.uint32),
               ((n * r, first.values.shape[1]), jnp.int32)]
    values24, meta24, slots = _call_results("jaxsparse_as_2_4", results, *_weight_operands(sws),
                                            v=np.int32(first.spec.v), m=np.int32(m))
    return SparseWeight(values24, None, meta24, (k, n * r), VNM(1, 2, 4)), slots


def transpose_2_4_unsupported(sw: SparseWeight) -> str | None:
    """Why ``jaxsparse_transpose_2_4`` cannot take ``sw`` (its shape rules are :func:`format.transpose_2_4`'s), or
    None."""
    if jnp.dtype(sw.values.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"W^T's build takes bf16 or fp16 values, got {sw.values.dtype}"
    return None


def transpose_2_4(sw: SparseWeight) -> SparseWeight:
    """:func:`jaxsparse.format.transpose_2_4` (``W^T`` as a 2:4 weight, NaN where the mask is not transposable) by
    the CUDA handler ``jaxsparse_transpose_2_4`` in one pass."""
    return transpose_2_4_stacked((sw,))


def _not_one_kind(sws: Sequence[SparseWeight]) -> str | None:
    """What differs among weights that one stacked call takes (shape, spec or dtype), or None when nothing does."""
    first = sws[0]
    for sw in sws:
        if (sw.shape, sw.spec, jnp.dtype(sw.values.dtype)) != (first.shape, first.spec, jnp.dtype(first.values.dtype)):
            return (f"weights of one shape, spec and dtype, got {first.shape} {first.spec} {first.values.dtype} and "
                    f"{sw.shape} {sw.spec} {sw.values.dtype}")
    return None


def _check_stack(name: str, sws: Sequence[SparseWeight], most: int,
                 unsupported: Callable[[SparseWeight], str | None] | None = None) -> None:
    """The checks of the calls that build views of stacked weights: one to ``most`` weights, none of which
    ``unsupported`` refuses, of one shape, spec and dtype; a ``ValueError`` naming ``name`` otherwise."""
    if not 1 <= len(sws) <= most:
        raise ValueError(f"{name}: one to {most} weights, got {len(sws)}")
    for sw in sws:
        if unsupported is not None and (problem := unsupported(sw)):
            raise ValueError(f"{name}: {problem}")
    if problem := _not_one_kind(sws):
        raise ValueError(f"{name}: {problem}")


def _weight_operands(sws: Sequence[SparseWeight]) -> list[jax.Array]:
    """The view builders' operands: each weight's values, columns and metadata, in order (the first, then the further
    triples)."""
    return [a for sw in sws for a in (sw.values, _columns_operand(sw), sw.metadata)]


def _rows_stacked(sws: Sequence[SparseWeight]) -> SparseWeight:
    """Weights of one shape ``(K, R)`` and spec as one of shape ``(K, n R)``: values, metadata and columns concatenated
    along ``R`` (columns along ``R/V``), which keeps every V block whole when ``R % V == 0``."""
    cat = lambda arrays: jnp.concatenate(arrays, axis=0)
    first = sws[0]
    columns = None if first.columns is None else cat([w.columns for w in sws])
    return SparseWeight(cat([w.values for w in sws]), columns, cat([w.metadata for w in sws]),
                        (first.shape[0], len(sws) * first.shape[1]), first.spec)


def transpose_2_4_stacked(sws: Sequence[SparseWeight]) -> SparseWeight:
    """The ``W^T`` 2:4 views of up to :data:`SPMM_SUM_MAX` weights of one shape ``(K, R)``, spec and dtype, stacked
    along the views' reduction: a 2:4 weight of shape ``(n R, K)`` whose values ``[K, n R/2]`` and metadata
    ``[K, n R/32]`` hold the i-th view in the i-th slice of each row, as :func:`spmm_sum` concatenates them. One
    ``jaxsparse_transpose_2_4`` call (further weights as extra operands), so neither a launch per weight nor a
    concatenation follows."""
    _check_stack("transpose_2_4_stacked", sws, SPMM_SUM_MAX, transpose_2_4_unsupported)
    first = sws[0]
    k, r = first.shape
    n = len(sws)
    results = [((k, n * r // 2), first.values.dtype), ((k, n * r // 32), jnp.uint32)]
    values_t, meta_t = _call_results("jaxsparse_transpose_2_4", results, *_weight_operands(sws),
                                     v=np.int32(first.spec.v), m=np.int32(first.spec.m))
    return SparseWeight(values_t, None, meta_t, (n * r, k), VNM(1, 2, 4))


def decompress(sw: SparseWeight) -> jax.Array:
    """Dense ``[K, R]`` kernel of ``sw`` by the CUDA handler ``jaxsparse_decompress``."""
    return _call(
        "jaxsparse_decompress", sw.shape, sw.values.dtype, sw.values, _columns_operand(sw), sw.metadata,
        v=np.int32(sw.spec.v), m=np.int32(sw.spec.m),
    )


# The handlers' `activation` attribute for each epilogue activation (jaxsparse.reference.ACTIVATIONS defines them;
# cuda/mma_common.cuh Activate computes them).
ACTIVATION_CODES = {None: 0, "gelu": 1, "gelu_erf": 2, "relu": 3}


def _spmm_checks(name: str, sw: SparseWeight, dtype, bias: jax.Array | None, activation: str | None) -> None:
    """The checks both SpMM entry points share: operand dtype, the kernels' constraint list, bias, activation."""
    if sw.values.dtype != dtype:
        raise ValueError(f"{name}: x dtype {dtype} must equal the values dtype {sw.values.dtype}")
    problem = spmm_unsupported(sw)
    if problem:
        raise ValueError(f"{name}: {problem}")
    r = sw.shape[1]
    if bias is not None and (bias.shape != (r,) or bias.dtype not in (dtype, jnp.float32)):
        raise ValueError(f"{name}: bias must be [R] = [{r}] in {dtype} or float32, got {bias.shape} {bias.dtype}")
    if activation not in ACTIVATION_CODES:
        raise ValueError(f"{name}: activation must be one of {list(ACTIVATION_CODES)}, got {activation!r}")


def spmm(x: jax.Array, sw: SparseWeight, bias: jax.Array | None = None, activation: str | None = None,
         x_layout: str | None = None, row_kernel: str | None = None, with_derivative: bool = False):
    """``act(x @ W + bias)`` on the GPU: ``x [T, K] -> [T, R]`` in ``x.dtype``; with ``with_derivative`` the pair
    ``(act(z), act'(z))`` for ``z = x @ W + bias``, both written by the Hopper kernels' epilogue (act_mode 1; after the
    ``mma`` kernel XLA computes them).

    ``x_layout`` (see :func:`spmm_x_layout`): ``"row"`` reads ``x`` as it is, with the kernel
    :func:`spmm_row_kernel` picks (``row_kernel``); ``"col"`` transposes ``x`` (:func:`transpose`) and runs the
    Hopper kernel :func:`spmm_from_xt`. Kernel constraints (``ValueError`` here, before anything is launched): ``x`` 2-D
    bf16/fp16 with the dtype of ``sw.values``; ``K`` equal to ``sw.shape[0]``; spec ``2:4`` (V = 1) or
    ``V:2:M`` with ``V`` in {64, 128} and ``M`` in {8, 16, 32}; ``R % 64 == 0``; ``K % (8*M) == 0``;
    ``bias`` ``[R]`` in the input dtype or float32; ``activation`` one of ``ACTIVATION_CODES`` (``"gelu"`` is the tanh
    approximation, ``"gelu_erf"`` the exact GELU; ``with_derivative`` needs one). Any ``T`` on the row route.
    """
    if x.ndim != 2:
        raise ValueError(f"spmm: x must be 2-D [T, K], got shape {x.shape}")
    k, r = sw.shape
    spec = sw.spec
    if x.shape[1] != k:
        raise ValueError(f"spmm: x has K = {x.shape[1]} but the weight has K = {k}")
    _spmm_checks("spmm", sw, x.dtype, bias, activation)
    _check_act_mode("spmm", activation, with_derivative)
    if spmm_x_layout(x.shape[0], sw, x_layout) == "col":
        return _spmm_xt_call(transpose(x), sw, bias, activation, act_mode=int(with_derivative))
    if spmm_row_kernel(sw, row_kernel) == "tma":  # V:2:M through its 2:4 view (as_2_4)
        return _spmm_xt_call(x, as_2_4(sw)[0], bias, activation, x_rows=True, act_mode=int(with_derivative))
    if with_derivative:
        return reference.activation_with_derivative(activation, spmm(x, sw, bias, None, "row", "mma"))
    b = _optional_operand(bias, x.dtype)
    return _call(
        "jaxsparse_spmm",
        (x.shape[0], r),
        x.dtype,
        x,
        sw.values,
        _columns_operand(sw),
        sw.metadata,
        b,
        v=np.int32(spec.v),
        m=np.int32(spec.m),
        activation=np.int32(ACTIVATION_CODES[activation]),
    )


def _check_act_mode(name: str, activation: str | None, with_derivative: bool) -> None:
    if with_derivative and activation is None:
        raise ValueError(f"{name}: with_derivative needs an activation")


SPMM_X_LAYOUT_ENV = "JAXSPARSE_SPMM_X"
SPMM_X_LAYOUTS = ("auto", "row", "col")
SPMM_ROW_KERNEL_ENV = "JAXSPARSE_SPMM_ROW_KERNEL"
SPMM_ROW_KERNELS = ("auto", "mma", "tma")
# The M whose weights the auto routes run on the Hopper kernels that read x [T, K] as it is (the TMA row forward
# and the SDDMM's tma engine; V:2:M through its 2:4 view, as_2_4) instead of the x^T route.  M = 8 since session 9:
# its layer (forward + backward) on the view took 0.764 / 0.717 ms against 0.791 / 0.867 on the x^T route
# (1024x4096 / 4096x1024 at 16384 tokens, H100; benchmarks/layer_routes.py, docs/kernel-notes.md, session 9).
# At M >= 16 the view does M/4 times the condensed work and the x^T route stays ahead.
TMA_ROW_AUTO_M = (4, 8)
SPMM_XT_TILE_ENV = "JAXSPARSE_SPMM_XT_TILE"
SPMM_XT_TILES = {"auto": 0, "128x256": 1, "64x256": 2, "128x128": 3, "64x128": 4, "ws128x256": 5, "ws64x256": 6}
SPMM_ROW_TILES = ("auto", "ws128x256", "ws64x256")  # the tiles of the TMA row kernel (x [T, K])


def spmm_x_layout(tokens: int, sw: SparseWeight, layout: str | None = None, shares_xt: bool = False) -> str:
    """How the forward product reads ``x``: ``"row"`` (``x [T, K]`` as XLA holds it, ``jaxsparse_spmm``) or
    ``"col"`` (``x^T [K, T]`` made by :func:`transpose`, the Hopper kernel ``jaxsparse_spmm_xt``).

    ``sparse_linear`` follows the same choice for the whole layer: on ``"col"`` it keeps ``x^T`` as the
    residual and its SDDMM reads it (:func:`sddmm_from_xt`), so one transpose serves both products.
    ``layout`` ``None`` reads ``JAXSPARSE_SPMM_X`` (``auto``, ``row`` or ``col``; default ``auto``).
    ``auto``: ``col`` on a Hopper GPU for ``M > 4`` not in ``TMA_ROW_AUTO_M`` when ``T % 8 == 0`` and
    ``R % 128 == 0`` (what both x^T kernels need) and either ``shares_xt`` (the caller keeps x^T for the SDDMM,
    as ``sparse_linear`` does) or ``M >= 16``; ``row`` otherwise (an M in ``TMA_ROW_AUTO_M`` runs on the TMA
    row kernel through the weight's 2:4 view). 2:4 has no columns to gather, so its Hopper kernels read ``x`` as it is
    (:func:`spmm_row_kernel`, and the SDDMM's TMA engine): no transpose at all. Measured on the H100 at 16384
    tokens (docs/kernel-notes.md, session 5): with its own transpose the x^T route wins the forward alone at
    M >= 16 (128:2:16 at 4096x1024: 0.272 ms against 0.340) and ties or loses below (64:2:8: 0.471 against
    0.428); inside the layer, where the transpose also serves the SDDMM, it wins at every M > 4. An explicit
    ``col`` that the shapes cannot take raises ``ValueError``.
    """
    layout = _setting(layout, SPMM_X_LAYOUT_ENV)
    if layout not in SPMM_X_LAYOUTS:
        raise ValueError(f"the SpMM x layout ({SPMM_X_LAYOUT_ENV}) must be one of {SPMM_X_LAYOUTS}, got {layout!r}")
    problem = _xt_shape_problem(tokens, sw)
    if layout == "col" and problem:
        raise ValueError(f"spmm: a column-major x needs {problem}")
    if layout == "auto":
        m = sw.spec.m
        layout = "col" if (problem is None and m > 4 and m not in TMA_ROW_AUTO_M and (shares_xt or m >= 16)
                           and hopper_gpu()) else "row"
    return layout


def spmm_row_kernel(sw: SparseWeight, kernel: str | None = None) -> str:
    """The kernel of :func:`spmm`'s ``"row"`` route (``x [T, K]`` read as it is): ``"tma"``, the Hopper kernel
    ``jaxsparse_spmm_xt`` in its x-rows mode (TMA loads of x, ``wgmma.sp``; ``R % 64 == 0``, an
    sm_90a build on a Hopper GPU; a V:2:M weight runs as its 2:4 view, :func:`as_2_4`:
    dense-rate work over ``K``, nothing gathered), or ``"mma"``, ``jaxsparse_spmm`` (``mma.sp``, sm_80 and
    sm_90a, every spec). ``kernel`` ``None`` reads ``JAXSPARSE_SPMM_ROW_KERNEL`` (``auto``, ``mma`` or ``tma``;
    default ``auto``: ``tma`` for the specs in ``TMA_ROW_AUTO_M`` where it runs). An explicit ``tma`` that
    ``sw`` cannot take raises ``ValueError``.
    """
    kernel = _setting(kernel, SPMM_ROW_KERNEL_ENV)
    if kernel not in SPMM_ROW_KERNELS:
        raise ValueError(f"the SpMM row kernel ({SPMM_ROW_KERNEL_ENV}) must be one of {SPMM_ROW_KERNELS}, got {kernel!r}")
    problem = None if sw.shape[1] % 64 == 0 else f"R % 64 == 0, got R = {sw.shape[1]}"
    if kernel == "tma" and problem:
        raise ValueError(f"spmm: the TMA row kernel needs {problem}")
    if kernel == "auto":
        kernel = "tma" if problem is None and sw.spec.m in TMA_ROW_AUTO_M and hopper_gpu() else "mma"
    return kernel


def spmm_xt_tile(tile: str | None = None) -> int:
    """The x^T SpMM's tile attribute (``features x tokens`` per CTA): ``auto`` (0; ws128x256 at 2:4, 64x128 when
    V = 64, else 128x256 for a condensed reduction 4G > 512 and 128x128 below: measured, cuda/spmm_xt.cu
    ``AutoTile``),
    ``128x256``, ``64x256``, ``128x128``, ``64x128``, or ``ws128x256`` / ``ws64x256``: the warp-specialized
    persistent kernel (a producer warpgroup and two consumer warpgroups; the only tiles of the TMA row kernel,
    which reads x [T, K]). ``None`` reads ``JAXSPARSE_SPMM_XT_TILE``."""
    tile = _setting(tile, SPMM_XT_TILE_ENV)
    if tile not in SPMM_XT_TILES:
        raise ValueError(f"the x^T SpMM tile ({SPMM_XT_TILE_ENV}) must be one of {sorted(SPMM_XT_TILES)}, got {tile!r}")
    return SPMM_XT_TILES[tile]


def spmm_from_xt(xt: jax.Array, sw: SparseWeight, bias: jax.Array | None = None, activation: str | None = None,
                 tile: str | None = None, with_derivative: bool = False, transpose_out: bool = False):
    """:func:`spmm` from ``x^T [K, T]`` by the Hopper handler ``jaxsparse_spmm_xt`` (what ``x_layout="col"``
    runs after :func:`transpose`): ``[T, R]`` in ``xt.dtype`` (a pair with ``with_derivative``, as :func:`spmm`).
    Needs ``T % 8 == 0``, ``R % 128 == 0`` and a Hopper GPU with the sm_90a build, besides :func:`spmm`'s list.
    ``tile``: see :func:`spmm_xt_tile`.

    ``transpose_out`` (with ``with_derivative``; act_mode 2): the pair ``(act(z)^T [R, T], act'(z) [T, R])``, the
    first being the ``x^T`` a following layer on this route reads (:func:`jaxsparse.ops.sparse_mlp`); the
    warp-specialized tiles do not take it (``ValueError``)."""
    k, r = sw.shape
    if xt.ndim != 2 or xt.shape[0] != k:
        raise ValueError(f"spmm_from_xt: need x^T [{k}, T], got {xt.shape}")
    _spmm_checks("spmm_from_xt", sw, xt.dtype, bias, activation)
    _check_act_mode("spmm_from_xt", activation, with_derivative)
    if transpose_out and not with_derivative:
        raise ValueError("spmm_from_xt: transpose_out needs with_derivative (act_mode 2)")
    if transpose_out and (problem := transpose_out_problem(tile)):
        raise ValueError(f"spmm_from_xt: transpose_out needs {problem}")
    spmm_x_layout(xt.shape[1], sw, "col")  # raises ValueError naming the constraint the shapes miss
    return _spmm_xt_call(xt, sw, bias, activation, tile, act_mode=2 if transpose_out else int(with_derivative))


ACT_TABLE_ENV = "JAXSPARSE_ACT_TABLE"
ACT_TABLE_SETTINGS = ("on", "off")


def act_table(setting: str | None = None) -> bool:
    """Whether the x^T SpMM's bf16 feed-forward epilogues (``with_derivative``, a GELU) read ``act(z)`` and
    ``act'(z)`` from a table of the bf16 codes of ``z`` in shared memory (cuda/act_table.cuh: every entry the correctly
    rounded value, polynomials and limits outside the table) instead of computing them in float32 (about 45
    instructions an element: as long as the stores they feed). ``setting`` ``None`` reads ``JAXSPARSE_ACT_TABLE``
    (``on``, the default, or ``off``: the float32 formula, kept for comparison). fp16 and ReLU always compute."""
    setting = _setting(setting, ACT_TABLE_ENV, "on")
    if setting not in ACT_TABLE_SETTINGS:
        raise ValueError(f"the activation table setting ({ACT_TABLE_ENV}) must be one of {ACT_TABLE_SETTINGS}, "
                         f"got {setting!r}")
    return setting == "on"


DZ_EPILOGUE_ENV = "JAXSPARSE_DZ_EPILOGUE"
DZ_EPILOGUE_SETTINGS = ("auto", "on", "off")


def dz_epilogue(dz_summed: bool, setting: str | None = None) -> bool:
    """Whether the FFN's backward takes ``dz = dh * act'(z)`` from the epilogue of the input-gradient product of a
    second layer of diagonal blocks (:func:`spmm_blocks` with ``mul``; the kernel's producer brings ``act'`` in by
    TMA) rather than from an XLA multiply after it. ``dz_summed``: XLA sums ``dz`` over tokens afterwards (FFN in's
    bias gradient where its SDDMM does not sum it, :func:`sddmm_bias_grad_fused`). ``setting`` ``None`` reads
    ``JAXSPARSE_DZ_EPILOGUE``: ``on``, ``off``, or ``auto`` (the default), which is on unless ``dz_summed``: XLA
    fuses its multiply into that sum, so the epilogue would only trade the multiply for one more read of ``dz``
    (BERT-large on an H200, docs/kernel-notes.md session 46: busy time -1.23 ms a step at 64:2:8, where FFN in's
    SDDMM sums the bias, against -0.47 ms at 128:2:16, where XLA does)."""
    setting = _setting(setting, DZ_EPILOGUE_ENV, "auto")
    if setting not in DZ_EPILOGUE_SETTINGS:
        raise ValueError(f"the dz epilogue setting ({DZ_EPILOGUE_ENV}) must be one of {DZ_EPILOGUE_SETTINGS}, "
                         f"got {setting!r}")
    return setting == "on" or (setting == "auto" and not dz_summed)


def transpose_out_problem(tile: str | None = None) -> str | None:
    """Why :func:`spmm_from_xt`'s ``transpose_out`` (act_mode 2) cannot run on the x^T tile ``tile`` (``None``: the
    ``JAXSPARSE_SPMM_XT_TILE`` setting), or None where it can: only the plain tiles' epilogue stores y^T."""
    name = _setting(tile, SPMM_XT_TILE_ENV)
    if name.startswith("ws"):
        return f"a plain x^T tile, not {name} ({SPMM_XT_TILE_ENV}): act_mode 2 runs on the plain x^T tiles only"
    return None


def _spmm_xt_call(xt: jax.Array, sw: SparseWeight, bias, activation, tile: str | None = None,
                  x_rows: bool = False, act_mode: int = 0, x_blocks: int = 1, x_chunks=None, y_chunks=None, mul=None,
                  x_parts: tuple[jax.Array, ...] = (), y_parts: int = 1):
    """The ``jaxsparse_spmm_xt`` call, operands checked: ``xt`` is x^T [K, T], or x [T, K] with ``x_rows``
    (``[T, x_blocks K]`` for a weight of ``x_blocks`` diagonal blocks, :func:`spmm_blocks`, which also passes the
    chunk tables and ``mul``; with ``x_parts``, up to two more ``[T, K]`` operands that continue the reduction,
    :func:`spmm_sum`). ``act_mode`` 1 returns ``(act(z), act'(z))``, 2 ``(act(z)^T, act'(z))`` (cuda/spmm_xt.cu);
    ``y_parts`` P > 1 (act_mode 0) returns P arrays ``[T, R/P]``, the stacked weight's rows in P outputs
    (:func:`spmm_stacked`)."""
    b = _optional_operand(bias, xt.dtype)
    tokens = xt.shape[0] if x_rows else xt.shape[1]
    name = _setting(tile, SPMM_XT_TILE_ENV)
    tile_id = spmm_xt_tile(name)
    if name.removeprefix("ws").startswith("128x") and (sw.shape[1] % 128 or sw.spec.v == 64):
        raise ValueError(f"spmm: the x^T SpMM tile {name} needs R % 128 == 0 and V >= 128 (or 2:4), got R = "
                         f"{sw.shape[1]} and {sw.spec}")
    if x_rows and name not in SPMM_ROW_TILES:
        raise ValueError(f"spmm: the TMA row kernel reads x [T, K] with tile {', '.join(SPMM_ROW_TILES)}, got {name} "
                         f"({SPMM_XT_TILE_ENV}; or {SPMM_ROW_KERNEL_ENV}=mma)")
    out, empty = ((tokens, sw.shape[1] // y_parts), xt.dtype), ((0,), xt.dtype)
    first = ((sw.shape[1], tokens), xt.dtype) if act_mode == 2 else out
    second = out if act_mode != 0 or y_parts > 1 else empty
    results = _call_results(
        "jaxsparse_spmm_xt", [first, second, out if y_parts == 3 else empty], xt, sw.values,
        _columns_operand(sw), sw.metadata, b, _chunks_operand(x_chunks), _chunks_operand(y_chunks),
        _optional_operand(mul, xt.dtype), *(_optional_operand(x_parts[i] if i < len(x_parts) else None, xt.dtype)
                                            for i in range(2)),
        v=np.int32(sw.spec.v), m=np.int32(sw.spec.m),
        activation=np.int32(ACTIVATION_CODES[activation]), act_mode=np.int32(act_mode), tile=np.int32(tile_id),
        x_rows=np.int32(x_rows), act_table=np.int32(act_table()),
        x_blocks=np.int32(x_blocks), y_parts=np.int32(y_parts),
    )
    if y_parts > 1:
        return tuple(results[:y_parts])
    return tuple(results[:2]) if act_mode != 0 else results[0]


SPMM_SUM_MAX = 3
"""The most products :func:`spmm_sum` runs as one call (the operands the warp-specialized kernel takes by TMA)."""


def spmm_sum_unsupported(sws) -> str | None:
    """Why :func:`spmm_sum` cannot take these weights (None when it can); any token count is fine."""
    if not 1 <= len(sws) <= SPMM_SUM_MAX:
        return f"one to {SPMM_SUM_MAX} products, got {len(sws)}"
    first = sws[0]
    for sw in sws:
        if problem := spmm_unsupported(sw):
            return problem
        if sw.spec.m != 4:
            return f"2:4 weights (the TMA row kernel reads x as it is), got {sw.spec}"
        if sw.shape != first.shape or jnp.dtype(sw.values.dtype) != jnp.dtype(first.values.dtype):
            return (f"weights of one shape and dtype, got {first.shape} {first.values.dtype} and {sw.shape} "
                    f"{sw.values.dtype}")
    if first.shape[0] % 64:
        return f"K % 64 == 0 (no k-step of 64 straddles two products), got K = {first.shape[0]}"
    if not hopper_gpu():
        return "a Hopper GPU (the warp-specialized TMA row kernel)"
    return None


def spmm_sum(xs, sws) -> jax.Array:
    """``sum_i xs[i] @ W_i`` for up to :data:`SPMM_SUM_MAX` 2:4 weights of one shape ``(K, R)``, each ``xs[i]``
    ``[T, K]``: one ``jaxsparse_spmm_xt`` call on the warp-specialized TMA row kernel whose reduction runs over the
    products in turn (the values and metadata concatenated along K, each x loaded by its own TMA descriptor), so the
    sum is accumulated in float32 and ``[T, R]`` is written once, in x's dtype. Constraints:
    :func:`spmm_sum_unsupported`."""
    if problem := spmm_sum_unsupported(sws):
        raise ValueError(f"spmm_sum: needs {problem}")
    k, r = sws[0].shape
    cat = SparseWeight(jnp.concatenate([sw.values for sw in sws], axis=1), None,
                       jnp.concatenate([sw.metadata for sw in sws], axis=1), (len(sws) * k, r), sws[0].spec)
    return _stacked_sum(xs, cat, len(sws))


def _stacked_problem(name: str, sws: Sequence[SparseWeight], most: int, x_layout: str) -> str | None:
    """What the stacked calls (:func:`spmm_stacked`, :func:`sddmm_stacked`) ask alike of their layers, or None: one to
    ``most`` weights of one shape, spec and dtype that the kernels take (:func:`spmm_unsupported`, the SDDMM's list
    too), and ``R % 128 == 0`` (no tile straddles two layers). A ``x_layout`` other than ``"row"`` and ``"col"`` raises
    ``ValueError``."""
    if x_layout not in ("row", "col"):
        raise ValueError(f"{name}: x_layout must be 'row' or 'col', got {x_layout!r}")
    if not 1 <= len(sws) <= most:
        return f"one to {most} layers, got {len(sws)}"
    for sw in sws:
        if problem := spmm_unsupported(sw):
            return problem
    if problem := _not_one_kind(sws):
        return problem
    if sws[0].shape[1] % COL_MAJOR_ROW_TILE:
        return f"R % {COL_MAJOR_ROW_TILE} == 0 (a tile's rows in one layer), got R = {sws[0].shape[1]}"
    return None


SPMM_STACKED_MAX = 3
"""The most layers :func:`spmm_stacked` computes by one call (the outputs ``jaxsparse_spmm_xt`` writes)."""


def spmm_stacked_unsupported(tokens: int, sws: Sequence[SparseWeight], x_layout: str) -> str | None:
    """Why :func:`spmm_stacked` cannot take the forward of these layers from a ``tokens``-token input held as
    ``x_layout`` (``"row"``: ``x [T, K]`` on the TMA row kernel, :func:`spmm_row_kernel`; ``"col"``: ``x^T [K, T]`` on
    the x^T kernels), or None when it can: one to :data:`SPMM_STACKED_MAX` weights of one shape, spec and dtype that
    the SpMM takes, ``R % 128 == 0`` (no tile straddles two layers' outputs), a Hopper GPU, and the route's own
    conditions. A ``x_layout`` other than those two raises ``ValueError``."""
    if problem := _stacked_problem("spmm_stacked", sws, SPMM_STACKED_MAX, x_layout):
        return problem
    first = sws[0]
    if not hopper_gpu():
        return "a Hopper GPU (the x^T and TMA row kernels)"
    if x_layout == "col":
        return _xt_shape_problem(tokens, first)
    if spmm_row_kernel(first) != "tma":
        return (f"the TMA row kernel for x [T, K] (2:4 or M in {TMA_ROW_AUTO_M}, {SPMM_ROW_KERNEL_ENV} auto or tma), "
                f"got {first.spec}")
    return None


def spmm_stacked(x: jax.Array, sws: Sequence[SparseWeight], biases=None, x_layout: str = "row") -> tuple:
    """``x @ W_i + b_i`` for up to :data:`SPMM_STACKED_MAX` layers of one input (attention's query, key and value) by
    one ``jaxsparse_spmm_xt`` call: the weights' rows stacked (values, metadata, columns and biases concatenated along
    the output features; a V:2:M weight on the ``"row"`` route through its 2:4 view, :func:`as_2_4`), x read once, and
    each layer's output written by the kernel's epilogue into its own array (attribute ``y_parts``), so no slice
    follows. ``x`` is ``x [T, K]`` on ``x_layout`` ``"row"`` and ``x^T [K, T]`` on ``"col"``; ``biases`` None or one
    ``[R]`` array or None a layer (in x's dtype or float32; a missing one adds zeros). Returns one ``[T, R]`` array a
    layer in x's dtype. Constraints: :func:`spmm_stacked_unsupported`."""
    n, col = len(sws), x_layout == "col"
    tokens = x.shape[-1] if col else x.shape[0]
    if problem := spmm_stacked_unsupported(tokens, sws, x_layout):
        raise ValueError(f"spmm_stacked: needs {problem}")
    k, r = sws[0].shape
    want = (k, tokens) if col else (tokens, k)
    if x.ndim != 2 or x.shape != want:
        raise ValueError(f"spmm_stacked: needs x{'^T' if col else ''} {want}, got {x.shape}")
    biases = (None,) * n if biases is None else tuple(biases)
    if len(biases) != n:
        raise ValueError(f"spmm_stacked: one bias (or None) a weight, got {len(biases)} for {n} weights")
    for sw, b in zip(sws, biases):
        _spmm_checks("spmm_stacked", sw, x.dtype, b, None)
    # the 2:4 views built stacked by one call, or the weights as they are, concatenated along R
    stacked = as_2_4_stacked(sws)[0] if not col and sws[0].spec.m != 4 else _rows_stacked(sws)
    bias = None
    if any(b is not None for b in biases):
        dtype = jnp.result_type(*(b.dtype for b in biases if b is not None))
        bias = jnp.concatenate([jnp.zeros((r,), dtype) if b is None else b.astype(dtype) for b in biases])
    out = _spmm_xt_call(x, stacked, bias, None, x_rows=not col, y_parts=n)
    return out if n > 1 else (out,)


def spmm_t_sum_unsupported(sws) -> str | None:
    """Why :func:`spmm_t_sum` cannot take these weights (None when it can): :func:`transpose_2_4_unsupported` for
    each, then :func:`spmm_sum_unsupported` for their ``W^T`` views."""
    for sw in sws:
        if problem := transpose_2_4_unsupported(sw):
            return problem
    if len({(sw.shape, sw.spec) for sw in sws}) > 1:
        return f"weights of one shape and spec, got {[(sw.shape, str(sw.spec)) for sw in sws]}"
    return spmm_sum_unsupported(tuple(_transposed_view_shapes(sw) for sw in sws))


def _transposed_view_shapes(sw: SparseWeight) -> SparseWeight:
    """What :func:`transpose_2_4` returns for ``sw``, as shapes only (nothing is built)."""
    k, r = sw.shape
    return SparseWeight(jax.ShapeDtypeStruct((k, r // 2), sw.values.dtype), None,
                        jax.ShapeDtypeStruct((k, r // 32), jnp.uint32), (r, k), VNM(1, 2, 4))


def spmm_t_sum(dys, sws) -> jax.Array:
    """``sum_i dys[i] @ W_i^T`` for up to :data:`SPMM_SUM_MAX` weights ``W_i`` of one shape ``(K, R)``, spec and dtype
    with transposable masks, each ``dys[i]`` ``[T, R]``: the input gradient of layers that share their input
    (:func:`jaxsparse.ops.shared_linear`). Two calls: :func:`transpose_2_4_stacked` builds every ``W_i^T`` 2:4 view
    into one stacked weight, and one ``jaxsparse_spmm_xt`` product reduces over all of it (:func:`spmm_sum`'s
    kernel). NaN where a mask is not transposable, as :func:`transpose_2_4`. Constraints:
    :func:`spmm_t_sum_unsupported`."""
    if problem := spmm_t_sum_unsupported(sws):
        raise ValueError(f"spmm_t_sum: needs {problem}")
    return _stacked_sum(dys, transpose_2_4_stacked(sws), len(sws))


def _stacked_sum(xs, stacked: SparseWeight, parts: int) -> jax.Array:
    """``sum_i xs[i] @ W_i`` where ``stacked`` is the 2:4 weights ``W_i`` concatenated along K: the summed product's
    ``jaxsparse_spmm_xt`` call, its inputs checked."""
    k = stacked.shape[0] // parts
    if len(xs) != parts:
        raise ValueError(f"spmm_sum: one x a weight, got {len(xs)} for {parts}")
    for x in xs:
        if x.ndim != 2 or x.shape != xs[0].shape or x.shape[1] != k or x.dtype != stacked.values.dtype:
            raise ValueError(f"spmm_sum: every x must be [T, {k}] in {stacked.values.dtype}, got "
                             f"{[(a.shape, str(a.dtype)) for a in xs]}")
    return _spmm_xt_call(xs[0], stacked, None, None, x_rows=True, x_parts=tuple(xs[1:]))


SDDMM_SPLIT_ENV = "JAXSPARSE_SDDMM_SPLIT"


def sddmm_split(split: int | str | None = None) -> int:
    """The SDDMM's token-split attribute: 1 = one pass over all tokens, 0 = auto, n > 1 = n token ranges.

    ``None`` reads ``JAXSPARSE_SDDMM_SPLIT`` (``auto``, ``none`` or an integer; default ``auto``, which splits
    only grids of fewer (row, group) tiles than half the GPU's SMs, or than its SMs on the one-CTA x^T and tma engines,
    by whole waves: measured on the H100, 2.4x on a 1024x1024 layer at 64:2:8, and a loss on layers whose grid already
    fills the GPU; docs/kernel-notes.md).
    """
    split = _setting(split, SDDMM_SPLIT_ENV)
    if isinstance(split, str):
        named = {"auto": 0, "none": 1}
        if split in named:
            return named[split]
        try:
            split = int(split)
        except ValueError:
            raise ValueError(f"{SDDMM_SPLIT_ENV} must be 'auto', 'none' or an integer >= 1, got {split!r}") from None
    if split < 0:
        raise ValueError(f"the SDDMM split must be 0 (auto), 1 (none) or more token ranges, got {split}")
    return int(split)


SDDMM_ENGINE_ENV = "JAXSPARSE_SDDMM_ENGINE"
SDDMM_ENGINES = {"auto": 0, "mma": 1, "wgmma": 2, "tma": 3}


def sddmm_engine(engine: str | None = None) -> int:
    """The SDDMM's engine attribute: ``auto`` (0; at 2:4 from a row-major x the TMA engine where it runs, else
    wgmma where it runs), ``mma`` (1; mma.sync, any GPU from sm_80), ``wgmma`` (2; Hopper warpgroup MMAs
    gathering from a row-major x: an sm_90a build on a Hopper GPU, M in {4, 8, 16} and R a multiple of 128,
    else the call fails), ``tma`` (3; the x^T engine's TMA pipeline reading x [T, K] as it is: R a multiple of 128,
    a Hopper GPU, else the call fails; a V:2:M weight runs as its 2:4 view, :func:`as_2_4`,
    and its gradient is gathered back to the weight's values). ``None`` reads ``JAXSPARSE_SDDMM_ENGINE`` (default
    ``auto``).
    """
    engine = _setting(engine, SDDMM_ENGINE_ENV)
    if engine not in SDDMM_ENGINES:
        raise ValueError(f"the SDDMM engine ({SDDMM_ENGINE_ENV}) must be one of {sorted(SDDMM_ENGINES)}, got {engine!r}")
    return SDDMM_ENGINES[engine]


SDDMM_X_LAYOUT_ENV = "JAXSPARSE_SDDMM_X"
SDDMM_X_LAYOUTS = ("auto", "row", "col")
SDDMM_BIAS_ENV = "JAXSPARSE_SDDMM_BIAS"  # "on" (default): the tma engine sums dy for the bias gradient; "off": XLA
SDDMM_BIAS_MODES = ("on", "off")
COL_MAJOR_ROW_TILE = 128  # output features per CTA of the x^T engine (cuda/sddmm.cu)


def hopper_gpu() -> bool:
    """True when the first GPU JAX sees is a Hopper (compute capability 9.x); False without a GPU."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return False
    return bool(gpus) and str(getattr(gpus[0], "compute_capability", "")).startswith("9")


def transpose(x: jax.Array) -> jax.Array:
    """``x [T, K] -> x^T [K, T]`` (bf16/fp16, ``T % 8 == 0``, ``K % 8 == 0``) by the CUDA handler
    ``jaxsparse_transpose``. In the BERT-large step, asking XLA for the same layout instead cost 148.8 ms of
    transposing fusions per step; the 96 calls of this kernel cost about 6 ms (docs/kernel-notes.md)."""
    if x.ndim != 2 or jnp.dtype(x.dtype) not in KERNEL_DTYPES:
        raise ValueError(f"transpose: x must be 2-D bfloat16 or float16, got {x.shape} {x.dtype}")
    if x.shape[0] % 8 or x.shape[1] % 8:
        raise ValueError(f"transpose: needs T % 8 == 0 and K % 8 == 0, got {x.shape}")
    return _call("jaxsparse_transpose", (x.shape[1], x.shape[0]), x.dtype, x)


def sddmm_x_layout(tokens: int, sw: SparseWeight, layout: str | None = None, engine: str | None = None) -> str:
    """How the SDDMM reads ``x``: ``"row"`` (``x [T, K]`` as XLA holds activations) or ``"col"`` (``x^T [K, T]``,
    tokens contiguous, made by :func:`transpose` first).

    With tokens contiguous a kept column of ``x`` is a contiguous row of ``x^T``: the Hopper engine copies the
    condensed operand straight from global memory instead of gathering it from a dense slab in shared
    memory (docs/kernel-notes.md, session 4); the transpose costs one read and one write of ``x``.
    ``layout`` ``None`` reads ``JAXSPARSE_SDDMM_X`` (``auto``, ``row`` or ``col``; default ``auto``).
    ``auto``: ``col`` on a Hopper GPU for ``M > 4`` when ``T % 8 == 0``, ``R % 128 == 0`` and the engine is
    neither ``mma`` nor the tma engine on the 2:4 view (``tma``, or auto for an M in ``TMA_ROW_AUTO_M``); ``row``
    otherwise (2:4 keeps every column, so it has nothing to gather: on a Hopper GPU its
    ``tma`` engine, :func:`sddmm_engine`, reads ``x`` as it is with the x^T engine's TMA pipeline). An explicit
    ``col`` that these shapes cannot take, and the ``tma`` engine on a spec or shape it cannot take, raise
    ``ValueError``.
    """
    layout = _setting(layout, SDDMM_X_LAYOUT_ENV)
    if layout not in SDDMM_X_LAYOUTS:
        raise ValueError(f"the SDDMM x layout ({SDDMM_X_LAYOUT_ENV}) must be one of {SDDMM_X_LAYOUTS}, got {layout!r}")
    if sddmm_engine(engine) == SDDMM_ENGINES["tma"]:
        if sw.shape[1] % COL_MAJOR_ROW_TILE:
            raise ValueError(f"sddmm: the tma engine needs R % {COL_MAJOR_ROW_TILE} == 0, got R = {sw.shape[1]}")
        if layout == "col":
            raise ValueError("sddmm: the tma engine reads x [T, K]: x_layout must be 'row' or 'auto'")
        return "row"
    problem = _xt_shape_problem(tokens, sw)
    if problem is None and sddmm_engine(engine) == SDDMM_ENGINES["mma"]:
        problem = "the wgmma engine (the mma.sync engine reads a row-major x only)"
    if layout == "col" and problem:
        raise ValueError(f"sddmm: a column-major x needs {problem}")
    if layout == "auto":
        layout = "col" if problem is None and sw.spec.m > 4 and not _sddmm_on_view(sw, engine) and hopper_gpu() else "row"
    return layout


def _sddmm_on_tma(sw: SparseWeight, engine: str | None) -> bool:
    """Whether :func:`sddmm` on a row-major x runs the tma engine (on a 2:4 weight itself, or on a V:2:M weight's 2:4
    view): asked for (``engine`` tma), or the auto engine for an M in ``TMA_ROW_AUTO_M`` on a Hopper GPU with
    R % 128 == 0 (the handler's Dispatch in cuda/sddmm.cu)."""
    e = sddmm_engine(engine)
    if e == SDDMM_ENGINES["tma"]:
        return True
    return (e == SDDMM_ENGINES["auto"] and sw.spec.m in TMA_ROW_AUTO_M and sw.shape[1] % COL_MAJOR_ROW_TILE == 0
            and hopper_gpu())


def _sddmm_on_view(sw: SparseWeight, engine: str | None) -> bool:
    """Whether :func:`sddmm` on a row-major x runs a V:2:M weight as its 2:4 view on the tma engine."""
    return sw.spec.m != 4 and _sddmm_on_tma(sw, engine)


def sddmm_bias_grad_fused(tokens: int, sw: SparseWeight, engine: str | None = None,
                          x_layout: str | None = None) -> bool:
    """Whether :func:`sddmm` with ``bias_grad=True`` takes the bias gradient from the kernel, whose CTAs also sum
    ``dy`` over their tokens (m64n8k16 products against a tile of ones, a stage's four k16 steps shared out over
    column tiles; docs/kernel-notes.md, sessions 44 to 46): where the call runs the x^T engine (``x_layout``
    ``"col"``, :func:`sddmm_x_layout`; any number of column tiles), or the tma engine on ``x [T, K]`` (2:4, or a
    V:2:M weight's 2:4 view; ``R % 128 == 0``; a Hopper GPU) over at least :data:`SDDMM_BIAS_WAYS` column tiles
    (``K >= 772``). Elsewhere the sum is XLA's. ``JAXSPARSE_SDDMM_BIAS=off`` turns the kernel's sum off."""
    mode = _setting(None, SDDMM_BIAS_ENV, "on")
    if mode not in SDDMM_BIAS_MODES:
        raise ValueError(f"{SDDMM_BIAS_ENV} must be one of {SDDMM_BIAS_MODES}, got {mode!r}")
    if mode == "off":
        return False
    if sddmm_x_layout(tokens, sw, x_layout, engine) == "col":
        return True
    if -(-sw.shape[0] // (4 * SDDMM_TMA_GROUP_TILE)) < SDDMM_BIAS_WAYS:  # the 2:4 view's column tiles
        return False
    return _sddmm_on_tma(sw, engine)


def sddmm(x: jax.Array, dy: jax.Array, sw: SparseWeight, out_dtype=None, split: int | str | None = None,
          engine: str | None = None, x_layout: str | None = None, bias_grad: bool = False):
    """Weight gradient ``x^T dy`` at ``sw``'s kept positions by the CUDA handler ``jaxsparse_sddmm``.

    ``x [T, K]`` and ``dy [T, R]`` -> ``[R, 2G]`` in the layout of ``sw.values``, accumulated in float32
    and returned in ``out_dtype`` (``sw.values.dtype`` when None, or float32). Constraints (``ValueError``
    here, before anything is launched): ``x`` and ``dy`` 2-D with one token count and the dtype of
    ``sw.values``; ``sddmm_unsupported(sw)`` is None. Any ``T`` (``T = 0`` gives zeros). ``split``: see
    :func:`sddmm_split` (token ranges reduced in float32 through the call's second result, a buffer sized by
    :func:`sddmm_partial_elements`). ``engine``: see
    :func:`sddmm_engine`. ``x_layout``: see :func:`sddmm_x_layout`. With ``bias_grad`` the result is the pair
    ``(dvalues, dbias)``, ``dbias`` being ``dy`` summed over tokens in float32 ``[R]``: from the kernel where
    :func:`sddmm_bias_grad_fused` says so (no second pass over ``dy``), else from XLA.
    """
    if x.ndim != 2 or dy.ndim != 2:
        raise ValueError(f"sddmm: x and dy must be 2-D, got shapes {x.shape} and {dy.shape}")
    k, r = sw.shape
    if x.shape[1] != k or dy.shape[1] != r or x.shape[0] != dy.shape[0]:
        raise ValueError(f"sddmm: need x [T, {k}] and dy [T, {r}] for a weight {sw.shape}, got {x.shape} and {dy.shape}")
    out = _sddmm_out_dtype("sddmm", "x", x, dy, sw, out_dtype)
    fused = bias_grad and sddmm_bias_grad_fused(x.shape[0], sw, engine, x_layout)
    if sddmm_x_layout(x.shape[0], sw, x_layout, engine) == "col":
        dvalues, dbias = _sddmm_call(transpose(x), dy, sw, out, split, SDDMM_ENGINES["wgmma"], x_layout=1,
                                     bias_grad=fused)
    elif _sddmm_on_view(sw, engine):
        # V:2:M through its 2:4 view: the gradient at every 2:4 slot, then back to sw's values.
        sw24, slots = as_2_4(sw)
        dvalues, dbias = _sddmm_call(x, dy, sw24, out, split, SDDMM_ENGINES["tma"], x_layout=0, bias_grad=fused)
        dvalues = jnp.take_along_axis(dvalues, slots, axis=1)
    else:
        dvalues, dbias = _sddmm_call(x, dy, sw, out, split, sddmm_engine(engine), x_layout=0, bias_grad=fused)
    return _sddmm_result(dvalues, dbias, dy, bias_grad, fused)


def sddmm_from_xt(xt: jax.Array, dy: jax.Array, sw: SparseWeight, out_dtype=None,
                  split: int | str | None = None, bias_grad: bool = False):
    """:func:`sddmm` from ``x^T [K, T]`` (the Hopper x^T engine; what ``x_layout="col"`` runs after
    :func:`transpose`). Needs ``T % 8 == 0``, ``R % 128 == 0`` and a Hopper GPU, besides :func:`sddmm`'s list. With
    ``bias_grad`` the result is the pair ``(dvalues, dbias)`` as :func:`sddmm`'s, the sum the kernel's unless
    ``JAXSPARSE_SDDMM_BIAS=off`` (:func:`sddmm_bias_grad_fused`)."""
    k, r = sw.shape
    if xt.ndim != 2 or dy.ndim != 2 or xt.shape != (k, dy.shape[0]) or dy.shape[1] != r:
        raise ValueError(f"sddmm_from_xt: need x^T [{k}, T] and dy [T, {r}], got {xt.shape} and {dy.shape}")
    out = _sddmm_out_dtype("sddmm_from_xt", "x^T", xt, dy, sw, out_dtype)
    sddmm_x_layout(dy.shape[0], sw, "col")  # raises ValueError naming the constraint the shapes miss
    fused = bias_grad and sddmm_bias_grad_fused(dy.shape[0], sw, x_layout="col")
    dvalues, dbias = _sddmm_call(xt, dy, sw, out, split, SDDMM_ENGINES["wgmma"], x_layout=1, bias_grad=fused)
    return _sddmm_result(dvalues, dbias, dy, bias_grad, fused)


def _sddmm_result(dvalues: jax.Array, dbias: jax.Array | None, dy: jax.Array, bias_grad: bool, fused: bool):
    """What :func:`sddmm` and :func:`sddmm_from_xt` return: ``dvalues``, or with ``bias_grad`` the pair ``(dvalues,
    dbias)``, ``dbias`` the kernel's sum where ``fused``, else XLA's (:func:`jaxsparse.reference.bias_grad`)."""
    if not bias_grad:
        return dvalues
    return dvalues, dbias if fused else reference.bias_grad(dy, jnp.float32)


def _sddmm_out_dtype(name: str, x_name: str, x: jax.Array, dy: jax.Array, sw: SparseWeight, out_dtype) -> np.dtype:
    """The checks both SDDMM entry points share (operand dtypes, output dtype, the kernels' constraint list);
    returns the output dtype."""
    if x.dtype != sw.values.dtype or dy.dtype != sw.values.dtype:
        raise ValueError(f"{name}: {x_name} ({x.dtype}) and dy ({dy.dtype}) must have the values dtype {sw.values.dtype}")
    out = jnp.dtype(out_dtype or sw.values.dtype)
    if out not in (jnp.dtype(sw.values.dtype), jnp.dtype(jnp.float32)):
        raise ValueError(f"{name}: out_dtype must be the values dtype {sw.values.dtype} or float32, got {out}")
    problem = sddmm_unsupported(sw)
    if problem:
        raise ValueError(f"{name}: {problem}")
    return out


# The handler's token split: at most this many ranges, and only on grids of fewer (row, group) tiles than the GPU has
# SMs (half as many on engines of two CTAs an SM); the buffer is sized where the grid has at most half as many tiles
# of SDDMM_MAX_TILE_VALUES values as SDDMM_SM_BOUND (elsewhere the handler does not split, for want of room); no
# engine's tile holds more than SDDMM_MAX_TILE_VALUES values or takes fewer than
# SDDMM_MIN_STAGE_TOKENS tokens per stage, and auto keeps >= 4 stages per range (cuda/sddmm.cu, ChooseSplits).
SDDMM_MAX_SPLITS = 16
SDDMM_MAX_TILE_VALUES = 128 * 128
SDDMM_MIN_STAGE_TOKENS = 32
SDDMM_SM_BOUND = 256  # SMs of any GPU this sizes for (the H100 has 132)


SDDMM_BIAS_WAYS = 4  # the most column tiles whose CTAs write the kernel's bias gradient (cuda/sddmm.cu, DbWays)
SDDMM_TMA_GROUP_TILE = 64  # groups of 4 per CTA of the tma engine (cuda/sddmm.cu, XtLayout<true>::kGC)


def sddmm_partial_elements(tokens: int, n_values: int, split: int, bias_rows: int = 0) -> int:
    """Float32 elements of the SDDMM's token-split buffer (its second result) for ``n_values = R * 2G`` values:
    room for every range the handler's rule can choose for ``split`` (:func:`sddmm_split`), 0 where it cannot
    split; with ``bias_rows = R`` (the kernel's bias gradient), also its :data:`SDDMM_BIAS_WAYS` planes of ``R``
    floats a range. The handler never takes more ranges than this buffer holds, so the size bounds, and never
    changes, the result."""
    ranges = 0
    if split != 1 and n_values != 0:
        if split == 0:
            if 2 * -(-n_values // SDDMM_MAX_TILE_VALUES) <= SDDMM_SM_BOUND:  # else the grid fills the GPU: no split
                ranges = min(SDDMM_MAX_SPLITS, tokens // (4 * SDDMM_MIN_STAGE_TOKENS) + 1)
        else:
            ranges = min(split, -(-tokens // SDDMM_MIN_STAGE_TOKENS))
    values = ranges * n_values if ranges > 1 else 0
    return values + max(ranges, 1) * SDDMM_BIAS_WAYS * bias_rows


def _chunks_operand(chunks) -> jax.Array:
    """A chunk table as the handlers take it: int32, flat; empty for none."""
    return jnp.zeros((0,), jnp.int32) if chunks is None else jnp.asarray(chunks, jnp.int32).reshape(-1)


def _sddmm_call(x: jax.Array, dy: jax.Array, sw: SparseWeight, out, split, engine: int, x_layout: int,
                x_blocks: int = 1, x_chunks=None, bias_grad: bool = False,
                further: Sequence[tuple[jax.Array, SparseWeight]] = ()) -> tuple[jax.Array, jax.Array | None]:
    """The ``jaxsparse_sddmm`` call, operands checked: ``x`` is ``[T, K]`` (x_layout 0) or ``x^T [K, T]`` (1).
    Returns ``(dvalues, dbias)``: ``dbias`` (``dy`` summed over tokens, float32 ``[R]``) only with ``bias_grad``,
    which only the tma and x^T engines take (:func:`sddmm_bias_grad_fused`), else None. ``further``: the other
    layers' ``(dy, weight)`` of :func:`sddmm_stacked` (their columns and metadata are passed, each weight's own); ``sw``
    then has the first layer's columns and metadata and the stacked shape ``(K, parts R)``, values ``[parts R, 2G]``.
    Stacked 2:4 views (:func:`as_2_4_stacked`) pass every layer's metadata as ``sw``'s (``[parts R, G/8]``) and
    empty metadata in ``further``.

    Its second result is the token split's float32 buffer (:func:`sddmm_partial_elements`), dropped here: an
    XLA buffer rather than scratch memory, so XLA may record the call into its command buffers."""
    split = sddmm_split(split)
    tokens = x.shape[1] if x_layout == 1 else x.shape[0]
    rows = sw.shape[1] if bias_grad else 0
    partial = sddmm_partial_elements(tokens, int(np.prod(sw.values.shape)), split, rows)
    dvalues, _, dbias = _call_results(
        "jaxsparse_sddmm", [(sw.values.shape, out), ((partial,), jnp.float32), ((rows,), jnp.float32)], x, dy,
        _columns_operand(sw), sw.metadata, _chunks_operand(x_chunks),
        *(a for d, w in further for a in (d, _columns_operand(w), w.metadata)), v=np.int32(sw.spec.v),
        m=np.int32(sw.spec.m), split=np.int32(split), engine=np.int32(engine), x_layout=np.int32(x_layout),
        x_blocks=np.int32(x_blocks),
    )
    return dvalues, dbias if bias_grad else None


SDDMM_STACKED_MAX = 3
"""The most layers :func:`sddmm_stacked` runs as one call (the dy tensor maps the x^T and tma engines take)."""


def sddmm_stacked_unsupported(tokens: int, sws: Sequence[SparseWeight], x_layout: str) -> str | None:
    """Why :func:`sddmm_stacked` cannot take these layers' weight gradients from a ``tokens``-token input held as
    ``x_layout`` (``"col"``: ``x^T [K, T]``, the x^T engine; ``"row"``: ``x [T, K]``, the tma engine on a 2:4 weight
    or a V:2:M weight's 2:4 view), or None when it can: one to :data:`SDDMM_STACKED_MAX` weights of one shape, spec and
    dtype that the SDDMM takes, ``R % 128 == 0``, and the engine's own conditions (a Hopper GPU among them). A
    ``x_layout`` other than those two raises ``ValueError``."""
    if problem := _stacked_problem("sddmm_stacked", sws, SDDMM_STACKED_MAX, x_layout):
        return problem
    first = sws[0]
    if x_layout == "col":
        try:
            sddmm_x_layout(tokens, first, "col")
        except ValueError as e:  # the x^T engine's shape and engine conditions
            return str(e).removeprefix("sddmm: a column-major x needs ")
        return None if hopper_gpu() else "a Hopper GPU (the x^T engine)"
    if not _sddmm_on_tma(first, None):
        return "the tma engine (2:4, or a V:2:M weight's 2:4 view, from x [T, K] with R % 128 == 0 on a Hopper GPU)"
    return None


def sddmm_stacked(x: jax.Array, dys: Sequence[jax.Array], sws: Sequence[SparseWeight], x_layout: str = "row",
                  bias_grad: bool = False) -> tuple:
    """The weight gradients of up to :data:`SDDMM_STACKED_MAX` layers of one input (attention's query, key and value):
    :func:`sddmm` of ``x`` (``x_layout`` ``"row"``) or :func:`sddmm_from_xt` of ``x^T`` (``"col"``) with each ``dys[i]``
    at ``sws[i]``'s mask, by one ``jaxsparse_sddmm`` call over the weights' rows stacked (each layer's dy read by its
    own TMA descriptor and its columns and metadata where they are, so nothing is concatenated). Returns one result a
    layer, as :func:`sddmm` returns it: ``dvalues`` in the values dtype, or with ``bias_grad`` the pair ``(dvalues,
    dbias)``. Constraints: :func:`sddmm_stacked_unsupported`."""
    n = len(sws)
    tokens = dys[0].shape[0] if dys else 0
    if problem := sddmm_stacked_unsupported(tokens, sws, x_layout):
        raise ValueError(f"sddmm_stacked: needs {problem}")
    k, r = sws[0].shape
    want = (k, tokens) if x_layout == "col" else (tokens, k)
    if len(dys) != n or x.ndim != 2 or x.shape != want:
        raise ValueError(f"sddmm_stacked: needs one dy a weight and x{'^T' if x_layout == 'col' else ''} {want}, got "
                         f"{len(dys)} dy for {n} weights and x {x.shape}")
    for dy in dys:
        if dy.ndim != 2 or dy.shape != (tokens, r):
            raise ValueError(f"sddmm_stacked: every dy must be [T, {r}] with T = {tokens}, got "
                             f"{[d.shape for d in dys]}")
    out = _sddmm_out_dtype("sddmm_stacked", "x", x, dys[0], sws[0], None)
    for dy in dys[1:]:
        _sddmm_out_dtype("sddmm_stacked", "x", x, dy, sws[0], None)
    engine = SDDMM_ENGINES["wgmma" if x_layout == "col" else "tma"]
    first, slots = sws[0], None
    further = tuple(zip(dys[1:], sws[1:]))  # each further layer's dy, columns and metadata where they are
    if x_layout == "row" and first.spec.m != 4:  # V:2:M through the 2:4 views, gathered back per layer
        # The forward's stacked views (as_2_4_stacked, the same call): the metadata of all layers in one array, which
        # the handler reads layer by layer; the further layers pass none of their own.
        first, slots = as_2_4_stacked(sws)
        empty = SparseWeight(None, None, jnp.zeros((0,), jnp.uint32), first.shape, first.spec)
        further = tuple((dy, empty) for dy in dys[1:])
        slots = jnp.split(slots, n, axis=0)
    stacked = SparseWeight(jax.ShapeDtypeStruct((n * r, first.values.shape[1]), first.values.dtype), first.columns,
                           first.metadata, (k, n * r), first.spec)
    fused = bias_grad and sddmm_bias_grad_fused(tokens, sws[0], x_layout=x_layout)
    dvalues, dbias = _sddmm_call(x, dys[0], stacked, out, None, engine, x_layout=1 if x_layout == "col" else 0,
                                 bias_grad=fused, further=further)
    parts = jnp.split(dvalues, n, axis=0)
    if slots is not None:
        parts = [jnp.take_along_axis(d, s, axis=1) for d, s in zip(parts, slots)]
    biases = jnp.split(dbias, n) if fused else [None] * n
    return tuple(_sddmm_result(d, b, dy, bias_grad, fused) for d, b, dy in zip(parts, biases, dys))


def _check_dy(name: str, dy: jax.Array, sw: SparseWeight, problem: str | None) -> None:
    """The checks of both input-gradient kernels: ``dy`` 2-D ``[T, R]`` in the values' dtype, and the kernel's own
    ``problem`` with ``sw`` (None when it has none); a ``ValueError`` naming ``name`` otherwise."""
    if dy.ndim != 2:
        raise ValueError(f"{name}: dy must be 2-D [T, R], got shape {dy.shape}")
    if dy.shape[1] != sw.shape[1]:
        raise ValueError(f"{name}: dy has R = {dy.shape[1]} but the weight has R = {sw.shape[1]}")
    if dy.dtype != sw.values.dtype:
        raise ValueError(f"{name}: dy dtype {dy.dtype} must equal the values dtype {sw.values.dtype}")
    if problem:
        raise ValueError(f"{name}: {problem}")


def spmm_t(dy: jax.Array, sw: SparseWeight) -> jax.Array:
    """Input gradient ``dy @ W^T`` by the CUDA handler ``jaxsparse_spmm_t``: ``dy [T, R] -> [T, K]`` in ``dy.dtype``.

    Constraints (``ValueError`` here, before anything is launched): ``dy`` 2-D with ``R = sw.shape[1]``
    and the dtype of ``sw.values``; ``spmm_t_unsupported(sw)`` is None. Any ``T``.
    """
    _check_dy("spmm_t", dy, sw, spmm_t_unsupported(sw))
    k = sw.shape[0]
    return _call(
        "jaxsparse_spmm_t", (dy.shape[0], k), dy.dtype, dy, sw.values, _columns_operand(sw), sw.metadata,
        v=np.int32(sw.spec.v), m=np.int32(sw.spec.m),
    )


# The condensed dX kernel (cuda/dx_condensed.cu) is built for one group width.
CONDENSED_DX_M = 16


def spmm_t_condensed_unsupported(sw: SparseWeight) -> str | None:
    """Why ``jaxsparse_spmm_t_condensed`` cannot take ``sw`` (None when it can): the SpMM's list, ``M = 16``, and a
    Hopper GPU (its kernel is wgmma-only)."""
    problem = spmm_unsupported(sw)
    if problem:
        return problem
    if sw.spec.m != CONDENSED_DX_M:
        return f"the condensed dX kernel is built for M = {CONDENSED_DX_M}, got {sw.spec}"
    if not hopper_gpu():
        return "the condensed dX kernel needs a Hopper GPU (wgmma)"
    return None


def spmm_t_condensed(dy: jax.Array, sw: SparseWeight) -> jax.Array:
    """Input gradient ``dy @ W^T`` by ``jaxsparse_spmm_t_condensed``: per V block, the product over the block's kept
    columns only (``4/M`` of the dense work) and a one-hot scatter product per 4 groups (``16/V`` of it), both on
    wgmma with the intermediate in registers (docs/kernel-notes.md, session 24). Its operands
    (:func:`jaxsparse.format.condensed_dx_operands`) are built by XLA from the weight on each call.

    Constraints (``ValueError`` here): ``dy`` 2-D ``[T, R]`` in the values' dtype; :func:`spmm_t_condensed_unsupported`
    is None. Any ``T``.
    """
    _check_dy("spmm_t_condensed", dy, sw, spmm_t_condensed_unsupported(sw))
    wc, scatter = condensed_dx_operands(sw)
    return _call("jaxsparse_spmm_t_condensed", (dy.shape[0], sw.shape[0]), dy.dtype, dy, wc, scatter,
                 v=np.int32(sw.spec.v), m=np.int32(sw.spec.m))


# The resident dX kernel (cuda/dx_resident.cu) holds a CTA's rows of dy, all R of them, in shared memory.
RESIDENT_DX_M = 16
RESIDENT_DX_MAX_ROWS = 1024


def spmm_t_resident_unsupported(sw: SparseWeight) -> str | None:
    """Why ``jaxsparse_spmm_t_resident`` cannot take ``sw`` (None when it can): the SpMM's list, ``M = 16``,
    ``R <= 1024`` (dy's rows of one token tile live in shared memory), ``G = K/M`` divisible by 16, and a Hopper GPU."""
    problem = spmm_unsupported(sw)
    if problem:
        return problem
    k, r = sw.shape
    if sw.spec.m != RESIDENT_DX_M:
        return f"the resident dX kernel is built for M = {RESIDENT_DX_M}, got {sw.spec}"
    if r > RESIDENT_DX_MAX_ROWS:
        return f"the resident dX kernel needs R <= {RESIDENT_DX_MAX_ROWS} (dy's rows in shared memory), got R = {r}"
    if (k // sw.spec.m) % RESIDENT_DX_GROUPS:
        return f"the resident dX kernel needs G = K/M divisible by {RESIDENT_DX_GROUPS}, got K = {k}"
    if not hopper_gpu():
        return "the resident dX kernel needs a Hopper GPU (wgmma)"
    return None


def spmm_t_resident(dy: jax.Array, sw: SparseWeight) -> jax.Array:
    """Input gradient ``dy @ W^T`` by ``jaxsparse_spmm_t_resident``: per 64 tokens, dy's rows loaded once into shared
    memory; per V block and 16 groups one wgmma over the block's kept columns (``4/M`` of the dense work) with the
    weight's fragments read from global memory into registers, summed into the output columns in a shared tile
    in block order (any mask, the same sums every run; docs/kernel-notes.md, session 26). The fragments
    (:func:`jaxsparse.format.resident_dx_fragments`) are built by XLA from the weight on each call.

    Constraints (``ValueError`` here): ``dy`` 2-D ``[T, R]`` in the values' dtype; :func:`spmm_t_resident_unsupported`
    is None. Any ``T``.
    """
    _check_dy("spmm_t_resident", dy, sw, spmm_t_resident_unsupported(sw))
    return _call("jaxsparse_spmm_t_resident", (dy.shape[0], sw.shape[0]), dy.dtype, dy, resident_dx_fragments(sw),
                 sw.columns, v=np.int32(sw.spec.v), m=np.int32(sw.spec.m))


# ----------------------------------------------------------------------------- diagonal 2:4 blocks


def blocks_unsupported(sw: SparseWeight, blocks: int) -> str | None:
    """Why the kernels cannot take ``sw`` as ``blocks`` diagonal 2:4 blocks (:func:`spmm_blocks`,
    :func:`sddmm_blocks`, and the input gradient through ``jaxsparse.format.transpose_blocks``), None when they can:
    the SpMM's list, a 2:4 weight, a Hopper GPU (the TMA row kernel and the SDDMM's tma engine), ``R % (128 blocks)
    == 0`` and ``K % 128 == 0`` (``K`` per block: whole 64-column stages, and the input gradient's blocks of ``K``
    rows in whole 128-row tiles)."""
    problem = spmm_unsupported(sw)
    if problem:
        return problem
    k, r = sw.shape
    if sw.spec.m != 4:
        return f"diagonal blocks are 2:4 weights, got {sw.spec}"
    if r % (128 * blocks) or k % 128:
        return (f"{blocks} diagonal blocks need R % (128 * {blocks}) == 0 and K % 128 == 0 (K per block), got "
                f"K = {k}, R = {r}")
    if not hopper_gpu():
        return "diagonal blocks run on the Hopper kernels (the TMA row kernel and the SDDMM's tma engine)"
    return None


def _check_blocks(name: str, x: jax.Array, sw: SparseWeight, blocks: int, x_name: str = "x",
                  x_chunks=None) -> None:
    """``x`` 2-D ``[T, blocks K]`` in the values' dtype, ``x_chunks`` None or its chunk table
    (``jaxsparse.format.check_chunks``), and :func:`blocks_unsupported` None; ``ValueError`` else."""
    if x.ndim != 2 or x.shape[1] != blocks * sw.shape[0]:
        raise ValueError(f"{name}: {x_name} must be [T, {blocks} * {sw.shape[0]}] for {blocks} diagonal blocks of a "
                         f"weight {sw.shape}, got {x.shape}")
    if x_chunks is not None:
        try:
            check_chunks(x_chunks, blocks, sw.shape[0], x.shape[1])
        except ValueError as e:
            raise ValueError(f"{name}: x_chunks: {e}") from None
    if x.dtype != sw.values.dtype:
        raise ValueError(f"{name}: {x_name} dtype {x.dtype} must equal the values dtype {sw.values.dtype}")
    problem = blocks_unsupported(sw, blocks)
    if problem:
        raise ValueError(f"{name}: {problem}")


def spmm_blocks(x: jax.Array, sw: SparseWeight, blocks: int, bias: jax.Array | None = None,
                activation: str | None = None, with_derivative: bool = False, x_chunks=None, y_chunks=None,
                mul=None):
    """``act(x @ W + bias)`` for a weight of ``blocks`` diagonal 2:4 blocks, on the TMA row kernel: ``x [T, blocks
    K]``, ``sw`` the blocks stacked along the outputs (a 2:4 weight of shape ``(K, R)``; output feature ``r`` reads
    x's columns ``(r // (R / blocks)) K + [0, K)``) -> ``[T, R]`` (with ``with_derivative``, ``(act(z), act'(z))``).
    ``x_chunks`` (int32 ``[blocks, K/64]``, ``jaxsparse.format.diagonal_chunks``): block ``b`` reads x's 64-column
    chunks ``x_chunks[b]`` instead of its contiguous range. ``y_chunks`` (int32 ``[R/64]``, no activation): output
    feature ``f`` is written to column ``y_chunks[f // 64] * 64 + f % 64`` (the input gradient of a chunked layer).
    The tables' entries must be permutations of x's (y's) chunks: an entry out of range reads zeros (is clamped), it
    never touches memory outside x or y. ``mul`` (``[T, R]`` in x's dtype; no activation, no ``y_chunks``): the
    result times ``mul``, each product in float32 rounded to x's dtype (the FFN backward's ``dz = dh * act'(z)``,
    :func:`dz_epilogue`). Constraints: :func:`blocks_unsupported`, ``bias`` and ``activation`` as :func:`spmm`'s."""
    _check_blocks("spmm_blocks", x, sw, blocks, x_chunks=x_chunks)
    _spmm_checks("spmm_blocks", sw, x.dtype, bias, activation)
    _check_act_mode("spmm_blocks", activation, with_derivative)
    if y_chunks is not None and (activation is not None or tuple(getattr(y_chunks, "shape", ())) != (sw.shape[1] // 64,)
                                 or sw.shape[1] % 64):
        raise ValueError(f"spmm_blocks: y_chunks needs no activation, R % 64 == 0 and shape (R/64,) = "
                         f"({sw.shape[1] // 64},), got {getattr(y_chunks, 'shape', None)} with activation {activation}")
    if mul is not None and (activation is not None or y_chunks is not None or getattr(mul, "ndim", 0) != 2
                            or mul.shape != (x.shape[0], sw.shape[1]) or mul.dtype != x.dtype):
        raise ValueError(f"spmm_blocks: mul needs no activation, no y_chunks, and shape {(x.shape[0], sw.shape[1])} in "
                         f"x's dtype {x.dtype}, got {getattr(mul, 'shape', None)} {getattr(mul, 'dtype', None)} with "
                         f"activation {activation}")
    tile = None if blocks == 1 else "auto"  # the 64-row tile could straddle two blocks' rows: not for x_blocks > 1
    return _spmm_xt_call(x, sw, bias, activation, tile=tile, x_rows=True, act_mode=int(with_derivative),
                         x_blocks=blocks, x_chunks=x_chunks, y_chunks=y_chunks, mul=mul)


def sddmm_blocks(x: jax.Array, dy: jax.Array, sw: SparseWeight, blocks: int, out_dtype=None,
                 split: int | str | None = None, x_chunks=None) -> jax.Array:
    """:func:`sddmm` for a weight of ``blocks`` diagonal 2:4 blocks (:func:`spmm_blocks`' layout, ``x_chunks`` as
    there): ``x [T, blocks K]``, ``dy [T, R]`` -> ``[R, K/2]`` like ``sw.values``, on the SDDMM's tma engine."""
    _check_blocks("sddmm_blocks", x, sw, blocks, x_chunks=x_chunks)
    if dy.ndim != 2 or dy.shape != (x.shape[0], sw.shape[1]):
        raise ValueError(f"sddmm_blocks: dy must be [{x.shape[0]}, {sw.shape[1]}], got {dy.shape}")
    out = _sddmm_out_dtype("sddmm_blocks", "x", x, dy, sw, out_dtype)
    return _sddmm_call(x, dy, sw, out, split, SDDMM_ENGINES["tma"], x_layout=0, x_blocks=blocks, x_chunks=x_chunks)[0]
