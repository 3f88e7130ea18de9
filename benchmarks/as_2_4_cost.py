"""The cost of the 2:4 view of a V:2:M weight (``as_2_4``, what the TMA row forward and the SDDMM's tma engine run a
V:2:M weight as): built by XLA ops (``jaxsparse.format.as_2_4``, the reference) against the ``jaxsparse_as_2_4``
kernel (``jaxsparse.ffi.calls.as_2_4``), each jitted alone, median of timed repetitions after warm-up.
Jitted alone, a call this small is bound by the host's dispatch, not the GPU (docs/kernel-notes.md, session 20):
read the kernel's device time from a profile or from the product it feeds, not from this file.

  python3 benchmarks/as_2_4_cost.py      # writes benchmarks/results/<gpu>/as_2_4_cost.json
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402
from jaxsparse import format as F  # noqa: E402
from jaxsparse.ffi import calls  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="json path (default benchmarks/results/<gpu>/as_2_4_cost.json)")
    args = ap.parse_args()
    rows = []
    for k, n in [(1024, 4096), (4096, 1024)]:
        w = (jax.random.normal(jax.random.PRNGKey(9), (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
        for spec in ["64:2:8", "128:2:16"]:
            sw = F.compress(w, F.select_mask(w, spec), spec)
            sws = [(sw,), (sw.replace(values=sw.values * 2),)]
            xla = common.time_jax(jax.jit(F.as_2_4), sws)
            kernel = common.time_jax(jax.jit(calls.as_2_4), sws)
            rows.append(dict(K=k, N=n, spec=spec, xla_ms=xla, kernel_ms=kernel))
            print(f"{k:>5} {n:>5} {spec:>9} as_2_4 XLA {xla:.4f} ms, kernel {kernel:.4f} ms", flush=True)
    common.write_json(common.results_path("as_2_4_cost.json", args.out), dict(gpu=common.gpu_name(), versions=common.versions(), results=rows))


if __name__ == "__main__":
    main()
