#!/usr/bin/env bash
# Builds benchmarks/rs_probe.cu (nvcc, sm_90a) and runs it on the GPU: the row kernel's main loop stripped down (A
# from shared memory or registers, 128x256 or 256x128 tiles, stage-ordered metadata, ping-pong), each SS variant
# checked byte for byte against the extension's kernel.  Writes benchmarks/results/<gpu>/rs_probe.json (or $1) and
# prints the table.
#   bash benchmarks/rs_probe.sh [out.json]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/probe_build.sh"
work=$(mktemp -d)
probe_build "$here/rs_probe.cu" "$work/rs_probe"
"$work/rs_probe" > "$work/probe.json"
python3 - "$here" "$work/probe.json" "${1:-}" <<'PY'
import sys
here, raw, out = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, here)
import common
doc = common.probe_document(raw)
common.write_json(common.results_path("rs_probe.json", out or None), doc)
print(f"{'K':>5} {'N':>5} {'tile':>22} {'stages':>6} {'full ms':>8} {'no epi':>8} {'L2 sink':>8} {'held':>8} "
      f"{'dry':>8} {'differ':>7}")
for r in doc["results"]:
    ne = "-" if r["no_epilogue_ms"] is None else f"{r['no_epilogue_ms']:8.4f}"
    sk = "-" if r.get("l2_sink_ms") is None else f"{r['l2_sink_ms']:8.4f}"
    hd = "-" if r.get("held_ms") is None or r["held_ms"] < 0 else f"{r['held_ms']:8.4f}"
    dr = "-" if r.get("dry_ms") is None else f"{r['dry_ms']:8.4f}"
    print(f"{r['K']:>5} {r['N']:>5} {r['tile']:>22} {r['stages']:>6} {r['full_ms']:8.4f} {ne:>8} {sk:>8} {hd:>8} "
          f"{dr:>8} {r['mismatches_vs_extension']:>7}")
PY
