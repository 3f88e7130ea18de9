"""``jaxsparse-profile``: where the time of a jitted BERT training step goes, by kernel class.

The step (:mod:`jaxsparse.trainstep`) is compiled once; a few steps run under ``jax.profiler.trace``;
the trace's XSpace is read back with ``jax.profiler.ProfileData`` and every device event is put in one
bucket (:data:`BUCKETS`). On a GPU the events are the kernels on the device plane's stream lines; on a
CPU there is no device plane, and the events are the XLA CPU runtime's op executions on the host plane
(``/host:CPU``), which run on several threads and may overlap. The output says which plane was read.

How an event is classified (:func:`classify`): by its kernel name (jaxsparse kernels, cuBLAS/CUTLASS
GEMMs, flash attention, NCCL, memcpy) and by what the compiled HLO says about the instruction the event
ran (the ``hlo_op`` stat of the event): its opcode, whether it is or fuses a dot, and its ``op_name``
metadata, which carries the named scopes: ``optimizer`` (the AdamW update), the Flax module path, and
``<layer>._compressed`` for the compressed ``NMDense`` product (forward under ``jvp(...)``, its
backward under ``transpose(jvp(...))``, where the SDDMM is the dot contracting over tokens and the input
gradient the other). The Amdahl bound is the step time minus the time of every sparse-layer kernel.

Example::

    jaxsparse-profile --model base --sparsity 64:2:8 --batch-size 32 --seq-len 512 --json prof.json
    jaxsparse-profile --model base --sparsity dense --batch-size 32 --seq-len 512 --json dense.json
    jaxsparse-profile --compare dense.json prof.json   # the two side by side, class by class
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from typing import Iterable, Mapping, Sequence

__all__ = [
    "BUCKETS",
    "SPARSE_BUCKETS",
    "OpInfo",
    "DeviceEvent",
    "Profile",
    "parse_hlo",
    "classify",
    "device_events",
    "summarize",
    "profile_step",
    "format_table",
    "main",
]

BUCKETS = ("sparse_fwd", "sddmm", "sparse_dx", "dense_gemm", "attention", "elementwise_norm", "transpose_copy",
           "optimizer", "collective", "other")
"""Kernel classes, in table order."""

SPARSE_BUCKETS = ("sparse_fwd", "sddmm", "sparse_dx")
"""The classes that sparse kernels replace (the Amdahl bound removes them)."""

LABELS = {
    "sparse_fwd": "sparse forward (SpMM)",
    "sddmm": "SDDMM (sparse dW)",
    "sparse_dx": "sparse dX",
    "dense_gemm": "dense GEMM",
    "attention": "attention",
    "elementwise_norm": "elementwise and norms",
    "transpose_copy": "transposes and copies",
    "optimizer": "optimizer",
    "collective": "collectives",
    "other": "other",
}

# ----------------------------------------------------------------------------- the compiled HLO


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """What the compiled HLO module says about one instruction.

    Attributes:
      opcode: ``fusion``, ``dot``, ``custom-call``, ``copy``, ...
      op_name: its ``metadata={op_name=...}`` (named scopes and transformations), "" when absent.
      has_dot: it is, or fuses, a dot / convolution / GEMM custom call.
      dot_lhs_contracting: the lhs contracting dimensions of that dot (empty when none or unknown).
      fused_opcodes: the opcodes inside a fusion (the instruction's own opcode otherwise).
      custom_call_target: the target of a custom call ("" otherwise).
      io_bytes: the bytes of its operands and results as the module declares them (each counted once: the
        traffic of an instruction that reads each input and writes each output once; 0 when a shape is unknown).
    """

    opcode: str
    op_name: str = ""
    has_dot: bool = False
    dot_lhs_contracting: tuple[int, ...] = ()
    fused_opcodes: frozenset = frozenset()
    custom_call_target: str = ""
    io_bytes: int = 0


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\([^=]*?\)|\S+)\s+(?P<op>[\w\-]+)\((?P<rest>.*)$")
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_GEMM_TARGET = re.compile(r"gemm|matmul|cublas|cutlass", re.I)
_DATA_MOVE = {"transpose", "copy", "bitcast", "reshape", "parameter", "slice", "concatenate", "pad", "dynamic-slice",
              "dynamic-update-slice", "reverse", "tuple", "get-tuple-element", "constant", "copy-start", "copy-done"}


_DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
                "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")


def _shape_bytes(text: str) -> int:
    """The bytes of the array shapes written in ``text`` (``bf16[16384,1024]{1,0}``, tuples included)."""
    return sum(_DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
               for dtype, dims in _ARRAY.findall(text) if dtype in _DTYPE_BYTES)


def _operands(rest: str) -> str:
    """The operand list of an instruction: ``rest`` up to the parenthesis that closes it."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[:i]
    return rest


def _dims(text: str, key: str) -> tuple[int, ...]:
    m = re.search(key + r"=\{([\d,\s]*)\}", text)
    if m:
        return tuple(int(d) for d in m.group(1).split(",") if d.strip())
    m = re.search(r'"' + key.replace("dims", "dimensions") + r'"\s*:\s*\[([^\]]*)\]', text)  # cuBLAS backend_config
    if m:
        return tuple(int(d.strip().strip('"')) for d in m.group(1).split(",") if d.strip())
    return ()


def _backend_config(rest: str) -> dict:
    """An instruction's ``backend_config={...}`` as a dict (braces matched, quoted strings skipped); {} when it has
    none or it is not JSON."""
    start = rest.find("backend_config={")
    if start < 0:
        return {}
    i = start + len("backend_config=")
    depth, quoted = 0, False
    for j in range(i, len(rest)):
        ch = rest[j]
        if quoted:
            quoted = not (ch == '"' and rest[j - 1] != "\\")
        elif ch == '"':
            quoted = True
        elif ch in "{}":
            depth += 1 if ch == "{" else -1
            if depth == 0:
                try:
                    return json.loads(rest[i:j + 1])
                except ValueError:
                    return {}
    return {}


# Fusion kinds that are GEMMs: Triton's (older, with a triton_gemm_config; nested, with a block-level config) and cuDNN's.
# Other "__triton" fusions (softmax, normalizations) also carry a block-level config and are not GEMMs.
_GEMM_FUSION_KINDS = ("__triton_gemm", "__triton_nested_gemm_fusion", "__cudnn$fusion")


def gemm_configs(text: str) -> dict[str, int]:
    """What the compiler chose for each dense GEMM of a compiled GPU module (``compiled.as_text()``): ``{"<result
    shape> <kind> <choice>": count}``, the choice being cuBLAS's ``selected_algorithm``, a Triton GEMM's tiling or a
    cuDNN GEMM fusion's plan. XLA picks these by timing candidates on the GPU while it compiles, so two compiles of one
    step that differ here may run at different speeds (the dense step's spread, docs/results.md, session 55). Empty
    for a module without such GEMMs (a CPU module)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = _INSTR.match(line)
        if not m or ("backend_config" not in m.group("rest")):
            continue
        rest = m.group("rest")
        target = re.search(r'custom_call_target="([^"]*)"', rest)
        config = _backend_config(rest)
        gemm = config.get("gemm_backend_config")
        fusion = config.get("fusion_backend_config") or {}
        if target and _GEMM_TARGET.search(target.group(1)) and isinstance(gemm, dict):
            kind, choice = target.group(1), f"algorithm {gemm.get('selected_algorithm', '?')}"
        elif fusion.get("kind") in _GEMM_FUSION_KINDS or "triton_gemm_config" in fusion:
            kind = fusion.get("kind", "fusion")
            detail = (fusion.get("triton_gemm_config") or fusion.get("block_level_fusion_config")
                      or fusion.get("cudnn_fusion_config") or {})
            choice = " ".join(f"{k}={v}" for k, v in sorted(detail.items())) if isinstance(detail, dict) else str(detail)
        else:
            continue
        key = f"{m.group('shape')} {kind} {choice}"
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def parse_hlo(text: str) -> dict[str, OpInfo]:
    """``{instruction name: OpInfo}`` for every instruction of an HLO module's text (``compiled.as_text()``)."""
    comps: dict[str, list[tuple[str, str, str]]] = {}
    result_bytes: dict[str, int] = {}
    current = None
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m and current is not None:
            comps[current].append((m.group("name"), m.group("op"), m.group("rest")))
            result_bytes[m.group("name")] = _shape_bytes(m.group("shape"))
            continue
        c = _COMP.match(line)
        if c and "=" not in line.split("{")[0].split("(")[0]:
            current = c.group("name")
            comps.setdefault(current, [])

    memo: dict[str, tuple[bool, tuple[int, ...], frozenset]] = {}

    def callees(rest: str) -> list[str]:
        return re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", rest)

    def summarize_comp(name: str, depth: int = 0) -> tuple[bool, tuple[int, ...], frozenset]:
        if name in memo:
            return memo[name]
        memo[name] = (False, (), frozenset())  # cycles cannot happen, but be safe
        has, contracting, ops = False, (), set()
        for _, op, rest in comps.get(name, []):
            ops.add(op)
            d, c, o = _instr_summary(op, rest, depth)
            if d and not has:
                has, contracting = True, c
            ops |= o
        memo[name] = (has, contracting, frozenset(ops))
        return memo[name]

    def _instr_summary(op: str, rest: str, depth: int) -> tuple[bool, tuple[int, ...], frozenset]:
        if op in ("dot", "convolution"):
            return True, _dims(rest, "lhs_contracting_dims"), frozenset({op})
        if op == "custom-call":
            target = re.search(r'custom_call_target="([^"]*)"', rest)
            if target and _GEMM_TARGET.search(target.group(1)):
                return True, _dims(rest, "lhs_contracting_dims"), frozenset({op})
            return False, (), frozenset({op})
        if depth < 8 and op in ("fusion", "call", "async-start", "while", "conditional"):
            has, contracting, ops = False, (), set()
            for callee in callees(rest):
                d, c, o = summarize_comp(callee, depth + 1)
                if d and not has:
                    has, contracting = True, c
                ops |= o
            return has, contracting, frozenset(ops)
        return False, (), frozenset({op})

    def io_bytes(name: str, rest: str) -> int:
        """Result bytes plus each operand's: written beside it (``bf16[8]{0} %p``) or its definition's result."""
        total = result_bytes.get(name, 0)
        for operand in _operands(rest).split(", "):
            if _ARRAY.search(operand):
                total += _shape_bytes(operand)
            elif ref := re.search(r"%?([\w.\-]+)\s*$", operand):  # "%name" (compiled) or "name" (lowered)
                total += result_bytes.get(ref.group(1), 0)
        return total

    out: dict[str, OpInfo] = {}
    for instrs in comps.values():
        for name, op, rest in instrs:
            has, contracting, ops = _instr_summary(op, rest, 0)
            op_name = re.search(r'op_name="((?:[^"\\]|\\.)*)"', rest)
            target = re.search(r'custom_call_target="([^"]*)"', rest)
            out[name] = OpInfo(op, op_name.group(1) if op_name else "", has, contracting,
                               ops if op in ("fusion", "call") else frozenset({op}),
                               target.group(1) if target else "", io_bytes(name, rest))
    return out


# ----------------------------------------------------------------------------- classification

_COLLECTIVE = re.compile(r"nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|all[-_]?to[-_]?all|"
                         r"collective[-_]?permute|allreduce|allgather|reducescatter", re.I)
_SDDMM_NAME = re.compile(r"sddmm", re.I)
_DX_NAME = re.compile(r"spmm_?t(?![a-z])|spmmt|spmm_?dx|sparse_?dx|spmm_?transpose|spmm_?bwd|transpose_?2_?4", re.I)
_SPMM_NAME = re.compile(r"spmm|jaxsparse_decompress|decompresskernel", re.I)
_VIEW_NAME = re.compile(r"as_2_4|as24kernel", re.I)
_GEMM_NAME = re.compile(r"gemm|cublas|cutlass|nvjet|xmma|wgmma|hmma|s16816|tensorop|matmul|__dot|triton_dot", re.I)
_ATTN_NAME = re.compile(r"flash|fmha|mha_|sdpa|attention", re.I)
_MOVE_NAME = re.compile(r"memcpy|memset|transpose|^(?:loop_|input_|wrapped_)?copy(?:_fusion)?(?:[._]\d+)*$", re.I)
_ATTN_CHILDREN = {"query", "key", "value", "output", "LayerNorm"}


def _scopes(op_name: str) -> list[str]:
    return [s for s in op_name.split(";")[0].split("/") if s]


def _sparse_scope(scopes: Sequence[str]) -> str | None:
    """``fwd``/``bwd`` when the op belongs to a compressed sparse layer's product, else None."""
    for s in scopes:
        if s.endswith("._compressed") or s in ("sparse_linear", "jaxsparse"):
            return "bwd" if any(x.startswith("transpose(") for x in scopes) else "fwd"
    return None


def _in_attention_core(scopes: Sequence[str]) -> bool:
    """The op sits in the attention module itself (scores, softmax, context), not in one of its layers."""
    for i in range(len(scopes) - 1, -1, -1):
        if scopes[i] == "attention" or scopes[i].endswith("Attention"):
            nxt = scopes[i + 1] if i + 1 < len(scopes) else ""
            return nxt.split(".")[0] not in _ATTN_CHILDREN
    return False


def classify(name: str, info: OpInfo | None = None) -> str:
    """The bucket (one of :data:`BUCKETS`) of a device event.

    Args:
      name: the event name: a GPU kernel name or an XLA CPU op (the HLO instruction) name.
      info: what the compiled HLO says about the event's instruction, when known.
    """
    opcode = info.opcode if info else ""
    op_name = info.op_name if info else ""
    target = info.custom_call_target if info else ""
    scopes = _scopes(op_name)
    if _COLLECTIVE.search(name) or _COLLECTIVE.search(opcode):
        return "collective"
    # jaxsparse kernels, by kernel name or custom-call target
    for text in (name, target):
        if text and ("jaxsparse" in text.lower() or "spmm" in text.lower() or "sddmm" in text.lower()
                     or "decompresskernel" in text.lower()):
            if "jaxsparse_spmm_t" in scopes:  # the input gradient, whichever kernels its route runs (W^T's build
                return "sparse_dx"            # and the forward kernel on the transposed route)
            if _VIEW_NAME.search(text):  # the 2:4 view of a V:2:M weight: traced for the forward and the SDDMM
                return "sddmm" if _sparse_scope(scopes) == "bwd" else "sparse_fwd"
            if _SDDMM_NAME.search(text):
                return "sddmm"
            if _DX_NAME.search(text):
                return "sparse_dx"
            if _SPMM_NAME.search(text):
                return "sparse_fwd"
    if OPTIMIZER_SCOPE_NAME in scopes:
        return "optimizer"
    for s in scopes:  # explicit named scopes, should the ops carry them
        if s in ("sddmm", "jaxsparse_sddmm"):
            return "sddmm"
        if s in ("spmm_t", "sparse_dx", "jaxsparse_spmm_t"):
            return "sparse_dx"
    if "jaxsparse_spmm" in scopes and not any(x.startswith("transpose(") for x in scopes):
        return "sparse_fwd"
    side = _sparse_scope(scopes)
    if side == "fwd" and (info and info.has_dot or "decompress" in op_name):
        return "sparse_fwd"
    if side == "bwd":
        if "take_along_axis" in op_name or "compress_like" in op_name:
            return "sddmm"
        if info and info.has_dot:
            return "sddmm" if info.dot_lhs_contracting == (0,) else "sparse_dx"
    if _ATTN_NAME.search(name) or (scopes and _in_attention_core(scopes) and (not info or opcode != "copy")):
        if not (info and info.fused_opcodes and info.fused_opcodes <= _DATA_MOVE):
            return "attention"
    if (info and info.has_dot) or _GEMM_NAME.search(name):
        return "dense_gemm"
    if info and info.fused_opcodes:
        if info.fused_opcodes <= _DATA_MOVE and info.fused_opcodes & {"transpose", "copy", "copy-start", "copy-done"}:
            return "transpose_copy"
        if info.fused_opcodes & {"gather", "scatter"}:
            return "other"
        if opcode in ("custom-call",):
            return "other"
        return "elementwise_norm"
    if _MOVE_NAME.search(name):
        return "transpose_copy"
    if info is None and re.search(r"fusion|^wrapped_|^loop_|^input_|reduce|convert|elementwise|broadcast", name, re.I):
        return "elementwise_norm"
    return "other"


from jaxsparse.format import VNM  # noqa: E402
from jaxsparse.train import OPTIMIZER_SCOPE as OPTIMIZER_SCOPE_NAME  # noqa: E402 - the step names it
from jaxsparse.train import parser_check  # noqa: E402

# ----------------------------------------------------------------------------- reading the trace


@dataclasses.dataclass(frozen=True)
class DeviceEvent:
    """One kernel (GPU) or XLA op execution (CPU) read from the trace."""

    name: str
    hlo_op: str
    duration_ns: float
    line: str
    start_ns: float = 0.0


def _stats(obj) -> dict:
    try:
        with warnings.catch_warnings():  # JAX 0.11: "builtin type event_stats has no __module__ attribute"
            warnings.simplefilter("ignore", DeprecationWarning)
            return dict(obj.stats)
    except Exception:  # noqa: BLE001 - stats may hold values the binding cannot convert
        return {}


_DERIVED_LINES = ("xla ops", "xla modules", "steps", "framework", "source", "launch", "tensorflow", "task environment",
                  "host threads", "sparsecore")


def latest_xplane(trace_dir: str) -> str:
    """The newest ``.xplane.pb`` that ``jax.profiler.trace(trace_dir)`` wrote under ``trace_dir``."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {trace_dir}")
    return files[-1]


def device_events(xspace_path: str, module: str | None = None,
                  first_gpu_only: bool = False) -> tuple[list[DeviceEvent], dict]:
    """Device events of an ``.xplane.pb`` and a description of what was read.

    On a GPU: the events of the ``/device:GPU:*`` planes' stream lines (kernels, memcpy); with
    ``first_gpu_only``, of the first GPU's plane alone (one replica of a data-parallel step). Without a GPU
    plane: the XLA op events on the ``/host:CPU`` plane (those with an ``hlo_op`` stat). With ``module``,
    only events whose ``hlo_module`` stat names it (events without that stat are kept).
    """
    from jax.profiler import ProfileData

    data = ProfileData.from_file(xspace_path)
    planes = list(data.planes)
    gpu = sorted((p for p in planes if p.name.startswith("/device:GPU")), key=lambda p: p.name)
    if first_gpu_only:
        gpu = gpu[:1]
    out: list[DeviceEvent] = []
    lines_read: list[str] = []

    def keep(stats: Mapping) -> bool:
        return module is None or "hlo_module" not in stats or str(stats["hlo_module"]) == module

    if gpu:
        for plane in gpu:
            for line in plane.lines:
                lname = line.name
                if any(lname.lower().startswith(d) for d in _DERIVED_LINES):
                    continue
                lines_read.append(f"{plane.name}:{lname}")
                for ev in line.events:
                    st = _stats(ev)
                    if keep(st):
                        out.append(DeviceEvent(ev.name, str(st.get("hlo_op", "")), float(ev.duration_ns), lname,
                                               float(ev.start_ns)))
        desc = {"plane": ", ".join(p.name for p in gpu), "kind": "gpu",
                "note": "GPU kernels and memory operations on the device streams"}
    else:
        host = [p for p in planes if p.name == "/host:CPU"]
        if not host:
            raise RuntimeError(f"the trace has neither a GPU plane nor /host:CPU: planes {[p.name for p in planes]}")
        for line in host[0].lines:
            n0 = len(out)
            for ev in line.events:
                st = _stats(ev)
                if "hlo_op" in st and keep(st):
                    out.append(DeviceEvent(ev.name, str(st["hlo_op"]), float(ev.duration_ns), line.name,
                                           float(ev.start_ns)))
            if len(out) > n0:
                lines_read.append(line.name)
        desc = {"plane": "/host:CPU", "kind": "cpu",
                "note": "no device plane: XLA CPU op executions on the host, not GPU kernels; ops run on "
                        f"{len(lines_read)} threads and may overlap, so their sum can exceed the step time"}
    desc["lines"] = lines_read
    return out, desc


# ----------------------------------------------------------------------------- the summary


@dataclasses.dataclass
class Profile:
    """A step's breakdown. Times are per step, in milliseconds."""

    buckets: dict[str, dict[str, float]]
    busy_ms: float
    step_ms: float
    steps: int
    device: dict
    top: list[dict]
    meta: dict = dataclasses.field(default_factory=dict)
    scopes: list[dict] = dataclasses.field(default_factory=list)

    @property
    def sparse_ms(self) -> float:
        return sum(self.buckets[b]["ms"] for b in SPARSE_BUCKETS)

    @property
    def amdahl_bound_ms(self) -> float:
        """The step time if every sparse kernel took no time."""
        return max(self.step_ms - self.sparse_ms, 0.0)

    def to_json(self) -> dict:
        return {**self.meta, "device": self.device, "steps_traced": self.steps, "step_ms": self.step_ms,
                "busy_ms": self.busy_ms, "sparse_ms": self.sparse_ms, "amdahl_bound_ms": self.amdahl_bound_ms,
                "amdahl_max_speedup": self.step_ms / self.amdahl_bound_ms if self.amdahl_bound_ms > 0 else None,
                "buckets": self.buckets, "top_ops": self.top, "top_scopes": self.scopes}


_SPMM_TARGETS = ("jaxsparse_spmm", "jaxsparse_spmm_xt")
_FORWARD_KERNEL_NAME = re.compile(r"spmm", re.I)  # the SpMM kernels (not the 2:4 view's or decompression's)


def _spmm_calls(hlo: Mapping[str, OpInfo]) -> tuple[int, int]:
    """The forward-kernel custom calls of one step in the compiled HLO: (forward products, input-gradient products).

    The input-gradient products are those of the transposed dX route: one per ``jaxsparse_transpose_2_4`` call (the
    route builds W^T once for its one product; ``ops.shared_linear``'s summed product builds the W^T of all its layers
    in one call, ``calls.spmm_t_sum``). The count, not the calls' ``op_name``: custom calls lose their named scopes on
    the way to the compiled module."""
    calls = sum(info.custom_call_target in _SPMM_TARGETS for info in hlo.values())
    dx = sum(info.custom_call_target == "jaxsparse_transpose_2_4" for info in hlo.values())
    return calls - dx, dx


def _split_forward_kernel(events: Sequence[DeviceEvent], infos: Sequence[OpInfo | None], buckets: list[str],
                          calls: tuple[int, int], steps: int) -> str:
    """Re-bucket the forward kernel's events that ran an input gradient; returns a note on what was done.

    Inside XLA's command buffers the GPU events carry no ``hlo_op``, so the forward kernel running the transposed dX
    route (the 2:4 product of W^T, same kernel as the forward) cannot be told apart by scope. The order can: in a step
    every forward product precedes every input gradient (each dX needs the loss gradient, which needs every forward
    output). So when the step's HLO has ``calls`` = (F forward, D input-gradient) calls of the forward kernels
    (``_spmm_calls``) and exactly ``steps * (F + D)`` such events came without HLO information (``infos``), the
    first F of each step's run (by start time) stay ``sparse_fwd`` and the next D become ``sparse_dx``. Otherwise
    nothing changes.
    """
    fwd, dx = calls
    idx = [i for i, (ev, info) in enumerate(zip(events, infos))
           if buckets[i] == "sparse_fwd" and info is None and _FORWARD_KERNEL_NAME.search(ev.name)]
    if dx == 0 or not idx:
        return ""
    if len(idx) != steps * (fwd + dx):
        return (f"{len(idx)} forward-kernel events without hlo_op where the HLO's {fwd} forward and {dx} "
                f"input-gradient calls over {steps} steps make {steps * (fwd + dx)}: left under sparse forward")
    idx.sort(key=lambda i: events[i].start_ns)
    for n, i in enumerate(idx):
        if n % (fwd + dx) >= fwd:
            buckets[i] = "sparse_dx"
    return (f"forward-kernel events split by order: the first {fwd} of each step forward, the next {dx} the "
            f"transposed dX route")


HBM_TBPS = 3.0
"""The memory bandwidth the floors assume, TB/s: a device copy on this workplace's H100 (docs/kernel-notes.md)."""


def _floor(io_bytes: int, count: float, ms: float) -> dict:
    """A top op's memory floor: its instruction's operand and result bytes (:attr:`OpInfo.io_bytes`, per call) moved
    once at :data:`HBM_TBPS`, per step, and its time over that floor; empty when the bytes are unknown."""
    if not io_bytes:
        return {}
    floor = count * io_bytes / (HBM_TBPS * 1e12) * 1e3
    return {"io_bytes": io_bytes, "floor_ms": floor, "over_floor": ms / floor}


_LAYER_INDEX = re.compile(r"(layer_)\d+")


def _scope(op_name: str, kernel: str) -> str:
    """What :func:`summarize`'s ``top_scopes`` groups a kernel under: its op name with every layer index written
    ``N`` (the same op of every layer together), or the kernel's own name when the trace and the HLO give none."""
    return _LAYER_INDEX.sub(r"\1N", op_name) if op_name else kernel


def _top_scopes(per_op: Mapping[tuple[str, str], list], steps: int, top: int) -> list[dict]:
    """The ops by time with kernel names folded: XLA names one op's kernels differently from step to step and
    layer to layer (``loop_add_fusion_486`` and ``_490`` may both be ``optimizer/add``), so a per-kernel list can
    show an op in one step and hide it, split over several names, in another."""
    groups: dict[tuple[str, str], list] = {}
    for (name, bucket), (ns, count, op_name, *_) in per_op.items():
        rec = groups.setdefault((_scope(op_name, name), bucket), [0.0, 0, set()])
        rec[0] += ns
        rec[1] += count
        rec[2].add(name)
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"scope": s, "bucket": b, "ms": v[0] / 1e6 / steps, "count": v[1] / steps, "kernels": len(v[2])}
            for (s, b), v in ranked]


def _event_info(ev: DeviceEvent, hlo: Mapping[str, OpInfo], by_kernel_name: Mapping[str, OpInfo]) -> OpInfo | None:
    """The HLO instruction an event ran: its ``hlo_op``'s; inside a command buffer (the event names the buffer, which
    the module's text does not hold) the instruction its kernel is named after, as XLA names its own kernels; None for
    a library or custom-call kernel there (cuBLAS, cuDNN, jaxsparse's), which :func:`classify` buckets by name."""
    if ev.hlo_op and not ev.hlo_op.startswith("command_buffer") and ev.hlo_op in hlo:
        return hlo[ev.hlo_op]
    return by_kernel_name.get(ev.name)


def summarize(events: Iterable[DeviceEvent], hlo: Mapping[str, OpInfo], steps: int, step_ms: float,
              device: dict | None = None, top: int = 25) -> Profile:
    """Bucket ``events`` (from ``steps`` steps) with :func:`classify`; per-step ms, % of step, counts.

    The forward kernel's events that ran the transposed dX route are moved to ``sparse_dx`` by their order in the
    step where the trace cannot name them (``_split_forward_kernel``; what was done is noted in ``device["split"]``).
    Besides the ``top`` kernels by time, the ``top`` ops with kernel names folded (:func:`_top_scopes`).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    events = list(events)
    by_kernel_name = {**{n.replace(".", "_"): i for n, i in hlo.items()}, **hlo}  # kernel names have "_" for "."
    infos = [_event_info(ev, hlo, by_kernel_name) for ev in events]
    kinds = [classify(ev.name, info) for ev, info in zip(events, infos)]
    calls = _spmm_calls(hlo)
    note = _split_forward_kernel(events, infos, kinds, calls, steps)
    device = dict(device or {})
    if note:
        device["split"] = note
    sums = {b: 0.0 for b in BUCKETS}
    counts = {b: 0 for b in BUCKETS}
    per_op: dict[tuple[str, str], list] = {}
    for ev, info, b in zip(events, infos, kinds):
        sums[b] += ev.duration_ns
        counts[b] += 1
        named = by_kernel_name.get(ev.name)  # an XLA kernel is named after its instruction, in a command buffer too
        rec = per_op.setdefault((ev.name, b), [0.0, 0, info.op_name if info else "", ev.hlo_op,
                                               named.io_bytes if named else 0])
        if named and not rec[2]:
            rec[2] = named.op_name
        rec[0] += ev.duration_ns
        rec[1] += 1
    busy_ms = sum(sums.values()) / 1e6 / steps
    buckets = {b: {"ms": sums[b] / 1e6 / steps, "pct_step": 100.0 * sums[b] / 1e6 / steps / step_ms if step_ms > 0 else 0.0,
                   "pct_busy": 100.0 * sums[b] / sum(sums.values()) if sum(sums.values()) else 0.0,
                   "count": counts[b] / steps} for b in BUCKETS}
    ranked = sorted(per_op.items(), key=lambda kv: -kv[1][0])[:top]
    top_ops = [{"name": n, "bucket": b, "ms": v[0] / 1e6 / steps, "count": v[1] / steps, "op_name": v[2],
                "hlo_op": v[3], **_floor(v[4], v[1] / steps, v[0] / 1e6 / steps)} for (n, b), v in ranked]
    device["forward_kernel_calls"] = {"hlo_forward": calls[0], "hlo_dx": calls[1]}  # per step, from the compiled HLO
    # kernels XLA launched from a CUDA graph (a command buffer) against one by one: launch gaps live in the second
    device["events_in_command_buffers"] = (sum(ev.hlo_op.startswith("command_buffer") for ev in events) / len(events)
                                           if events else 0.0)
    return Profile(buckets, busy_ms, step_ms, steps, device, top_ops, scopes=_top_scopes(per_op, steps, top))


def format_table(p: Profile, top: int = 0) -> str:
    """The printed breakdown: one row per bucket, the totals, the step time and the Amdahl bound."""
    w = max(len(v) for v in LABELS.values())
    rows = [f"{'class':<{w}}  {'ms/step':>9}  {'% step':>7}  {'% busy':>7}  {'count':>7}", "-" * (w + 40)]
    for b in BUCKETS:
        r = p.buckets[b]
        rows.append(f"{LABELS[b]:<{w}}  {r['ms']:9.3f}  {r['pct_step']:7.1f}  {r['pct_busy']:7.1f}  {r['count']:7.0f}")
    rows.append("-" * (w + 40))
    n = sum(r["count"] for r in p.buckets.values())
    rows.append(f"{'total busy':<{w}}  {p.busy_ms:9.3f}  {100 * p.busy_ms / p.step_ms if p.step_ms else 0:7.1f}  "
                f"{100.0:7.1f}  {n:7.0f}")
    dev = p.device
    lines = [f"device: {dev.get('device', '?')}; plane read: {dev.get('plane', '?')} ({dev.get('note', '')})",
             *([f"note: {dev['split']}"] if dev.get("split") else []),
             *rows,
             f"step time (median wall, synced): {p.step_ms:.3f} ms; busy - step = {p.busy_ms - p.step_ms:+.3f} ms; "
             f"{100 * dev.get('events_in_command_buffers', 0.0):.0f} % of the kernels launched from CUDA graphs",
             f"sparse kernels (SpMM + SDDMM + dX): {p.sparse_ms:.3f} ms = {100 * p.sparse_ms / p.step_ms if p.step_ms else 0:.1f} % of step",
             f"Amdahl bound (step - sparse): {p.amdahl_bound_ms:.3f} ms"
             + (f" -> at most {p.step_ms / p.amdahl_bound_ms:.2f}x from faster sparse kernels" if p.amdahl_bound_ms > 0 else "")]
    if top:
        lines.append(f"top {min(top, len(p.top))} ops by time:")
        lines.append(f"  (floor: the instruction's operand and result bytes once at {HBM_TBPS} TB/s, where the HLO "
                     "names the kernel)")
        for t in p.top[:top]:
            floor = f"{t['floor_ms']:7.3f} ({t['over_floor']:4.1f}x)" if "floor_ms" in t else " " * 15
            lines.append(f"  {t['ms']:8.3f} ms  x{t['count']:<4.0f} floor {floor} {t['bucket']:<16} {t['name'][:60]}  "
                         f"{t['op_name'][-70:]}")
        lines.append(f"top {min(top, len(p.scopes))} ops with kernel names folded (layer indices written N):")
        for t in p.scopes[:top]:
            lines.append(f"  {t['ms']:8.3f} ms  x{t['count']:<4.0f} in {t['kernels']:>3} kernel names  "
                         f"{t['bucket']:<16} {t['scope'][-90:]}")
    return "\n".join(lines)


def _describe(saved: Mapping) -> str:
    """A saved breakdown's step in a few words: model, sparsity and the options that change its kernels."""
    opts = [name for key, name in (("transposable_masks", "transposable"), ("exclusive_columns", "exclusive"),
                                   ("diagonal_ffn_out", "FFN out diagonal"), ("diagonal_ffn", "FFN diagonal"),
                                   ("diagonal_all", "all diagonal")) if saved.get(key)]
    parts = [f"BERT-{saved.get('model', '?')} {saved.get('sparsity', '?')}", *opts,
             "hash dropout" if saved.get("dropout") == "hash" else "flax's dropout"]  # no key: before session 42
    return ", ".join(parts)


def compare_table(a: Mapping, b: Mapping) -> str:
    """Two saved breakdowns (``--json`` files of this tool) side by side: each bucket's ms a step in A and in B and
    their difference, the busy and step times, and B's speedup over A in busy time. A is the baseline (for example
    the dense step), B the step compared with it. The steps must have been traced on the same kind of device."""
    for name, saved in (("A", a), ("B", b)):
        missing = [key for key in ("buckets", "busy_ms", "step_ms") if key not in saved]
        if missing or set(saved.get("buckets", {})) != set(BUCKETS):
            raise ValueError(f"{name} is not a jaxsparse-profile --json breakdown (missing {missing or 'buckets'})")
    dev_a, dev_b = (saved.get("device", {}).get("device") for saved in (a, b))
    if dev_a != dev_b:
        raise ValueError(f"the breakdowns come from different devices ({dev_a} and {dev_b}): not comparable")
    w = max(len(v) for v in LABELS.values())
    head = f"{'class':<{w}}  {'A ms':>9}  {'B ms':>9}  {'B - A':>9}"
    rows = [f"A: {_describe(a)}", f"B: {_describe(b)}", f"device: {dev_a}", head, "-" * len(head)]
    for bucket in BUCKETS:
        ma, mb = a["buckets"][bucket]["ms"], b["buckets"][bucket]["ms"]
        if ma or mb:
            rows.append(f"{LABELS[bucket]:<{w}}  {ma:9.3f}  {mb:9.3f}  {mb - ma:+9.3f}")
    rows.append("-" * len(head))
    for label, key in (("total busy", "busy_ms"), ("step (traced, synced)", "step_ms")):
        rows.append(f"{label:<{w}}  {a[key]:9.3f}  {b[key]:9.3f}  {b[key] - a[key]:+9.3f}")
    rows.append(f"B over A in busy time: {a['busy_ms'] / b['busy_ms']:.3f}x" if b["busy_ms"] > 0 else
                "B has no busy time")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- profiling a step


def _median_step_ms(compiled, args: tuple, steps: int) -> tuple[float, tuple]:
    import jax

    times = []
    params, state, *rest = args
    for _ in range(steps):
        t0 = time.perf_counter()
        params, state, loss = compiled(params, state, *rest)
        jax.block_until_ready((params, state, loss))
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times), (params, state, *rest)


def profile_step(config, steps: int = 5, warmup: int = 2, trace_dir: str | None = None, top: int = 25,
                 hlo_path: str | None = None) -> Profile:
    """Compile the step of ``config`` (a :class:`jaxsparse.trainstep.StepConfig`), time it, trace
    ``steps`` steps and return the breakdown; ``hlo_path`` also keeps the compiled module's text there (the
    top ops' kernel names are its fusions' names)."""
    import jax

    from jaxsparse import trainstep

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*donated buffers.*")
        ts = trainstep.build_step(config)
        compiled = ts.fn.lower(*ts.args).compile()
        hlo_text = compiled.as_text()
        if hlo_path:
            _write_text(hlo_path, hlo_text)
        module = re.search(r"^HloModule\s+([\w.\-]+)", hlo_text, re.M)
        hlo = parse_hlo(hlo_text)
        args = ts.args
        _, args = _median_step_ms(compiled, args, max(warmup, 1))
        step_ms, args = _median_step_ms(compiled, args, max(steps, 3))
        tmp = trace_dir or tempfile.mkdtemp(prefix="jaxsparse-profile-")
        params, state, *rest = args
        with jax.profiler.trace(tmp):
            for _ in range(steps):
                params, state, loss = compiled(params, state, *rest)
            jax.block_until_ready((params, state, loss))
    xplane = latest_xplane(tmp)
    events, desc = device_events(xplane, module.group(1) if module else None, first_gpu_only=config.devices > 1)
    if not events:
        raise RuntimeError(f"no device events of module {module.group(1) if module else '?'} in {xplane}")
    dev = jax.devices()[0]
    desc = {"device": f"{dev.platform}:{dev.device_kind}", **desc, "xplane": xplane}
    prof = summarize(events, hlo, steps, step_ms, desc, top)
    prof.meta = {"model": config.model, "sparsity": config.sparsity, "mode": ts.mode, "mode_reason": ts.reason,
                 "batch_size": config.batch_size, "seq_len": config.seq_len, "tokens": ts.tokens,
                 "dtype": config.dtype, "attention": config.attention, "dropout": config.dropout,
                 "devices": config.devices, "jax": jax.__version__,
                 "hlo_module": module.group(1) if module else None}
    return prof


def _write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``jaxsparse-profile --help``)."""
    from jaxsparse.trainstep import MODELS

    p = argparse.ArgumentParser(prog="jaxsparse-profile", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny", choices=MODELS)
    p.add_argument("--sparsity", default="64:2:8", help="'dense' or a V:N:M pattern (2:4, 64:2:8, 128:2:16, ...)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="per device; default: the headline benchmark's batch for --model and --seq-len (32 for large "
                        "at 512), else 8")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=5, help="steps traced (and timed)")
    p.add_argument("--warmup", type=int, default=2)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--compressed", dest="compressed", action="store_true", default=None,
                      help="train the compressed values (error if the shapes do not allow it)")
    mode.add_argument("--masked", dest="compressed", action="store_false",
                      help="masked-dense sparse layers (default: compressed where the shapes allow it)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--attention", default="softmax", choices=("softmax", "fused"),
                   help="BERT's softmax attention, or cuDNN flash attention (no dropout on the probabilities)")
    p.add_argument("--dropout", default="hash", choices=("hash", "rng"),
                   help="jaxsparse.dropout.HashDropout (the default), or flax's dropout "
                        "(jaxsparse.trainstep.StepConfig.dropout)")
    p.add_argument("--transposable-masks", action="store_true",
                   help="transposable masks, and the input gradient as the 2:4 forward product of W^T "
                        "(JAXSPARSE_DX=transposed)")
    p.add_argument("--exclusive-columns", action="store_true",
                   help="column-exclusive masks, and the input gradient by V blocks (JAXSPARSE_DX=blocks; this wins "
                        "over --transposable-masks' route)")
    p.add_argument("--diagonal-all", action="store_true",
                   help="every encoder kernel as M/4 diagonal 2:4 blocks read through chunk tables "
                        "(jaxsparse.trainstep.StepConfig.diagonal_all)")
    p.add_argument("--diagonal-ffn", action="store_true",
                   help="the FFN's two kernels as M/4 diagonal 2:4 blocks read through chunk tables "
                        "(jaxsparse.trainstep.StepConfig.diagonal_ffn)")
    p.add_argument("--diagonal-ffn-out", action="store_true",
                   help="the FFN out kernels as M/4 diagonal 2:4 blocks (V:2:M with M >= 8; "
                        "jaxsparse.trainstep.StepConfig.diagonal_ffn_out)")
    p.add_argument("--devices", type=int, default=1,
                   help="data parallel over this many local devices (the batch is per device; the breakdown is the "
                        "first GPU's, collectives included)")
    p.add_argument("--top", type=int, default=10, help="list the N most expensive ops (0: none)")
    p.add_argument("--trace-dir", default=None, help="keep the trace here (TensorBoard/xprof can open it)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the breakdown as JSON")
    p.add_argument("--hlo", default=None, metavar="PATH",
                   help="also write the compiled step's HLO text (where the top ops' fusions are defined)")
    p.add_argument("--compare", nargs=2, default=None, metavar=("A.json", "B.json"),
                   help="profile nothing: print two saved --json breakdowns side by side (A the baseline, e.g. the "
                        "dense step) with each class's difference and B's speedup over A in busy time")
    args = p.parse_args(argv)
    if args.sparsity != "dense":
        parser_check(p, "--sparsity", VNM.parse, args.sparsity)
    for name, low in (("batch_size", 1), ("seq_len", 1), ("steps", 1), ("warmup", 0), ("devices", 1), ("top", 0)):
        value = getattr(args, name)
        if value is not None and value < low:
            p.error(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    return args


def step_config(args: argparse.Namespace):
    """The :class:`~jaxsparse.trainstep.StepConfig` that ``args`` (:func:`parse_args`) describe; without
    ``--batch-size``, the headline benchmark's batch for the model and sequence length
    (:func:`jaxsparse.trainstep.default_batch_size`)."""
    from jaxsparse.trainstep import StepConfig, default_batch_size

    batch = args.batch_size if args.batch_size is not None else default_batch_size(args.model, args.seq_len)
    return StepConfig(args.model, args.sparsity, batch * args.devices, args.seq_len, args.dtype, args.compressed,
                      devices=args.devices,
                      attention=args.attention, transposable=args.transposable_masks,
                      exclusive_columns=args.exclusive_columns, diagonal_ffn_out=args.diagonal_ffn_out,
                      diagonal_all=args.diagonal_all, diagonal_ffn=args.diagonal_ffn, dropout=args.dropout)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``jaxsparse-profile``."""
    from jaxsparse import dispatch, ops
    args = parse_args(argv)
    if args.compare:
        saved = []
        for path in args.compare:
            try:
                with open(path) as f:
                    saved.append(json.load(f))
            except (OSError, json.JSONDecodeError) as err:
                raise SystemExit(f"jaxsparse-profile --compare: cannot read {path}: {err}") from err
        try:
            print(compare_table(*saved))
        except ValueError as err:
            raise SystemExit(f"jaxsparse-profile --compare: {err}") from err
        return 0
    config = step_config(args)
    with ops.dx_route_scope(config.dx_route(), keep_set=True):  # JAXSPARSE_DX, when set, wins
        prof = profile_step(config, args.steps, args.warmup, args.trace_dir, top=max(args.top, 25), hlo_path=args.hlo)
        prof.meta.update(transposable_masks=args.transposable_masks, exclusive_columns=args.exclusive_columns,
                         diagonal_ffn_out=args.diagonal_ffn_out, diagonal_all=args.diagonal_all,
                         diagonal_ffn=args.diagonal_ffn,
                         dx_route=ops.dx_route(),  # the route traced
                         settings=dispatch.settings())
    m = prof.meta
    print(f"jaxsparse-profile: BERT-{m['model']} {m['sparsity']} ({m['mode']}{': ' + m['mode_reason'] if m['mode_reason'] else ''}), "
          f"batch {m['batch_size']} x seq {m['seq_len']} = {m['tokens']} tokens, {m['dtype']} compute, "
          f"{m['attention']} attention, AdamW, {prof.steps} steps traced"
          + (f", data parallel over {m['devices']} devices (the first one's kernels)" if m["devices"] > 1 else "")
          + (", transposable masks (dX on W^T)" if args.transposable_masks else "")
          + (", column-exclusive masks (dX by V blocks)" if args.exclusive_columns else "")
          + (", FFN out as diagonal 2:4 blocks" if args.diagonal_ffn_out else "")
          + (", every layer as diagonal 2:4 blocks (chunk tables)" if args.diagonal_all else "")
          + (", the FFN as diagonal 2:4 blocks (chunk tables)" if args.diagonal_ffn else ""))
    print(format_table(prof, args.top))
    if args.json:
        _write_text(args.json, json.dumps(prof.to_json(), indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
