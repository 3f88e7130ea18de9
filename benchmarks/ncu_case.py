"""One product under Nsight Compute, at 16384 tokens (the session-9 traces in
``benchmarks/results/nvidia-h100-80gb-hbm3/ncu_session9/`` came from it):

  ncu --clock-control none --kernel-name regex:SpmmWgmmaXt --launch-skip 2 --launch-count 1 \\
      --section SpeedOfLight --section WarpStateStats --page raw python3 benchmarks/ncu_case.py 2:4 1024 4096 row:auto

SPEC K N TILE: SPEC ``dense`` runs XLA's ``x @ w`` (TILE ignored but ``dw``); a TILE ``row:NAME`` runs the TMA row
kernel on ``x [T, K]`` as it is (through the 2:4 view where M > 4); TILE ``dw`` runs the weight gradient instead: XLA's
``x^T @ dy`` for ``dense``, else the SDDMM on the route ``sparse_linear`` takes (session 21:
``ncu ... --kernel-name regex:"Sddmm|nvjet|gemm" ... python3 benchmarks/ncu_case.py 2:4 1024 4096 dw``); any other
TILE runs the x^T kernel with ``x^T`` given; TILE ``dx_resident`` runs the resident input gradient ``dy @ W^T``
(session 27: ``ncu ... --kernel-name regex:DxResident ... python3 benchmarks/ncu_case.py 128:2:16 4096 1024 dx_resident``).
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import format as F
from jaxsparse.ffi import calls

spec, k, n, tile = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
t = 16384
x = jax.random.normal(jax.random.PRNGKey(0), (t, k), jnp.float32).astype(jnp.bfloat16)
w = (jax.random.normal(jax.random.PRNGKey(1), (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
dy = (jax.random.normal(jax.random.PRNGKey(2), (t, n), jnp.float32).astype(jnp.bfloat16)
      if tile in ("dw", "dx_resident") else None)  # the products that read dy
if tile == "dx_resident":
    sw = F.compress(w, F.select_mask(w, spec), spec)
    f, args = jax.jit(lambda dy, sw: calls.spmm_t_resident(dy, sw)), (dy, sw)
elif tile == "dw" and spec == "dense":
    f, args = jax.jit(lambda x, dy: x.T @ dy), (x, dy)
elif tile == "dw":
    sw = F.compress(w, F.select_mask(w, spec), spec)
    f, args = jax.jit(lambda x, dy, sw: calls.sddmm(x, dy, sw)), (x, dy, sw)
elif spec == "dense":
    f, args = jax.jit(lambda x, w: x @ w), (x, w)
elif tile.startswith("row:"):
    sw = F.compress(w, F.select_mask(w, spec), spec)
    sw = calls.as_2_4(sw)[0] if sw.spec.m > 4 else sw
    f, args = jax.jit(lambda x, sw: calls._spmm_xt_call(x, sw, None, None, tile[4:], x_rows=True)), (x, sw)
else:
    sw = F.compress(w, F.select_mask(w, spec), spec)
    xt = jax.jit(lambda x: x.T)(x)
    f, args = jax.jit(lambda xt, sw: calls.spmm_from_xt(xt, sw, None, None, tile)), (xt, sw)
for _ in range(4):
    f(*args).block_until_ready()
print("done", spec, k, n, tile)
