"""Loading the built CUDA extension and registering its XLA FFI targets.

The extension ``jaxsparse.ffi._jaxsparse_cuda`` is built by ``pip install .`` when a CUDA compiler is
present. Without it, ``available()`` is False and every op runs its pure-JAX reference.
"""

from __future__ import annotations

import threading

import jax

try:
    from jaxsparse.ffi import _jaxsparse_cuda as _extension
except ImportError as error:  # built without CUDA, or the build failed to load
    _extension = None
    _import_error: ImportError | None = error
else:
    _import_error = None

__all__ = ["available", "unavailable_reason", "register", "target_names"]

_lock = threading.Lock()
_registered = False


def available() -> bool:
    """True when the CUDA extension was built and imports."""
    return _extension is not None


def unavailable_reason() -> str:
    """Why the extension cannot be used (empty when it can)."""
    if _extension is not None:
        return ""
    return f"the jaxsparse CUDA extension is not built or failed to import ({_import_error})"


def target_names() -> list[str]:
    """Names of the FFI targets the extension provides."""
    return sorted(_extension.registrations()) if _extension is not None else []


def register() -> None:
    """Registers every FFI target with XLA for the CUDA platform (idempotent, thread-safe)."""
    global _registered
    if _registered:
        return
    if _extension is None:
        raise RuntimeError(unavailable_reason())
    with _lock:
        if not _registered:
            for name, capsule in _extension.registrations().items():
                jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
            _registered = True
