"""Sparse products on ``SparseWeight``: validation, dispatch, and ``sparse_linear``'s custom VJP.

Every public op validates its operands first (a ``ValueError`` naming the constraint), then goes through
``jaxsparse.dispatch.call``, which picks the CUDA kernel or the reference in ``jaxsparse.reference``.
Activations may carry any leading dimensions; they are flattened to ``[tokens, features]``.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import os
from typing import Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import dispatch, reference
from jaxsparse.ffi import calls as cuda_calls
from jaxsparse.ffi.calls import spmm_unsupported
from jaxsparse.format import SparseWeight, check_transpose_2_4_shape, check_weight_arrays
from jaxsparse.format import decompress as _reference_decompress
from jaxsparse.format import transpose_2_4 as format_transpose_2_4
from jaxsparse.format import block_dx_operands, check_blocks_shape, check_chunks, stack_transposed_blocks

__all__ = ["decompress", "transpose_2_4", "spmm", "sddmm", "spmm_t", "dx_route",
           "dx_route_scope", "linear_x_layout", "mlp_hidden_layout", "mlp_hidden_scope", "sparse_linear", "sparse_mlp",
           "shared_linear", "shared_dx", "shared_dx_scope", "shared_sddmm", "shared_spmm",
           "FUSED_ACTIVATIONS", "masked_linear", "spmm_unsupported", "diagonal_linear", "transpose_blocks",
           "diagonal_mlp"]

FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


# ----------------------------------------------------------------------------- validation


def _check_weight(sw: SparseWeight) -> None:
    if not isinstance(sw, SparseWeight):
        raise ValueError(f"expected a jaxsparse.format.SparseWeight, got {type(sw).__name__}")
    if jnp.dtype(sw.values.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"sparse values must be bfloat16, float16 or float32, got {sw.values.dtype}")
    check_weight_arrays(sw)


def _check_activation(x: jax.Array, sw: SparseWeight, name: str, features: int) -> None:
    if x.ndim < 1 or x.shape[-1] != features:
        raise ValueError(f"{name}'s last dimension must be {features} for a weight of shape {sw.shape}, got {x.shape}")
    if jnp.dtype(x.dtype) != jnp.dtype(sw.values.dtype):
        raise ValueError(f"{name} dtype {x.dtype} must equal the sparse values dtype {sw.values.dtype}")


def _check_bias(bias: Optional[jax.Array], sw: SparseWeight) -> None:
    if bias is not None and bias.shape != (sw.shape[1],):
        raise ValueError(f"bias must have shape ({sw.shape[1]},), got {bias.shape}")


def _flatten(x: jax.Array) -> jax.Array:
    return x.reshape(-1, x.shape[-1])


# ----------------------------------------------------------------------------- products


def decompress(sw: SparseWeight) -> jax.Array:
    """The dense ``[K, R]`` kernel of ``sw``."""
    _check_weight(sw)
    return dispatch.call("decompress", _reference_decompress, cuda_calls.decompress, sw)


def spmm(x: jax.Array, sw: SparseWeight, bias: Optional[jax.Array] = None, activation: Optional[str] = None) -> jax.Array:
    """Forward product ``act(x @ W + bias)`` with ``x`` of shape ``[..., K]``; returns ``[..., R]``."""
    _check_weight(sw)
    _check_activation(x, sw, "x", sw.shape[0])
    _check_bias(bias, sw)
    if activation not in reference.ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(reference.ACTIVATIONS)}, got {activation!r}")
    ref = lambda x2, s, b: reference.spmm(x2, s, b, activation)
    cuda = lambda x2, s, b: cuda_calls.spmm(x2, s, b, activation)
    with jax.named_scope("jaxsparse_spmm"):  # named for jaxsparse-profile's breakdown
        y = dispatch.call("spmm", ref, cuda, _flatten(x), sw, bias, unsupported=spmm_unsupported(sw))
    return y.reshape(*x.shape[:-1], sw.shape[1])


def sddmm(x: jax.Array, dy: jax.Array, sw: SparseWeight, out_dtype=None) -> jax.Array:
    """Weight gradient ``x^T dy`` at ``sw``'s kept positions, shaped like ``sw.values``."""
    _check_weight(sw)
    _check_activation(x, sw, "x", sw.shape[0])
    _check_activation(dy, sw, "dy", sw.shape[1])
    if x.shape[:-1] != dy.shape[:-1]:
        raise ValueError(f"x and dy must share their leading dimensions, got {x.shape} and {dy.shape}")
    if out_dtype is not None and jnp.dtype(out_dtype) not in (jnp.dtype(sw.values.dtype), jnp.dtype(jnp.float32)):
        raise ValueError(f"out_dtype must be the values dtype {sw.values.dtype} or float32, got {jnp.dtype(out_dtype)}")
    ref = lambda x2, d2, s: reference.sddmm(x2, d2, s, out_dtype)
    cuda = lambda x2, d2, s: cuda_calls.sddmm(x2, d2, s, out_dtype)
    with jax.named_scope("jaxsparse_sddmm"):
        return dispatch.call("sddmm", ref, cuda, _flatten(x), _flatten(dy), sw,
                             unsupported=cuda_calls.sddmm_unsupported(sw))


def _dense_dx(dy2: jax.Array, sw: SparseWeight) -> jax.Array:
    """``dy @ W^T`` as XLA's dense product over the weight decompressed by the CUDA handler."""
    w = cuda_calls.decompress(sw)  # [K, R]
    dx = jax.lax.dot_general(dy2, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return dx.astype(dy2.dtype)


DX_ROUTE_ENV = "JAXSPARSE_DX"
DX_ROUTES = ("dense", "kernel", "transposed", "condensed", "blocks", "resident")


def dx_route(route: Optional[str] = None) -> str:
    """How the GPU computes the input gradient ``dy @ W^T``: one of :data:`DX_ROUTES`.

    ``"dense"`` (the default): XLA's dense product over the weight decompressed by ``jaxsparse_decompress``
    (a transient ``[K, R]`` weight in the values dtype, never a dense gradient). ``"kernel"``: the structured
    ``jaxsparse_spmm_t`` kernel for ``M >= 8`` (2:4 stays dense: its pattern runs along dX's output
    columns, so a sparse kernel does dense work on slower MMAs). ``"transposed"``: for weights whose masks were
    chosen with ``select_mask(..., transposable=True)``, the 2:4 forward product of ``W^T``
    (:func:`transpose_2_4`, built by ``jaxsparse_transpose_2_4`` on a GPU), on every platform; where a mask is not
    transposable the gradient is NaN, never wrong. ``"condensed"``: for ``M = 16`` on a Hopper GPU, the
    ``jaxsparse_spmm_t_condensed`` kernel (per V block the product over its kept columns, then a one-hot scatter
    product, any mask; :func:`jaxsparse.ffi.calls.spmm_t_condensed`), else the dense route. ``"blocks"``: for
    weights whose masks were chosen with ``select_mask(..., exclusive_columns=True)`` (``M > 4``), in XLA on every
    platform: each V block's product over its kept columns as one batched product (``4/M`` of the dense work), then
    at most ``column_cap`` gathered terms per column of dx (:func:`jaxsparse.format.block_dx_operands`); where a
    column is kept by more blocks than that, its gradient is NaN, never wrong. Other weights take the dense route.
    ``"resident"``: the ``jaxsparse_spmm_t_resident`` kernel where it applies (Hopper, ``M = 16``, ``R <= 1024``: per 64
    tokens all of dy's rows in shared memory, per V block the product over its kept columns, summed in a shared tile
    in block order, any mask; :func:`jaxsparse.ffi.calls.spmm_t_resident`; slower than the transposed route in
    sessions 26-27), the transposed route elsewhere (so, like it, for transposable masks). ``None`` reads
    ``JAXSPARSE_DX``.
    The default follows the measurements in docs/kernel-notes.md: the v1 kernel is slower than the dense
    route at every M measured on the H100 (64:2:8 at 16384x1024x4096: 0.92 ms against 0.20 ms), so it
    is opt-in until a faster version lands; ``benchmarks/linear.py`` times both routes side by side.
    """
    if route is None:
        route = os.environ.get(DX_ROUTE_ENV, "dense").strip().lower() or "dense"
    if route not in DX_ROUTES:
        raise ValueError(f"the dX route ({DX_ROUTE_ENV}) must be one of {DX_ROUTES}, got {route!r}")
    return route


@contextlib.contextmanager
def dx_route_scope(route: Optional[str], *, keep_set: bool = False) -> Iterator[None]:
    """Sets ``JAXSPARSE_DX`` to ``route`` for the block and restores it after: the route is read when the sparse
    layers are traced, so trace (jit-compile) inside the block. ``None`` changes nothing; with ``keep_set`` a route
    already set in the environment wins."""
    with dispatch.env_scope({DX_ROUTE_ENV: None if route is None else dx_route(route)}, keep_set=keep_set):
        yield


def spmm_t(dy: jax.Array, sw: SparseWeight, route: Optional[str] = None) -> jax.Array:
    """Input gradient ``dy @ W^T`` with ``dy`` of shape ``[..., R]``; returns ``[..., K]``.

    On the GPU the product follows :func:`dx_route` (``route`` or ``JAXSPARSE_DX``).
    """
    _check_weight(sw)
    _check_activation(dy, sw, "dy", sw.shape[1])
    route = dx_route(route)
    with jax.named_scope("jaxsparse_spmm_t"):  # jaxsparse-profile files everything inside under the input gradient
        if route == "transposed" or (route == "resident" and cuda_calls.spmm_t_resident_unsupported(sw)):
            return _transposed_dx(dy, sw)
        if route == "blocks" and sw.columns is not None:
            return _block_dx(_flatten(dy), sw).reshape(*dy.shape[:-1], sw.shape[0])
        if route == "resident":
            cuda = cuda_calls.spmm_t_resident
        elif route == "condensed" and cuda_calls.spmm_t_condensed_unsupported(sw) is None:
            cuda = cuda_calls.spmm_t_condensed
        elif route == "kernel" and sw.spec.m > 4:
            cuda = cuda_calls.spmm_t
        else:
            cuda = _dense_dx
        dx = dispatch.call("spmm_t", reference.spmm_t, cuda, _flatten(dy), sw,
                           unsupported=cuda_calls.spmm_t_unsupported(sw))
    return dx.reshape(*dy.shape[:-1], sw.shape[0])


def transpose_2_4(sw: SparseWeight) -> SparseWeight:
    """``W^T`` as a 2:4 weight (:func:`jaxsparse.format.transpose_2_4`: NaN values where the mask is not
    transposable), by the CUDA handler on a GPU."""
    _check_weight(sw)
    check_transpose_2_4_shape(sw.shape)
    return dispatch.call("transpose_2_4", format_transpose_2_4, cuda_calls.transpose_2_4, sw,
                         unsupported=cuda_calls.transpose_2_4_unsupported(sw))


def _block_dx(dy2: jax.Array, sw: SparseWeight) -> jax.Array:
    """``dy @ W^T`` by V blocks (the ``"blocks"`` route of :func:`dx_route`): one batched product of every block's
    rows of ``dy`` with its kept-column values, then ``column_cap`` gathered terms per input column
    (:func:`jaxsparse.format.block_dx_operands`; NaN where a column is kept by more blocks than the cap)."""
    wc, sources = block_dx_operands(sw)
    blocks, v, width = wc.shape
    t = dy2.shape[0]
    # In dy's dtype: XLA's GPU products accumulate bf16 and fp16 in float32 (and the CPU has no batched bf16 dot
    # with a float32 result).
    p = jnp.einsum("tbv,bvc->tbc", dy2.reshape(t, blocks, v), wc.astype(dy2.dtype)).reshape(t, blocks * width)
    # The sources' zero and NaN columns (indices blocks * width and + 1) are past P's end: filled with 0, then the
    # columns over the cap set to NaN, so that no concatenated copy of P is needed.
    dx = sum(jnp.take(p, sources[i], axis=1, mode="fill", fill_value=0).astype(jnp.float32)
             for i in range(sources.shape[0]))
    return jnp.where(sources[0] > blocks * width, jnp.nan, dx).astype(dy2.dtype)


def _transposed_dx(dy: jax.Array, sw: SparseWeight) -> jax.Array:
    """``dy @ W^T`` as the 2:4 forward product of ``W^T`` (the ``"transposed"`` route of :func:`dx_route`). Where
    the mask is not transposable ``W^T`` holds NaN, so those columns of dx are NaN, never wrong."""
    return spmm(dy, transpose_2_4(sw))


# ----------------------------------------------------------------------------- the layer product


def _no_cotangent(a: Optional[jax.Array]):
    return None if a is None else np.zeros(a.shape, dtype=jax.dtypes.float0)


# The layer's route (linear_x_layout): on "col" (Hopper, V:2:M) the forward transposes x once, runs the x^T SpMM and
# keeps x^T, which the backward's SDDMM reads as it is: one transpose per layer serves both products; on "row" x is
# read as it is by both.


def _forward_keeping_x(x2: jax.Array, sw: SparseWeight, bias: Optional[jax.Array], activation: Optional[str] = None,
                       with_derivative: bool = False, transpose_out: bool = False):
    """One layer's forward on the route :func:`sparse_linear` takes (:func:`linear_x_layout`), and what its SDDMM
    reads: ``(out, x)``, or ``(out, x^T)`` on the ``"col"`` route. ``out`` is ``act(x @ W + bias)``, or with
    ``with_derivative`` the pair ``(act(z), act'(z))`` for ``z = x @ W + bias``, both from the kernel's epilogue on a
    GPU (``z`` is rounded to the input dtype first, as the product's output would be); ``transpose_out`` (``"col"``
    route, with ``with_derivative``) gives ``act(z)^T`` in that pair, written so by the epilogue (act_mode 2)."""
    col = linear_x_layout(x2.shape[0], sw) == "col"
    if transpose_out and not (col and with_derivative):
        raise ValueError("transpose_out needs the layer's x^T route and with_derivative")

    def ref(x, s, b):
        if with_derivative:
            out = reference.activation_with_derivative(activation, reference.spmm(x, s, b))
            out = (out[0].T, out[1]) if transpose_out else out
        else:
            out = reference.spmm(x, s, b, activation)
        return out, (x.T if col else x)

    def cuda(x, s, b):
        if col:
            xt = cuda_calls.transpose(x)
            return cuda_calls.spmm_from_xt(xt, s, b, activation, with_derivative=with_derivative,
                                           transpose_out=transpose_out), xt
        return cuda_calls.spmm(x, s, b, activation, x_layout="row", with_derivative=with_derivative), x

    with jax.named_scope("jaxsparse_spmm"):
        return dispatch.call("spmm", ref, cuda, x2, sw, bias, unsupported=spmm_unsupported(sw))


def _forward_from_xt(xt: jax.Array, sw: SparseWeight, bias: Optional[jax.Array]) -> jax.Array:
    """A ``"col"``-route layer's forward from its input already transposed, ``x^T [K, T]``."""
    ref = lambda a, s, b: reference.spmm(a.T, s, b)
    with jax.named_scope("jaxsparse_spmm"):
        return dispatch.call("spmm", ref, cuda_calls.spmm_from_xt, xt, sw, bias, unsupported=spmm_unsupported(sw))


def _sddmm_kept(kept: jax.Array, dy: jax.Array, sw: SparseWeight, bias: Optional[jax.Array] = None):
    """The SDDMM from what :func:`_forward_keeping_x` kept (x, or x^T on the ``"col"`` route): ``(dvalues, dbias)``,
    ``dbias`` being ``dy`` summed over tokens in float32 when the layer has a ``bias`` (else None). On the tma and x^T
    engines the SDDMM kernel sums it while it reads ``dy`` (:func:`jaxsparse.ffi.calls.sddmm_bias_grad_fused`);
    elsewhere it is XLA's reduction."""
    col = linear_x_layout(dy.shape[0], sw) == "col"
    if bias is None:
        return (_sddmm_from_xt(kept, dy, sw) if col else sddmm(kept, dy, sw)), None
    ref = lambda x2, d2, s: (reference.sddmm(x2.T if col else x2, d2, s, None), reference.bias_grad(d2, jnp.float32))
    if col:
        cuda = lambda xt, d2, s: cuda_calls.sddmm_from_xt(xt, d2, s, bias_grad=True)
    else:
        cuda = lambda x2, d2, s: cuda_calls.sddmm(x2, d2, s, bias_grad=True)
    with jax.named_scope("jaxsparse_sddmm"):
        return dispatch.call("sddmm", ref, cuda, kept, dy, sw, unsupported=cuda_calls.sddmm_unsupported(sw))


def _sddmm_from_xt(xt: jax.Array, dy: jax.Array, sw: SparseWeight) -> jax.Array:
    ref = lambda a, d, s: reference.sddmm(a.T, d, s, None)
    with jax.named_scope("jaxsparse_sddmm"):
        return dispatch.call("sddmm", ref, cuda_calls.sddmm_from_xt, xt, dy, sw,
                             unsupported=cuda_calls.sddmm_unsupported(sw))


def _weight_cotangents(dy: jax.Array, sw: SparseWeight, bias: Optional[jax.Array], dvalues: jax.Array,
                       dbias: Optional[jax.Array] = None):
    """``(dsw, dbias)`` of a layer product, given the SDDMM's ``dvalues`` and, when it summed it, ``dbias`` (float32;
    None: summed here)."""
    dsw = SparseWeight(dvalues, _no_cotangent(sw.columns), _no_cotangent(sw.metadata), sw.shape, sw.spec)
    if bias is None:
        return dsw, None
    return dsw, reference.bias_grad(dy, bias.dtype) if dbias is None else dbias.astype(bias.dtype)


def _cotangents(dy: jax.Array, sw: SparseWeight, bias: Optional[jax.Array], dvalues: jax.Array,
                dbias: Optional[jax.Array] = None):
    """``(dx, dsw, dbias)`` of a layer product, given the SDDMM's ``dvalues`` (and ``dbias``: see
    :func:`_weight_cotangents`)."""
    return (spmm_t(dy, sw), *_weight_cotangents(dy, sw, bias, dvalues, dbias))


@jax.custom_vjp
def _linear(x2: jax.Array, sw: SparseWeight, bias: Optional[jax.Array]) -> jax.Array:
    return spmm(x2, sw, bias)


def _linear_fwd(x2, sw, bias):
    y, kept = _forward_keeping_x(x2, sw, bias)
    return y, (kept, sw, bias)


def _linear_bwd(residuals, dy):
    kept, sw, bias = residuals
    return _cotangents(dy, sw, bias, *_sddmm_kept(kept, dy, sw, bias))


_linear.defvjp(_linear_fwd, _linear_bwd)


def linear_x_layout(tokens: int, sw: SparseWeight) -> str:
    """The layer route :func:`sparse_linear` and :func:`sparse_mlp` take: ``"col"`` (the x^T route above) when
    :func:`jaxsparse.ffi.calls.spmm_x_layout` says so (``JAXSPARSE_SPMM_X``; a Hopper GPU by default) and the
    kernels take ``sw``; ``"row"`` otherwise."""
    if spmm_unsupported(sw) or cuda_calls.sddmm_unsupported(sw):
        return "row"
    return cuda_calls.spmm_x_layout(tokens, sw, shares_xt=True)


def sparse_linear(x: jax.Array, sw: SparseWeight, bias: Optional[jax.Array] = None) -> jax.Array:
    """``x @ W + bias`` for a compressed ``W``, differentiable in ``x``, ``sw.values`` and ``bias``.

    The gradient with respect to ``sw.values`` is the dense weight gradient sampled at the kept
    positions (SDDMM), never a dense ``[K, R]`` array on the kernel path. On a Hopper GPU the layer
    takes the x^T route (:func:`linear_x_layout`): one transpose of ``x`` feeds the forward and the SDDMM.
    """
    _check_weight(sw)
    _check_activation(x, sw, "x", sw.shape[0])
    _check_bias(bias, sw)
    y = _linear(_flatten(x), sw, bias)
    return y.reshape(*x.shape[:-1], sw.shape[1])


# ----------------------------------------------------------------------------- layers sharing their input

SHARED_DX_ENV = "JAXSPARSE_SHARED_DX"
SHARED_DX_SETTINGS = ("auto", "on", "off")


def _shared_setting(setting: Optional[str], env: str, what: str) -> bool:
    """One of :func:`shared_linear`'s on/off settings: ``setting``, or when None the variable ``env``; ``auto`` and
    ``on`` are True, ``off`` False, anything else a ``ValueError`` naming ``what`` and ``env``."""
    setting = cuda_calls._setting(setting, env)
    if setting not in SHARED_DX_SETTINGS:
        raise ValueError(f"the shared {what} setting ({env}) must be one of {SHARED_DX_SETTINGS}, got {setting!r}")
    return setting != "off"


def shared_dx(setting: Optional[str] = None) -> bool:
    """Whether :func:`shared_linear`'s backward computes the input gradient of its layers as one product
    (``sum_i dy_i W_i^T``, :func:`jaxsparse.ffi.calls.spmm_t_sum`: the sum accumulated in float32 and written once)
    where it can: on the ``"transposed"`` route of :func:`dx_route` with a Hopper GPU. ``setting`` ``None`` reads
    ``JAXSPARSE_SHARED_DX``: ``auto`` (the default) and ``on`` do; ``off`` runs one product per layer and lets XLA add
    them (for A/B timings)."""
    return _shared_setting(setting, SHARED_DX_ENV, "input-gradient")


@contextlib.contextmanager
def shared_dx_scope(setting: Optional[str]) -> Iterator[None]:
    """Sets ``JAXSPARSE_SHARED_DX`` for the block (read when :func:`shared_linear` is traced, so trace inside the
    block); ``None`` changes nothing."""
    if setting is not None:
        shared_dx(setting)  # raises ValueError on a bad setting
    with dispatch.env_scope({SHARED_DX_ENV: setting}):
        yield


SHARED_SDDMM_ENV = "JAXSPARSE_SHARED_SDDMM"


def shared_sddmm(setting: Optional[str] = None) -> bool:
    """Whether :func:`shared_linear`'s backward computes its layers' weight gradients by one SDDMM call
    (:func:`jaxsparse.ffi.calls.sddmm_stacked`: the weights' rows stacked, each layer's dy read where it is) where the
    kernels take them (:func:`jaxsparse.ffi.calls.sddmm_stacked_unsupported`: the x^T engine, or the tma engine on 2:4
    and 2:4 views, on a Hopper GPU). ``setting`` ``None`` reads ``JAXSPARSE_SHARED_SDDMM``: ``auto`` (the default) and
    ``on`` do; ``off`` runs one SDDMM per layer (for A/B timings)."""
    return _shared_setting(setting, SHARED_SDDMM_ENV, "weight-gradient")


SHARED_SPMM_ENV = "JAXSPARSE_SHARED_SPMM"


def shared_spmm(setting: Optional[str] = None) -> bool:
    """Whether :func:`shared_linear`'s forward runs its layers as one product (:func:`jaxsparse.ffi.calls.spmm_stacked`:
    the weights' rows stacked, x read once, each layer's output written to its own array) where the kernels take them
    (:func:`jaxsparse.ffi.calls.spmm_stacked_unsupported`: the x^T kernels, or the TMA row kernel on 2:4 and 2:4 views,
    on a Hopper GPU). ``setting`` ``None`` reads ``JAXSPARSE_SHARED_SPMM``: ``auto`` (the default) and ``on`` do;
    ``off`` runs one product per layer (for A/B timings)."""
    return _shared_setting(setting, SHARED_SPMM_ENV, "forward")


def _stacked_forward(x2: jax.Array, sws: tuple, biases: tuple) -> Optional[tuple]:
    """``(outputs, kept)`` of :func:`shared_linear`'s layers by one :func:`jaxsparse.ffi.calls.spmm_stacked`, where
    :func:`shared_spmm` says so and the kernels take the layers (``kept``: what the SDDMM reads, x or on the ``"col"``
    route the one x^T, for every layer); None where one forward a layer runs instead."""
    tokens = x2.shape[0]
    layout = linear_x_layout(tokens, sws[0])
    if len(sws) < 2 or not shared_spmm() or cuda_calls.spmm_stacked_unsupported(tokens, sws, layout) is not None:
        return None
    col = layout == "col"

    def ref(x, s, b):
        return tuple(reference.spmm(x, w, c) for w, c in zip(s, b)), (x.T if col else x)

    def cuda(x, s, b):
        xin = cuda_calls.transpose(x) if col else x
        return cuda_calls.spmm_stacked(xin, s, b, layout), xin

    with jax.named_scope("jaxsparse_spmm"):
        ys, kept = dispatch.call("spmm", ref, cuda, x2, sws, biases)
    return tuple(ys), (kept,) * len(sws)


def _shared_weight_grads(kept: tuple, dys: tuple, sws: tuple, biases: tuple) -> list:
    """``(dsw, dbias)`` of each layer of :func:`shared_linear` from what the forward kept (x, or x^T on the ``"col"``
    route; one array for all, which XLA holds once): one :func:`jaxsparse.ffi.calls.sddmm_stacked` where
    :func:`shared_sddmm` says so and the kernels take the layers, else one SDDMM a layer (:func:`_sddmm_kept`)."""
    tokens = dys[0].shape[0]
    layout = linear_x_layout(tokens, sws[0])
    # (sddmm_stacked_unsupported asks for weights of one shape and spec, so every layer takes sws[0]'s layout)
    if len(sws) > 1 and shared_sddmm() and cuda_calls.sddmm_stacked_unsupported(tokens, sws, layout) is None:
        with_bias = any(b is not None for b in biases)
        ref = lambda x, d, s: reference.sddmm_stacked(x, d, s, layout, with_bias)
        cuda = lambda x, d, s: cuda_calls.sddmm_stacked(x, d, s, layout, with_bias)
        with jax.named_scope("jaxsparse_sddmm"):  # (only arrays through dispatch.call: jax.lax.platform_dependent)
            out = dispatch.call("sddmm", ref, cuda, kept[0], dys, sws)
        out = out if with_bias else tuple((d, None) for d in out)
        return [_weight_cotangents(dy, sw, b, d, db if b is not None else None)
                for dy, sw, b, (d, db) in zip(dys, sws, biases, out)]
    return [_weight_cotangents(dy, sw, b, *_sddmm_kept(k, dy, sw, b)) for k, dy, sw, b in zip(kept, dys, sws, biases)]


def _shared_input_grad(dys: tuple, sws: tuple) -> jax.Array:
    """``sum_i dys[i] @ W_i^T`` (flattened ``dys``): one :func:`jaxsparse.ffi.calls.spmm_t_sum` (every ``W_i^T`` 2:4
    view built by one call, then one product over them) where :func:`shared_dx` says so and the kernels take the
    weights (:func:`jaxsparse.ffi.calls.spmm_t_sum_unsupported`: a Hopper GPU among them), else one :func:`spmm_t` per
    layer, added by XLA."""
    if shared_dx() and dx_route() == "transposed" and cuda_calls.spmm_t_sum_unsupported(sws) is None:
        with jax.named_scope("jaxsparse_spmm_t"):
            return dispatch.call("spmm", reference.spmm_t_sum, cuda_calls.spmm_t_sum, dys, sws)
    return functools.reduce(jnp.add, (spmm_t(dy, sw) for dy, sw in zip(dys, sws)))


@jax.custom_vjp
def _shared(x2: jax.Array, sws: tuple, biases: tuple) -> tuple:
    stacked = _stacked_forward(x2, sws, biases)
    return stacked[0] if stacked is not None else tuple(spmm(x2, sw, b) for sw, b in zip(sws, biases))


def _shared_fwd(x2, sws, biases):
    stacked = _stacked_forward(x2, sws, biases)
    if stacked is not None:
        return stacked[0], (stacked[1], sws, biases)
    outs = [_forward_keeping_x(x2, sw, b) for sw, b in zip(sws, biases)]  # on the x^T route XLA keeps one x^T
    return tuple(y for y, _ in outs), (tuple(kept for _, kept in outs), sws, biases)


def _shared_bwd(residuals, dys):
    kept, sws, biases = residuals
    grads = _shared_weight_grads(kept, tuple(dys), sws, biases)
    return _shared_input_grad(tuple(dys), sws), tuple(g[0] for g in grads), tuple(g[1] for g in grads)


_shared.defvjp(_shared_fwd, _shared_bwd)


def shared_linear(x: jax.Array, sws, biases=None) -> tuple:
    """``x @ W_i + b_i`` for compressed layers that share their input (attention's query, key and value),
    differentiable in ``x``, every ``sw.values`` and bias, as :func:`sparse_linear` is for each.

    The forward is :func:`sparse_linear`'s for each layer; with :func:`shared_spmm` a Hopper GPU runs the layers as
    one product over their stacked rows (:func:`jaxsparse.ffi.calls.spmm_stacked`, x read once, each output written
    where it is held), and with :func:`shared_sddmm` their weight gradients by one SDDMM call. The input gradient is
    their sum; with :func:`shared_dx` on the ``"transposed"`` route of :func:`dx_route` a Hopper GPU computes it as one
    product over the layers' transposed views (:func:`jaxsparse.ffi.calls.spmm_t_sum`, at most
    :data:`jaxsparse.ffi.calls.SPMM_SUM_MAX` layers of one shape and pattern; one call builds all their views): ``dx``
    is written once instead of once a layer and summed by XLA.

    Args:
      x: ``[..., K]`` in the values' dtype.
      sws: a sequence of compressed weights, each ``(K, R_i)``.
      biases: None, or a sequence as long as ``sws`` of ``[R_i]`` arrays or None.

    Returns:
      A tuple of ``[..., R_i]``.
    """
    sws = tuple(sws)
    biases = (None,) * len(sws) if biases is None else tuple(biases)
    if not sws or len(biases) != len(sws):
        raise ValueError(f"shared_linear: needs at least one weight and one bias (or None) per weight, got "
                         f"{len(sws)} weights and {len(biases)} biases")
    for sw, b in zip(sws, biases):
        _check_weight(sw)
        _check_activation(x, sw, "x", sw.shape[0])
        _check_bias(b, sw)
    ys = _shared(_flatten(x), sws, biases)
    return tuple(y.reshape(*x.shape[:-1], sw.shape[1]) for y, sw in zip(ys, sws))


# ----------------------------------------------------------------------------- diagonal 2:4 blocks


def _check_blocks(sw: SparseWeight, blocks: int) -> int:
    """``blocks`` as a Python int (a NumPy integer is fine), after checking it against ``sw``."""
    if sw.spec.m != 4:
        raise ValueError(f"diagonal blocks are 2:4 weights, got {sw.spec}")
    if not isinstance(blocks, numbers.Integral) or isinstance(blocks, (bool, np.bool_)):
        raise ValueError(f"blocks must be an integer, got {blocks!r}")
    blocks = int(blocks)
    check_blocks_shape(sw.shape, blocks)
    return blocks


def transpose_blocks(sw: SparseWeight, blocks: int) -> SparseWeight:
    """The stacked transposed blocks of a weight of ``blocks`` diagonal 2:4 blocks (see :func:`diagonal_linear`;
    :func:`jaxsparse.format.stack_transposed_blocks` of :func:`transpose_2_4`, which the CUDA handler builds on a
    GPU). NaN values where a block's mask is not transposable, as :func:`transpose_2_4`."""
    _check_weight(sw)
    blocks = _check_blocks(sw, blocks)
    return stack_transposed_blocks(transpose_2_4(sw), blocks)


def _blocks_product(x2: jax.Array, sw: SparseWeight, bias: Optional[jax.Array], blocks: int,
                    x_chunks: Optional[jax.Array] = None, y_chunks: Optional[jax.Array] = None,
                    activation: Optional[str] = None, with_derivative: bool = False,
                    mul: Optional[jax.Array] = None):
    """The blocked forward product (``act(x @ W + bias)``, or ``(act(z), act'(z))`` with ``with_derivative``, both
    from the kernel's epilogue on a GPU; with ``mul``, ``(x @ W + bias) * mul`` as :func:`_times` rounds it) on the
    kernels or the reference."""
    def ref(x, s, b):
        if with_derivative:
            z = reference.spmm_blocks(x, s, blocks, b, x_chunks=x_chunks)
            return reference.activation_with_derivative(activation, z)
        y = reference.spmm_blocks(x, s, blocks, b, activation, x_chunks=x_chunks, y_chunks=y_chunks)
        return y if mul is None else _times(y, mul)

    cuda = lambda x, s, b: cuda_calls.spmm_blocks(x, s, blocks, b, activation, with_derivative, x_chunks=x_chunks,
                                                  y_chunks=y_chunks, mul=mul)
    with jax.named_scope("jaxsparse_spmm"):
        return dispatch.call("spmm", ref, cuda, x2, sw, bias, unsupported=cuda_calls.blocks_unsupported(sw, blocks))


def _blocks_sddmm(x2: jax.Array, dy: jax.Array, sw: SparseWeight, blocks: int,
                  x_chunks: Optional[jax.Array] = None) -> jax.Array:
    ref = lambda x, d, s: reference.sddmm_blocks(x, d, s, blocks, x_chunks=x_chunks)
    cuda = lambda x, d, s: cuda_calls.sddmm_blocks(x, d, s, blocks, x_chunks=x_chunks)
    with jax.named_scope("jaxsparse_sddmm"):
        return dispatch.call("sddmm", ref, cuda, x2, dy, sw, unsupported=cuda_calls.blocks_unsupported(sw, blocks))


def _blocks_cotangents(x2: jax.Array, dy: jax.Array, sw: SparseWeight, bias: Optional[jax.Array], blocks: int,
                       chunks: Optional[jax.Array] = None, dx_times: Optional[jax.Array] = None,
                       dx_summed: bool = False):
    """``(dx, dsw, dbias)`` of a diagonal-block layer (:func:`diagonal_linear`): the input gradient is the blocked
    forward on the stacked transposed blocks, its stacked row chunk ``j`` written to x's chunk
    ``chunks.reshape(-1)[j]``; the weight gradient the blocked SDDMM. With ``dx_times`` (``[T, blocks K]``), ``dx``
    comes back multiplied by it (:func:`_times`): in the product's epilogue where there is no chunk table and
    :func:`jaxsparse.ffi.calls.dz_epilogue` says so (``dx_summed``: the caller sums ``dx`` over tokens in XLA), else
    by XLA after it."""
    in_epilogue = dx_times is not None and chunks is None and cuda_calls.dz_epilogue(dx_summed)
    with jax.named_scope("jaxsparse_spmm_t"):
        dx = _blocks_product(dy, transpose_blocks(sw, blocks), None, blocks,
                             y_chunks=None if chunks is None else chunks.reshape(-1),
                             mul=dx_times if in_epilogue else None)
    if dx_times is not None and not in_epilogue:
        dx = _times(dx, dx_times)
    return (dx, *_weight_cotangents(dy, sw, bias, _blocks_sddmm(x2, dy, sw, blocks, chunks)))


def _bias_grad_by_xla(tokens: int, sw: SparseWeight, bias: Optional[jax.Array]) -> bool:
    """Whether a layer's bias gradient is XLA's sum of ``dy`` (:func:`_sddmm_kept`): it has a bias and its SDDMM does
    not sum it (:func:`jaxsparse.ffi.calls.sddmm_bias_grad_fused`, on the layer's route)."""
    if bias is None:
        return False
    col = linear_x_layout(tokens, sw) == "col"  # else sddmm() picks its own x layout, as the predicate does
    return not cuda_calls.sddmm_bias_grad_fused(tokens, sw, x_layout="col" if col else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _diagonal(x2: jax.Array, sw: SparseWeight, bias: Optional[jax.Array], blocks: int,
              chunks: Optional[jax.Array]) -> jax.Array:
    return _blocks_product(x2, sw, bias, blocks, chunks)


def _diagonal_fwd(x2, sw, bias, blocks, chunks):
    return _blocks_product(x2, sw, bias, blocks, chunks), (x2, sw, bias, chunks)


def _diagonal_bwd(blocks, residuals, dy):
    x2, sw, bias, chunks = residuals
    return (*_blocks_cotangents(x2, dy, sw, bias, blocks, chunks), None)


_diagonal.defvjp(_diagonal_fwd, _diagonal_bwd)


def diagonal_linear(x: jax.Array, sw: SparseWeight, blocks: int, bias: Optional[jax.Array] = None,
                    chunks: Optional[jax.Array] = None) -> jax.Array:
    """``x @ W + bias`` for a block-diagonal ``W`` of ``blocks`` 2:4 blocks, differentiable in ``x``, ``sw.values``
    and ``bias``.

    ``sw`` is the blocks stacked along the outputs: a 2:4 weight of Flax shape ``(K, R)`` whose output feature ``r``
    belongs to block ``b = r // (R / blocks)`` and reads x's features ``b K .. b K + K - 1``; ``W`` is the
    ``[blocks K, R]`` kernel they form. A V:2:M mask with ``M = 4 blocks`` has the same density; a layer whose input
    features can be relabelled at no cost (the FFN's hidden units) can take this layout instead
    (:func:`jaxsparse.format.select_diagonal_mask` chooses such masks; docs/kernel-notes.md, session 31). Any other
    layer takes it through ``chunks``, a table ``[blocks, K / 64]`` of the 64-feature chunks of x each block reads
    (:func:`jaxsparse.format.diagonal_chunks`; a permutation of x's chunks): no relabelling, no gather of x (the
    kernels load each k-step's chunk where the table says, and write the input gradient's chunks back there). Each
    product is then a 2:4 product of ``1 / blocks`` the dense work: on a Hopper GPU the forward and the input gradient
    run on the TMA row kernel (the input gradient on :func:`transpose_blocks`, so the masks must be transposable:
    ``select_mask(..., transposable=True)`` per block), the weight gradient on the SDDMM's tma engine, with no
    transpose of any activation (:func:`jaxsparse.ffi.calls.blocks_unsupported` lists the shapes; elsewhere the
    reference runs).

    Args:
      x: ``[..., blocks K]`` in the values' dtype.
      sw: the stacked 2:4 weight, ``(K, R)``, ``R % (32 blocks) == 0``.
      blocks: the number of diagonal blocks.
      bias: ``[R]`` or None.
      chunks: None (block ``b`` reads x's features ``b K .. b K + K - 1``) or an integer table ``[blocks, K / 64]``.

    Returns:
      ``[..., R]``.
    """
    _check_weight(sw)
    blocks = _check_blocks(sw, blocks)
    if x.ndim < 1 or x.shape[-1] != blocks * sw.shape[0]:
        raise ValueError(f"x's last dimension must be {blocks} * {sw.shape[0]} for {blocks} diagonal blocks of a "
                         f"weight {sw.shape}, got {x.shape}")
    if jnp.dtype(x.dtype) != jnp.dtype(sw.values.dtype):
        raise ValueError(f"x dtype {x.dtype} must equal the sparse values dtype {sw.values.dtype}")
    _check_bias(bias, sw)
    if chunks is not None:
        check_chunks(chunks, blocks, sw.shape[0], x.shape[-1])
        chunks = jnp.asarray(chunks, jnp.int32)
    y = _diagonal(_flatten(x), sw, bias, blocks, chunks)
    return y.reshape(*x.shape[:-1], sw.shape[1])


# ----------------------------------------------------------------------------- a feed-forward block

FUSED_ACTIVATIONS = tuple(a for a in reference.ACTIVATIONS if a is not None)
"""The activations :func:`sparse_mlp` fuses (``jaxsparse.reference.ACTIVATIONS``: ``"gelu"`` is the tanh
approximation, ``"gelu_erf"`` the exact GELU)."""


def _times(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a * b`` in float32, in ``a``'s dtype."""
    return (a.astype(jnp.float32) * b.astype(jnp.float32)).astype(a.dtype)


MLP_HIDDEN_ENV = "JAXSPARSE_MLP_HIDDEN"
MLP_HIDDEN_LAYOUTS = ("auto", "row", "col")


def _check_mlp_hidden(layout: str) -> str:
    """``layout`` if it is one of :data:`MLP_HIDDEN_LAYOUTS`, else ``ValueError`` naming them."""
    if layout not in MLP_HIDDEN_LAYOUTS:
        raise ValueError(f"the feed-forward hidden layout ({MLP_HIDDEN_ENV}) must be one of {MLP_HIDDEN_LAYOUTS}, "
                         f"got {layout!r}")
    return layout


@contextlib.contextmanager
def mlp_hidden_scope(layout: Optional[str]) -> Iterator[None]:
    """Sets ``JAXSPARSE_MLP_HIDDEN`` to ``layout`` for the block and restores it after (read when :func:`sparse_mlp`
    is traced, so trace inside the block); ``None`` changes nothing."""
    with dispatch.env_scope({MLP_HIDDEN_ENV: None if layout is None else _check_mlp_hidden(layout)}):
        yield


def mlp_hidden_layout(tokens: int, sw1: SparseWeight, sw2: SparseWeight, layout: Optional[str] = None) -> str:
    """How :func:`sparse_mlp`'s first product hands the hidden activation ``h`` to the second: ``"col"``, as ``h^T``
    from its epilogue (act_mode 2), which the second layer's x^T route reads with no transpose of its own; or
    ``"row"``, as ``h``. ``layout`` ``None`` reads ``JAXSPARSE_MLP_HIDDEN`` (``auto``, ``row`` or ``col``; default
    ``auto``, which is ``col`` exactly where it can be: both layers on the ``"col"`` route (:func:`linear_x_layout`)
    and the x^T tile setting not a warp-specialized one). An explicit ``col`` that the layers cannot take raises
    ``ValueError``."""
    if layout is None:
        layout = os.environ.get(MLP_HIDDEN_ENV, "auto").strip().lower() or "auto"
    _check_mlp_hidden(layout)
    if linear_x_layout(tokens, sw1) != "col" or linear_x_layout(tokens, sw2) != "col":
        problem = "both layers on the x^T route (linear_x_layout)"
    else:
        problem = cuda_calls.transpose_out_problem()
    if layout == "col" and problem:
        raise ValueError(f"sparse_mlp: a transposed hidden activation needs {problem}")
    return "col" if layout == "col" or (layout == "auto" and problem is None) else "row"


def _mlp_fwd(x2, sw1, b1, sw2, b2, activation, blocks=1):
    if blocks > 1:  # the second layer of diagonal 2:4 blocks reads h by rows
        (h, dact), x_kept = _forward_keeping_x(x2, sw1, b1, activation, with_derivative=True)
        return _blocks_product(h, sw2, b2, blocks), (x_kept, dact, h, sw1, b1, sw2, b2)
    if mlp_hidden_layout(x2.shape[0], sw1, sw2) == "col":  # h^T from the first epilogue: no transpose of h
        (ht, dact), x_kept = _forward_keeping_x(x2, sw1, b1, activation, with_derivative=True, transpose_out=True)
        return _forward_from_xt(ht, sw2, b2), (x_kept, dact, ht, sw1, b1, sw2, b2)
    (h, dact), x_kept = _forward_keeping_x(x2, sw1, b1, activation, with_derivative=True)
    y, h_kept = _forward_keeping_x(h, sw2, b2)
    return y, (x_kept, dact, h_kept, sw1, b1, sw2, b2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _mlp(x2, sw1, b1, sw2, b2, activation, blocks=1):
    h, _ = _forward_keeping_x(x2, sw1, b1, activation)
    if blocks > 1:
        return _blocks_product(h, sw2, b2, blocks)
    return _forward_keeping_x(h, sw2, b2)[0]


def _mlp_bwd(activation, blocks, residuals, dy):
    x_kept, dact, h_kept, sw1, b1, sw2, b2 = residuals
    if blocks > 1:  # dz = dh * act'(z) in the input gradient's epilogue (where it can: _blocks_cotangents)
        dz, dsw2, db2 = _blocks_cotangents(h_kept, dy, sw2, b2, blocks, dx_times=dact,
                                           dx_summed=_bias_grad_by_xla(dy.shape[0], sw1, b1))
    else:
        dsw2, db2 = _weight_cotangents(dy, sw2, b2, *_sddmm_kept(h_kept, dy, sw2, b2))
        dz = _times(spmm_t(dy, sw2), dact)  # XLA's multiply (fused with FFN in's bias sum where XLA takes it)
    dx, dsw1, db1 = _cotangents(dz, sw1, b1, *_sddmm_kept(x_kept, dz, sw1, b1))
    return dx, dsw1, db1, dsw2, db2


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _diagonal_mlp(x2, sw1, b1, c1, sw2, b2, c2, activation, blocks):
    h = _blocks_product(x2, sw1, b1, blocks, c1, activation=activation)
    return _blocks_product(h, sw2, b2, blocks, c2)


def _diagonal_mlp_fwd(x2, sw1, b1, c1, sw2, b2, c2, activation, blocks):
    h, dact = _blocks_product(x2, sw1, b1, blocks, c1, activation=activation, with_derivative=True)
    return _blocks_product(h, sw2, b2, blocks, c2), (x2, dact, h, sw1, b1, c1, sw2, b2, c2)


def _diagonal_mlp_bwd(activation, blocks, residuals, dy):
    x2, dact, h, sw1, b1, c1, sw2, b2, c2 = residuals
    dz, dsw2, db2 = _blocks_cotangents(h, dy, sw2, b2, blocks, c2, dx_times=dact, dx_summed=b1 is not None)
    dx, dsw1, db1 = _blocks_cotangents(x2, dz, sw1, b1, blocks, c1)
    return dx, dsw1, db1, None, dsw2, db2, None


_diagonal_mlp.defvjp(_diagonal_mlp_fwd, _diagonal_mlp_bwd)


def diagonal_mlp(x: jax.Array, sw1: SparseWeight, b1: Optional[jax.Array], chunks1: jax.Array, sw2: SparseWeight,
                 b2: Optional[jax.Array], chunks2: jax.Array, blocks: int, activation: str = "gelu_erf") -> jax.Array:
    """:func:`sparse_mlp` with both layers of ``blocks`` diagonal 2:4 blocks read through chunk tables
    (:func:`diagonal_linear` with ``chunks``): ``act(x @ W1 + b1) @ W2 + b2``, differentiable in ``x``, both
    weights' values and both biases. The first product's epilogue writes ``h`` and ``act'`` (as in
    :func:`sparse_mlp`); the second reads ``h`` by its own table, so neither layer's inputs are relabelled.

    Args:
      x: ``[..., blocks K]`` in the values' dtype.
      sw1: the first layer's stacked weight ``(K, F)``; ``b1``: ``[F]`` or None; ``chunks1``: ``[blocks, K / 64]``.
      sw2: the second's ``(F / blocks, R)``; ``b2``: ``[R]`` or None; ``chunks2``: ``[blocks, F / (64 blocks)]``.
      blocks: the number of diagonal blocks of each layer.
      activation: one of :data:`FUSED_ACTIVATIONS`.

    Returns:
      ``[..., R]``.
    """
    for sw, b, c, width in ((sw1, b1, chunks1, x.shape[-1]), (sw2, b2, chunks2, sw1.shape[1])):
        _check_weight(sw)
        blocks = _check_blocks(sw, blocks)
        _check_bias(b, sw)
        check_chunks(c, blocks, sw.shape[0], width)
    if jnp.dtype(x.dtype) != jnp.dtype(sw1.values.dtype) or sw2.values.dtype != sw1.values.dtype:
        raise ValueError(f"x and both weights must share one dtype, got {x.dtype}, {sw1.values.dtype} and "
                         f"{sw2.values.dtype}")
    if activation not in FUSED_ACTIVATIONS:
        raise ValueError(f"activation must be one of {FUSED_ACTIVATIONS}, got {activation!r}")
    c1, c2 = jnp.asarray(chunks1, jnp.int32), jnp.asarray(chunks2, jnp.int32)
    y = _diagonal_mlp(_flatten(x), sw1, b1, c1, sw2, b2, c2, activation, blocks)
    return y.reshape(*x.shape[:-1], sw2.shape[1])


def sparse_mlp(x: jax.Array, sw1: SparseWeight, b1: Optional[jax.Array], sw2: SparseWeight, b2: Optional[jax.Array],
               activation: str = "gelu_erf", blocks: int = 1) -> jax.Array:
    """A feed-forward block ``act(x @ W1 + b1) @ W2 + b2`` of two compressed weights, differentiable in ``x``, both
    weights' values and both biases: :func:`sparse_linear` twice with the activation fused into the kernels.

    The first product's epilogue writes the activation (the second product's input) and its derivative (kept for
    the backward) in one pass, so XLA's activation pass over the ``[tokens, F]`` pre-activation is gone; where both
    layers take the x^T route it writes the activation transposed, as the second layer reads it
    (:func:`mlp_hidden_layout`), so no transpose of it runs either; the backward
    multiplies the second layer's input gradient by that derivative in XLA's bias-gradient reduction
    (docs/kernel-notes.md, session 22: an epilogue multiply measured no faster).

    Args:
      x: ``[..., K]`` in the values' dtype.
      sw1: ``[K, F]``; ``b1``: ``[F]`` or None.
      sw2: ``[F, R]``; ``b2``: ``[R]`` or None. With ``blocks > 1``, the stacked 2:4 weight ``(F / blocks, R)`` of
        ``blocks`` diagonal blocks (:func:`diagonal_linear`; ``h`` then goes to it by rows).
      activation: one of :data:`FUSED_ACTIVATIONS`.
      blocks: the second layer's diagonal blocks (1: a plain compressed weight).

    Returns:
      ``[..., R]``.
    """
    _check_weight(sw1)
    _check_weight(sw2)
    _check_activation(x, sw1, "x", sw1.shape[0])
    _check_bias(b1, sw1)
    _check_bias(b2, sw2)
    if blocks > 1:
        blocks = _check_blocks(sw2, blocks)
    if blocks * sw2.shape[0] != sw1.shape[1]:
        k2 = f"{blocks} x {sw2.shape[0]}" if blocks > 1 else f"{sw2.shape[0]}"
        raise ValueError(f"the second weight's K ({k2}) must equal the first's output features ({sw1.shape[1]}), got "
                         f"shapes {sw1.shape} and {sw2.shape}" + (f" with {blocks} diagonal blocks" if blocks > 1 else ""))
    if sw2.values.dtype != sw1.values.dtype:
        raise ValueError(f"both weights must share one dtype, got {sw1.values.dtype} and {sw2.values.dtype}")
    if activation not in FUSED_ACTIVATIONS:
        raise ValueError(f"activation must be one of {FUSED_ACTIVATIONS}, got {activation!r}")
    y = _mlp(_flatten(x), sw1, b1, sw2, b2, activation, blocks)
    return y.reshape(*x.shape[:-1], sw2.shape[1])


def masked_linear(x: jax.Array, w: jax.Array, mask: jax.Array, bias: Optional[jax.Array] = None) -> jax.Array:
    """``x @ (w * mask) + bias`` as a dense product (for N != 2 stages and before compression)."""
    if w.ndim != 2 or mask.shape != w.shape:
        raise ValueError(f"w must be 2-D and mask of the same shape, got {w.shape} and {mask.shape}")
    if x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"x's last dimension must be {w.shape[0]}, got {x.shape}")
    if bias is not None and bias.shape != (w.shape[1],):
        raise ValueError(f"bias must have shape ({w.shape[1]},), got {bias.shape}")
    y = jnp.dot(x, jnp.where(mask, w, jnp.zeros((), w.dtype)), preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + bias
    return y.astype(jnp.result_type(x.dtype, w.dtype))
