#!/usr/bin/env bash
# Builds benchmarks/ws_probe.cu (nvcc, sm_90a, the XLA FFI headers from the installed jax) and runs it on the
# GPU: the warp-specialized 2:4 row kernel timed alone in its probe modes (no products, no loads, no
# epilogue).  Writes benchmarks/results/<gpu>/ws_probe.json (or $1) and prints the table.
#   bash benchmarks/ws_probe.sh [out.json]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/probe_build.sh"
work=$(mktemp -d)
probe_build "$here/ws_probe.cu" "$work/ws_probe"
"$work/ws_probe" > "$work/probe.json"
python3 - "$here" "$work/probe.json" "${1:-}" <<'PY'
import sys
here, raw, out = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, here)
import common
doc = common.probe_document(raw)  # the probe names its GPU itself
common.write_json(common.results_path("ws_probe.json", out or None), doc)
print(f"{'K':>5} {'N':>5} {'tile':>20} {'mode':>14} {'ms':>8} {'of full':>8} {'TB/s in':>8} {'differ':>7} "
      f"{'poison':>7}")
full = {}
for r in doc["results"]:
    key = (r["K"], r["N"], r["tile"])
    full.setdefault(key, r["ms"])
    print(f"{r['K']:>5} {r['N']:>5} {r['tile']:>20} {r['mode']:>14} {r['ms']:8.4f} {r['ms'] / full[key]:8.2f} "
          f"{r['intake_TBps']:8.2f} {r['mismatches_vs_first']:>7} {r['bad_poison']:>7}")
PY
