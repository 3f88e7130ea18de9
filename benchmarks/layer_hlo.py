"""Which jaxsparse custom calls (and how many of each) the optimized HLO of one sparse layer's forward + backward
holds, per spec, on the default routes: for instance that XLA merges a 64:2:8 layer's two identical
``jaxsparse_as_2_4`` calls (the forward's and the SDDMM's) into one.  Needs the GPU backend (on the CPU the layer
runs the pure-JAX reference and no custom call appears).

  python3 benchmarks/layer_hlo.py
"""

from __future__ import annotations

import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

import common  # noqa: E402
from jaxsparse import format as F  # noqa: E402


def main() -> None:
    (x,), (dy,), w, b = common.layer_operands(4096, 1024, 4096, sets=1)
    for spec in ["2:4", "64:2:8", "128:2:16"]:
        sw = F.compress(w, F.select_mask(w, spec), spec)
        f = jax.jit(lambda x, dy, sw, b: common.sparse_vjp(x, dy, sw.values, b, sw))
        hlo = f.lower(x, dy, sw, b).compile().as_text()
        calls = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', hlo))
        print(spec, dict(calls))


if __name__ == "__main__":
    main()
