"""What a dropout costs where BERT puts it: ``LayerNorm(dropout(y) + residual)``, forward and backward, at one
encoder layer's activation shape, with no dropout, with ``flax.linen.Dropout`` and with
``jaxsparse.dropout.hash_dropout``, side by side in one process.

A BERT-large step at 32 x 512 tokens runs 49 of these (two an encoder layer, and the embeddings'), dense and sparse
steps alike; ``per_step_ms`` scales each variant's extra time over the no-dropout block by 49. ``flax_extra_bytes``
is what flax's random words and mask move on top of the block (a 4-byte word written and read, a 1-byte mask written
and read by the forward and the backward: 11 bytes an element), and ``flax_extra_floor_ms`` their time at
:data:`common.HBM_TBPS`; the hash moves none and adds integer work inside the block's fusions instead.

  python3 benchmarks/dropout_cost.py                  # writes benchmarks/results/<gpu or cpu>/dropout_cost.json
  python3 benchmarks/dropout_cost.py --tokens 2048    # smaller, e.g. on a CPU
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

common.import_jaxsparse_from_install_or_checkout()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxsparse.dropout import hash_dropout  # noqa: E402

DROPOUTS_PER_STEP = 49
"""Dropouts on ``[tokens, hidden]`` activations in one BERT-large training step (24 layers x 2 + the embeddings')."""
VARIANTS = ("none", "flax", "hash")
FLAX_EXTRA_BYTES_PER_ELEMENT = 11  # u32 word written + read, bool mask written + read in the forward and the backward


def block(variant: str, rate: float):
    """``(y, residual, dz, key) -> (z, dy, dresidual)``: the post-dropout residual LayerNorm and its vjp."""
    def drop(y, key):
        if variant == "none":
            return y
        if variant == "hash":
            return hash_dropout(key, y, rate)
        return nn.Dropout(rate).apply({}, y, deterministic=False, rngs={"dropout": key})

    def forward(y, residual, key):
        h = (drop(y, key) + residual).astype(jnp.float32)
        mu = h.mean(-1, keepdims=True)
        var = ((h - mu) ** 2).mean(-1, keepdims=True)
        return ((h - mu) * jax.lax.rsqrt(var + 1e-12)).astype(y.dtype)

    def f(y, residual, dz, key):
        z, vjp = jax.vjp(lambda y, r: forward(y, r, key), y, residual)
        return (z, *vjp(dz))

    return jax.jit(f)


def measure(tokens: int, hidden: int, dtype: str, rate: float, sets: int = 3, inner: int = 20,
            outer: int = 15) -> dict:
    """Median ms of each variant's block (inputs and keys rotating over ``sets``), and the per-step sums."""
    dt = jnp.dtype(dtype)
    ks = jax.random.split(jax.random.key(0), 3 * sets)
    args = [(jax.random.normal(ks[3 * i], (tokens, hidden), dt), jax.random.normal(ks[3 * i + 1], (tokens, hidden), dt),
             jax.random.normal(ks[3 * i + 2], (tokens, hidden), dt), jax.random.key(100 + i, impl="rbg"))
            for i in range(sets)]
    ms = {v: common.time_jax(block(v, rate), args, inner=inner, outer=outer) for v in VARIANTS}
    elements = tokens * hidden
    extra = {v: ms[v] - ms["none"] for v in ("flax", "hash")}
    return {"tokens": tokens, "hidden": hidden, "dtype": dtype, "rate": rate, "elements": elements,
            "ms": ms, "extra_ms": extra, "per_step_ms": {v: DROPOUTS_PER_STEP * e for v, e in extra.items()},
            "hash_over_flax": ms["hash"] / ms["flax"],
            "flax_extra_bytes": FLAX_EXTRA_BYTES_PER_ELEMENT * elements,
            "flax_extra_floor_ms": FLAX_EXTRA_BYTES_PER_ELEMENT * elements / (common.HBM_TBPS * 1e12) * 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384, help="rows of the activation (BERT-large: 32 x 512)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                    help="default: bfloat16 on a GPU, float32 elsewhere")
    ap.add_argument("--rate", type=float, default=0.1)
    ap.add_argument("--out", default=None, help="json path (default benchmarks/results/<gpu or cpu>/dropout_cost.json)")
    a = ap.parse_args(argv)
    if a.tokens < 1 or a.hidden < 1:
        ap.error(f"--tokens and --hidden must be >= 1, got {a.tokens}, {a.hidden}")
    if not 0.0 < a.rate < 1.0:
        ap.error(f"--rate must be in (0, 1), got {a.rate}")
    gpu = jax.default_backend() == "gpu"
    dtype = a.dtype or ("bfloat16" if gpu else "float32")
    row = measure(a.tokens, a.hidden, dtype, a.rate)
    print(common.table([{"variant": v, "block ms": f"{row['ms'][v]:.4f}",
                         "extra ms": f"{row['extra_ms'][v]:.4f}" if v != "none" else "-",
                         "x 49 a step": f"{row['per_step_ms'][v]:.2f}" if v != "none" else "-"} for v in VARIANTS],
                       ["variant", "block ms", "extra ms", "x 49 a step"]))
    print(f"flax's words and mask: {row['flax_extra_bytes'] / 2**20:.0f} MiB, floor {row['flax_extra_floor_ms']:.4f} ms "
          f"at {common.HBM_TBPS} TB/s; hash / flax block time {row['hash_over_flax']:.3f}")
    device = common.gpu_name() if gpu else "cpu"
    out = a.out or os.path.join(common.REPO, "benchmarks", "results", common.gpu_slug(device) if gpu else "cpu",
                                "dropout_cost.json")
    common.write_json(out, {"benchmark": "dropout_cost", "description": __doc__.split("\n\n")[0], "device": device,
                            "platform": jax.default_backend(), "versions": common.versions(),
                            "dropouts_per_step": DROPOUTS_PER_STEP, **row})
    return 0


if __name__ == "__main__":
    sys.exit(main())
