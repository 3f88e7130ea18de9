#!/usr/bin/env bash
# Build the CUDA extension here (sm_90a only) for the GPU machine's Python 3.12, so a device call can skip
# its build: scripts/gpu_check.sh installs the pure-Python package there and drops this .so into it when
# .prebuilt/SOURCE_HASH matches the current cuda/ + CMakeLists.txt (otherwise it builds as usual).
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
cp "$work"/unpacked/jaxsparse/ffi/_jaxsparse_cuda*.so "$repo/.prebuilt/"
bash "$repo/scripts/source_hash.sh" > "$repo/.prebuilt/SOURCE_HASH"
ls -l "$repo/.prebuilt"
rm -rf "$work"
