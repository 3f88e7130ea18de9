#!/usr/bin/env bash
# Build the CUDA extension here (sm_90a only) for the GPU machine's Python 3.12, so a device call can skip
# its build: scripts/gpu_install.sh (which scripts/gpu_check.sh runs) installs the pure-Python package there and
# drops this extension into it when .prebuilt/SOURCE_HASH matches the current cuda/ + CMakeLists.txt (otherwise it
# builds as usual). The .so is stored xz-compressed (.so.xz, about 3 MiB), to fit a call's carry beside .devdata.
#   PY312=/tmp/py312/bin/python bash scripts/prebuild_extension.sh   # a venv with jaxlib 0.11, nanobind, scikit-build-core
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PY312:-/tmp/py312/bin/python}
work=$(mktemp -d)
git -C "$repo" ls-files -co --exclude-standard | tar -C "$repo" -cf - -T - | tar -C "$work" -xf -
(cd "$work" && JAXSPARSE_CUDA_GENCODE="-gencode=arch=compute_90a,code=sm_90a" \
   "$py" -m pip wheel . --no-build-isolation --no-deps -q -w "$work/dist")
rm -rf "$repo/.prebuilt" && mkdir -p "$repo/.prebuilt"
(cd "$work" && python3 -m zipfile -e dist/*.whl unpacked)
so=$(ls "$work"/unpacked/jaxsparse/ffi/_jaxsparse_cuda*.so)
python3 -c "import lzma, shutil, sys
with open(sys.argv[1], 'rb') as src, lzma.open(sys.argv[2], 'wb', preset=9) as dst: shutil.copyfileobj(src, dst)" \
  "$so" "$repo/.prebuilt/$(basename "$so").xz"
bash "$repo/scripts/source_hash.sh" > "$repo/.prebuilt/SOURCE_HASH"
ls -l "$repo/.prebuilt"
rm -rf "$work"
