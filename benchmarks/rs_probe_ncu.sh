#!/usr/bin/env bash
# Nsight Compute counters of benchmarks/rs_probe.cu's kernels (1024x4096, 16384 tokens, 2:4): DRAM and L2 traffic,
# L2 hit rate and unit throughputs of the stripped main loops with and without their Y stores, and of the
# extension's row kernel.  Needs ncu and a Hopper GPU; prints the counters (ncu's locked clocks make its durations
# longer than the probe's event timings).  Session 15: benchmarks/results/nvidia-h100-80gb-hbm3/session15/
# ncu_c11_rs_probe.txt.
#   bash benchmarks/rs_probe_ncu.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/probe_build.sh"
work=$(mktemp -d)
probe_build "$here/rs_probe.cu" "$work/rs_probe" 2>/dev/null
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct
metrics+=,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum
metrics+=,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_write.sum
# run TITLE VARIANT KERNEL SKIP: the first launch after SKIP launches of KERNEL, with only VARIANT's launches run
# (RS_PROBE_ONLY); each timed variant is launched 60 times (10 warm-up, 50 timed) with its Y stores, then 60
# without, and the SS tiles once more first for their byte check.
run() {
  echo "=== $1"
  RS_PROBE_ONLY="$2" ncu --metrics "$metrics" -k regex:"$3" --launch-skip "$4" --launch-count 1 "$work/rs_probe" 2>&1 |
    grep -E "^\s+(gpu__|dram__|lts__|l1tex__|sm__)|Kernel<" | head -16
}
run "rs256x128 s8 full" rs256x128 StrippedKernel 0
run "rs256x128 s8 no epilogue" rs256x128 StrippedKernel 60
run "ss128x256 s4 full" ss128x256 StrippedKernel 1
run "ss128x256 s4 no epilogue" ss128x256 StrippedKernel 61
run "extension ws128x256 full" nothing SpmmWgmmaXtWsKernel 2
