#!/usr/bin/env bash
# Session 31: the breakdown of the steps with diagonal FFN out blocks (kind nvidia-h100-x1).
set -uo pipefail
repo=$PWD; t0=$(date +%s)
el() { echo "t=$(( $(date +%s) - t0 ))"; }
OUT=/tmp/gc GPU_TESTS="$repo/tests/test_diagonal_gpu.py::test_blocks_reject" timeout 150 bash scripts/gpu_check.sh 2>&1 | tail -2
el
cd /tmp
for sp in 64:2:8 128:2:16; do
  timeout 170 jaxsparse-profile --model large --seq-len 512 --batch-size 32 --attention fused --sparsity $sp --compressed \
    --transposable-masks --diagonal-ffn-out --steps 5 --warmup 3 --top 0 --json $OUT/profile_large_${sp//:/_}_diagonal.json 2>&1 | tail -16
  el
done
