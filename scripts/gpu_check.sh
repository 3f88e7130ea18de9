#!/usr/bin/env bash
# On the GPU machine: build the extension, run every GPU test, then any extra commands given.
#   bash scripts/gpu_check.sh                       # build + pytest -m gpu
#   bash scripts/gpu_check.sh "python3 benchmarks/spmm.py --quick"
#   GPU_PROCS=15 bash scripts/gpu_check.sh          # the GPU tests in 15 processes at once (pytest-xdist where it is
#                                                   # installed or carried in .whl/, JAXSPARSE_TEST_SHARD otherwise)
#   GPU_TESTS="tests/test_ffi_gpu.py" bash scripts/gpu_check.sh   # only these test files (or node ids)
#   GPU_PROCS=15 GPU_SPLIT=1 bash scripts/gpu_check.sh  # two or more GPUs: tests/test_backward_gpu.py (half the suite's
#                                                   # time) on the last GPU beside the other files (session 39: 1192
#                                                   # tests in 203 s on two H200s against 420 s on one)
# Writes logs under $OUT when that is set. Only sm_90a is built here unless JAXSPARSE_CUDA_GENCODE says
# otherwise (the full sm_80 + sm_90a build is what `pip install .` does).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
repo=$(pwd)
t0=$(date +%s)
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
OUT=$OUT bash scripts/gpu_install.sh || exit 1  # the prebuilt extension when it matches the sources, else a build
echo "build: $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
(cd /tmp && python3 -c "import jax, jaxsparse.ffi as f; print('jax', jax.__version__, jax.devices(), 'targets', f.target_names())")
procs=${GPU_PROCS:-1}
# GPU_TESTS="tests/test_ffi_gpu.py ..." selects test files; relative paths are the checkout's (pytest runs from /tmp)
tests=()
for t in ${GPU_TESTS:-tests}; do case $t in /*) tests+=("$t") ;; *) tests+=("$repo/$t") ;; esac; done
if [ "$procs" -gt 1 ] && (cd /tmp && python3 -c "import xdist" 2>/dev/null); then
  # pytest-xdist: n workers share the GPU and take tests as they free up (tests/conftest.py turns preallocation off).
  xdist() { local log=$1; shift; (cd /tmp && pytest -q -rfE -m gpu -p no:cacheprovider -n "$procs" --dist worksteal "$@" > "$log" 2>&1); }
  report() { grep -h "^FAILED\|^ERROR" "$1" | head -40; echo "$2$(tail -1 "$1")"; }
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
  split_pid=
  if [ "${GPU_SPLIT:-0}" = 1 ] && [ "$ngpu" -gt 1 ] && [ -z "${GPU_TESTS:-}" ]; then
    # The backward file on the last GPU alone, its own n workers; the other files on every GPU (the two-GPU tests).
    tests=()
    for f in "$repo"/tests/test_*.py; do [ "$(basename "$f")" = test_backward_gpu.py ] || tests+=("$f"); done
    CUDA_VISIBLE_DEVICES=$((ngpu - 1)) xdist "$OUT/gpu_tests_backward.log" "$repo/tests/test_backward_gpu.py" &
    split_pid=$!
  fi
  xdist "$OUT/gpu_tests.log" "${tests[@]}"
  status=$?
  report "$OUT/gpu_tests.log" ""
  if [ -n "$split_pid" ]; then
    wait "$split_pid" || status=1
    report "$OUT/gpu_tests_backward.log" "tests/test_backward_gpu.py on GPU $((ngpu - 1)): "
  fi
elif [ "$procs" -gt 1 ]; then
  # n pytest processes share the GPU (JAXSPARSE_TEST_SHARD=i/n; the host's cores compile in parallel, and the
  # processes allocate GPU memory as they go instead of each taking most of it up front).
  for i in $(seq 0 $((procs - 1))); do
    (cd /tmp && JAXSPARSE_TEST_SHARD=$i/$procs XLA_PYTHON_CLIENT_PREALLOCATE=false \
       pytest -q -rfE -m gpu -p no:cacheprovider "${tests[@]}" > "$OUT/gpu_tests.shard$i.log" 2>&1) &
  done
  status=0
  for job in $(jobs -p); do wait "$job"; rc=$?; [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || status=1; done  # 5: a shard with no test
  for i in $(seq 0 $((procs - 1))); do
    echo "shard $i/$procs: $(tail -1 "$OUT/gpu_tests.shard$i.log")"
  done
  grep -h "^FAILED\|^ERROR" "$OUT"/gpu_tests.shard*.log | head -40
else
  cd /tmp && pytest -q -m gpu -p no:cacheprovider "${tests[@]}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
  status=${PIPESTATUS[0]}
fi
cd "$repo"
for cmd in "$@"; do echo "== $cmd"; bash -c "$cmd" || status=1; done
exit $status
