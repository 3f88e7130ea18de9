"""What column-exclusive V:N:M masks would cost: a CPU proxy for a faster input gradient (docs/kernel-notes.md,
session 24).

At high M the input gradient ``dx = dy W^T`` is the largest sparse product of the step, and its transposed route does
half the dense work at every M. If, in every group, each input column were kept by at most ``c = ceil(4 (R/V) / M)``
of the ``R/V`` V blocks (``c = 1`` at BERT-large's 1024-wide outputs at M = 32: the blocks partition every group's
columns), each output column of dx would take at most ``c`` blocks' products over their kept columns: ``4/M`` of the
dense work on dense-rate MMAs, with a fixed permutation (``c = 1``) or a ``c``-way sum in place of the condensed
kernel's scatter product (``16/V`` of the dense work) and of the transposed route's half. A kernel worth building
only if the masks keep nearly what the plain masks keep.

For the pretrained MiniLM encoder kernels (and one Gaussian matrix), per pattern: the fraction of ``sum w^2`` kept by
``jaxsparse.format.select_mask`` (plain), by a column-norm greedy choice without the constraint, and by the same greedy
choice with each column's use capped at ``c`` blocks per group (then the top 2 of each row's 4 kept columns, as
always). The two greedy rows isolate the constraint's cost from the heuristic's. Magnitude is a proxy, not accuracy;
``--oneshot`` adds ``benchmarks/oneshot_proxy.py``'s functional proxy for the same masks (every encoder kernel pruned
once, token states and sentence embeddings on held-out Rotten Tomatoes sentences against the dense model).
Writes ``benchmarks/results/cpu/exclusive_columns.json``.

    python benchmarks/exclusive_columns.py [--layers 0,5] [--patterns 128:2:16,128:2:32] [--oneshot]
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
from mask_energy import kept_energy  # noqa: E402

PATTERNS = ["64:2:8", "128:2:8", "64:2:16", "128:2:16", "128:2:32"]


def greedy_mask(w: np.ndarray, spec: F.VNM, cap: int | None) -> np.ndarray:
    """Per group, the 4 columns of each V block by descending block-column energy, each column given to at most
    ``cap`` blocks (None: no cap); then the top 2 of each row among its block's 4."""
    k, r = w.shape
    m, v = spec.m, spec.v
    g, blocks = k // m, r // v
    e = (w.astype(np.float64) ** 2).reshape(g, m, blocks, v)  # [group, column, block, row]
    score = e.sum(axis=3)  # [g, m, b]
    chosen = np.zeros((g, m, blocks), bool)
    for gi in range(g):
        order = np.argsort(-score[gi], axis=None, kind="stable")
        need = np.full(blocks, 4)
        left = np.full(m, cap if cap is not None else blocks)
        for flat in order:
            col, blk = divmod(int(flat), blocks)
            if need[blk] and left[col]:
                chosen[gi, col, blk] = True
                need[blk] -= 1
                left[col] -= 1
        for blk in np.flatnonzero(need):  # the greedy pass can strand a block whose free columns it already holds
            while need[blk]:
                free = [c for c in range(m) if left[c] and not chosen[gi, c, blk]]
                if free:
                    col = max(free, key=lambda c: score[gi, c, blk])
                    chosen[gi, col, blk], need[blk], left[col] = True, need[blk] - 1, left[col] - 1
                    continue
                # swap: a block b2 hands over a column x this block lacks and takes a free column f instead
                f = next(c for c in range(m) if left[c])
                b2, x = next((b2, x) for b2 in range(blocks) for x in range(m)
                             if chosen[gi, x, b2] and not chosen[gi, x, blk] and not chosen[gi, f, b2])
                chosen[gi, x, b2], chosen[gi, f, b2], left[f] = False, True, left[f] - 1
                chosen[gi, x, blk], need[blk] = True, need[blk] - 1
    # top 2 of each row among its block's 4 columns
    mag = np.where(chosen[..., None], e, -1.0)  # [g, m, b, v]
    top2 = np.argsort(-mag, axis=1, kind="stable")[:, :2]  # [g, 2, b, v]
    mask = np.zeros_like(e, bool)
    np.put_along_axis(mask, top2, True, axis=1)
    return mask.reshape(k, r)


def oneshot_rows(patterns: list[str], sentences: int = 256, max_len: int = 64) -> list[dict]:
    """``oneshot_proxy.compare`` for every encoder kernel of MiniLM pruned once by the greedy choice, with and without
    the cap, and by ``select_mask``."""
    import jax.numpy as jnp

    from jaxsparse import pruning, train
    from jaxsparse.models import bert
    from oneshot_proxy import compare

    cfg, params = bert.load_minilm()
    data = train.load_data("rt", 2 * sentences, 16, max_len).train
    evalb = tuple(jnp.asarray(a[sentences:]) for a in (data.input_ids, data.token_type_ids, data.attention_mask))
    model = bert.BertModel(cfg, add_pooler=False)
    dense_h, _ = jax.jit(lambda p: model.apply({"params": p}, *evalb))(params)
    rows = []
    for pattern in patterns:
        spec = F.VNM.parse(pattern)
        plain = pruning.oneshot_masks(params, spec)
        for variant in ("plain", "greedy", "capped"):
            def pick(mask, w):
                if mask is None or variant == "plain":
                    return mask
                w = np.asarray(w)
                return jnp.asarray(greedy_mask(w, spec, F.column_cap(w.shape[1], spec) if variant == "capped" else None))
            masks = jax.tree_util.tree_map(pick, plain, params, is_leaf=lambda x: x is None)
            rows.append(dict(pattern=pattern, masks=variant, **compare(model, params, masks, evalb, dense_h)))
            r = rows[-1]
            print(f"{pattern:>9} {variant:>7}: token-state rel. error {r['token_state_rel_error']:.4f}, embedding cosine "
                  f"{r['embedding_cosine_mean']:.4f} (min {r['embedding_cosine_min']:.4f})", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="0,1,2,3,4,5")
    parser.add_argument("--patterns", default=",".join(PATTERNS))
    parser.add_argument("--oneshot", action="store_true", help="also the one-shot functional proxy (oneshot_proxy.py)")
    parser.add_argument("--out", default="benchmarks/results/cpu/exclusive_columns.json")
    args = parser.parse_args()
    patterns = args.patterns.split(",")
    weights = {"gaussian_4096x1024": np.asarray(jax.random.normal(jax.random.PRNGKey(0), (4096, 1024)))}
    weights.update(minilm_kernels([int(i) for i in args.layers.split(",")]))
    rows = []
    for name, w in weights.items():
        for pattern in patterns:
            spec = F.VNM.parse(pattern)
            k, r = w.shape
            if k % spec.m or r % spec.v:
                continue
            cap = F.column_cap(r, spec)
            plain = np.asarray(F.select_mask(w, spec))
            free, capped = greedy_mask(w, spec, None), greedy_mask(w, spec, cap)
            for mask in (plain, free, capped):
                assert F.check_mask(mask, spec)
            use = capped.reshape(k // spec.m, spec.m, r // spec.v, spec.v).any(axis=3).sum(axis=2)  # blocks a column
            assert use.max() <= cap
            rows.append(dict(weights=name, shape=[k, r], pattern=pattern, cap=cap, blocks=r // spec.v,
                             plain=kept_energy(w, plain), greedy=kept_energy(w, free), exclusive=kept_energy(w, capped)))
    summary = {}
    print(f"{'pattern':>9} {'matrices':>8} {'plain':>7} {'greedy':>7} {'capped':>7} {'capped/greedy (min)':>20}  caps")
    for pattern in patterns:
        sel = [x for x in rows if x["pattern"] == pattern and not x["weights"].startswith("gaussian")]
        if not sel:
            continue
        ratio = [x["exclusive"] / x["greedy"] for x in sel]
        summary[pattern] = dict(plain=float(np.mean([x["plain"] for x in sel])),
                                greedy=float(np.mean([x["greedy"] for x in sel])),
                                exclusive=float(np.mean([x["exclusive"] for x in sel])),
                                exclusive_over_greedy=float(np.mean(ratio)), exclusive_over_greedy_min=float(min(ratio)),
                                caps=sorted({x["cap"] for x in sel}))
        s = summary[pattern]
        print(f"{pattern:>9} {len(sel):8d} {s['plain']:7.3f} {s['greedy']:7.3f} {s['exclusive']:7.3f} "
              f"{s['exclusive_over_greedy']:12.3f} ({s['exclusive_over_greedy_min']:.3f})  {s['caps']}")
    for x in rows:
        if x["weights"].startswith("gaussian"):
            print(f"{x['weights']} {x['pattern']}: plain {x['plain']:.3f} greedy {x['greedy']:.3f} capped "
                  f"{x['exclusive']:.3f} (cap {x['cap']} of {x['blocks']} blocks)")
    oneshot = oneshot_rows(patterns) if args.oneshot else None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(jax=jax.__version__, python=platform.python_version(), rows=rows, summary=summary,
                                   oneshot=oneshot), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
