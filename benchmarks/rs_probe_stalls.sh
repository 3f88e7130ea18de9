#!/usr/bin/env bash
# Nsight Compute's stall reasons (cycles per issued instruction, those above 0.05) of benchmarks/rs_probe.cu's RS
# 256x128 kernel at 1024x4096: without an epilogue, with its work but no stores ("dry"), and in full.  Needs ncu
# and a Hopper GPU.  Session 15: benchmarks/results/nvidia-h100-80gb-hbm3/session15/ncu_c19_stall_reasons.txt.
#   bash benchmarks/rs_probe_stalls.sh
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/probe_build.sh"
work=$(mktemp -d)
probe_build "$here/rs_probe.cu" "$work/rs_probe" 2>/dev/null
# The variant's launches: 60 full (10 warm-up, 50 timed), 60 without epilogue, 60 L2 sink, 60 held, 60 dry.
for v in "no-epilogue 60" "dry 240" "full 0"; do set -- $v; echo "=== rs256x128 s8 $1"
RS_PROBE_ONLY=rs256x128 timeout 150 ncu --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" -k regex:StrippedKernel --launch-skip $2 --launch-count 1 "$work/rs_probe" 2>&1 | grep -E "stalled" | awk '$NF+0 > 0.05' ; done
