"""Tests for spmd3d.bench on a tiny model: the record's numbers are sane and the CLI is parseable.

Timings depend on machine load, so only their sign is checked; the parameter count and the
tensor-parallel all-reduce are exact properties of the model and mesh.
"""

import json
from pathlib import Path

import pytest

from spmd3d import config as config_lib
from spmd3d import hlo, manual, profile
from spmd3d.bench import (format_report, main, measure_attention, measure_checkpoint,
                          measure_experts, run_bench)

TINY = ["model.num_layers=1", "model.d_model=64", "model.num_kv_heads=4", "model.d_ff=128",
        "train.seq_len=32", "train.global_batch=8", "mesh.simulated_devices=0", "mesh.tensor=2"]


def expected_params(m) -> int:
    """LLaMA-style parameter count from the dims alone (independent of the model code)."""
    d, h, k, f, v = m.d_model, m.num_heads, m.num_kv_heads, m.d_ff, m.vocab_size
    hd = d // h
    layer = 2 * d + d * (h + 2 * k) * hd + h * hd * d + 2 * d * f + f * d
    return v * d + d * v + d + m.num_layers * layer


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    cfg = config_lib.load(None, TINY)
    return cfg, run_bench(cfg, steps=2, warmup=1, profile_dir=str(tmp_path_factory.mktemp("prof")))


def test_run_bench_record(record):
    from spmd3d.metrics import flops_per_token

    cfg, r = record
    assert r["params"] == expected_params(cfg.model)
    assert r["mesh"] == {"data": 4, "stage": 1, "tensor": 2, "seq": 1} and r["devices"] == 8
    # the figures are one another's: tokens of a step over its median time, model FLOPs of
    # those tokens over the peak
    assert r["compile_s"] > 0 and r["step_time_median_s"] > 0
    tokens = cfg.train.global_batch * cfg.train.seq_len
    assert r["tokens_per_s"] == pytest.approx(tokens / r["step_time_median_s"])
    assert r["mfu"] == pytest.approx(flops_per_token(cfg.model, cfg.train.seq_len)
                                     * r["tokens_per_s"] / (r["peak_tflops"] * 1e12))
    # the compiled step's arguments: the state (fp32 weights, two Adam moments), between all
    # of it split over the 8 devices and all of it on each (exact per layout: test_zero)
    m, state = r["memory"], 3 * 4 * r["params"]
    assert state / 8 <= m["argument_bytes"] <= state + 4 * tokens
    assert m["total_bytes"] == (m["argument_bytes"] + m["output_bytes"] + m["temp_bytes"]
                                - m["alias_bytes"])
    assert any(c["kind"] == "all-reduce" and c["axes"] == ["tensor"] and c["count"] > 0
               for c in r["collectives"])
    assert r["peak_bytes"] is None  # CPU devices keep no memory_stats (a GPU's: test_gpu_preset)
    json.dumps(r)  # the record is JSON-serializable as it is


def test_profile_summary(record):
    """The trace is written, and its events add up per instruction of the compiled step: the
    tensor-parallel step spends time in matmuls and in collectives."""
    _, r = record
    p = r["profile"]
    assert Path(p["trace"]).is_file() and p["trace"].endswith("perfetto_trace.json.gz")
    assert p["op_seconds_per_step"] > 0
    assert set(p["by_category"]) <= {"matmuls", "collectives", "other"}
    assert p["by_category"]["matmuls"] > 0 and p["by_category"]["collectives"] > 0
    assert sum(p["by_category"].values()) == pytest.approx(p["op_seconds_per_step"])
    assert p["top"] and all(op["seconds"] > 0 and op["opcode"] != "while" for op in p["top"])
    assert "op time" in format_report(r)


def test_profile_categories():
    text = """
  %ynn_fusion.3 = f32[64,128]{1,0} fusion(%a, %b), kind=kCustom, calls=%c
  %all-reduce.49 = f32[64,64]{1,0} all-reduce(%x), channel_id=4, to_apply=%add
  ROOT %ag-start = (f32[8], f32[16]) all-gather-start(%y), dimensions={0}
  %dot.1 = f32[4,4]{1,0} dot(%p, %q), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %add_fusion = f32[4]{0} fusion(%r), kind=kLoop, calls=%d
  %while.2 = (s32[], f32[4]) while(%t), condition=%cond, body=%body
"""
    ops = hlo.instructions(text)
    assert ops["all-reduce.49"] == ("all-reduce", "f32[64,64]{1,0}")
    assert ops["ag-start"] == ("all-gather-start", "(f32[8], f32[16])")
    assert {n: profile.category(n, ops[n][0]) for n in ops} == {
        "ynn_fusion.3": "matmuls", "all-reduce.49": "collectives", "ag-start": "collectives",
        "dot.1": "matmuls", "add_fusion": "other", "while.2": "other"}


def test_profile_of_a_gpu_trace(tmp_path):
    """A GPU trace (as jax 0.11 writes one on an H100): kernels on the device's streams, most
    launched from CUDA graphs that name no instruction, are summed by kernel name and sorted
    by it; an instruction the step names keeps its own entry; host events do not count."""
    import gzip

    meta = [{"ph": "M", "name": "process_name", "pid": p, "args": {"name": n}}
            for p, n in ((1, "/host:CPU"), (2, "/device:GPU:0"))]

    def kernel(name, op, ms):
        return {"ph": "X", "pid": 2, "tid": 14, "name": name, "dur": ms * 1e3,
                "args": {"hlo_op": op, "hlo_module": "jit_train_step"}}

    events = meta + [
        {"ph": "X", "pid": 1, "tid": 1, "name": "block_until_ready", "dur": 9e6},
        kernel("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "command_buffer_90", 30),
        kernel("sm90_xmma_gemm_f32f32_tf32f32_f32_nt_n_tilesize128x256x32", "command_buffer_61", 20),
        kernel("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", "command_buffer_90", 10),
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "command_buffer_90", 6),
        kernel("loop_add_fusion_1", "command_buffer_61", 4),
        kernel("loop_add_subtract_fusion", "add_fusion", 8),
        kernel("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "command_buffer_10", 30)]
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    hlo_text = "  %add_fusion = f32[4]{0} fusion(%r), kind=kLoop, calls=%d\n"
    p = profile.summarize(path, hlo_text, steps=2)
    assert p["device"] and p["op_seconds_per_step"] == pytest.approx(0.054)
    assert p["by_category"] == pytest.approx(
        {"matmuls": 0.040, "attention": 0.005, "collectives": 0.003, "other": 0.006})
    assert [(op["name"][:6], op["opcode"]) for op in p["top"]] == [
        ("nvjet_", "kernel"), ("sm90_x", "kernel"), ("cudnn_", "kernel"),
        ("add_fu", "fusion"), ("ncclDe", "kernel"), ("loop_a", "kernel")]
    assert "summed over device streams" in "\n".join(profile.format_summary(p))


def test_main_json_last_line(capsys):
    assert main(TINY + ["--steps=2", "--warmup=1", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    r = json.loads(out[-1])
    for key in ("config", "mesh", "devices", "device_kind", "dtype", "zero_stage", "params",
                "compile_s", "step_time_median_s", "step_time_mean_s", "tokens_per_s", "mfu",
                "memory", "peak_bytes", "collectives"):
        assert key in r
    assert r["config"] == "default" and r["tokens_per_s"] > 0
    # the whole config as it ran (dtype and mesh resolved), which `plan --calibrate` replans
    ran, asked = config_lib.load(base=r["cfg"]), config_lib.load(None, TINY)
    assert ran.model.dtype == r["dtype"] and ran.mesh.sizes() == r["mesh"]
    assert (ran.train, ran.parallel, ran.model.d_model) == (asked.train, asked.parallel, 64)
    assert any(line.startswith("bench default") for line in out[:-1])  # the human report


def test_checkpoint_timings():
    """Each timing is positive (how they compare is load-dependent: that is the benchmark's to
    report), a synchronous save has committed its step when it returns, and the size is that of
    the parameters and both Adam moments (fp32, barely compressible)."""
    cfg = config_lib.load(None, TINY)
    c = measure_checkpoint(cfg, saves=1)
    for mode in ("async", "sync"):  # the caller waits for part of the save, at most all
        assert 0 < c[mode]["blocking_s"] <= c[mode]["total_s"]
    assert c["sync"]["committed_on_return"] is True
    assert c["restore_s"] > 0
    assert 0.8 < c["bytes"] / (3 * 4 * expected_params(cfg.model)) < 1.5


@pytest.mark.parametrize("args, field", [
    (["model.num_layers=zero"], "model.num_layers"),
    (["--steps=0"], "argv"),
    (["--bogus"], "argv"),
    (["--profile"], "argv"),
    # XLA's cost analysis counts a conditional as its costliest branch: no FLOPs to compare
    (["model.num_layers=2", "mesh.stage=2", "train.microbatches=2",
      "parallel.pipeline_schedule=zb_h1", "--bubble"], "parallel.pipeline_schedule"),
])
def test_main_bad_input_exits_2(capsys, args, field, monkeypatch):
    """Refused before the benchmark compiles anything."""
    monkeypatch.setattr("spmd3d.bench.run_bench", lambda *a, **k: pytest.fail("benchmarked"))
    assert main(TINY + args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {field}:") and len(err.splitlines()) == 1


def test_model_flops_match_the_compiled_step():
    """The MFU numerator against XLA's count of the compiled step (one device, layers and the
    loss unrolled, no recompute): 6 N per token plus the attention scores, at the share of the
    score matrix the blocked kernel computes (all of it in one tile of 512: XLA's count takes a
    tile the kernel skips behind a `cond` as computed, so more tiles would not show it), within
    5 % (the rest is elementwise work: norms, softmax, the optimizer). Attention is a fifth of
    this model's FLOPs, so counting it causal (half) or not at all would miss."""
    import jax

    from spmd3d import attention
    from spmd3d.metrics import flops_per_token
    from spmd3d.runtime import setup

    t = 512
    cfg = config_lib.load(None, [
        "model.num_layers=2", "model.d_model=256", "model.num_heads=4", "model.num_kv_heads=2",
        "model.d_ff=1024", "model.vocab_size=512", f"train.seq_len={t}", "train.global_batch=2",
        "mesh.data=1", "mesh.tensor=1", "mesh.simulated_devices=0", "parallel.zero_stage=0",
        "parallel.scan_layers=false", "parallel.loss_chunk=0"])
    with manual.unrolled_loops():
        measured = hlo.flops(setup(cfg, jax.devices()[:1]).compile()[0])
    tokens = cfg.train.global_batch * t
    computed = flops_per_token(cfg.model, t, causal=attention.computed_fraction(t)) * tokens
    assert attention.computed_fraction(t) == 1
    assert abs(measured / computed - 1) < 0.05
    for wrong in (0.0, 0.5):
        assert abs(measured / (flops_per_token(cfg.model, t, causal=wrong) * tokens) - 1) > 0.05


def test_peak_flops_from_the_device_kind(caplog):
    """The MFU denominator: the device kind's data-sheet peak where it is known, the
    topology's otherwise; simulated devices share the host's peak. MFU above 100 % is logged."""
    from spmd3d.mesh import device_peak_tflops, load_topology
    from spmd3d.metrics import mfu

    assert device_peak_tflops("NVIDIA H100 80GB HBM3")["bfloat16"] == 989.4
    assert device_peak_tflops("NVIDIA H100 PCIe")["bfloat16"] == 756.0
    assert device_peak_tflops("NVIDIA H200")["float32"] == 494.7
    assert device_peak_tflops("NVIDIA A100-SXM4-80GB")["bfloat16"] == 312.0
    assert device_peak_tflops("cpu") is None
    node = load_topology("dgx_a100_420")  # an A100 cluster's yaml, run on H100s: by kind
    assert node.peak_flops("bfloat16", 8, "NVIDIA H100 80GB HBM3") == 8 * 989.4e12
    assert node.peak_flops("bfloat16", 8, "cpu") == 8 * dict(node.peak_tflops)["bfloat16"] * 1e12
    cpu = load_topology("cpu")
    assert cpu.peak_flops("float32", 8, "NVIDIA H100 80GB HBM3") == cpu.peak_flops("float32", 1)
    cfg = config_lib.load(None, TINY).model
    with caplog.at_level("WARNING", logger="spmd3d.metrics"):
        assert mfu(1e9, cfg, 32, 1e6) > 1
    assert "above 100%" in caplog.text


def test_attention_kernels_agree(record):
    """`--attention`: the fused call (JAX's reference implementation on a CPU) and the blocked
    kernel agree on the output and every gradient, with packed documents too; all are timed;
    the report says so."""
    cfg, r = record
    a = measure_attention(cfg, repeats=1)
    assert a["implementation"] == "xla" and a["dtype"] == "float32"
    assert a["shape"] == {"rows": 2, "T": 32, "kv_heads": 2, "groups": 1, "head_dim": 16}
    assert max(a["error"].values()) < 1e-5 and a["fused_s"] > 0 and a["blocked_s"] > 0
    d = a["documents"]
    assert max(d["error"].values()) < 1e-5 and d["fused_s"] > 0 and d["blocked_s"] > 0
    assert max(d["pallas_error"].values()) < 1e-5 and d["pallas_s"] > 0
    report = format_report({**r, "attention": a})
    assert "attention   fused (xla)" in report and "documents   packed" in report
    assert "Pallas (document ids)" in report


def test_experts_grouped_matmul_against_a_dense_one(record):
    """`--experts`: the MoE layer's grouped matmul through the plan's kernel (ragged_dot on a
    CPU; the capacity path's batched matmul with a capacity factor) equals a loop over the
    experts, with a device's rows (here its tokens x k over 4 local experts, experts split 2
    ways: gathered over the 2); both it and the dense matmul are timed; a dense model is
    refused naming the field."""
    cfg, r = record
    moe = config_lib.override(cfg, model=dict(num_experts=8, experts_per_token=2, d_ff_expert=32),
                              mesh=dict(expert=2))
    x = measure_experts(moe, repeats=1)
    # 8 x 32 tokens over 4 data devices, gathered over 2, two choices each; F over tensor 2
    assert (x["kernel"], x["experts"], x["rows"], x["f"]) == ("ragged", 4, 64 * 2 * 2, 16)
    assert x["error"] < 1e-5 and x["grouped_tflops"] > 0 and x["dense_tflops"] > 0
    assert x["weight_grad"] == "xla"
    assert "experts     grouped matmul (ragged, weight gradient xla)" in format_report(
        {**r, "experts": x})
    x = measure_experts(config_lib.override(moe, model=dict(capacity_factor=1.25)), repeats=1)
    assert x["kernel"] == "capacity" and x["error"] < 1e-5
    with pytest.raises(config_lib.ConfigError, match="model.num_experts"):
        measure_experts(cfg, repeats=1)
