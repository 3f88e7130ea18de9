"""jaxsparse-profile: the kernel classifier, the HLO reader, and a real CPU profile of a tiny step."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from jaxsparse import profile
from jaxsparse.profile import OpInfo, classify

FWD = "jit(step)/jvp(BertForSequenceClassification)/bert/encoder_layer_0"
BWD = "jit(step)/transpose(jvp(BertForSequenceClassification))/bert/encoder_layer_0"

# GPU kernel names as nsys / the XLA GPU profiler show them, classified by name alone.
GPU_NAMES = [
    ("void jaxsparse::(anonymous namespace)::SpmmKernel<__nv_bfloat16, 8, 128, 128, 8, 4>(jaxsparse::SpmmParams)", "sparse_fwd"),
    ("void jaxsparse::SddmmKernel<__nv_bfloat16, 16>(jaxsparse::SddmmParams)", "sddmm"),
    ("void jaxsparse::SpmmTKernel<__nv_bfloat16, 8>(jaxsparse::SpmmTParams)", "sparse_dx"),
    ("jaxsparse_spmm_t", "sparse_dx"),
    ("void jaxsparse::(anonymous namespace)::As24Kernel<unsigned short, 2>(const T1 *, const unsigned char *)", "sparse_fwd"),
    # W^T's build for the transposed dX route (its name says transpose, but it belongs to the input gradient)
    ("jaxsparse::(anonymous namespace)::Transpose24Kernel(unsigned int const*, unsigned char const*)", "sparse_dx"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas", "dense_gemm"),
    ("nvjet_hsh_192x192_64x4_2x1_v_bz_coopB_NNT", "dense_gemm"),
    ("cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_256x128_32x3_nn_align8", "dense_gemm"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn", "dense_gemm"),
    ("flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4, false, false, cutlass::bfloat16_t>>", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", "attention"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collective"),
    ("all-gather-start", "collective"),
    ("Memcpy DtoD (Device -> Device)", "transpose_copy"),
    ("loop_transpose_fusion_3", "transpose_copy"),
    ("copy_fusion.2", "transpose_copy"),
    ("loop_multiply_fusion_12", "elementwise_norm"),
    ("input_reduce_fusion_2", "elementwise_norm"),
    ("some_vendor_kernel", "other"),
]

# CPU XLA op names (or GPU kernels) with what the compiled HLO says about their instruction.
HLO_EVENTS = [
    ("ynn_fusion.91", OpInfo("fusion", f"{FWD}/attention/value/value._compressed/dot_general", True, (1,)), "sparse_fwd"),
    ("compare_convert_fusion.1", OpInfo("fusion", f"{FWD}/intermediate/intermediate._compressed/jit(decompress)/jit(_one_hot)/convert_element_type",
                                        False, (), frozenset({"compare", "convert"})), "sparse_fwd"),
    ("wrapped_convert.5", OpInfo("fusion", f"{FWD}/intermediate/intermediate._compressed/convert_element_type", False, (),
                                 frozenset({"convert"})), "elementwise_norm"),
    ("ynn_fusion.12", OpInfo("fusion", f"{BWD}/output/output._compressed/dot_general", True, (0,)), "sddmm"),
    ("ynn_fusion.13", OpInfo("fusion", f"{BWD}/output/output._compressed/dot_general", True, (1,)), "sparse_dx"),
    ("gather_fusion.2", OpInfo("fusion", f"{BWD}/attention/query/query._compressed/jit(take_along_axis)/gather", False, (),
                               frozenset({"gather"})), "sddmm"),
    ("multiply_add_fusion.102", OpInfo("fusion", "jit(step)/optimizer/add", False, (), frozenset({"multiply", "add"})), "optimizer"),
    ("loop_multiply_fusion_4", OpInfo("fusion", "jit(step)/optimizer/mul", False, (), frozenset({"multiply"})), "optimizer"),
    ("ynn_fusion.5", OpInfo("fusion", f"{FWD}/attention/dot_general", True, (3,)), "attention"),
    ("reduce_fusion.3", OpInfo("fusion", f"{FWD}/attention/reduce_max", False, (), frozenset({"reduce", "maximum"})), "attention"),
    ("multiply_fusion.9", OpInfo("fusion", f"{FWD}/attention/LayerNorm/mul", False, (), frozenset({"multiply", "rsqrt"})),
     "elementwise_norm"),
    ("dot.3", OpInfo("dot", f"{FWD}/attention/query/dot_general", True, (2,), frozenset({"dot"})), "dense_gemm"),
    ("custom-call.7", OpInfo("custom-call", f"{BWD}/intermediate/dot_general", True, (0,), frozenset({"custom-call"}),
                             "__cublas$gemm"), "dense_gemm"),
    ("custom-call.9", OpInfo("custom-call", f"{FWD}/output/output._compressed/spmm", False, (), frozenset({"custom-call"}),
                             "jaxsparse_spmm"), "sparse_fwd"),
    # the 2:4 view of a V:2:M weight, traced in the forward and in the SDDMM (XLA keeps one call; either scope classifies)
    ("custom-call.10", OpInfo("custom-call", f"{FWD}/output/output._compressed/as_2_4", False, (), frozenset({"custom-call"}),
                              "jaxsparse_as_2_4"), "sparse_fwd"),
    ("custom-call.11", OpInfo("custom-call", f"{BWD}/output/output._compressed/as_2_4", False, (), frozenset({"custom-call"}),
                              "jaxsparse_as_2_4"), "sddmm"),
    ("transpose.3", OpInfo("transpose", f"{FWD}/attention/transpose", False, (), frozenset({"transpose"})), "transpose_copy"),
    ("copy.5", OpInfo("copy", "jit(step)/jvp(BertForSequenceClassification)/bert/copy", False, (), frozenset({"copy"})), "transpose_copy"),
    ("copy_fusion", OpInfo("fusion", "jit(step)/bert/reshape", False, (), frozenset({"copy", "bitcast", "parameter"})), "transpose_copy"),
    ("scatter_fusion", OpInfo("fusion", "jit(step)/transpose(jvp(jit(_take)))/scatter-add", False, (), frozenset({"scatter", "add"})), "other"),
    ("all-reduce.1", OpInfo("all-reduce", "jit(step)/psum", False, (), frozenset({"all-reduce"})), "collective"),
    # the named scopes jaxsparse.ops puts around its products
    ("fusion.40", OpInfo("fusion", f"{FWD}/output/jaxsparse_spmm/dot_general", True, (1,)), "sparse_fwd"),
    ("fusion.41", OpInfo("fusion", f"{BWD}/output/jaxsparse_sddmm/dot_general", True, (0,)), "sddmm"),
    ("fusion.42", OpInfo("fusion", f"{BWD}/output/jaxsparse_spmm_t/dot_general", True, (1,)), "sparse_dx"),
    # the transposed dX route: W^T's build and the forward kernel on it, both inside the input gradient's scope
    ("custom-call.12", OpInfo("custom-call", f"{BWD}/output/jaxsparse_spmm_t/jaxsparse_spmm/spmm_xt", False, (),
                              frozenset({"custom-call"}), "jaxsparse_spmm_xt"), "sparse_dx"),
    ("custom-call.13", OpInfo("custom-call", f"{BWD}/output/jaxsparse_spmm_t/transpose_2_4", False, (),
                              frozenset({"custom-call"}), "jaxsparse_transpose_2_4"), "sparse_dx"),
]


@pytest.mark.parametrize("name,want", GPU_NAMES, ids=[n[:40] for n, _ in GPU_NAMES])
def test_classify_gpu_kernel_names(name, want):
    assert classify(name) == want


@pytest.mark.parametrize("name,info,want", HLO_EVENTS, ids=[n for n, _, _ in HLO_EVENTS])
def test_classify_with_hlo_info(name, info, want):
    assert classify(name, info) == want


_WS = ("void jaxsparse::(anonymous namespace)::SpmmWgmmaXtWsKernel<__nv_bfloat16, 128, 256, 4, true, 256, 0>"
       "(jaxsparse::(anonymous namespace)::SpmmXtParams, CUtensorMap_st, CUtensorMap_st, CUtensorMap_st)")


def _route_hlo(fwd: int, dx: int) -> dict:
    """A step's HLO summary with ``fwd`` forward and ``dx`` transposed-route calls of the forward kernel (each with
    its W^T build); the custom calls carry no op_name, as in the compiled GPU module."""
    call = lambda target: OpInfo("custom-call", "", False, (), frozenset({"custom-call"}), target)
    hlo = {f"custom-call.f{i}": call("jaxsparse_spmm_xt") for i in range(fwd + dx)}
    hlo.update({f"custom-call.t{i}": call("jaxsparse_transpose_2_4") for i in range(dx)})
    return hlo


def test_transposed_route_events_without_hlo_op_split_by_order():
    """Inside command buffers the forward kernel's events carry no hlo_op: the ones after each step's forward
    products (by start time) are the transposed dX route's, with their own durations."""
    steps, fwd, dx = 2, 3, 3
    events, t = [], 0.0
    for _ in range(steps):  # per step: 3 forward products of 1 us, an SDDMM, then 3 dX products of 5 us
        for _ in range(fwd):
            events.append(profile.DeviceEvent(_WS, "", 1000.0, "stream 7", t)); t += 2000
        events.append(profile.DeviceEvent("void jaxsparse::SddmmWgmmaXtKernel<bf16, true>", "", 700.0, "s", t)); t += 1000
        for _ in range(dx):
            events.append(profile.DeviceEvent(_WS, "", 5000.0, "stream 7", t)); t += 6000
    shuffled = events[1::2] + events[0::2]  # the trace's order is not the time order
    p = profile.summarize(shuffled, _route_hlo(fwd, dx), steps, step_ms=1.0)
    assert p.buckets["sparse_fwd"]["ms"] == pytest.approx(fwd * 1e-3) and p.buckets["sparse_fwd"]["count"] == fwd
    assert p.buckets["sparse_dx"]["ms"] == pytest.approx(dx * 5e-3) and p.buckets["sparse_dx"]["count"] == dx
    assert p.buckets["sddmm"]["count"] == 1
    assert "split by order" in p.device["split"] and "note: forward-kernel events split" in profile.format_table(p)
    # a count that does not match the HLO's calls leaves every event where its name puts it, and says so
    p = profile.summarize(shuffled[:-1], _route_hlo(fwd, dx), steps, step_ms=1.0)
    assert p.buckets["sparse_dx"]["count"] == 0 and "left under sparse forward" in p.device["split"]
    # without input-gradient calls in the HLO (the dense dX route) nothing moves and nothing is noted
    p = profile.summarize(shuffled, _route_hlo(2 * fwd, 0), steps, step_ms=1.0)
    assert p.buckets["sparse_dx"]["count"] == 0 and "split" not in p.device


@pytest.mark.parametrize("spec", ["2:4", "64:2:8"])
def test_transposed_route_hlo_has_one_w_t_build_per_input_gradient(monkeypatch, spec):
    """What the split counts on, on a real module: lowered for CUDA (on any machine: lowering needs no GPU), a sparse
    layer's gradient on the transposed route holds one ``jaxsparse_transpose_2_4`` per input-gradient product."""
    from jaxsparse import ffi, format as fmt, ops
    from jaxsparse.ffi import calls

    monkeypatch.setattr(ffi, "available", lambda: True)  # take the kernel branch of every dispatch when lowering
    monkeypatch.setattr(calls, "register", lambda: None)
    k, r, t = 256, 256, 64
    w = jax.random.normal(jax.random.PRNGKey(0), (k, r), jnp.float32)
    sw = fmt.compress(w.astype(jnp.bfloat16), fmt.select_mask(jnp.abs(w), spec, transposable=True), spec)
    x = jax.random.normal(jax.random.PRNGKey(1), (t, k), jnp.bfloat16)

    def loss(x, values):  # two layers, both sparse: two forward products, two input gradients, two W^T builds
        s = sw.replace(values=values)
        h = ops.sparse_linear(x, s)
        return jnp.sum(jnp.square(ops.sparse_linear(h[:, :k], s).astype(jnp.float32)))  # needs both outputs

    with ops.dx_route_scope("transposed"):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, sw.values).lower(lowering_platforms=("cuda",))
    hlo = profile.parse_hlo(lowered.as_text(dialect="hlo"))
    targets = [i.custom_call_target for i in hlo.values() if i.custom_call_target]
    assert targets.count("jaxsparse_transpose_2_4") == 2, targets
    assert profile._spmm_calls(hlo) == (2, 2), targets


@pytest.mark.parametrize("shared", ["auto", "off"])
@pytest.mark.parametrize("shared_spmm", ["auto", "off"])
def test_shared_input_gradient_counts_as_one_product(monkeypatch, shared, shared_spmm):
    """Three 2:4 layers of one input through ``ops.shared_linear``, lowered for a Hopper GPU: one stacked W^T build
    feeds one summed input-gradient product (``JAXSPARSE_SHARED_DX`` on), or three builds feed three products (off);
    the forward is one stacked product (``JAXSPARSE_SHARED_SPMM`` on) or three (off); the split counts the
    products."""
    from jaxsparse import ffi, format as fmt, ops
    from jaxsparse.ffi import calls

    monkeypatch.setattr(ffi, "available", lambda: True)
    monkeypatch.setattr(calls, "register", lambda: None)
    monkeypatch.setattr(calls, "hopper_gpu", lambda: True)
    monkeypatch.setenv(ops.SHARED_DX_ENV, shared)
    monkeypatch.setenv(ops.SHARED_SPMM_ENV, shared_spmm)
    k, r, t = 128, 128, 64
    sws = []
    for i in range(3):
        w = jax.random.normal(jax.random.PRNGKey(i), (k, r), jnp.float32)
        sws.append(fmt.compress(w.astype(jnp.bfloat16), fmt.select_mask(jnp.abs(w), "2:4", transposable=True), "2:4"))
    x = jax.random.normal(jax.random.PRNGKey(5), (t, k), jnp.bfloat16)

    def loss(x, values):
        ys = ops.shared_linear(x, [s.replace(values=v) for s, v in zip(sws, values)])
        return sum(jnp.sum(jnp.square(y.astype(jnp.float32))) for y in ys)

    with ops.dx_route_scope("transposed"):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, [s.values for s in sws]).lower(
            lowering_platforms=("cuda",))
    hlo = profile.parse_hlo(lowered.as_text(dialect="hlo"))
    targets = [i.custom_call_target for i in hlo.values() if i.custom_call_target]
    dx = 1 if shared == "auto" else 3
    assert targets.count("jaxsparse_transpose_2_4") == dx, targets
    assert profile._spmm_calls(hlo) == (1 if shared_spmm == "auto" else 3, dx), targets


def test_parse_hlo_reads_dots_scopes_and_contracting_dims():
    def f(x, w, v):
        with jax.named_scope("optimizer"):
            dw = jnp.dot(x.T, w)  # [32, 48]: contracts over the leading (token) dimension
        return jnp.dot(x, v), dw  # [64, 16]: contracts over features

    text = jax.jit(f).lower(jnp.ones((64, 32)), jnp.ones((64, 48)), jnp.ones((32, 16))).compile().as_text()
    hlo = profile.parse_hlo(text)
    dots = [i for i in hlo.values() if i.has_dot and i.opcode != "parameter"]
    assert any(i.dot_lhs_contracting == (0,) and "optimizer" in i.op_name for i in dots), text[-3000:]
    assert any(i.dot_lhs_contracting == (1,) and "optimizer" not in i.op_name for i in dots), text[-3000:]


def test_parse_hlo_counts_each_instructions_operand_and_result_bytes():
    """The memory floor of a top op rests on these: a fusion reading two [64, 32] float32 arrays and a bfloat16 [32]
    bias, writing one bfloat16 [64, 32] array, moves 2*8192 + 64 + 4096 bytes (tuple results counted whole)."""
    def f(a, b, c):
        return (a * b + c.astype(jnp.float32)).astype(jnp.bfloat16)

    text = jax.jit(f).lower(jnp.ones((64, 32)), jnp.ones((64, 32)), jnp.ones((32,), jnp.bfloat16)).compile().as_text()
    hlo = profile.parse_hlo(text)
    fusions = [i for i in hlo.values() if i.opcode == "fusion"]
    assert [i.io_bytes for i in fusions] == [2 * 64 * 32 * 4 + 32 * 2 + 64 * 32 * 2], text
    assert profile._shape_bytes("(f32[8]{0}, bf16[2,3]{1,0}, pred[], s32[4])") == 32 + 12 + 1 + 16
    assert profile._operands("f32[2] %a, (f32[1], s8[3]) %t), kind=kLoop, calls=%c") == "f32[2] %a, (f32[1], s8[3]) %t"


def test_top_ops_named_in_the_hlo_get_their_memory_floor():
    """A GPU kernel that XLA emitted is named after its instruction (``.`` written ``_``) even when its event's hlo_op
    is the command buffer around it: its op_name and bytes come from that instruction, its floor is the bytes at
    HBM_TBPS per call."""
    hlo = {"loop_add_fusion.3": OpInfo("fusion", "jit(step)/encoder/LayerNorm/add", io_bytes=3_000_000),
           "command_buffer_1": OpInfo("call")}
    events = [profile.DeviceEvent("loop_add_fusion_3", "command_buffer_1", 2000.0, "s", float(i)) for i in range(4)]
    events.append(profile.DeviceEvent("void some_library_kernel<int>", "command_buffer_1", 500.0, "s", 9.0))
    p = profile.summarize(events, hlo, steps=2, step_ms=1.0)
    top = {t["name"]: t for t in p.top}
    add = top["loop_add_fusion_3"]
    assert add["count"] == 2 and add["ms"] == pytest.approx(4e-3)
    assert add["floor_ms"] == pytest.approx(2 * 3e6 / (profile.HBM_TBPS * 1e12) * 1e3)  # 2 calls a step
    assert add["over_floor"] == pytest.approx(add["ms"] / add["floor_ms"])
    assert add["op_name"].endswith("LayerNorm/add") and add["io_bytes"] == 3_000_000
    assert "floor_ms" not in top["void some_library_kernel<int>"]
    table = profile.format_table(p, top=5)
    assert f"floor {add['floor_ms']:7.3f} ({add['over_floor']:4.1f}x)" in table


def test_top_scopes_fold_one_ops_kernel_names_and_layer_indices():
    """One op under several kernel names (XLA's per-layer fusions) is one scope, every layer index written N; a
    kernel without an op name is its own scope. Both land in the JSON and, with --top, in the table."""
    ln = "jit(step)/transpose(jvp(M))/bert/encoder_layer_{}/LayerNorm/reduce_sum"
    hlo = {"loop_add_fusion.486": OpInfo("fusion", "jit(step)/optimizer/add"),
           "loop_add_fusion.490": OpInfo("fusion", "jit(step)/optimizer/add"),
           "input_reduce_fusion.7": OpInfo("fusion", ln.format(3)),
           "input_reduce_fusion.9": OpInfo("fusion", ln.format(11))}
    ev = [profile.DeviceEvent("loop_add_fusion_486", "command_buffer_1", 100.0, "s"),
          profile.DeviceEvent("loop_add_fusion_490", "command_buffer_1", 300.0, "s"),
          profile.DeviceEvent("input_reduce_fusion_7", "command_buffer_1", 50.0, "s"),
          profile.DeviceEvent("input_reduce_fusion_9", "command_buffer_1", 70.0, "s"),
          profile.DeviceEvent("void jaxsparse::SddmmKernel", "command_buffer_1", 1000.0, "s")]
    p = profile.summarize(ev, hlo, steps=1, step_ms=1.0)
    scopes = {t["scope"]: t for t in p.scopes}
    assert set(scopes) == {"jit(step)/optimizer/add", ln.format("N"), "void jaxsparse::SddmmKernel"}
    add = scopes["jit(step)/optimizer/add"]
    assert add["count"] == 2 and add["kernels"] == 2 and add["ms"] == pytest.approx(4e-4)
    assert scopes[ln.format("N")]["kernels"] == 2
    assert [t["scope"] for t in p.scopes][0] == "void jaxsparse::SddmmKernel"  # by time
    assert p.to_json()["top_scopes"] == p.scopes
    assert "in   2 kernel names" in profile.format_table(p, top=5)


def test_command_buffer_events_take_the_instruction_their_kernel_is_named_after():
    """On a GPU every event of the step runs inside a command buffer (its hlo_op names the buffer, not in the module's
    text): XLA's own kernels are still classified by the instruction they are named after (the optimizer's update is
    ``optimizer``, not elementwise), and library kernels by their names, with no instruction (so the forward kernel's
    split by order still finds them)."""
    hlo = {"loop_add_fusion.486": OpInfo("fusion", "jit(step)/optimizer/add", fused_opcodes=frozenset({"add"})),
           "input_reduce_fusion.7": OpInfo("fusion", "jit(step)/bert/encoder_layer_3/LayerNorm/reduce_sum",
                                           fused_opcodes=frozenset({"reduce", "add"}))}
    ev = [profile.DeviceEvent("loop_add_fusion_486", "command_buffer_1", 100.0, "s"),
          profile.DeviceEvent("input_reduce_fusion_7", "command_buffer_1", 50.0, "s"),
          profile.DeviceEvent("void jaxsparse::SddmmKernel", "command_buffer_1", 1000.0, "s"),
          profile.DeviceEvent("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "command_buffer_2", 700.0, "s")]
    p = profile.summarize(ev, hlo, steps=1, step_ms=1.0)
    assert p.buckets["optimizer"]["count"] == 1 and p.buckets["optimizer"]["ms"] == pytest.approx(1e-4)
    assert p.buckets["elementwise_norm"]["count"] == 1 and p.buckets["sddmm"]["count"] == 1
    assert p.buckets["attention"]["count"] == 1
    assert profile._event_info(ev[2], hlo, hlo) is None


def test_real_cpu_profile_buckets_sum_to_measured_total(tmp_path, capsys):
    out = tmp_path / "prof.json"
    trace = tmp_path / "trace"
    rc = profile.main(["--model", "tiny", "--sparsity", "2:4", "--batch-size", "2", "--seq-len", "32", "--steps", "2",
                       "--warmup", "1", "--top", "3", "--trace-dir", str(trace), "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "/host:CPU" in printed and "Amdahl bound" in printed
    d = json.loads(out.read_text())
    assert d["mode"] == "compressed" and d["device"]["kind"] == "cpu"
    # the measured total, read again from the trace file independently of the bucketing
    events, _ = profile.device_events(d["device"]["xplane"], d["hlo_module"])
    measured_ms = sum(e.duration_ns for e in events) / 1e6 / d["steps_traced"]
    assert measured_ms > 0
    assert sum(b["ms"] for b in d["buckets"].values()) == pytest.approx(measured_ms, rel=1e-9)
    assert d["busy_ms"] == pytest.approx(measured_ms, rel=1e-9)
    assert sum(b["count"] for b in d["buckets"].values()) == pytest.approx(len(events) / d["steps_traced"])
    for b in ("sparse_fwd", "sddmm", "sparse_dx", "optimizer", "elementwise_norm"):
        assert d["buckets"][b]["ms"] > 0, b
    sparse = sum(d["buckets"][b]["ms"] for b in profile.SPARSE_BUCKETS)
    assert d["sparse_ms"] == pytest.approx(sparse)
    assert d["amdahl_bound_ms"] == pytest.approx(max(d["step_ms"] - sparse, 0.0))
    # each of the 12 compressed layers' backward runs its dX dot inside the ``jaxsparse_spmm_t`` scope; the
    # reference's weight decompression in that scope may add fusions of its own (14 seen on JAX 0.10.2)
    assert d["buckets"]["sparse_dx"]["count"] >= 12


@pytest.mark.parametrize("flag, said, meta, route, dense_error", [
    ("--transposable-masks", "transposable masks (dX on W^T)", "transposable_masks", "transposed",
     "transposable masks need a sparse pattern"),
    ("--exclusive-columns", "column-exclusive masks (dX by V blocks)", "exclusive_columns", "blocks", "M > 4"),
])
def test_cpu_profile_of_a_dx_route(tmp_path, capsys, flag, said, meta, route, dense_error):
    """--transposable-masks / --exclusive-columns: the step traces with those masks on their dX route (restored
    after), records both, and the route's work lands under sparse_dx; a dense run is refused."""
    import os

    from jaxsparse import ops

    out = tmp_path / "prof.json"
    before = os.environ.get(ops.DX_ROUTE_ENV)
    rc = profile.main(["--model", "tiny", "--sparsity", "64:2:8", "--batch-size", "2", "--seq-len", "32", "--steps",
                       "1", "--warmup", "1", "--top", "0", flag, "--json", str(out)])
    assert rc == 0 and os.environ.get(ops.DX_ROUTE_ENV) == before
    assert said in capsys.readouterr().out
    d = json.loads(out.read_text())
    assert d[meta] is True and d["dx_route"] == route
    assert d["buckets"]["sparse_dx"]["ms"] > 0
    with pytest.raises(ValueError, match=dense_error):
        profile.main(["--model", "tiny", "--sparsity", "dense", flag])


def test_cpu_profile_keeps_a_dx_route_set_in_the_environment(tmp_path, monkeypatch):
    """A ``JAXSPARSE_DX`` set by the user wins over the masks' own route (``resident`` with transposable masks: on the
    CPU it runs the transposed route, where its kernel does not apply), and the profile records the route traced and
    the ``JAXSPARSE_*`` settings it ran under."""
    from jaxsparse import ops

    monkeypatch.setenv(ops.DX_ROUTE_ENV, "resident")
    monkeypatch.setenv("JAXSPARSE_DZ_EPILOGUE", "off")
    out = tmp_path / "prof.json"
    assert profile.main(["--model", "tiny", "--sparsity", "128:2:16", "--batch-size", "2", "--seq-len", "32",
                         "--steps", "1", "--warmup", "1", "--top", "0", "--transposable-masks", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["transposable_masks"] is True and d["dx_route"] == "resident"
    assert d["settings"][ops.DX_ROUTE_ENV] == "resident" and d["settings"]["JAXSPARSE_DZ_EPILOGUE"] == "off"
    assert d["buckets"]["sparse_dx"]["ms"] > 0


_AD_NAMED_HLO = """\
HloModule jit_loss

%fused_reduce.1 (param_0.7: f32[256]) -> f32[] {
  %param_0.7 = f32[256]{0} parameter(0), metadata={scheduling_name="param_0.7"}
  %constant_3_1 = f32[] constant(0)
  ROOT %reduce_sum.14.1 = f32[] reduce(%param_0.7, %constant_3_1), dimensions={0}, to_apply=%region_0.1, metadata={op_name="jit(loss)/jvp()/reduce_sum"}
}

%fused_t (p: bf16[4,8]) -> bf16[8,4] {
  %p = bf16[4,8]{1,0} parameter(0)
  ROOT %t = bf16[8,4]{1,0} transpose(%p), dimensions={1,0}
}

ENTRY %main.3 (x.1: bf16[256,512], target.1: f32[256,256]) -> (f32[], bf16[256,512]) {
  %target.1 = f32[256,256]{1,0} parameter(1), metadata={op_name="target"}
  %x.1 = bf16[256,512]{1,0} parameter(0), metadata={op_name="x"}
  %input_reduce_fusion = bf16[256]{0} fusion(%target.1), kind=kInput, calls=%fused_reduce.1, metadata={op_name="jit(loss)/transpose(jvp())/convert_element_type"}
  %tf = bf16[8,4]{1,0} fusion(%x.1), kind=kLoop, calls=%fused_t
  ROOT %tuple.1.0 = (f32[], bf16[256,512]{1,0}) tuple(%input_reduce_fusion, %x.1)
}
"""


def test_layout_moves_reads_opcodes_not_metadata():
    """The GPU tests' no-transpose check: JAX's AD metadata says transpose(jvp(..)), which is no transpose."""
    from gpu_common import layout_moves

    assert layout_moves(_AD_NAMED_HLO) == ["t:transpose", "tf:fusion"]
    no_move = _AD_NAMED_HLO.replace("  %tf = bf16[8,4]{1,0} fusion(%x.1), kind=kLoop, calls=%fused_t\n", "")
    no_move = no_move.replace("ROOT %t = bf16[8,4]{1,0} transpose(%p)", "ROOT %t = bf16[8,4]{1,0} negate(%p)")
    assert layout_moves(no_move) == []


def test_standalone_layout_moves_counts_only_kernels_that_just_move():
    """A fusion that only transposes is a layout kernel of its own; a producer that computes and writes its
    result transposed is not; moves inside fused bodies are not counted as instructions that run."""
    from gpu_common import standalone_layout_moves

    assert standalone_layout_moves(_AD_NAMED_HLO) == ["tf:fusion"]
    computing = _AD_NAMED_HLO.replace("ROOT %t = bf16[8,4]{1,0} transpose(%p)",
                                      "%n = bf16[4,8]{1,0} tanh(%p)\n  ROOT %t = bf16[8,4]{1,0} transpose(%n)")
    assert standalone_layout_moves(computing) == []


def test_profile_defaults_to_the_headline_batch():
    """Without --batch-size the profile traces the batch the headline benchmark times (BERT-large at 512 tokens:
    32), so its breakdown describes that step; an explicit --batch-size wins, and other shapes take 8."""
    from jaxsparse import profile
    from jaxsparse.trainstep import HEADLINE_BATCH, default_batch_size

    assert default_batch_size("large", 512) == HEADLINE_BATCH[("large", 512)] == 32
    assert default_batch_size("tiny", 128) == 8
    cfg = profile.step_config(profile.parse_args(["--model", "large", "--seq-len", "512", "--sparsity", "dense"]))
    assert (cfg.model, cfg.seq_len, cfg.batch_size) == ("large", 512, 32)
    cfg = profile.step_config(profile.parse_args(["--model", "large", "--seq-len", "512", "--batch-size", "4"]))
    assert cfg.batch_size == 4
    assert profile.step_config(profile.parse_args([])).batch_size == 8


def test_profile_runs_the_benchmarks_dropout():
    """The profiled step uses the hash dropout, as benchmarks/train_step.py does by default; --dropout rng profiles
    flax's."""
    assert profile.step_config(profile.parse_args([])).bert_config().dropout_impl == "hash"
    assert profile.step_config(profile.parse_args(["--dropout", "rng"])).bert_config().dropout_impl == "rng"


@pytest.mark.parametrize("argv, message", [
    (["--sparsity", "garbage"], "--sparsity: "), (["--steps", "0"], "--steps must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1"), (["--devices", "0"], "--devices must be >= 1"),
    (["--seq-len", "0"], "--seq-len must be >= 1"), (["--warmup", "-1"], "--warmup must be >= 0"),
])
def test_cli_rejects_bad_values_naming_the_flag(argv, message, capsys):
    from jaxsparse import profile

    with pytest.raises(SystemExit):
        profile.parse_args(argv)
    assert message in capsys.readouterr().err


def test_devices_makes_the_batch_per_device_and_a_data_parallel_step():
    """--devices N profiles the data-parallel step: the batch given (or the headline's) is per device."""
    from jaxsparse import profile

    cfg = profile.step_config(profile.parse_args(["--model", "large", "--seq-len", "512", "--devices", "2"]))
    assert (cfg.devices, cfg.batch_size) == (2, 64)
    cfg = profile.step_config(profile.parse_args(["--batch-size", "3", "--devices", "4"]))
    assert (cfg.devices, cfg.batch_size) == (4, 12)


def test_events_in_command_buffers_is_the_share_launched_from_graphs():
    events = [profile.DeviceEvent("k", "command_buffer_1", 1.0, "s"), profile.DeviceEvent("k", "fusion_3", 1.0, "s"),
              profile.DeviceEvent("k", "command_buffer_2", 1.0, "s"), profile.DeviceEvent("k", "", 1.0, "s")]
    p = profile.summarize(events, {}, steps=1, step_ms=1.0)
    assert p.device["events_in_command_buffers"] == pytest.approx(0.5)


def _saved(device: str = "gpu:NVIDIA H200", **ms: float) -> dict:
    """A minimal --json breakdown: every bucket (``ms`` gives some a time), busy the sum, a step time."""
    buckets = {b: {"ms": ms.get(b, 0.0), "pct_step": 0.0, "pct_busy": 0.0, "count": 1.0} for b in profile.BUCKETS}
    busy = sum(ms.values())
    return {"model": "large", "sparsity": "dense", "dropout": "hash", "device": {"device": device},
            "buckets": buckets, "busy_ms": busy, "step_ms": busy + 5.0}


def test_compare_sets_two_breakdowns_side_by_side(tmp_path, capsys):
    """--compare profiles nothing: it prints each class's ms in A and B with their difference, the totals and B's
    speedup in busy time; breakdowns from different devices, or a file that is not one, are refused."""
    a = _saved(dense_gemm=40.0, elementwise_norm=30.0, attention=10.0)
    b = dict(_saved(sparse_fwd=13.0, sddmm=14.0, sparse_dx=11.0, elementwise_norm=18.0, attention=9.0),
             sparsity="64:2:8", transposable_masks=True, dropout="rng")
    text = profile.compare_table(a, b)
    assert "A: BERT-large dense, hash dropout" in text and "B: BERT-large 64:2:8, transposable, flax's dropout" in text
    assert "elementwise and norms" in text and "-12.000" in text and "+13.000" in text
    assert "optimizer" not in text  # a class empty in both is left out
    assert "B over A in busy time: 1.231x" in text  # 80 / 65
    with pytest.raises(ValueError, match="different devices"):
        profile.compare_table(a, _saved(device="gpu:NVIDIA H100 80GB HBM3", dense_gemm=1.0))
    with pytest.raises(ValueError, match="not a jaxsparse-profile --json breakdown"):
        profile.compare_table(a, {"buckets": {}})
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert profile.main(["--compare", str(pa), str(pb)]) == 0
    assert capsys.readouterr().out.strip() == text
    with pytest.raises(SystemExit, match="cannot read"):
        profile.main(["--compare", str(pa), str(tmp_path / "missing.json")])


def test_gemm_configs_reads_what_the_compiler_chose():
    """``gemm_configs`` counts each GEMM's choice by result shape: cuBLAS's selected algorithm (its backend config
    nested in braces, a brace inside a quoted op_name after it), a Triton GEMM's tiling (older and nested-fusion
    configs); other fusions, a Triton softmax with its block-level config among them, are not GEMMs, and a CPU module
    has none."""
    gemm = ('  %custom-call.{i} = (bf16[16384,1024]{{1,0}}, s8[4194304]{{0}}) custom-call(bf16[16384,4096]{{1,0}} %p0, '
            'bf16[4096,1024]{{1,0}} %p1), custom_call_target="__cublas$gemm", backend_config={{"operation_queue_id":'
            '"0","gemm_backend_config":{{"alpha_real":1,"selected_algorithm":"{a}","epilogue":"DEFAULT"}}}}, '
            'metadata={{op_name="jit(step)/dot{{x}}"}}')
    triton = ('  %fusion.2 = bf16[64,64]{1,0} fusion(bf16[64,32]{1,0} %a, bf16[32,64]{1,0} %b), kind=kCustom, '
              'calls=%gemm_fusion, backend_config={"fusion_backend_config":{"kind":"__triton_gemm",'
              '"triton_gemm_config":{"block_m":"64","block_n":"32","split_k":"1"}}}')
    nested = ('  %fusion.4 = bf16[16384,1024]{1,0} fusion(bf16[16384,4096]{1,0} %a, bf16[4096,1024]{1,0} %b), '
              'kind=kCustom, calls=%gemm_fusion_dot, backend_config={"fusion_backend_config":{"kind":'
              '"__triton_nested_gemm_fusion","block_level_fusion_config":{"num_warps":"8","num_stages":4}}}')
    softmax = ('  %fusion.5 = f32[64,512]{1,0} fusion(f32[64,512]{1,0} %s), kind=kCustom, calls=%softmax, '
               'backend_config={"fusion_backend_config":{"kind":"__triton","block_level_fusion_config":'
               '{"num_warps":"4"}}}')
    loop = '  %fusion.3 = f32[8]{0} fusion(f32[8]{0} %c), kind=kLoop, calls=%add, backend_config={"fusion_backend_config":{"kind":"__loop"}}'
    text = "\n".join([gemm.format(i=1, a=7), gemm.format(i=2, a=7), gemm.format(i=3, a=12), triton, nested, softmax,
                      loop])
    assert profile.gemm_configs(text) == {
        "(bf16[16384,1024]{1,0}, s8[4194304]{0}) __cublas$gemm algorithm 12": 1,
        "(bf16[16384,1024]{1,0}, s8[4194304]{0}) __cublas$gemm algorithm 7": 2,
        "bf16[16384,1024]{1,0} __triton_nested_gemm_fusion num_stages=4 num_warps=8": 1,
        "bf16[64,64]{1,0} __triton_gemm block_m=64 block_n=32 split_k=1": 1,
    }
    cpu = jax.jit(lambda a, b: a @ b).lower(jnp.ones((8, 8)), jnp.ones((8, 8))).compile().as_text()
    assert profile.gemm_configs(cpu) == {}
