"""What fusing BERT's residual sum into a sparse product's epilogue could save, at attention-out's shape: the GPU time
of one residual block's forward, ``h + hash_dropout(y)`` as XLA runs it after the product, against what the
warp-specialized x-row kernel's epilogue pays to read a ``[T, R]`` operand (its ``mul`` operand, which the producer
brings in by TMA as it would bring a residual).

Each row times, as kernel durations from ``jax.profiler`` traces (``common.trace_kernels``; launches excluded, as
``jaxsparse-profile`` counts them), on fresh random inputs in one process: the product alone (``calls.spmm_blocks`` on
the 2:4 weight, or on a 64:2:8 weight's 2:4 view built beforehand), the same product with ``mul``, and the block
(every kernel XLA runs for it). ``read_cost_us`` is the second less the first; ``block_us`` is what a fused epilogue
would remove where XLA runs the block as kernels of its own; ``bound_saving_us = block_us - read_cost_us`` bounds one
such block's saving from above: the keep bits, which the epilogue would have to hash (or read from a byte mask), are
not in it. ``per_step_ms`` scales that bound to the step's blocks after sparse products (attention out and FFN out: two
an encoder layer of BERT-large). In the training step XLA runs no such kernels: the block's forward is inside its
LayerNorm fusions, and the one standalone dropout kernel is the backward's (docs/kernel-notes.md, session 60), so the
step's saving is about nothing; the figures are this block timed alone.

  python3 benchmarks/residual_epilogue.py              # writes benchmarks/results/<gpu>/residual_epilogue.json
  python3 benchmarks/residual_epilogue.py --tokens 4096
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

common.import_jaxsparse_from_install_or_checkout()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxsparse import format as F  # noqa: E402
from jaxsparse.dropout import hash_dropout  # noqa: E402

CASES = [(1024, 1024, "2:4"), (1024, 1024, "64:2:8")]  # (K, R, spec): attention out; 64:2:8 through its 2:4 view
BLOCKS_PER_STEP = 48  # BERT-large: attention out's and FFN out's residual blocks in each of 24 layers
RATE = 0.1  # BERT's hidden dropout
KERNEL = "SpmmWgmmaXt"  # the forward kernels' names (spmm_blocks on x rows runs the warp-specialized one)


def summarize(plain_us: float, mul_us: float, block_us: float, blocks: int = BLOCKS_PER_STEP) -> dict:
    """The row's derived figures from the three measured times (us): the epilogue's read cost, the bound of one
    block's saving, and that bound over a step's ``blocks``."""
    read = mul_us - plain_us
    bound = block_us - read
    return {"product_us": round(plain_us, 2), "product_with_mul_us": round(mul_us, 2), "read_cost_us": round(read, 2),
            "block_us": round(block_us, 2), "bound_saving_us": round(bound, 2),
            "per_step_ms": round(bound * blocks / 1e3, 3)}


def operands(tokens: int, k: int, r: int, spec: str, seed: int = 0) -> tuple:
    """``(x, sw, bias, h, y)``: fresh random bf16 inputs, a weight pruned to ``spec`` by magnitude, its bias, and the
    block's residual and product output."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = jax.random.normal(keys[0], (tokens, k), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (k, r)) / 32).astype(jnp.bfloat16)
    sw = F.compress(w, F.select_mask(w, spec), spec)
    bias = (0.1 * jax.random.normal(keys[2], (r,))).astype(jnp.bfloat16)
    h = jax.random.normal(keys[3], (tokens, r), jnp.bfloat16)
    y = jax.random.normal(keys[4], (tokens, r), jnp.bfloat16)
    return x, sw, bias, h, y


def measure(tokens: int, k: int, r: int, spec: str) -> dict:
    from jaxsparse.ffi import calls

    x, sw, bias, h, y = operands(tokens, k, r, spec)
    w24 = sw if sw.spec.m == 4 else jax.jit(lambda s: calls.as_2_4(s)[0])(sw)  # built once, outside the timings
    plain = jax.jit(lambda a, w, b: calls.spmm_blocks(a, w, 1, b))
    with_mul = jax.jit(lambda a, w, b, m: calls.spmm_blocks(a, w, 1, b, mul=m))
    block = jax.jit(lambda a, res, key: res + hash_dropout(key, a, RATE))
    got = np.asarray(with_mul(x, w24, bias, h), np.float32)
    want = np.asarray(plain(x, w24, bias), np.float32) * np.asarray(h, np.float32)
    if not np.isfinite(got).all() or not np.allclose(got, want, rtol=2e-2, atol=2e-2):
        raise RuntimeError(f"{spec}: the product with mul is not the product times mul")
    times = [common.trace_kernels(plain, (x, w24, bias), KERNEL)["median_us"],
             common.trace_kernels(with_mul, (x, w24, bias, h), KERNEL)["median_us"],
             common.trace_kernels(block, (y, h, jax.random.key(1)), "")["per_call_us"]]
    return {"tokens": tokens, "K": k, "R": r, "spec": spec, **summarize(*times)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384, help="rows of the activation (BERT-large: 32 x 512)")
    ap.add_argument("--out", default=None, help="json path (default benchmarks/results/<gpu>/residual_epilogue.json)")
    a = ap.parse_args(argv)
    if a.tokens < 1:
        ap.error(f"--tokens must be >= 1, got {a.tokens}")
    if common.missing_gpu_extension("residual_epilogue.py"):
        return 1
    rows = [measure(a.tokens, k, r, spec) for k, r, spec in CASES]
    cols = ["spec", "product_us", "product_with_mul_us", "read_cost_us", "block_us", "bound_saving_us", "per_step_ms"]
    print(common.table(rows, cols))
    common.write_json(common.results_path("residual_epilogue.json", a.out),
                      {"benchmark": "residual_epilogue", "description": __doc__.split("\n\n")[0],
                       "gpu": common.gpu_name(), "versions": common.versions(), "rate": RATE,
                       "blocks_per_step": BLOCKS_PER_STEP,
                       "timing": "median kernel duration from jax.profiler traces (3 calls); the block: all its kernels",
                       "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
