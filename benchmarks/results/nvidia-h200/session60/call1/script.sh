# Session 60 call 1 (one H200): the cluster-summed SDDMM split: its GPU tests and the SDDMM tests around it; the split
# benchmark; the 64:2:8 profile with planes and with the cluster (one build, env switch).
source runs/common.sh
t0=$(date +%s)
repo=$(pwd)
bash scripts/gpu_install.sh > $OUT/install.log 2>&1 || { tail -20 $OUT/install.log; exit 1; }
echo "install $(( $(date +%s) - t0 )) s"
(cd /tmp && timeout 150 pytest -q -rfE -m gpu -p no:cacheprovider -n 14 --dist worksteal -x \
   $repo/tests/test_backward_gpu.py -k "cluster" > $OUT/t_cluster.log 2>&1)
grep -h "^FAILED\|^ERROR" $OUT/t_cluster.log | head -20; echo "cluster tests: $(tail -1 $OUT/t_cluster.log) at $(( $(date +%s) - t0 )) s"
(cd /tmp && timeout 60 python3 $repo/benchmarks/sddmm_split_reduce.py --out $OUT/sddmm_split_reduce.json > $OUT/bench.log 2>&1)
tail -8 $OUT/bench.log
(export JAXSPARSE_SDDMM_SPLIT_REDUCE=planes; prof p_64_2_8_planes new 64:2:8)
prof p_64_2_8_cluster new 64:2:8
echo "profiles $(( $(date +%s) - t0 )) s"
(cd /tmp && timeout 140 pytest -q -rfE -m gpu -p no:cacheprovider -n 14 --dist worksteal \
   $repo/tests/test_backward_gpu.py $repo/tests/test_ffi_gpu.py -k "sddmm and not cluster" > $OUT/t_sddmm.log 2>&1)
grep -h "^FAILED\|^ERROR" $OUT/t_sddmm.log | head -20; echo "sddmm tests: $(tail -1 $OUT/t_sddmm.log) at $(( $(date +%s) - t0 )) s"
table
python3 - $OUT <<'PY'
import json, sys, os
for f in ("p_64_2_8_planes", "p_64_2_8_cluster"):
    d = json.load(open(os.path.join(sys.argv[1], f + ".json")))
    for t in d["top_ops"]:
        if "Sddmm" in t["name"]:
            print(f"{f:20s} {t['ms']:7.3f} ms x{int(t['count'])} {t['name'][60:140]}")
PY
cd $OUT && tar czf logs.tgz *.log && rm -f *.log
