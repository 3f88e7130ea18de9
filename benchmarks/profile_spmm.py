"""Runs jaxsparse spmm once per spec at one shape (for ncu): python3 benchmarks/profile_spmm.py T K N spec..."""
import sys

import jax
import jax.numpy as jnp

from jaxsparse import format as F
from jaxsparse.ffi import calls

t, k, n = (int(a) for a in sys.argv[1:4])
x = jax.random.normal(jax.random.PRNGKey(0), (t, k), jnp.float32).astype(jnp.bfloat16)
w = jax.random.normal(jax.random.PRNGKey(1), (k, n), jnp.float32).astype(jnp.bfloat16)
for spec in sys.argv[4:]:
    sw = F.compress(w, jax.jit(F.select_mask, static_argnums=1)(w, F.VNM.parse(spec)), spec)
    jax.block_until_ready(jax.jit(lambda x, sw: calls.spmm(x, sw, None, None))(x, sw))
