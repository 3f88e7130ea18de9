#!/usr/bin/env bash
# Nsight Compute on benchmarks/rs_probe.cu's kernels (1024x4096, 16384 tokens, 2:4).  Needs ncu and a Hopper GPU;
# prints what ncu reports (its locked clocks make its durations longer than the probe's event timings).
#   bash benchmarks/rs_probe_ncu.sh           # counters: DRAM and L2 traffic, L2 hit rate, unit throughputs of
#                                             # the stripped main loops with and without their Y stores, and of
#                                             # the extension's row kernel (session 15: ncu_c11_rs_probe.txt)
#   bash benchmarks/rs_probe_ncu.sh stalls    # stall reasons (cycles per issued instruction, those above 0.05) of
#                                             # RS 256x128 without an epilogue, "dry" and in full
#                                             # (session 15: ncu_c19_stall_reasons.txt)
# (Files under benchmarks/results/nvidia-h100-80gb-hbm3/session15/.)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/probe_build.sh"
work=$(mktemp -d)
probe_build "$here/rs_probe.cu" "$work/rs_probe" 2>/dev/null
mode=${1:-counters}

# run TITLE VARIANT KERNEL SKIP: the first launch after SKIP launches of KERNEL, with only VARIANT's launches run
# (RS_PROBE_ONLY).  rs_probe launches each variant 60 times (10 warm-up, 50 timed) per ending, in the order full,
# no epilogue, L2 sink, held, dry; an SS variant once more first, for its byte check.  Before the variants it
# launches the extension's kernel twice for its reference outputs, then 60 times for its timing.
run() {
  echo "=== $1"
  RS_PROBE_ONLY="$2" ncu --metrics "$metrics" -k regex:"$3" --launch-skip "$4" --launch-count 1 "$work/rs_probe" 2>&1 |
    grep -E "$keep" | awk -v stalls="$stalls" '!stalls || $NF + 0 > 0.05' | head -16
}

case $mode in
  counters)
    metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct
    metrics+=,lts__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed
    metrics+=,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed
    metrics+=,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum
    metrics+=,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_write.sum
    keep="^\s+(gpu__|dram__|lts__|l1tex__|sm__)|Kernel<" stalls=""
    run "rs256x128 s8 full" rs256x128 StrippedKernel 0
    run "rs256x128 s8 no epilogue" rs256x128 StrippedKernel 60
    run "ss128x256 s4 full" ss128x256 StrippedKernel 1
    run "ss128x256 s4 no epilogue" ss128x256 StrippedKernel 61
    run "extension ws128x256 full" nothing SpmmWgmmaXtWsKernel 2
    ;;
  stalls)
    metrics="regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
    keep="stalled" stalls=1
    run "rs256x128 s8 no-epilogue" rs256x128 StrippedKernel 60
    run "rs256x128 s8 dry" rs256x128 StrippedKernel 240
    run "rs256x128 s8 full" rs256x128 StrippedKernel 0
    ;;
  *)
    echo "usage: bash benchmarks/rs_probe_ncu.sh [counters|stalls]" >&2
    exit 2
    ;;
esac
