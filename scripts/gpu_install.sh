#!/usr/bin/env bash
# Install jaxsparse from this checkout on the GPU machine, with its CUDA extension:
#   bash scripts/gpu_install.sh            # the build log goes to $OUT/build.log (OUT defaults to /tmp/out)
# When .prebuilt/SOURCE_HASH matches the current sources (scripts/source_hash.sh), the pure-Python package is
# installed and the extension that scripts/prebuild_extension.sh built elsewhere is dropped into it (a few seconds,
# against 60-100 s of nvcc); otherwise the extension is built here, for sm_90a only unless JAXSPARSE_CUDA_GENCODE
# says otherwise. The prebuilt extension is kept xz-compressed (about 3 MiB against 11), so that it and the packed
# MiniLM data (.devdata, about 46 MiB) fit in one device call's 64 MiB carry.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export JAXSPARSE_CUDA_GENCODE=${JAXSPARSE_CUDA_GENCODE:-"-gencode=arch=compute_90a,code=sm_90a"}
prebuilt=$(ls .prebuilt/_jaxsparse_cuda*.so.xz .prebuilt/_jaxsparse_cuda*.so 2>/dev/null | head -1)
if [ -n "$prebuilt" ] && [ -f .prebuilt/SOURCE_HASH ] && [ "$(cat .prebuilt/SOURCE_HASH)" = "$(bash scripts/source_hash.sh)" ]; then
  JAXSPARSE_NO_CUDA=1 python3 -m pip install --no-build-isolation --no-deps -v . >"$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
  dest=$(cd /tmp && python3 -c "import jaxsparse.ffi, os; print(os.path.dirname(jaxsparse.ffi.__file__))") || exit 1
  name=$(basename "$prebuilt" .xz)
  python3 -c "import lzma, shutil, sys
src = lzma.open(sys.argv[1]) if sys.argv[1].endswith('.xz') else open(sys.argv[1], 'rb')
with src, open(sys.argv[2], 'wb') as dst: shutil.copyfileobj(src, dst)" "$prebuilt" "$dest/$name" || exit 1
  echo "prebuilt extension $(cat .prebuilt/SOURCE_HASH) -> $dest/$name"
else
  [ -n "$prebuilt" ] && echo "prebuilt extension is stale ($(cat .prebuilt/SOURCE_HASH 2>/dev/null) against $(bash scripts/source_hash.sh)): building"
  python3 -m pip install --no-build-isolation --no-deps -v . >"$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
fi
grep -E "warning|spill|error" "$OUT/build.log" | grep -v "xla/ffi" | head -20
exit 0
