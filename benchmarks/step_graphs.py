"""One BERT training step under the trace: its time, device busy time and memsets, for command-buffer studies.

XLA records runs of fusions, cuBLAS and cuDNN calls into command buffers (CUDA graphs), and FFI handlers only
where they are marked command-buffer compatible (``JAXSPARSE_GRAPH_SAFE`` in cuda/common.cuh). This script
times one step configuration (median of 10 synced steps after 3 warm-up steps), traces 2 more, and sums the
device busy time and the memsets (count, ms, MiB, and the HLO op that issued them). Run it once per
configuration, with ``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` to switch XLA's command buffers off;
each run appends one JSON line to ``--out``. Session 19 (docs/kernel-notes.md) used its first version to show
that cuDNN's attention issues 32 MiB memsets outside command buffers, and what marking our handlers saved:

    python benchmarks/step_graphs.py --sparsity 2:4 --tag s24 --out step_graphs.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
import warnings

import jax
from jax.profiler import ProfileData

from jaxsparse import trainstep
from jaxsparse.profile import _DERIVED_LINES, latest_xplane  # _DERIVED_LINES: trace lines repeating the stream lines


def device_summary(xplane: str, steps: int) -> dict:
    """Busy time, event count and memsets per step of the GPU stream lines of ``xplane``."""
    busy_ms = memset_ms = 0.0
    events = memsets = memset_bytes = 0
    issuers: dict[str, int] = {}
    for plane in ProfileData.from_file(xplane).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if line.name.lower().startswith(_DERIVED_LINES):
                continue
            for ev in line.events:
                events += 1
                busy_ms += ev.duration_ns / 1e6
                if "memset" not in ev.name.lower():
                    continue
                stats = {k: v for k, v in ev.stats}
                size = re.search(r"num_bytes:(\d+)", str(stats.get("Memset_details", "")))
                nbytes = int(size.group(1)) if size else 0
                memsets += 1
                memset_ms += ev.duration_ns / 1e6
                memset_bytes += nbytes
                key = f"{nbytes} B by {str(stats.get('hlo_op', '?')).split('.')[0]}"
                issuers[key] = issuers.get(key, 0) + 1
    return {"busy_ms": round(busy_ms / steps, 2), "events": events / steps, "memsets": memsets / steps,
            "memset_ms": round(memset_ms / steps, 3), "memset_mib": round(memset_bytes / steps / 2**20, 1),
            "memset_issuers": {k: v / steps for k, v in sorted(issuers.items(), key=lambda kv: -kv[1])[:8]}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sparsity", default="2:4", help="'dense' or a V:N:M pattern")
    p.add_argument("--model", default="large")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--tag", default="", help="a name for this run in the output line")
    p.add_argument("--out", required=True, help="JSON lines file to append to")
    args = p.parse_args()

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*donated buffers.*")
        ts = trainstep.build_step(trainstep.StepConfig(model=args.model, sparsity=args.sparsity,
                                                       batch_size=args.batch_size, seq_len=args.seq_len,
                                                       attention="fused"))
        compiled = ts.fn.lower(*ts.args).compile()
    params, state, *rest = ts.args
    times, losses = [], []
    for _ in range(13):
        t0 = time.perf_counter()
        params, state, loss = compiled(params, state, *rest)
        jax.block_until_ready((params, state, loss))
        times.append(1e3 * (time.perf_counter() - t0))
        losses.append(float(loss))
    trace_dir = tempfile.mkdtemp(prefix="step-graphs-")
    with jax.profiler.trace(trace_dir):
        for _ in range(2):
            params, state, loss = compiled(params, state, *rest)
        jax.block_until_ready(loss)
    xplane = latest_xplane(trace_dir)
    res = {"tag": args.tag, "model": args.model, "sparsity": args.sparsity, "device": jax.devices()[0].device_kind,
           "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "step_ms": round(statistics.median(times[3:]), 2), **device_summary(xplane, 2),
           "first_losses": [round(x, 5) for x in losses[:4]]}
    print(json.dumps(res))
    with open(args.out, "a") as fh:
        fh.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
