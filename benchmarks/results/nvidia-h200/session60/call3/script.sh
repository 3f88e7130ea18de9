# Session 60 call 3 (one H200): issue 6's other shapes on the current code, dense,64:2:8,128:2:16 (session 50's command:
# large seq 128, then base seq 512 and 128; --concurrent within an invocation).
t0=$(date +%s)
bash scripts/gpu_install.sh > $OUT/install.log 2>&1 || { tail -20 $OUT/install.log; exit 1; }
SP=${SP:-dense,64:2:8,128:2:16}
for shape in "large 128" "base 512,128"; do
  set -- $shape
  name=train_step_$1_$(echo $2 | tr , _)
  timeout 270 python3 benchmarks/train_step.py --models $1 --seqs $2 --steps 20 --warmup 3 --attention fused \
    --transposable --diagonal-ffn-out on --concurrent --sparsities $SP --out $OUT/$name.json \
    --plot $OUT/$name.png > $OUT/$name.log 2>&1
  echo "$name rc $? at $(( $(date +%s) - t0 )) s"
done
python3 - $OUT <<'PY'
import json, glob, sys, os
for f in sorted(glob.glob(os.path.join(sys.argv[1], "train_step_*.json")) + glob.glob(os.path.join(sys.argv[1], "*.partial"))):
    d = json.load(open(f))
    for r in d["rows"]:
        print(os.path.basename(f), r.get("model"), r.get("seq_len"), r.get("batch_size"), r["sparsity"], round(r.get("step_ms_pipelined") or 0, 2),
              r.get("speedup_vs_dense_pipelined"), r.get("memory_vs_dense"))
PY
cd $OUT && tar czf logs.tgz *.log && rm -f *.log *.png
