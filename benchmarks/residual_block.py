"""What BERT's residual block costs after each sublayer, ``LayerNorm(dropout(y) + residual)``, forward and backward, at
one encoder layer's activation shape, with each dropout (none, ``flax.linen.Dropout``,
``jaxsparse.dropout.hash_dropout``) side by side in one process.

A BERT-large step at 32 x 512 tokens runs 49 of these (two an encoder layer, and the embeddings' LayerNorm with its
dropout), dense and sparse steps alike; ``per_step_ms`` is 49 times each dropout's time, and
``saved_per_step_ms`` 49 times what it saves against flax's dropout (``BertConfig(dropout_impl="rng")``; the hash is
the model's default since session 43).
``flax_dropout_extra_bytes`` is what flax's random words and mask move (a 4-byte word written and read, a 1-byte mask
written and read by the forward and the backward: 11 bytes an element), ``flax_dropout_extra_floor_ms`` their time at
:data:`common.HBM_TBPS`; the hash moves none and adds integer work inside the block's fusions instead.

  python3 benchmarks/residual_block.py                  # writes benchmarks/results/<gpu or cpu>/residual_block.json
  python3 benchmarks/residual_block.py --tokens 2048    # smaller, e.g. on a CPU
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

BLOCKS_PER_STEP = 49
"""Residual blocks (dropout, residual sum, LayerNorm) on ``[tokens, hidden]`` activations in one BERT-large training
step: 24 layers x 2, and the embeddings'."""
DROPOUTS = ("none", "flax", "hash")
BASELINE = "flax"  # what every step before session 42 ran (BertConfig(dropout_impl="rng"))
FLAX_DROPOUT_EXTRA_BYTES_PER_ELEMENT = 11  # u32 word written + read, bool mask written + read in fwd and bwd
EPS = 1e-12  # BERT's layer_norm_eps


def block(dropout: str, rate: float):
    """``(y, residual, dz, scale, bias, key) -> (z, dy, dresidual, dscale, dbias)``: the block and its vjp."""
    if dropout not in DROPOUTS:
        raise ValueError(f"dropout must be one of {DROPOUTS}, got {dropout!r}")

    def drop(y, key):
        if dropout == "none":
            return y
        if dropout == "hash":
            return hash_dropout(key, y, rate)
        return nn.Dropout(rate).apply({}, y, deterministic=False, rngs={"dropout": key})

    def normalize(x, scale, bias):
        return nn.LayerNorm(epsilon=EPS, dtype=x.dtype).apply({"params": {"scale": scale, "bias": bias}}, x)

    def f(y, residual, dz, scale, bias, key):
        z, vjp = jax.vjp(lambda y, r, s, b: normalize(drop(y, key) + r, s, b), y, residual, scale, bias)
        return (z, *vjp(dz))

    return jax.jit(f)


def measure(tokens: int, hidden: int, dtype: str, rate: float, sets: int = 3, inner: int = 20,
            outer: int = 15) -> dict:
    """Median ms of the block with each dropout (inputs and keys rotating over ``sets``), and the per-step sums."""
    dt = jnp.dtype(dtype)
    ks = jax.random.split(jax.random.key(0), 3 * sets + 2)
    scale = 1.0 + 0.1 * jax.random.normal(ks[-2], (hidden,))
    bias = 0.1 * jax.random.normal(ks[-1], (hidden,))
    args = [tuple(jax.random.normal(ks[3 * i + j], (tokens, hidden), dt) for j in range(3))
            + (scale, bias, jax.random.key(100 + i, impl="rbg")) for i in range(sets)]
    ms = {d: common.time_jax(block(d, rate), args, inner=inner, outer=outer) for d in DROPOUTS}
    base = ms[BASELINE]
    elements = tokens * hidden
    return {"tokens": tokens, "hidden": hidden, "dtype": dtype, "rate": rate, "elements": elements, "ms": ms,
            "per_step_ms": {k: BLOCKS_PER_STEP * v for k, v in ms.items()},
            "saved_per_step_ms": {k: BLOCKS_PER_STEP * (base - v) for k, v in ms.items()},
            "flax_dropout_extra_bytes": FLAX_DROPOUT_EXTRA_BYTES_PER_ELEMENT * elements,
            "flax_dropout_extra_floor_ms": FLAX_DROPOUT_EXTRA_BYTES_PER_ELEMENT * elements / (common.HBM_TBPS * 1e12) * 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384, help="rows of the activation (BERT-large: 32 x 512)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                    help="default: bfloat16 on a GPU, float32 elsewhere")
    ap.add_argument("--rate", type=float, default=0.1)
    ap.add_argument("--out", default=None, help="json path (default benchmarks/results/<gpu or cpu>/residual_block.json)")
    a = ap.parse_args(argv)
    if a.tokens < 1 or a.hidden < 1:
        ap.error(f"--tokens and --hidden must be >= 1, got {a.tokens}, {a.hidden}")
    if not 0.0 < a.rate < 1.0:
        ap.error(f"--rate must be in (0, 1), got {a.rate}")
    gpu = jax.default_backend() == "gpu"
    dtype = a.dtype or ("bfloat16" if gpu else "float32")
    row = measure(a.tokens, a.hidden, dtype, a.rate)
    print(common.table([{"dropout": k, "block ms": f"{v:.4f}", "x 49 a step": f"{row['per_step_ms'][k]:.2f}",
                         "saved a step": f"{row['saved_per_step_ms'][k]:.2f}"} for k, v in row["ms"].items()],
                       ["dropout", "block ms", "x 49 a step", "saved a step"]))
    print(f"flax's dropout words and mask: {row['flax_dropout_extra_bytes'] / 2**20:.0f} MiB a block, floor "
          f"{row['flax_dropout_extra_floor_ms']:.4f} ms at {common.HBM_TBPS} TB/s")
    device = common.gpu_name() if gpu else "cpu"
    out = a.out or os.path.join(common.REPO, "benchmarks", "results", common.gpu_slug(device) if gpu else "cpu",
                                "residual_block.json")
    common.write_json(out, {"benchmark": "residual_block", "description": __doc__.split("\n\n")[0], "device": device,
                            "platform": jax.default_backend(), "versions": common.versions(),
                            "blocks_per_step": BLOCKS_PER_STEP, "baseline": BASELINE, **row})
    return 0


if __name__ == "__main__":
    sys.exit(main())
