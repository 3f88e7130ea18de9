#!/usr/bin/env bash
# Builds benchmarks/smem_probe.cu (nvcc, sm_90a) and runs it on the GPU: dense and sparse wgmma rates per SM from
# two consumer warpgroups or from one, alone and with warps streaming shared-memory loads beside them.  Writes
# benchmarks/results/<gpu>/smem_probe.json (or $1) and prints the table.
#   bash benchmarks/smem_probe.sh [out.json]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/probe_build.sh"
work=$(mktemp -d)
probe_build "$here/smem_probe.cu" "$work/smem_probe"
"$work/smem_probe" > "$work/probe.json"
python3 - "$here" "$work/probe.json" "${1:-}" <<'PY'
import sys
here, raw, out = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, here)
import common
doc = common.probe_document(raw)
common.write_json(common.results_path("smem_probe.json", out or None), doc)
print(f"{'mode':>28} {'ms':>8} {'GHz':>6} {'MAC/clk/SM':>10} {'operand B/clk':>13} {'noise B/clk':>11}")
for r in doc["results"]:
    print(f"{r['mode']:>28} {r['ms']:8.4f} {r['clock_GHz']:6.3f} {r['mac_per_clk_per_sm']:10.1f} "
          f"{r['operand_bytes_per_clk_per_sm']:13.1f} {r['noise_bytes_per_clk_per_sm']:11.1f}")
PY
