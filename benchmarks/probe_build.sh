# Sourced by the CUDA probe scripts (ws_probe.sh, sddmm_gather_probe.sh, smem_probe.sh): the one nvcc line they
# build with.  probe_build SRC OUT [nvcc arguments...] compiles SRC for sm_90a with the installed jax's XLA FFI
# headers and cuda/ on the include path.
probe_build() {
  local src=$1 out=$2
  shift 2
  nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -diag-suppress 940,2473,39,128 \
    -I"$(python3 -c "import jax.ffi; print(jax.ffi.include_dir())")" -I"$(dirname "${BASH_SOURCE[0]}")/../cuda" \
    "$@" -o "$out" "$src"
}
