"""How much more of MiniLM's kernels a V:N:M mask keeps after function-preserving channel permutations.

For each pattern, ``jaxsparse.permute.search_permutations`` chooses per encoder layer an FFN permutation
(intermediate units) and an attention permutation (whole heads, then dimensions inside a head) on the
pretrained all-MiniLM-L6-v2 weights; ``apply_permutations`` applies them. Then, per kernel, the fraction
of the squared weight magnitude that the magnitude mask of ``jaxsparse.format.select_mask`` keeps,
without and with the permutations, next to plain ``N:M`` (each output's top ``N`` of every ``M`` inputs,
no shared columns: the ceiling a permutation can approach). Writes
``benchmarks/results/cpu/permute_energy.json``.

    PYTHONPATH=. python benchmarks/permute_energy.py [--patterns 64:2:8 --iters 30]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import traverse_util

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mask_energy import kept_energy, plain_nm  # noqa: E402
from jaxsparse import format as F  # noqa: E402
from jaxsparse import permute  # noqa: E402
from jaxsparse.models import bert  # noqa: E402


def kernels(params: dict) -> dict[str, np.ndarray]:
    """``layerI/module/path -> [K, R]`` kernel of every encoder projection."""
    flat = traverse_util.flatten_dict(params)
    return {"/".join(p[:-1]): np.asarray(v) for p, v in flat.items()
            if p[-1] == "kernel" and p[0].startswith("encoder_layer_")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patterns", default="64:2:8", help="comma-separated; 128:2:16 runs but its search took over 8 min")
    parser.add_argument("--iters", type=int, default=30, help="swap rounds per permutation (search_permutations)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/cpu/permute_energy.json")
    args = parser.parse_args()
    cfg, params = bert.load_minilm()
    before = kernels(params)
    rows, summary, search_seconds = [], {}, {}
    for pattern in args.patterns.split(","):
        spec = F.VNM.parse(pattern)
        t0 = time.time()
        perms = permute.search_permutations(params, spec, num_heads=cfg.num_attention_heads, iters=args.iters,
                                            seed=args.seed)
        search_seconds[pattern] = time.time() - t0
        after = kernels(permute.apply_permutations(params, perms, num_heads=cfg.num_attention_heads))
        for name, w in before.items():
            wp = after[name]
            assert np.isclose((w**2).sum(), (wp**2).sum(), rtol=1e-6)  # a permutation keeps every weight
            masks = [np.asarray(F.select_mask(x, spec)) for x in (w, wp)]
            assert all(F.check_mask(mk, spec) for mk in masks)
            rows.append(dict(weights=name, shape=list(w.shape), pattern=pattern, density=spec.density,
                             kept=kept_energy(w, masks[0]), kept_permuted=kept_energy(wp, masks[1]),
                             plain_n_m=kept_energy(w, plain_nm(w, spec.n, spec.m))))
        sel = [r for r in rows if r["pattern"] == pattern]
        summary[pattern] = {k: float(np.mean([r[k] for r in sel])) for k in ("kept", "kept_permuted", "plain_n_m")}
        summary[pattern]["kept_min"] = min(r["kept"] for r in sel)
        summary[pattern]["kept_permuted_min"] = min(r["kept_permuted"] for r in sel)
        by_module = {}
        for r in sel:
            module = r["weights"].split("/", 1)[1]
            by_module.setdefault(module, []).append(r)
        summary[pattern]["by_module"] = {
            m: {k: float(np.mean([r[k] for r in rs])) for k in ("kept", "kept_permuted", "plain_n_m")}
            for m, rs in by_module.items()}
        s = summary[pattern]
        print(f"{pattern}: kept {s['kept']:.4f} (min {s['kept_min']:.4f}) -> permuted {s['kept_permuted']:.4f} "
              f"(min {s['kept_permuted_min']:.4f}); plain {spec.n}:{spec.m} {s['plain_n_m']:.4f}; "
              f"search {search_seconds[pattern]:.0f} s", flush=True)
        for m, v in s["by_module"].items():
            print(f"    {m:<22} {v['kept']:.4f} -> {v['kept_permuted']:.4f}  (plain {v['plain_n_m']:.4f})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(jax=jax.__version__, python=platform.python_version(), model="all-MiniLM-L6-v2",
                                   iters=args.iters, seed=args.seed, search_seconds=search_seconds,
                                   matrices=len(before), rows=rows, summary=summary), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
