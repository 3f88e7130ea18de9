"""The cost of building W^T as a 2:4 weight (issue 4's transposed dX route) at BERT-large shapes, bf16, transposable
masks: session 19's pure-JAX build (decompress, then _compress with argsort), the broadcasting reference
(format.transpose_2_4) and the CUDA handler (calls.transpose_2_4), and whether the three agree bit for bit.

Each build is timed alone under jit, so for the kernel the time is the host's dispatch, not the GPU's work
(docs/kernel-notes.md, session 20); linear.py's "dX transposed" rows show the build inside the product.

  python3 benchmarks/transpose_2_4_cost.py     # writes $OUT/wt_probe.json when OUT is set
"""
import json, os, sys
import jax, jax.numpy as jnp
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common
from jaxsparse import format as F


def old_compress_2_4(w, mask):  # session 19's _compress at M = 4 (argsort of ~mask)
    k, r = w.shape
    g = k // 4
    a = w.T.reshape(r, g, 4)
    mk = mask.T.reshape(r, g, 4)
    pos = jnp.argsort(~mk, axis=-1, stable=True)[..., :2]
    vals = jnp.where(jnp.take_along_axis(mk, pos, -1), jnp.take_along_axis(a, pos, -1), 0)
    return vals.reshape(r, 2 * g), F._pack_metadata(pos[..., 0], pos[..., 1])


@jax.jit
def old_transpose(sw):
    mask = F.kept_mask(sw)
    return old_compress_2_4(F.decompress(sw).T, mask.T)


if __name__ == "__main__":
    from jaxsparse.ffi import calls
    ref_transpose, kernel_transpose = jax.jit(F.transpose_2_4), jax.jit(calls.transpose_2_4)
    bits = lambda a: np.asarray(a).view(np.uint16)
    rows = []
    for k, n in [(1024, 1024), (1024, 4096), (4096, 1024)]:
        w = (jax.random.normal(jax.random.PRNGKey(k + n), (k, n)) / 32).astype(jnp.bfloat16)
        for spec in ["2:4", "64:2:8", "128:2:16"]:
            for transposable in (True, False):
                sw = F.compress(w, F.select_mask(w, spec, transposable=transposable), spec)
                ref, ker = ref_transpose(sw), kernel_transpose(sw)
                same = bool((bits(ref.values) == bits(ker.values)).all() and (ref.metadata == ker.metadata).all())
                row = dict(K=k, N=n, spec=spec, transposable=transposable, kernel_equals_reference=same)
                if transposable:
                    vo, mo = old_transpose(sw)
                    row["session19_equals_reference"] = bool((vo == ref.values).all() and (mo == ref.metadata).all())
                    for name, fn in (("session19", old_transpose), ("reference", ref_transpose),
                                     ("kernel", kernel_transpose)):
                        row[f"{name}_ms"] = round(common.time_jax(fn, [(sw,)], warmup=5, inner=20, outer=15), 4)
                rows.append(row)
                print(row, flush=True)
    if os.environ.get("OUT"):
        json.dump(dict(gpu=common.gpu_name(), versions=common.versions(), rows=rows),
                  open(os.path.join(os.environ["OUT"], "wt_probe.json"), "w"), indent=1)
