#!/usr/bin/env bash
# Issue 5: the learning-rate sweep of session 16 (docs/results.md, "Session 16's plan"), run on the GPU machine:
#   SPARSE="trec:2e-4:0 trec:4e-4:0" DENSE="trec:2e-4:0,1,2" OUT=/tmp/out bash benchmarks/accuracy_lr_sweep.sh
# copies each process's accuracy.json and log to $OUT and prints dev and test accuracy per run.
# Every run takes accuracy.py's default dropout, the hash since session 43: add --dropout-impl=rng to a spec's options
# to repeat a run committed before then (flax's dropout).
# SPARSE="task:lr:seed[:options] ..."  64:2:8 runs of session 14's recipe with --student-lr lr (teacher at --lr 1e-4);
#   options, comma-separated, are added to the run (session 18: learned masks, e.g.
#   "trec:4e-4:0:--regrow-every=20,--regrow-until=0.5,--regrow-decay=2e-3")
# DENSE="task:lr:seeds[:options] ..."   dense runs at --lr lr, seeds comma-separated, one process each; options as
#   SPARSE's (e.g. "trec:1e-4:0,1,2:--dropout-impl=rng")
# SPARSITY=128:2:16             the sparse runs' pattern (default 64:2:8); a seed may be a comma-free list "0+1"
#   (one process trains those seeds one after the other, sharing its compilations) or a range "0-11" (one process
#   per seed: "trec:4e-4:0-11:--transposable-masks" is twelve runs)
# GPUS=3                        spread the processes round-robin over that many GPUs (CUDA_VISIBLE_DEVICES; default 1);
#   the processes of one GPU share one teacher (--teacher-dir /tmp/teachers/gpuN), as those of one call did before
# GPU0=3                        the first GPU to use (default 0): two sweeps side by side on disjoint GPUs (with their
#   own OUT and ACC folders)
# ACC=/tmp/acc                  where the processes write (default /tmp/acc), each invocation in a fresh subfolder: a
#   machine kept warm between calls keeps /tmp, and an earlier call's runs must not join this one's results
set -u
: "${OUT:?set OUT to the folder for the result files}"
# (the processes run without OUT: accuracy.py would copy its result to $OUT/accuracy.json, each over the last)
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 JAXSPARSE_DATA_DIR=$PWD/.devdata PYTHONPATH=$PWD JAXSPARSE_COMMIT=${COMMIT:-unknown}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
t0=$(date +%s); el() { echo "$(( $(date +%s) - t0 ))s"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
ACC=${ACC:-/tmp/acc}/run-$(date +%Y%m%d-%H%M%S)-$$
mkdir -p /tmp/teachers $ACC "$OUT"
pids=()
n=0  # processes started (the next one's GPU is n % GPUS)
specs=()  # a seed range "A-B" becomes one spec per seed
for spec in ${SPARSE:-}; do
  IFS=: read task lr seed opts <<< "$spec"
  if [[ $seed =~ ^([0-9]+)-([0-9]+)$ ]]; then
    for s in $(seq "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}"); do specs+=("$task:$lr:$s${opts:+:$opts}"); done
  else
    specs+=("$spec")
  fi
done
for spec in "${specs[@]}"; do
  IFS=: read task lr seed opts <<< "$spec"
  tag=$(echo "${opts:-}" | sed 's/--//g; s/,/_/g; s/=/-/g')
  sp=${SPARSITY:-64:2:8}
  d=$ACC/sparse_${task}_${sp//:/_}_lr${lr}${tag:+_$tag}_s${seed//+/-}; mkdir -p $d
  g=$(( ${GPU0:-0} + n % ${GPUS:-1} )); n=$(( n + 1 ))
  env -u OUT CUDA_VISIBLE_DEVICES=$g timeout ${LIMIT:-570} python3 benchmarks/accuracy.py --tasks $task --sparsities $sp --seed-list ${seed//+/,} --epochs 6 \
    --prune-end 0.33 --fade 0.15 --distill 0.9 --refit-batches 32 --temperature 2 --score activation \
    --init teacher --prune oneshot --refit --distill-hidden 5 --distill-attention 1 --distill-augment 0.3 \
    --augment-neighbors 8 --student-epochs 24 --student-lr $lr ${opts//,/ } --teacher-dir /tmp/teachers/gpu$g \
    --out-dir $d --no-progress > $d/log.txt 2>&1 &
  pids+=($!)
done
for spec in ${DENSE:-}; do
  IFS=: read task lr seeds opts <<< "$spec"
  tag=$(echo "${opts:-}" | sed 's/--//g; s/,/_/g; s/=/-/g')
  d=$ACC/dense_${task}_lr${lr}${tag:+_$tag}_s${seeds//,/}; mkdir -p $d
  g=$(( ${GPU0:-0} + n % ${GPUS:-1} )); n=$(( n + 1 ))
  env -u OUT CUDA_VISIBLE_DEVICES=$g timeout ${LIMIT:-570} python3 benchmarks/accuracy.py --tasks $task --sparsities dense --seed-list $seeds --epochs 6 \
    --lr $lr ${opts//,/ } --out-dir $d --no-progress > $d/log.txt 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait $p; st=$?; echo "pid $p rc $st at $(el)"; done
for d in $ACC/*; do
  n=$(basename $d); echo "== $n"; tail -2 $d/log.txt
  [ -f $d/accuracy.json ] && cp $d/accuracy.json $OUT/$n.json
  cp $d/log.txt $OUT/$n.log
done
tar czf $OUT/accuracy_lr_sweep.tgz -C $OUT $(cd $OUT && ls *.json *.log)  # one file: the device returns few
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*.json")):
    d = json.load(open(f)); hp = d["hyperparameters"]
    for r in d["runs"]:
        lr = hp.get("student_lr") if r["sparsity"] != "dense" and hp.get("student_lr") else hp["lr"]
        regrow = f"  regrow {hp['regrow_every']}/{hp['regrow_decay']:g} changed {r['regrow_mask_change']:.3f}" \
            if r["sparsity"] != "dense" and hp.get("regrow_every") else ""
        last = f"  (last step: test {100*r['last_test_accuracy']:.2f})" if "last_test_accuracy" in r else ""
        print(f"{r['task']:5s} {r['sparsity']:7s} lr {lr:g} seed {r['seed']}  "
              f"dev {100*r['dev_accuracy']:.2f}  test {100*r['test_accuracy']:.2f}{last}  {r['seconds']:.0f} s{regrow}")
PY
