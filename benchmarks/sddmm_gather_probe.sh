#!/usr/bin/env bash
# Builds benchmarks/sddmm_gather_probe.cu (nvcc, sm_90a; with cuBLAS when its headers are found, for the dense dW
# in the same process) and runs it: the gathered-A SDDMM of docs/kernel-notes.md (session 11) at 64:2:8, checked
# against a float64 reference on sampled entries (outputs poisoned with NaN first) and timed against cuBLAS's
# dense dW.  Writes benchmarks/results/<gpu>/sddmm_gather_probe.json (or $1) and prints the table.  Exit status 1
# when a check fails.
#   bash benchmarks/sddmm_gather_probe.sh [out.json]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/probe_build.sh"
work=$(mktemp -d)
# cuBLAS: the toolkit's own when it has the library, else the nvidia-cublas wheel's; without either the dense dW
# is reported as null.
blas=(-DPROBE_NO_CUBLAS)
cuda_home=$(dirname "$(dirname "$(command -v nvcc)")")
cublas=$(python3 -c "import nvidia.cublas, os; print(list(nvidia.cublas.__path__)[0])" 2>/dev/null || true)
if [ -f "$cuda_home/include/cublas_v2.h" ] && ls "$cuda_home"/lib64/libcublas.so* > /dev/null 2>&1; then
  blas=(-L"$cuda_home/lib64" -lcublas)
elif [ -n "$cublas" ] && [ -f "$cublas/include/cublas_v2.h" ]; then
  lib=$(ls "$cublas"/lib/libcublas.so* 2>/dev/null | head -1)
  [ -n "$lib" ] && blas=(-I"$cublas/include" "$lib" -Xlinker -rpath -Xlinker "$cublas/lib")
fi
echo "cuBLAS: ${blas[*]}" >&2
probe_build "$here/sddmm_gather_probe.cu" "$work/probe" "${blas[@]}" || exit 2
"$work/probe" > "$work/probe.json"; st=$?
python3 - "$here" "$work/probe.json" "${1:-}" <<'PY' || cat "$work/probe.json"
import sys
here, raw, out = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, here)
import common
doc = common.probe_document(raw)
for r in doc["results"]:
    d = r.pop("dense_dw_cublas_ms")
    r["dense_dw_cublas_ms"] = d if d > 0 else None
    r["speedup_vs_cublas"] = d / r["ms"] if d > 0 else None
    r["of_floor"] = r["ms"] / r["floor_ms_at_3.35TBps"]
common.write_json(common.results_path("sddmm_gather_probe.json", out or None), doc)
print(f"{'T':>6} {'K':>5} {'R':>5} {'split':>5} {'ok':>5} {'rel err':>9} {'ms':>8} {'cuBLAS dW':>9} {'speedup':>7} {'of floor':>8}")
for r in doc["results"]:
    sp = f"{r['speedup_vs_cublas']:.2f}x" if r["speedup_vs_cublas"] else "n/a"
    dn = f"{r['dense_dw_cublas_ms']:.4f}" if r["dense_dw_cublas_ms"] else "n/a"
    print(f"{r['T']:>6} {r['K']:>5} {r['R']:>5} {r['splits']:>5} {str(r['ok']):>5} {r['rel_err']:9.2e} {r['ms']:8.4f} "
          f"{dn:>9} {sp:>7} {r['of_floor']:8.2f}")
PY
exit $st
