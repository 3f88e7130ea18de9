"""The one place that chooses between the CUDA kernels and the pure-JAX reference.

``JAXSPARSE_BACKEND`` (read at trace time):
  * ``auto`` (default): the CUDA kernel when the extension is built, the program is lowered for a GPU
    and the operands meet the kernel's constraints; the reference otherwise. The choice between GPU and
    CPU is made per lowering platform with ``jax.lax.platform_dependent``, so one jitted function runs
    on either.
  * ``reference``: always the reference.
  * ``cuda``: always the kernel; a missing extension, a missing GPU or operands the kernel cannot take
    raise instead of falling back.

``JAXSPARSE_REFERENCE_OPS`` (comma-separated op names, e.g. ``sddmm,spmm_t``) sends just those ops to the
reference whatever the backend: for diagnosis and for A/B timings of one kernel inside a whole step.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Callable, Iterator, Mapping, Optional

import jax

from jaxsparse import ffi

__all__ = ["BACKENDS", "OPS", "backend", "reference_ops", "settings", "env_scope", "call"]

BACKENDS = ("auto", "reference", "cuda")
OPS = ("decompress", "transpose_2_4", "spmm", "sddmm", "spmm_t")
_warned: set[tuple[str, str]] = set()


def backend() -> str:
    """The backend ``JAXSPARSE_BACKEND`` asks for (``auto`` when unset)."""
    mode = os.environ.get("JAXSPARSE_BACKEND", "auto").strip().lower() or "auto"
    if mode not in BACKENDS:
        raise ValueError(f"JAXSPARSE_BACKEND must be one of {BACKENDS}, got {mode!r}")
    return mode


def reference_ops() -> frozenset[str]:
    """The ops ``JAXSPARSE_REFERENCE_OPS`` sends to the reference (empty when unset)."""
    names = frozenset(n.strip().lower() for n in os.environ.get("JAXSPARSE_REFERENCE_OPS", "").split(",") if n.strip())
    if not names <= set(OPS):
        raise ValueError(f"JAXSPARSE_REFERENCE_OPS names unknown ops {sorted(names - set(OPS))}; known: {OPS}")
    return names


def settings() -> dict[str, str]:
    """The ``JAXSPARSE_*`` environment variables set now, by name: the backend, the routes and the other settings
    this package reads when a function is traced."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("JAXSPARSE_")}


@contextlib.contextmanager
def env_scope(settings: Mapping[str, Optional[str]], *, keep_set: bool = False) -> Iterator[None]:
    """Sets these environment variables for the block and restores each on exit, also when the block raises.

    The settings this package reads (``JAXSPARSE_BACKEND``, the routes of :mod:`jaxsparse.ops`) are read when a
    function is traced, so trace (jit-compile) inside the block. A value of ``None`` leaves its variable as it is;
    with ``keep_set`` a variable that is already set keeps its value.
    """
    previous = {name: os.environ.get(name) for name in settings}
    for name, value in settings.items():
        if value is not None and not (keep_set and previous[name] is not None):
            os.environ[name] = value
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def call(
    op: str,
    reference: Callable[..., Any],
    cuda: Optional[Callable[..., Any]],
    *operands: Any,
    unsupported: Optional[str] = None,
) -> Any:
    """Runs ``op`` on ``operands`` through the kernel or the reference.

    Args:
      op: the op's name, for messages.
      reference: the pure-JAX implementation.
      cuda: the FFI implementation, or None while the op has no kernel (then the reference always runs).
      *operands: arrays or pytrees of arrays, passed to either implementation.
      unsupported: why the kernel cannot take these operands, or None when it can.
    """
    mode = backend()
    if mode == "reference" or cuda is None or op in reference_ops():
        return reference(*operands)
    if mode == "cuda":
        if not ffi.available():
            raise RuntimeError(f"JAXSPARSE_BACKEND=cuda but {ffi.unavailable_reason()}")
        if not _has_gpu():
            raise RuntimeError("JAXSPARSE_BACKEND=cuda but JAX sees no GPU")
        if unsupported:
            raise ValueError(f"{op}: the CUDA kernel cannot take these operands: {unsupported}")
        return cuda(*operands)
    if not ffi.available():
        return reference(*operands)
    if unsupported:
        if _has_gpu() and (op, unsupported) not in _warned:
            _warned.add((op, unsupported))
            warnings.warn(f"jaxsparse.{op} runs its pure-JAX reference on the GPU: {unsupported}", stacklevel=3)
        return reference(*operands)
    return jax.lax.platform_dependent(*operands, cuda=cuda, default=reference)
