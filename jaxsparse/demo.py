"""``jaxsparse-demo``: compress one linear layer per pattern and check the sparse product against dense.

Runs on whatever JAX's default device is (CUDA kernels on a GPU with the extension built, the pure-JAX
reference elsewhere) and prints, per pattern, the relative error against the masked dense float32
product and how much weight magnitude the mask kept.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxsparse import ffi, format as F, ops


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--in-features", type=int, default=768)
    parser.add_argument("--out-features", type=int, default=768)
    parser.add_argument("--specs", default="2:4,64:2:8,128:2:16,128:2:32")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; CUDA extension: {ffi.available()}")
    kw, kx = jax.random.split(jax.random.PRNGKey(args.seed))
    w = jax.random.normal(kw, (args.in_features, args.out_features)) / np.sqrt(args.in_features)
    x = jax.random.normal(kx, (args.tokens, args.in_features)).astype(args.dtype)
    print(f"{'pattern':>10} {'density':>8} {'|w| kept':>9} {'rel err':>9} {'ms':>8}")
    worst = 0.0
    for text in args.specs.split(","):
        spec = F.VNM.parse(text)
        mask = F.select_mask(w, spec)
        sw = F.compress(w.astype(args.dtype), mask, spec)
        f = jax.jit(ops.sparse_linear)
        jax.block_until_ready(f(x, sw))
        t0 = time.perf_counter()
        y = jax.block_until_ready(f(x, sw))
        ms = 1e3 * (time.perf_counter() - t0)
        dense = jnp.where(mask, w.astype(args.dtype), 0).astype(jnp.float32)
        ref = np.asarray(x.astype(jnp.float32) @ dense, np.float64)
        err = float(np.linalg.norm(np.asarray(y, np.float64) - ref) / np.linalg.norm(ref))
        kept = float(jnp.abs(jnp.where(mask, w, 0)).sum() / jnp.abs(w).sum())
        worst = max(worst, err if np.isfinite(err) else np.inf)
        print(f"{text:>10} {spec.density:8.4f} {kept:9.3f} {err:9.2e} {ms:8.2f}")
    tol = 1e-5 if args.dtype == "float32" else 2e-2
    print(f"demo {'passed' if worst < tol else 'FAILED'}: worst relative error {worst:.2e} (tolerance {tol:.0e})")
    if worst >= tol:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
