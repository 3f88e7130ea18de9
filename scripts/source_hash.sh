#!/usr/bin/env bash
# One hash of everything the CUDA extension is built from (see scripts/prebuild_extension.sh).
cd "$(dirname "$0")/.." && cat CMakeLists.txt cuda/* | sha256sum | cut -c1-16
