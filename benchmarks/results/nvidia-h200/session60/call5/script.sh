# Session 60 call 5 (one H200): the breakdowns for issue 6's closing: dense and 128:2:16 profiles on the current code
# (64:2:8's is call 1's planes profile).
source runs/common.sh
t0=$(date +%s)
bash scripts/gpu_install.sh > $OUT/install.log 2>&1 || { tail -20 $OUT/install.log; exit 1; }
(cd /tmp && timeout 300 python3 -m jaxsparse.profile --model large --seq-len 512 --batch-size 32 --attention fused \
   --steps 5 --warmup 2 --sparsity dense --top 40 --json "$OUT/p_dense.json" > "$OUT/p_dense.log" 2>&1; echo "p_dense rc $?")
prof p_128_2_16 new 128:2:16
echo "profiles $(( $(date +%s) - t0 )) s"
table
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
