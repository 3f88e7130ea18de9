"""jaxsparse: V:N:M sparse training for JAX/Flax on NVIDIA Sparse Tensor Cores.

Modules: ``format`` (the V:N:M spec, mask selection, compression), ``reference`` (pure-JAX kernels),
``ops`` (validated, dispatched sparse products, ``sparse_linear`` and the fused feed-forward ``sparse_mlp``), ``dispatch`` (kernel or reference),
``ffi`` (the CUDA extension), ``nn`` (``NMDense``), ``pruning`` (``gmp_prune``).
"""

from jaxsparse.format import VNM, SparseWeight, check_mask, compress, decompress, select_diagonal_mask, select_mask
from jaxsparse.ops import diagonal_linear, masked_linear, sparse_linear, sparse_mlp

__version__ = "0.1.0"

__all__ = [
    "VNM",
    "SparseWeight",
    "check_mask",
    "compress",
    "decompress",
    "select_mask",
    "select_diagonal_mask",
    "diagonal_linear",
    "masked_linear",
    "sparse_linear",
    "sparse_mlp",
]
