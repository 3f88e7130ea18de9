"""The headline benchmark: a full BERT training step (forward, backward, AdamW), dense against sparse.

BERT-base and BERT-large with a 2-label classification head, sequences of 512 and 128 tokens, batches
from :data:`BATCH` (chosen for an 80 GB H100; with ``--attention fused`` BERT-large at sequence 512 fills one at
batch 96, not 32: docs/results.md, session 40; ``--batch-size`` overrides), bf16 compute with float32 master weights
and AdamW moments (:mod:`jaxsparse.trainstep`). Each sparsity runs in compressed mode (the compressed values are the
parameters; no dense weight, gradient or moment) where the format takes the layer shapes, masked-dense otherwise; the
output says which.

Each configuration runs in a fresh subprocess, so the device's ``peak_bytes_in_use`` is its own. The
step is timed one synced step at a time (``block_until_ready``) after the warm-up; the median is
reported with tokens/s, peak memory and the speedup and memory relative to dense. Then, as a training loop runs,
``--steps`` steps are dispatched back to back and synced once, three times: ``step_ms_pipelined`` is the median of the
three per-step averages (the host enqueues the next step while the GPU runs this one, so the per-step dispatch and
sync gaps that the synced time includes drop out), with its own speedup (``speedup_vs_dense_pipelined``).

With ``--devices 1,2`` each configuration also runs data parallel over 2 local devices at the same batch per
device (the global batch doubles); such a row's ``data_parallel_overhead_ms`` is its step time over the one-device
row's: the gradient all-reduce (dense kernels against compressed values) and what of it the step does not hide.

    python benchmarks/train_step.py                  # the full table (GPU); results/<gpu>/train_step.json
    python benchmarks/train_step.py --quick          # tiny BERT, few steps: a smoke test (CPU < 2 min)

Results go to ``benchmarks/results/<gpu-slug>/train_step.json`` (``train_step_quick.json`` with
``--quick``) and the plot to ``docs/train_step.png`` (skipped with a message without matplotlib, and
in ``--quick`` mode unless ``--plot`` is given). Configurations run one after another (without ``--concurrent``)
print each result as it comes and keep every row measured so far in ``<out>.partial`` (``"complete": false``), so a
run stopped by a time limit loses only the configuration it was in; the complete file replaces it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
_SOURCE_FALLBACK = common.import_jaxsparse_from_install_or_checkout()
from jaxsparse import format as fmt  # noqa: E402
from jaxsparse.models.bert import DROPOUT_IMPLS  # noqa: E402
from jaxsparse.trainstep import HEADLINE_BATCH as BATCH  # noqa: E402  (model, seq_len) -> batch size on an 80 GB H100

SPARSITIES = ("dense", "2:4", "64:2:8", "128:2:16", "128:2:32")
QUICK = {"models": ("tiny",), "seqs": (128,), "batch": 8, "steps": 6, "warmup": 2}


def _take_turn(turn: dict | None):
    """With ``--concurrent``: wait until every worker has compiled, then hold the timing lock.

    Compilation (CPU-bound, plus XLA's autotuning on the GPU) of all configurations overlaps; the timed
    steps run one configuration at a time, so no timing shares the GPU with anything else. Returns the
    open lock file (closing it releases the turn) or None without ``turn``.
    """
    if not turn:
        return None
    import fcntl

    ready = os.path.join(turn["dir"], f"ready-{turn['index']}")
    open(ready, "w").close()
    deadline = time.time() + turn["wait_s"]
    while time.time() < deadline:
        done = sum(any(os.path.exists(os.path.join(turn["dir"], f"{w}-{i}")) for w in ("ready", "exit"))
                   for i in range(turn["n"]))  # a worker counts once, compiled or gone
        if done >= turn["n"]:
            break
        time.sleep(0.5)
    lock = open(os.path.join(turn["dir"], "lock"), "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    return lock


def run_config(cfg: dict, turn: dict | None = None) -> dict:
    """Build, compile, warm up and time one configuration in this process; returns its result row."""
    from jaxsparse import ops
    from jaxsparse.trainstep import StepConfig

    sparse = cfg["sparsity"] != "dense"
    step_cfg = StepConfig(cfg["model"], cfg["sparsity"], cfg["batch_size"], cfg["seq_len"], cfg["dtype"],
                          attention=cfg.get("attention", "softmax"), transposable=bool(cfg.get("transposable")) and sparse,
                          fuse_feed_forward=cfg.get("fuse_feed_forward", True),
                          exclusive_columns=bool(cfg.get("exclusive_columns")) and sparse,
                          diagonal_ffn_out=bool(cfg.get("diagonal_ffn_out")) and sparse,
                          diagonal_all=bool(cfg.get("diagonal_all")) and sparse,
                          diagonal_ffn=bool(cfg.get("diagonal_ffn")) and sparse, dropout=cfg.get("dropout", "rng"),
                          devices=cfg.get("devices", 1))
    # An in-process run's other configurations keep their own dX route; a JAXSPARSE_DX set by the user wins.
    # How sparse_mlp hands h over (ops.mlp_hidden_layout); None: as the environment says.
    with ops.mlp_hidden_scope(cfg.get("mlp_hidden")), ops.dx_route_scope(step_cfg.dx_route(), keep_set=True):
        return _time_step(step_cfg, cfg, turn)


def _time_step(step_cfg, cfg: dict, turn: dict | None) -> dict:
    """Build, compile, warm up and time ``step_cfg`` (``cfg``'s row), taking the GPU in ``turn``."""
    import jax

    import jaxsparse
    from jaxsparse import ffi
    from jaxsparse.profile import gemm_configs
    from jaxsparse.trainstep import build_step

    row = dict(cfg)
    t0 = time.perf_counter()
    ts = build_step(step_cfg)
    row.update(mode=ts.mode, mode_reason=ts.reason, tokens=ts.tokens, build_s=time.perf_counter() - t0)
    t1 = time.perf_counter()
    ts.fn = ts.fn.lower(*ts.args).compile()  # ahead of time: no compilation inside the timed region
    row["compile_s"] = time.perf_counter() - t1
    # What XLA's autotuner picked for each dense GEMM: the dense step's time has differed between invocations of the
    # same code (docs/results.md, session 55); two rows whose picks differ explain such a difference.
    row["gemm_configs"] = gemm_configs(ts.fn.as_text())
    lock = _take_turn(turn)
    try:
        t2, window_start = time.perf_counter(), time.time()
        first = float(jax.block_until_ready(ts.run(1)))
        for _ in range(max(cfg["warmup"] - 1, 0)):
            jax.block_until_ready(ts.run(1))
        row["warmup_s"] = time.perf_counter() - t2
        times, loss = [], first
        for _ in range(cfg["steps"]):
            t = time.perf_counter()
            loss = ts.run(1)
            jax.block_until_ready((ts.args[0], ts.args[1], loss))
            times.append(1e3 * (time.perf_counter() - t))
        pipelined = []  # steps back to back, one sync: what a training loop sees
        for _ in range(3):
            t = time.perf_counter()
            loss = ts.run(cfg["steps"])
            jax.block_until_ready((ts.args[0], ts.args[1], loss))
            pipelined.append(1e3 * (time.perf_counter() - t) / cfg["steps"])
        row["gpu_window"] = [window_start, time.time()]  # wall clock of warm-up + timing (turns do not overlap)
    finally:
        if lock is not None:
            lock.close()
    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    med = statistics.median(times)
    row.update(
        step_ms=med,
        step_ms_pipelined=statistics.median(pipelined),
        step_ms_min=min(times),
        step_ms_p90=sorted(times)[int(0.9 * (len(times) - 1))],
        tokens_per_s=ts.tokens / (med / 1e3),
        peak_bytes=(stats or {}).get("peak_bytes_in_use"),
        loss_first=first,
        loss_last=float(loss),
        device_kind=dev.device_kind,
        platform=dev.platform,
        cuda_extension=ffi.available(),
        jaxsparse_path=os.path.dirname(jaxsparse.__file__),
        jaxsparse_backend=os.environ.get("JAXSPARSE_BACKEND", "auto"),
        routes=_routes(),
    )
    return row


def _routes() -> dict:
    """The product routes this process runs (the layer's x layout, dX route, SDDMM split, engine, x layout and
    bias gradient, the dz epilogue setting, ops sent to the reference)."""
    from jaxsparse import dispatch, ops
    from jaxsparse.ffi import calls

    return dict(spmm_x_layout=os.environ.get(calls.SPMM_X_LAYOUT_ENV, "auto"), dx=ops.dx_route(),
                sddmm_split=calls.sddmm_split(), sddmm_engine=calls.sddmm_engine(),
                sddmm_x_layout=os.environ.get(calls.SDDMM_X_LAYOUT_ENV, "auto"),
                sddmm_bias=os.environ.get(calls.SDDMM_BIAS_ENV, "on"),
                dz_epilogue=os.environ.get(calls.DZ_EPILOGUE_ENV, "auto"),
                reference_ops=sorted(dispatch.reference_ops()))


def _worker_cmd(cfg: dict, turn: dict | None = None) -> tuple[list[str], dict]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)]
    if turn:
        cmd += ["--turn", json.dumps(turn)]
    env = dict(os.environ)
    if _SOURCE_FALLBACK:
        env["PYTHONPATH"] = (env["PYTHONPATH"] + os.pathsep if env.get("PYTHONPATH") else "") + ROOT
    if turn:  # several processes share the GPU: each allocates what it uses, not 75 % of the memory
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return cmd, env


def _result(cfg: dict, returncode: int, stdout: str, stderr: str) -> dict:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (stderr or stdout).strip().splitlines()[-3:]
    return {**cfg, "error": f"worker exit {returncode}: {' | '.join(tail)}"}


def _worker(cfg: dict, timeout: float) -> dict:
    """Run one configuration in a fresh interpreter; its result, or the error it died of."""
    cmd, env = _worker_cmd(cfg)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {**cfg, "error": f"timed out after {timeout:.0f} s"}
    return _result(cfg, proc.returncode, proc.stdout, proc.stderr)


def _concurrent(configs: list[dict], timeout: float) -> list[dict]:
    """All configurations in fresh interpreters at once: compiles overlap, timed steps take turns."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="train_step_turns_") as d:
        procs = []
        for i, cfg in enumerate(configs):
            turn = {"dir": d, "index": i, "n": len(configs), "wait_s": timeout}
            cmd, env = _worker_cmd(cfg, turn)
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        rows, deadline = [], time.time() + timeout
        for i, (cfg, proc) in enumerate(zip(configs, procs)):
            try:
                out, err = proc.communicate(timeout=max(deadline - time.time(), 1.0))
                rows.append(_result(cfg, proc.returncode, out, err))
            except subprocess.TimeoutExpired:
                proc.kill()
                rows.append({**cfg, "error": f"timed out after {timeout:.0f} s"})
            open(os.path.join(d, f"exit-{i}"), "w").close()
        return rows


def _same_problem(a: dict, b: dict) -> bool:
    keys = ("model", "seq_len", "batch_size")
    return (all(a[k] == b[k] for k in keys)
            and a.get("attention", "softmax") == b.get("attention", "softmax")
            and a.get("dropout", "rng") == b.get("dropout", "rng")
            and a.get("devices", 1) == b.get("devices", 1))


_CONFIG_KEYS = ("model", "seq_len", "batch_size", "sparsity", "dtype", "attention", "steps", "warmup",
                "fuse_feed_forward", "mlp_hidden", "transposable", "exclusive_columns", "diagonal_ffn_out",
                "diagonal_all", "diagonal_ffn", "dropout", "devices")
"""The keys of a configuration (a result row holds them and its measurements)."""
_SCALED = ("devices", "batch_size", "steps", "warmup")
"""The keys in which a multi-device row and its one-device twin may differ."""


def _one_device_twin(r: dict, rows: list[dict]) -> dict | None:
    """The row that ran ``r``'s configuration on one device with the same per-device batch, if any."""
    want = {k: v for k, v in r.items() if k in _CONFIG_KEYS and k not in _SCALED}
    return next((o for o in rows if o.get("devices", 1) == 1 and "error" not in o
                  and {k: v for k, v in o.items() if k in _CONFIG_KEYS and k not in _SCALED} == want
                  and o["batch_size"] * r.get("devices", 1) == r["batch_size"]), None)


def add_relative(rows: list[dict]) -> None:
    """Speedup and memory against the dense row of the same model, sequence, batch and device count; with
    several devices, the time over the same configuration on one device at the same per-device batch
    (``data_parallel_overhead_ms``: the gradient all-reduce and whatever it does not overlap)."""
    for r in rows:
        one = _one_device_twin(r, rows) if r.get("devices", 1) > 1 and "error" not in r else None
        r["data_parallel_overhead_ms"] = r["step_ms"] - one["step_ms"] if one else None
        r["data_parallel_overhead_ms_pipelined"] = (r["step_ms_pipelined"] - one["step_ms_pipelined"]
                                                    if one and r.get("step_ms_pipelined") and one.get("step_ms_pipelined")
                                                    else None)
        dense = next((d for d in rows if d["sparsity"] == "dense" and "error" not in d
                      and _same_problem(d, r)), None)
        ok = dense is not None and "error" not in r
        r["speedup_vs_dense"] = dense["step_ms"] / r["step_ms"] if ok else None
        r["speedup_vs_dense_pipelined"] = (dense["step_ms_pipelined"] / r["step_ms_pipelined"]
                                           if ok and r.get("step_ms_pipelined") and dense.get("step_ms_pipelined") else None)
        r["memory_vs_dense"] = (r["peak_bytes"] / dense["peak_bytes"]
                                if ok and r.get("peak_bytes") and dense.get("peak_bytes") else None)


def _ffn(r: dict) -> str:
    """How a row's FFNs ran: ``fused`` (one sparse_mlp), ``unfused``, or ``-`` where no layer is compressed."""
    if r.get("mode") != "compressed":
        return "-"
    diagonal = (", all diagonal" if r.get("diagonal_all") else ", FFN diagonal" if r.get("diagonal_ffn")
                else ", out diagonal" if r.get("diagonal_ffn_out") else "")
    if not r.get("fuse_feed_forward", True):
        return "unfused" + diagonal
    return ("fused, h row" if r.get("mlp_hidden") == "row" else "fused") + diagonal


def print_table(rows: list[dict]) -> None:
    out = []
    for r in rows:
        if "error" in r:
            out.append({"model": r["model"], "seq": r["seq_len"], "batch": r["batch_size"], "gpus": r.get("devices", 1),
                        "sparsity": r["sparsity"], "mode": "error", "step ms": r["error"][:60]})
            continue
        out.append({
            "model": r["model"], "seq": r["seq_len"], "batch": r["batch_size"], "gpus": r.get("devices", 1),
            "sparsity": r["sparsity"], "attention": r.get("attention", "softmax"),
            "dropout": r.get("dropout", "rng"), "ffn": _ffn(r), "mode": r["mode"], "step ms": f"{r['step_ms']:.2f}",
            "tokens/s": f"{r['tokens_per_s']:.0f}",
            "peak GiB": f"{r['peak_bytes'] / 2**30:.2f}" if r.get("peak_bytes") else "n/a",
            "speedup": f"{r['speedup_vs_dense']:.3f}x" if r.get("speedup_vs_dense") else "-",
            "pipelined ms": f"{r['step_ms_pipelined']:.2f}" if r.get("step_ms_pipelined") else "n/a",
            "speedup pipelined": (f"{r['speedup_vs_dense_pipelined']:.3f}x" if r.get("speedup_vs_dense_pipelined")
                                  else "-"),
            "memory": f"{r['memory_vs_dense']:.3f}x" if r.get("memory_vs_dense") else "-",
            "dp overhead ms": (f"{r['data_parallel_overhead_ms_pipelined']:.2f}"
                               if r.get("data_parallel_overhead_ms_pipelined") is not None else "-"),
        })
    print(common.table(out, ["model", "seq", "batch", "gpus", "sparsity", "attention", "dropout", "ffn", "mode",
                             "step ms", "tokens/s",
                             "peak GiB", "speedup", "pipelined ms", "speedup pipelined", "memory", "dp overhead ms"]))
    for r in rows:
        if r.get("mode") == "masked":
            print(f"note: {r['model']} {r['sparsity']} ran masked-dense: {r['mode_reason']}")


def plot(rows: list[dict], path: str) -> str | None:
    """Speedup and peak memory against sparsity, one line per (model, seq); None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    groups = sorted({(r["model"], r["seq_len"], r["batch_size"], r.get("devices", 1)) for r in rows})
    for g in groups:
        sel = [r for r in rows if (r["model"], r["seq_len"], r["batch_size"], r.get("devices", 1)) == g
               and "error" not in r and r.get("fuse_feed_forward", True) and r.get("mlp_hidden") != "row"]
        xs = [SPARSITIES.index(r["sparsity"]) if r["sparsity"] in SPARSITIES else i for i, r in enumerate(sel)]
        label = f"{g[0]} seq {g[1]} batch {g[2]}" + (f" on {g[3]} GPUs" if g[3] > 1 else "")
        ax1.plot(xs, [r["speedup_vs_dense"] or float("nan") for r in sel], "o-", label=f"{label}, synced")
        if any(r.get("speedup_vs_dense_pipelined") for r in sel):  # steps dispatched back to back, as training runs
            ax1.plot(xs, [r.get("speedup_vs_dense_pipelined") or float("nan") for r in sel], "s--",
                     label=f"{label}, back to back")
        ax2.plot(xs, [r["memory_vs_dense"] or float("nan") for r in sel], "o-", label=label)
        for x, r in zip(xs, sel):
            if r["mode"] == "masked":
                ax1.annotate("masked", (x, r["speedup_vs_dense"] or 0), fontsize=7)
    for ax, title in ((ax1, "step speedup over dense"), (ax2, "peak memory / dense")):
        ax.set_xticks(range(len(SPARSITIES)), SPARSITIES)
        ax.set_title(title)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    device = next((r.get("device_kind") for r in rows if r.get("device_kind")), "?")
    fig.suptitle(f"BERT training step (fwd + bwd + AdamW, bf16 compute), {device}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def _draw(rows: list[dict], path: str) -> str | None:
    """:func:`plot`, saying where it went or that matplotlib is missing."""
    done = plot(rows, path)
    print(f"wrote {done}" if done else "matplotlib is not installed: no plot (pip install matplotlib)")
    return done


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny BERT, seq 128, batch 8, 6 steps: a smoke test")
    ap.add_argument("--models", default="base,large")
    ap.add_argument("--seqs", default="512,128")
    ap.add_argument("--sparsities", default=",".join(SPARSITIES))
    ap.add_argument("--batch-size", type=int, default=None, help="override the BATCH table (per device)")
    ap.add_argument("--devices", default="1",
                    help="comma-separated device counts: each configuration runs data parallel over this many local "
                         "devices (jaxsparse.parallel.data_parallel), the batch per device fixed (weak scaling); rows "
                         "with n > 1 report the time over the same configuration on one device")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per configuration (30; --quick: 6)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (5; --quick: 2)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--attention", default="softmax", choices=("softmax", "fused"),
                    help="BERT's softmax attention with dropout on the probabilities, or cuDNN flash attention "
                         "(jaxsparse.models.bert.fused_attention; no probability dropout) for dense and sparse alike")
    ap.add_argument("--dropout", default="hash", choices=DROPOUT_IMPLS + ("both",),
                    help="jaxsparse.dropout.HashDropout (hash, the default: keep bits hashed from the element index "
                         "inside the kernels that use them; BertConfig.dropout_impl), flax's dropout (rng: random "
                         "words drawn into memory, then compared; the results before session 42), or every "
                         "configuration both ways")
    ap.add_argument("--in-process", action="store_true",
                    help="run every configuration in this process (peak memory is then cumulative)")
    ap.add_argument("--concurrent", action="store_true",
                    help="start every configuration's process at once: compilations overlap, the timed steps "
                         "take turns (one configuration on the GPU at a time)")
    ap.add_argument("--transposable", action="store_true",
                    help="sparse configurations choose transposable masks and run dX as the 2:4 forward product of "
                         "W^T (JAXSPARSE_DX=transposed)")
    ap.add_argument("--exclusive-columns", action="store_true",
                    help="sparse configurations (M > 4) choose column-exclusive masks and run dX by V blocks "
                         "(JAXSPARSE_DX=blocks; this wins over --transposable's route when both are given)")
    ap.add_argument("--diagonal-ffn-out", default="off", choices=("off", "on", "both"),
                    help="sparse configurations with M >= 8 store each FFN out kernel as M/4 diagonal 2:4 blocks "
                         "(BertConfig.diagonal_ffn_out; jaxsparse.ops.diagonal_linear), or each such configuration "
                         "both ways in one run")
    ap.add_argument("--diagonal-all", action="store_true",
                    help="also run each sparse configuration with M >= 8 and V %% 64 == 0 with every encoder kernel as "
                         "M/4 diagonal 2:4 blocks read through chunk tables (BertConfig.diagonal_all)")
    ap.add_argument("--diagonal-ffn", action="store_true",
                    help="also run each sparse configuration with M >= 8 and V %% 64 == 0 with the FFN's two kernels as "
                         "M/4 diagonal 2:4 blocks read through chunk tables (BertConfig.diagonal_ffn)")
    ap.add_argument("--ffn", default="fused", choices=("fused", "unfused", "both"),
                    help="compressed FFNs as one jaxsparse.ops.sparse_mlp with the activation in the kernels (fused), "
                         "as two layers and XLA's activation (unfused, BertConfig.fuse_feed_forward=False), or each "
                         "sparse configuration both ways in one run")
    ap.add_argument("--mlp-hidden", default="auto", choices=("auto", "row", "both"),
                    help="how a fused FFN hands its hidden activation to its second layer (JAXSPARSE_MLP_HIDDEN, "
                         "jaxsparse.ops.mlp_hidden_layout): auto (h^T from the first epilogue where both layers take "
                         "the x^T route), row, or each fused sparse configuration both ways in one run")
    ap.add_argument("--worker-timeout", type=float, default=900.0, help="seconds per worker (--concurrent: all)")
    ap.add_argument("--out", default=None, help="json path (default benchmarks/results/<gpu>/train_step[_quick].json)")
    ap.add_argument("--plot", default=None, help="png path (default docs/train_step.png; none in --quick)")
    ap.add_argument("--replot", default=None, metavar="JSON",
                    help="only draw --plot from the rows of an earlier run's results JSON (runs nothing)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--turn", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.worker:
        print(json.dumps(run_config(json.loads(a.worker), json.loads(a.turn) if a.turn else None)), flush=True)
        return 0
    if a.replot:
        if not a.plot:
            ap.error("--replot needs --plot PATH")
        with open(a.replot) as f:
            return 0 if _draw(json.load(f)["rows"], a.plot) else 1

    if a.quick:
        models, seqs = QUICK["models"], QUICK["seqs"]
        steps, warmup = a.steps or QUICK["steps"], a.warmup if a.warmup is not None else QUICK["warmup"]
    else:
        models, seqs = a.models.split(","), [int(s) for s in a.seqs.split(",")]
        steps, warmup = a.steps or 30, a.warmup if a.warmup is not None else 5
    sparsities = a.sparsities.split(",")
    try:
        device_counts = [int(n) for n in a.devices.split(",")]
    except ValueError:
        ap.error(f"--devices takes comma-separated integers, got {a.devices!r}")
    if any(n < 1 for n in device_counts):
        ap.error(f"--devices must be >= 1, got {a.devices!r}")
    configs = []
    for model in models:
        for seq in seqs:
            batch = a.batch_size or (QUICK["batch"] if a.quick else BATCH.get((model, seq)))
            if batch is None:
                ap.error(f"no batch size in BATCH for {model} seq {seq}: pass --batch-size")
            for s in sparsities:
                ffns = [True] if s == "dense" else {"fused": [True], "unfused": [False], "both": [True, False]}[a.ffn]
                variants = [(fuse, hidden) for fuse in ffns
                            for hidden in ({"auto": [None], "row": ["row"], "both": [None, "row"]}[a.mlp_hidden]
                                           if fuse and s != "dense" else [None])]
                diagonals = ({"off": [False], "on": [True], "both": [False, True]}[a.diagonal_ffn_out]
                             if s != "dense" and fmt.takes_diagonal_blocks(s) else [False])
                if s != "dense" and fmt.takes_chunked_diagonal_blocks(s):
                    diagonals = diagonals + ["ffn"] * a.diagonal_ffn + ["all"] * a.diagonal_all
                dropouts = DROPOUT_IMPLS if a.dropout == "both" else [a.dropout]
                for (fuse, hidden), diagonal, n, drop in [(v, d, n, dr) for v in variants for d in diagonals
                                                          for n in device_counts for dr in dropouts]:
                    configs.append({"model": model, "seq_len": seq, "batch_size": batch * n, "sparsity": s,
                                    "dtype": a.dtype, "attention": a.attention, "steps": steps, "warmup": warmup,
                                    "fuse_feed_forward": fuse, **({"mlp_hidden": hidden} if hidden else {}),
                                    **({"dropout": drop} if drop != "rng" else {}),
                                    **({"devices": n} if n > 1 else {}),
                                    **({"transposable": True} if a.transposable and s != "dense" else {}),
                                    **({"exclusive_columns": True} if a.exclusive_columns and s != "dense" else {}),
                                    **({"diagonal_all": True} if diagonal == "all"
                                       else {"diagonal_ffn": True} if diagonal == "ffn"
                                       else {"diagonal_ffn_out": True} if diagonal else {})})
    t0 = time.time()

    def report(r: dict) -> None:
        status = r.get("error") or f"{r['mode']}: {r['step_ms']:.2f} ms/step"
        gpus = f" on {r['devices']} devices" if r.get("devices", 1) > 1 else ""
        print(f"[{time.time() - t0:6.1f} s] {r['model']} seq {r['seq_len']} batch {r['batch_size']}{gpus} "
              f"{r['sparsity']}: {status}", flush=True)

    def write(rows: list[dict], complete: bool) -> None:
        """The results file; a run not yet complete writes ``<out>.partial`` (every configuration measured so far,
        kept if the run is cut short), which the complete file replaces."""
        add_relative(rows)
        device = next((r["device_kind"] for r in rows if r.get("device_kind")), "unknown")
        platform = next((r["platform"] for r in rows if r.get("platform")), "unknown")
        slug = "cpu" if platform == "cpu" else common.gpu_slug(device)
        out = a.out or os.path.join(HERE, "results", slug, "train_step_quick.json" if a.quick else "train_step.json")
        payload = {
            "benchmark": "train_step",
            "description": "BERT + 2-label classifier, full step (fwd, bwd, AdamW), bf16 compute, f32 master weights; "
                           "median of synced single steps after warm-up (step_ms), and the median per-step time of 3 "
                           "runs of --steps steps synced once (step_ms_pipelined); each configuration in a fresh process"
                           + ("" if not a.in_process else " (in-process run: peak memory cumulative)"),
            "quick": a.quick,
            "complete": complete,
            "configurations": len(configs),
            "device": device,
            "platform": platform,
            "versions": common.versions(),
            "rows": rows,
        }
        common.write_json(out if complete else out + ".partial", payload)
        if complete and os.path.exists(out + ".partial"):
            os.remove(out + ".partial")

    if a.concurrent and not a.in_process:
        rows = _concurrent(configs, a.worker_timeout)
        for r in rows:
            report(r)
    else:
        rows = []
        for cfg in configs:  # one at a time: each result reported and saved as it comes
            rows.append(run_config(cfg) if a.in_process else _worker(cfg, a.worker_timeout))
            report(rows[-1])
            if len(rows) < len(configs):
                write(rows, complete=False)
    write(rows, complete=True)
    print_table(rows)
    plot_path = a.plot or (None if a.quick else os.path.join(ROOT, "docs", "train_step.png"))
    if plot_path:
        _draw(rows, plot_path)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
