"""Session 24, device call 2: the condensed dX kernel in full and in two stripped variants, read from the
environment by the handler of commit ca4ba56 (JAXSPARSE_DXC_PROBE=1: TMA loads, barrier waits and epilogue, no
wgmma; =2: the products on the prologue's two stages, no further loads), against XLA's dense dX. The probe was
removed from the kernel after this run; check out ca4ba56 to rerun it."""
import os, sys, time, json
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, "benchmarks")
import common
from jaxsparse import format as F
from jaxsparse.ffi import calls
res = []
for k, r in [(1024, 4096), (4096, 1024)]:
    t = 16384
    spec = F.VNM.parse("128:2:16")
    w = (jax.random.normal(jax.random.PRNGKey(0), (k, r)) / 32).astype(jnp.bfloat16)
    sw = F.compress(w, F.select_mask(w, spec), spec)
    dys = [jax.random.normal(jax.random.PRNGKey(i), (t, r)).astype(jnp.bfloat16) for i in range(3)]
    dense = jax.jit(lambda dy, w: dy @ w.T)
    ms_d = common.time_jax(dense, [(d, w) for d in dys], warmup=5, inner=20, outer=15)
    wc, s = F.condensed_dx_operands(sw)
    for probe in ["0", "1", "2"]:
        os.environ["JAXSPARSE_DXC_PROBE"] = probe
        f = jax.jit(lambda dy, wc, s: calls._call("jaxsparse_spmm_t_condensed", (t, k), dy.dtype, dy, wc, s, v=np.int32(128), m=np.int32(16)))
        ms = common.time_jax(f, [(d, wc, s) for d in dys], warmup=5, inner=20, outer=15)
        res.append(dict(K=k, R=r, probe=probe, ms=ms, dense_ms=ms_d))
        print(res[-1], flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.json"), "w"), indent=1)
