"""FP8 projections (`model.fp8=delayed`), emulated on the CPU: the casts and scales of the GPU
path with the GEMMs in float32.

Layouts give one device's FP8 numbers, within what FP8 itself allows. Rounding to FP8 is a
step function, and values built from FP8 products land on its ties (midpoints between two
FP8 values) often, so float32's reordering between layouts (1e-7) rounds some elements the
other way. Measured at a state with amax histories (three steps in): each gradient leaf of a
layout differs from one device's by 2e-4 to 9e-4 relative (L2), and one device's own
gradients move by as much (5e-4 to 1e-3) when its weights are perturbed by 1e-7. So:
- the loss, and every amax the step learns, are equal (1e-5; the amaxes exactly);
- each gradient leaf within 3e-3 relative (L2), at a state off the steps of FP8's rounding;
  skipping a quantization or taking a wrong scale is an error of several percent. Some states
  sit on a step: measured with jax 0.12.0.1, one device's `w_qkv` gradient moves by 2e-2 to
  4e-2 under a 1e-7 nudge after 3 or 4 steps (at LLVM levels 0 and 1 alike), and by 3e-4 to
  1e-3 after 5, 6 or 7, depending on the level. So the gradients are compared at the first
  state from `WARM` steps on where two nudges move no leaf of one device's by more than 1e-3
  (`QUIET`): there a layout that differs by more does so by its own error, not by a tie;
- at the fresh state (unit scales) every gradient to 1e-5 of its largest value, but for the
  leaves that a tie reaches, held to the same 3e-3 (L2). Ties are rarer there, not absent:
  the data is the embedded corpus, Python's own library, so they come with the Python version.
  Measured for zero3_dp2_seq2_tp2_sp (jax 0.10.2 and 0.12 alike): on Python 3.11's corpus no
  element of an e5m2-rounded gradient changed side; on 3.13's, two of layer 0's QKV output
  gradient did, each within 3 float32 ulps of an e5m2 midpoint (-0.2031250 between -0.1875
  and -0.21875), and one moved w_qkv by 1.35e-3 of its largest value, 2.7e-4 relative (L2),
  attn_norm/scale 3.0e-4 and embed 2.0e-4; every other leaf stayed within 2e-7;
- over several steps the losses agree to 1e-3, as bfloat16's do (test_bf16.py).
"""

import json
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (SMALL, by_layout, devices_for, job_for, max_rel_diff, small_config,
                     start_state, _grad_fn)
from spmd3d import config, fp8, hlo
from spmd3d.checkpoint import load
from spmd3d.plan import Plan
from spmd3d.forward import microbatches
from spmd3d.step import reorder
from spmd3d.store import flat

FP8 = ["model.fp8=delayed", "model.fp8_emulate=true", "model.fp8_history=16"]
WARM = 3  # steps of one-device training at least before the gradients are compared
QUIET = 1e-3  # the most a 1e-7 nudge may move one device's gradient leaf at that state (L2)
STEPS = 9  # one-device steps run: the 5 whose losses the layouts match, and states to choose

LAYOUTS = {
    "dp4_tp2_sp": dict(data=4, tensor=2, sp=True),
    "dp2_pp2_tp2_1f1b": dict(data=2, stage=2, tensor=2, micro=4,
                             extra=["parallel.pipeline_schedule=1f1b"]),
    # ZeRO-3's gathered weights, ring attention over seq, tensor with SP
    "zero3_dp2_seq2_tp2_sp": dict(data=2, seq=2, tensor=2, zero=3, sp=True),
    # ZB-H1 takes the weights' gradients, and with them the amaxes, in a pass of their own
    "zb_dp4_pp2_m4": dict(data=4, stage=2, micro=4, extra=["parallel.pipeline_schedule=zb_h1"]),
}


def cfg(extra=(), **kw):
    return small_config(**kw, extra=FP8 + list(extra))


# ------------------------------------------------------------------------------- the pieces
def test_summed_histograms_stand_for_the_largest_amax():
    amaxes = [0.3, 1e-5, 7.0, 448.0, 6.9, 2.0 ** -20]
    for a in amaxes:  # each amax's bin: its upper edge is at most a quarter binade above it
        edge = float(fp8.amax_of(fp8.histogram(jnp.float32(a))))
        assert a <= edge < a * 2 ** 0.25, (a, edge)
    summed = sum(fp8.histogram(jnp.float32(a)) for a in amaxes)
    assert float(fp8.amax_of(summed)) == float(fp8.amax_of(fp8.histogram(jnp.float32(448.0))))
    # an amax on an edge (a tensor clipped by the fp8 range) is that edge, whatever its rounding
    for a in (2.0, 2.0 * (1 + 1e-6), 2.0 * (1 - 1e-7)):
        assert float(fp8.amax_of(fp8.histogram(jnp.float32(a)))) == 2.0
    assert not np.any(fp8.histogram(jnp.float32(0.0)))
    assert float(fp8.amax_of(jnp.zeros(fp8.BINS))) == 0.0


def test_quantized_values_are_fp8_values_times_the_scale_and_saturate():
    """`quantize`, then the emulated GEMMs' dequantize (`_dequantize`)."""
    x = jax.random.normal(jax.random.key(0), (4096,)) * 30
    for dtype, scale in ((fp8.E4M3, 0.25), (fp8.E5M2, 2.0 ** -10)):
        s = jnp.float32(scale)
        y = np.asarray(fp8._dequantize(fp8.quantize(x, dtype, s), s, jnp.float32))
        units = y / scale
        assert np.array_equal(units, units.astype(dtype).astype(np.float32))
        fmax = float(jnp.finfo(dtype).max)
        assert np.max(np.abs(units)) == fmax  # x reaches past the range: saturated, not inf
        inside = np.abs(np.asarray(x)) / scale < fmax
        rel = np.abs(y - np.asarray(x))[inside] / np.maximum(np.abs(np.asarray(x))[inside], 1e-3)
        assert np.max(rel[np.abs(np.asarray(x))[inside] / scale > 1]) <= 2.0 ** -(
            3 if dtype == fp8.E4M3 else 2)


def test_scales_come_from_the_history():
    h = jnp.asarray([[0.0, 0.0], [2.0, 448.0], [1.0, 0.5]])[None]  # [1, 3 roles, 2 steps]
    s = np.asarray(fp8.scales(jnp.broadcast_to(h, (1, 3, 2))))[0]
    assert s[0] == 1.0  # nothing seen yet
    assert s[1] == 1.0  # 448 / e4m3's 448
    assert s[2] == pytest.approx(1.0 / 57344.0)  # e5m2's max
    assert np.asarray(fp8.scales(h, margin=1))[0, 2] == pytest.approx(2.0 / 57344.0)


def test_the_gemms_take_fp8_operands_and_emulated_ones_their_dequantized_values():
    """A projection's three GEMMs (forward, the input's and the weight's gradient) take the FP8
    tensors themselves, e4m3 x e4m3 and e5m2 with e4m3, no convert pair before them (XLA's GPU
    compiler folds `bf16 -> fp8 -> bf16` before its GEMM rewrite; docs/fp8.md) and no barrier.
    Emulated, each operand is dequantized between two barriers (the FP8 value before its
    dequantize, the dequantized value before the GEMM) and the GEMMs run in the compute dtype:
    the same numbers, up to where the scales are applied (fp32 here: 1e-6)."""
    x, w = jax.random.normal(jax.random.key(0), (8, 16)), jnp.full((16, 32), 0.1)

    def step(emulate):
        state = fp8.Fp8Meta(1, 4, emulate=emulate)

        def loss(x, w):
            return jnp.sum(jnp.square(fp8.einsum("bd,df->bf", x, w, state, 0)))

        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        text = grad.lower(x, w).as_text()
        dots = re.findall(r"stablehlo.dot_general .*: \((tensor<[^>]*>), (tensor<[^>]*>)\)", text)
        return grad(x, w), dots, text.count("stablehlo.optimization_barrier")

    (direct, dots, barriers), (emulated, emulated_dots, emulated_barriers) = step(False), step(True)
    kinds = sorted(tuple(t.split("x")[-1].rstrip(">") for t in d) for d in dots)
    assert kinds == sorted([("f8E4M3FN", "f8E4M3FN"), ("f8E5M2", "f8E4M3FN"),
                            ("f8E4M3FN", "f8E5M2")]) and barriers == 0
    assert len(emulated_dots) == 3 and emulated_barriers == 3 * 2 * 2
    assert all("f8" not in t for d in emulated_dots for t in d)
    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(emulated)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# A GPU module as XLA's GPU compiler leaves it, abridged by hand (no GPU compiles here): a
# projection's forward and input-gradient GEMMs rewritten into cuBLASLt FP8 calls, its weight
# gradient's inside a loop body, and an unquantized GEMM (the head's) in bf16.
GPU_HLO = """HloModule jit_step, entry_computation_layout={(f8e4m3fn[256,512]{1,0}, f8e4m3fn[1024,512]{1,0})->bf16[256,1024]{1,0}}

%body (p: (s32[], bf16[512,1024])) -> (s32[], bf16[512,1024]) {
  %p = (s32[], bf16[512,1024]{1,0}) parameter(0)
  %x8 = f8e4m3fn[512,256]{1,0} constant({...})
  %g8 = f8e5m2[1024,256]{1,0} constant({...})
  %s = f32[] constant(1)
  %dw = (bf16[512,1024]{1,0}, s8[33554432]{0}) custom-call(%x8, %g8, %s, %s, %s, %s), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"epilogue":"DEFAULT"}}
  %i = s32[] get-tuple-element(%p), index=0
  %dw0 = bf16[512,1024]{1,0} get-tuple-element(%dw), index=0
  ROOT %t = (s32[], bf16[512,1024]{1,0}) tuple(%i, %dw0)
}

ENTRY %main (x: f8e4m3fn[256,512], w: f8e4m3fn[1024,512]) -> bf16[256,1024] {
  %x = f8e4m3fn[256,512]{1,0} parameter(0)
  %w = f8e4m3fn[1024,512]{1,0} parameter(1)
  %s = f32[] constant(1)
  %y = (bf16[256,1024]{1,0}, s8[33554432]{0}) custom-call(%x, %w, %s, %s, %s, %s), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"epilogue":"DEFAULT"}}
  %dx = (bf16[256,512]{1,0}, s8[33554432]{0}) custom-call(%g, %wt, %s, %s, %s, %s), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"epilogue":"DEFAULT"}}
  %head = (bf16[256,4096]{1,0}, s8[33554432]{0}) custom-call(%h, %e), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"epilogue":"DEFAULT"}}
  %old = bf16[256,4096]{1,0} custom-call(%h, %e), custom_call_target="__cublas$gemm"
  %loop = (s32[], bf16[512,1024]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = bf16[256,1024]{1,0} get-tuple-element(%y), index=0
}
"""


def test_fp8_gemms_counts_the_cublaslt_fp8_calls_of_a_gpu_module():
    """What `bench` reports as the step's FP8 GEMMs: the cuBLASLt FP8 calls, each once
    (the one in the loop body too), not the bf16 GEMMs beside them."""
    assert hlo.fp8_gemms(GPU_HLO) == 3
    assert hlo.fp8_gemms(GPU_HLO.replace("$lt$matmul$f8", "$lt$matmul")) == 0


def test_refused_where_fp8_gemms_cannot_run_unless_emulated():
    c = small_config(extra=["model.fp8=delayed"])
    with pytest.raises(config.ConfigError) as e:
        Plan.resolve(c, devices_for(c))
    assert e.value.field == "model.fp8" and "fp8_emulate=true" in str(e.value)
    assert "cpu" in str(e.value)
    with pytest.raises(config.ConfigError, match="older GPUs"):
        Plan.resolve(config.override(c, mesh=dict(data=8)), topology="dgx_a100_128")
    on_h100 = Plan.resolve(config.override(c, mesh=dict(data=8)), topology="h100x8")
    assert on_h100.peak_dtype == "float8" and "fp8:" in on_h100.describe()
    emulated = Plan.resolve(cfg(), devices_for(cfg()))
    assert emulated.peak_dtype == "float32" and "emulated" in emulated.describe()


# ----------------------------------------------------------------------------------- layouts
def _host_states(c, steps):
    """(per-step losses, host copies of the state after each of `steps` steps) of `c`."""
    job, state, losses, kept = job_for(c), start_state(c), [], []
    for s in range(steps):
        state, metrics = job.step_fn(state, job.global_batch(s))
        losses.append(float(metrics["loss"]))
        # a copy: the next step donates the state's buffers
        kept.append(jax.tree.map(np.array, jax.device_get(state)))
    return np.array(losses), kept


def _place(c, host_state):
    job = job_for(c)
    if job.plan.canonical_layers:
        return jax.device_put(host_state, job.shardings)
    return job.reorder(jax.device_put(host_state, job.canonical[1]), to_canonical=False)


def _grads_at(c, host_state, step=WARM):
    """(loss, {key: gradient}, {key of a probe: the amaxes it stands for}) at `host_state`'s
    parameters on step `step`'s batch."""
    job = job_for(c)
    loss, grads = _grad_fn(c)(_place(c, host_state).params, job.global_batch(step))
    grads = {k: np.asarray(v) for k, v in flat(reorder(grads, job.plan, to_canonical=True)).items()}
    amaxes = {k: np.asarray(fp8.amax_of(v)) for k, v in grads.items() if k.endswith("fp8/probe")}
    return float(loss), grads, amaxes


def _nudged(state, seed: int, eps: float = 1e-7):
    """`state` with each float32 weight (not FP8's histories) scaled by 1 + eps * N(0, 1)."""
    rng = np.random.default_rng(seed)

    def nudge(path, a):
        if a.dtype != np.float32 or "fp8" in jax.tree_util.keystr(path):
            return a
        return (a * (1 + eps * rng.standard_normal(a.shape))).astype(np.float32)

    return state._replace(params=jax.tree_util.tree_map_with_path(nudge, state.params))


def _quiet(states):
    """(steps taken, that state, its gradients): the first of `states` (one per step) from
    `WARM` steps on where nudging the weights by 1e-7 moves no gradient leaf of one device's
    by more than `QUIET` (L2, relative), in either of two draws."""
    for step in range(WARM, len(states) + 1):
        state = states[step - 1]
        at = _grads_at(cfg(), state, step=step)
        moved = max(np.linalg.norm(g[k] - at[1][k]) / np.linalg.norm(at[1][k])
                    for g in (_grads_at(cfg(), _nudged(state, seed), step=step)[1]
                              for seed in (1, 2)) for k in g if "fp8/" not in k)
        if moved <= QUIET:
            return step, state, at
    raise AssertionError(f"every state from {WARM} to {len(states)} steps sits on a step of "
                         "FP8's rounding")


@pytest.fixture(scope="module")
def reference():
    losses, states = _host_states(cfg(), STEPS)
    return (losses, *_quiet(states))


@pytest.mark.parametrize("name", by_layout(LAYOUTS))
def test_layouts_give_one_devices_fp8_numbers(reference, name):
    ref_losses, step, warm, (ref_loss, ref_grads, ref_amax) = reference
    c = cfg(**LAYOUTS[name])
    losses, _ = _host_states(c, 5)
    assert job_for(c).mesh.size == 8 and ref_losses[4] < ref_losses[0] - 0.5
    assert max_rel_diff(losses, ref_losses[:5]) < 1e-3, (losses, ref_losses)

    h = warm.params["blocks"]["attn"]["fp8"]["history"]
    assert np.all(h[..., :step] > 0) and not np.any(h[..., step:])  # the histories fill up
    loss, grads, amax = _grads_at(c, warm, step=step)
    assert abs(loss - ref_loss) / ref_loss < 1e-5
    assert grads.keys() == ref_grads.keys() and amax.keys() == ref_amax.keys() and amax
    for k, a in amax.items():
        assert np.all(ref_amax[k] > 0) and np.array_equal(a, ref_amax[k]), k
    for k, g in grads.items():
        if "fp8/" not in k:
            r = ref_grads[k]
            assert np.linalg.norm(g - r) <= 3e-3 * np.linalg.norm(r), (k, np.linalg.norm(g - r))

    fresh = jax.device_get(start_state(cfg()))
    ref_loss, ref_grads, _ = _grads_at(cfg(), fresh, step=0)
    loss, grads, _ = _grads_at(c, fresh, step=0)
    assert abs(loss - ref_loss) / ref_loss < 1e-5
    for k, g in grads.items():
        if "fp8/" not in k:
            r = ref_grads[k]
            assert (np.max(np.abs(g - r)) <= 1e-5 * np.max(np.abs(r))
                    or np.linalg.norm(g - r) <= 3e-3 * np.linalg.norm(r)), k


@pytest.mark.xdist_group("dp2_pp2_tp2_1f1b")
def test_amaxes_combine_by_max_over_a_pipelines_microbatches(reference):
    """1F1B over 4 microbatches on data 2: each amax the step learns (each layer's, each
    projection's, each tensor's) is the largest of the amaxes one device sees on each
    microbatch alone, not their sum nor the last one."""
    _, step, warm, _ = reference
    c = cfg(**LAYOUTS["dp2_pp2_tp2_1f1b"])
    _, _, piped = _grads_at(c, warm, step=step)
    m = c.train.microbatches
    one = cfg(extra=[f"train.global_batch={c.train.global_batch // m}"])
    tokens = np.asarray(job_for(c).global_batch(step))
    each = {k: [] for k in piped}
    for mb in np.asarray(microbatches(tokens, m)):
        job = job_for(one)
        batch = jax.device_put(mb, job.batch_sharding)
        _, grads = _grad_fn(one)(_place(one, warm).params, batch)
        for k in piped:
            each[k].append(np.asarray(fp8.amax_of(flat(grads)[k])))
    for k, a in piped.items():
        stacked = np.stack(each[k])
        assert np.any(stacked != stacked[-1]), k  # the microbatches differ: max is not moot
        assert np.array_equal(a, stacked.max(axis=0)), k


# -------------------------------------------------------------------------------- kill -9
def test_scale_state_survives_kill9_and_resumes_exactly(tmp_path):
    """A run killed between checkpoints and started again takes up the amax histories where
    its checkpoint left them: every step's loss and the final histories equal those of the
    same command run uninterrupted (in a process of its own too: FP8 carries a program's
    float32 reordering into the losses, so a reference compiled in another setting, this
    test's 8-device process, is not the same run)."""
    steps = ["train.steps=8", "optim.decay_steps=8"]

    def start(run, name):
        argv = [sys.executable, "-m", "spmd3d.train", *SMALL, *FP8, *steps, "checkpoint.every=3",
                "mesh.simulated_devices=1", "mesh.data=1", "mesh.tensor=1", f"run.dir={run}"]
        log = open(tmp_path / f"{name}.log", "w")
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True), log.name

    def logged(run):  # {step: loss}, the last record of each (a resumed run logs some again)
        out = {}
        for line in ((run / "metrics.jsonl").read_text().splitlines()
                     if (run / "metrics.jsonl").exists() else []):
            try:
                r = json.loads(line)
            except ValueError:  # the line a running process is writing
                continue
            if "loss" in r:
                out[r["step"]] = r["loss"]
        return out

    ref, run = tmp_path / "uninterrupted", tmp_path / "run"
    proc, log = start(ref, "uninterrupted")
    assert proc.wait(timeout=300) == 0, open(log).read()
    proc, log = start(run, "killed")
    ckpts = run / "checkpoints"
    deadline = time.monotonic() + 300
    while not ((ckpts / "3").is_dir() and max(logged(run) or [0]) >= 4):
        assert proc.poll() is None and time.monotonic() < deadline, open(log).read()
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert not (ckpts / "6").exists()
    proc, log = start(run, "resumed")
    assert proc.wait(timeout=300) == 0, open(log).read()
    assert "resumed at step 3" in open(log).read()
    losses, ref_losses = logged(run), logged(ref)
    assert sorted(losses) == sorted(ref_losses) == list(range(1, 9))
    assert [losses[s] for s in range(1, 9)] == [ref_losses[s] for s in range(1, 9)]
    got, want = load(run, 8)[0], load(ref, 8)[0]
    for module in ("attn", "mlp"):
        h = np.asarray(want["blocks"][module]["fp8"]["history"])
        assert np.any(h[..., :8]) and np.array_equal(
            np.asarray(got["blocks"][module]["fp8"]["history"]), h), module


# ------------------------------------------------------------------------- Hugging Face
def test_hf_import_starts_the_scale_state_empty_and_export_leaves_it_out(tmp_path):
    """Published weights fine-tuned in FP8: the import makes the histories (zero: no amax
    seen yet), and the export hands transformers exactly its own tensors back."""
    from test_convert import assert_reloaded_equal, hf_llama, run_config, TOKENS
    import torch
    from transformers import LlamaForCausalLM

    from spmd3d import checkpoint, convert

    model = hf_llama(False)
    model.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        ref = model(torch.tensor(TOKENS)).logits.numpy()
    c = config.override(run_config(tmp_path / "hf"), model=dict(fp8="delayed", fp8_emulate=True))
    convert.import_hf(tmp_path / "hf", tmp_path / "run", c, jax.devices()[:1])
    arrays, _ = checkpoint.read(tmp_path / "run", lambda k: "fp8/" in k)
    assert sorted(arrays) == [f"params/blocks/{m}/fp8/{leaf}" for m in ("attn", "mlp")
                              for leaf in ("history", "probe")]
    assert all(a.shape[:3] == (2, 2, 3) and not np.any(a) for a in arrays.values())
    convert.export_hf(tmp_path / "run", tmp_path / "out")
    assert_reloaded_equal(model, LlamaForCausalLM.from_pretrained(tmp_path / "out").float().eval(),
                          ref)
