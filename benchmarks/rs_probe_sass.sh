#!/usr/bin/env bash
# Counts the sparse wgmma instructions (HGMMA.SP) in the SASS of every kernel of benchmarks/rs_probe.cu, so that a
# variant whose products ptxas dropped (accumulators never read) shows up: all endings of one StrippedKernel variant
# must hold the same count (docs/kernel-notes.md, session 16).  Needs nvcc and cuobjdump; no GPU.
#   bash benchmarks/rs_probe_sass.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/probe_build.sh"
work=$(mktemp -d)
probe_build "$here/rs_probe.cu" "$work/rs_probe" 2> "$work/build.log" || { tail -20 "$work/build.log"; exit 1; }
cuobjdump=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
"$cuobjdump" -sass "$work/rs_probe" > "$work/rs_probe.sass"
awk '/Function : /{name = $3; seen[name] = 1} /HGMMA/{count[name]++} END{for (n in seen) printf "%5d %s\n", count[n], n}' \
  "$work/rs_probe.sass" | sed 's/_ZN9jaxsparse[0-9]*_GLOBAL__N__[0-9a-f_]*rs_probe_cu_[0-9a-f]*//' | sort -k2
