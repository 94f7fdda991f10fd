"""The attention table: which kind runs where (`attention.choose`, resolved once in the plan),
and the fused kind's plumbing -- GQA head layout, tensor-parallel heads, gradients -- run on the
CPU through JAX's reference of the same `jax.nn.dot_product_attention` call (cuDNN itself needs
a GPU; the GPU benchmark compares the two there)."""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import devices_for, small_config
from test_ring import dense

from spmd3d import attention, config
from spmd3d.attention import causal_attention, choose, fused_attention
from spmd3d.plan import Plan
from spmd3d.schema import ConfigError
from spmd3d.step import make_grad_fn
from spmd3d.runtime import setup

GPU = dict(platform="gpu", dtype="bfloat16", head_dim=128, seq=1)


@pytest.mark.parametrize("requested,overrides,kind", [
    ("auto", {}, "cudnn"),
    ("auto", {"platform": "cpu"}, "blocked"),
    ("auto", {"dtype": "float32"}, "blocked"),
    ("auto", {"head_dim": 100}, "blocked"),  # not a multiple of 8
    ("auto", {"head_dim": 256}, "blocked"),  # > 128 before Hopper
    ("auto", {"head_dim": 256, "hopper": True}, "cudnn"),
    ("auto", {"seq": 2}, "ring"),
    ("auto", {"seq": 2, "branched": True}, "gather"),  # inside ZB-H1's per-stage branches
    ("blocked", {"seq": 4, "branched": True}, "gather"),
    ("auto", {"branched": True}, "cudnn"),
    ("blocked", {}, "blocked"),
    ("blocked", {"seq": 4}, "ring"),
    ("cudnn", {"dtype": "float16"}, "cudnn"),
    # packed documents: the kernel that takes their ids, where its shapes allow; else cuDNN's
    # dense mask (`fallback` says why), or blocked
    ("auto", {"documents": True}, "pallas"),
    ("auto", {"documents": True, "seq_len": 200}, "cudnn"),
    ("auto", {"documents": True, "head_dim": 96}, "cudnn"),
    ("auto", {"documents": True, "dtype": "float32"}, "blocked"),
    ("auto", {"documents": True, "seq": 2}, "ring"),
    ("cudnn", {"documents": True}, "cudnn"),
    ("auto", {"documents": True, "stage": 2}, "cudnn"),  # not in a pipeline's shard_map
    ("pallas", {}, "pallas"),
    # parallel.context: Ulysses while a tensor shard's kv heads divide by seq
    ("auto", {"seq": 2, "context": "auto", "kv_heads": 4}, "ulysses"),
    ("auto", {"seq": 4, "context": "auto", "kv_heads": 2}, "ring"),
    ("auto", {"seq": 2, "context": "auto", "kv_heads": 4, "branched": True}, "gather"),
    ("auto", {"seq": 2, "context": "auto", "kv_heads": 4, "stage": 2, "tensor": 2}, "ring"),
    ("auto", {"seq": 2, "context": "auto", "kv_heads": 4, "stage": 2}, "ulysses"),
    ("cudnn", {"seq": 2, "context": "ulysses", "kv_heads": 2}, "ulysses"),
    ("auto", {"seq": 2, "context": "ring", "kv_heads": 4}, "ring"),
    ("auto", {"seq": 2, "context": "auto", "kv_heads": 4, "across_nodes": True}, "ring"),
])
def test_choose(requested, overrides, kind):
    assert choose(requested, **{**GPU, **overrides}) == kind


@pytest.mark.parametrize("overrides,words", [
    ({"platform": "cpu"}, "needs a GPU"), ({"dtype": "float32"}, "bfloat16 or float16"),
    ({"head_dim": 260, "hopper": True}, "<= 256"), ({"seq": 2}, "ring attention"),
    ({"head_dim": 96}, "power of 2"), ({"seq_len": 200}, "multiple of 128"),
    ({"seq": 2}, "whole sequence"), ({"stage": 2}, "pipeline")])
def test_an_explicit_kernel_that_cannot_run_is_refused(overrides, words):
    """(And Ulysses where it cannot run: `test_ulysses_that_cannot_run_is_refused`.)"""
    kernel = ("pallas" if words in ("power of 2", "multiple of 128", "whole sequence", "pipeline")
              else "cudnn")
    with pytest.raises(ConfigError, match=words) as e:
        choose(kernel, **{**GPU, **overrides})
    assert e.value.field == "model.attention"
    if kernel == "pallas":  # the reason auto's fallback from it gives
        assert words in attention.fallback(**{"seq_len": 128, **GPU, **overrides})
    else:
        assert attention.fallback(**{"seq_len": 128, **GPU}) == ""


def test_zb_h1_with_the_sequence_split_gathers_kv_and_other_schedules_ring():
    kinds = {schedule: Plan.resolve(small_config(stage=2, seq=2, micro=2, extra=[
        f"parallel.pipeline_schedule={schedule}"]), topology="h100x8").attention
        for schedule in ("gpipe", "1f1b", "zb_h1")}
    assert kinds == {"gpipe": "ring", "1f1b": "ring", "zb_h1": "gather"}


def test_gathered_attention_is_causal_attention_over_the_whole_sequence():
    """Per device of a 4-way seq group: its zig-zag queries against the gathered K/V give the
    rows of dense causal attention at those positions, and so do the gradients. It scores
    the ring's blocks, one device's keys at a time: no [T_local, T] score matrix is ever
    formed, forward or backward (scoring the whole gathered sequence at once did)."""
    import re

    from jax.sharding import PartitionSpec as P

    from spmd3d.ring import gathered_attention_local, zigzag_order

    n, t = 4, 32
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, t, 2, 2, 8))
    k, v = (jax.random.normal(x, (2, t, 2, 8)) for x in keys[1:])
    order = zigzag_order(t, n)
    mesh = jax.make_mesh((n,), ("seq",), devices=jax.devices()[:n],
                         axis_types=(jax.sharding.AxisType.Auto,))
    gathered = jax.shard_map(lambda q, k, v: gathered_attention_local(q, k, v, "seq", n),
                             mesh=mesh, in_specs=(P(None, "seq"),) * 3, out_specs=P(None, "seq"))

    def loss(f, q, k, v):
        return jnp.sum(jnp.sin(f(q, k, v)))

    zig = lambda a: a[:, order]  # noqa: E731
    step = jax.jit(jax.value_and_grad(lambda *a: loss(gathered, *map(zig, a)), argnums=(0, 1, 2)))
    got = step(q, k, v)
    local = t // n  # [B, K, G, T_local, keys] scores: at most the device's own T_local keys
    scores = re.findall(rf"f32\[2,2,2,(\d+),(\d+)\]", step.lower(q, k, v).compile().as_text())
    assert scores and max(int(b) for _, b in scores) == local, set(scores)
    want = jax.value_and_grad(lambda *a: loss(dense, *a), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_the_plan_resolves_the_kind_on_its_devices():
    """On these CPU devices auto is blocked; the same config planned for an H100 node (no
    devices, the topology's platform) is cudnn; an unknown name fails at load."""
    cfg = config.load("configs/llama3_8b.yaml")
    assert cfg.model.attention == "auto" and cfg.model.dtype == "bfloat16"
    assert Plan.resolve(cfg, topology="h100x8").attention == "cudnn"
    small = small_config(data=8, extra=["model.dtype=bfloat16"])
    assert Plan.resolve(small, devices_for(small)).attention == "blocked"
    with pytest.raises(ConfigError, match="model.attention"):
        Plan.resolve(replace(small, model=replace(small.model, attention="cudnn")),
                     devices_for(small))
    with pytest.raises(ConfigError, match="model.attention"):
        config.load(None, ["model.attention=flash"])


@pytest.mark.parametrize("dtype,tol,e", [(jnp.float32, 1e-5, 16), (jnp.bfloat16, 2e-2, 16),
                                         (jnp.float32, 1e-5, 12)])
def test_fused_call_equals_the_blocked_kernel(monkeypatch, dtype, tol, e):
    """GQA grouping and the causal mask of the fused call, on JAX's reference implementation;
    with values narrower than the heads (e = 12: MLA's), padded for the call."""
    monkeypatch.setattr(attention, "FUSED", "xla")
    b, t, k, g, h = 2, 256, 2, 3, 16
    q, kk, v = (jax.random.normal(key, shape, dtype) for key, shape in zip(
        jax.random.split(jax.random.key(0), 3), [(b, t, k, g, h), (b, t, k, h), (b, t, k, e)]))
    got, want = fused_attention(q, kk, v), causal_attention(q, kk, v)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol)


def test_fused_kind_in_the_step_equals_blocked(monkeypatch):
    """The whole step with the fused kind (its reference implementation) on tensor 2 x data 4:
    heads split over tensor, the kernel per shard; loss and gradients equal the blocked kind's."""
    monkeypatch.setattr(attention, "FUSED", "xla")
    cfg = small_config(data=4, tensor=2, sp=True)
    job = setup(cfg, devices_for(cfg))
    state, batch = job.init_state(), job.global_batch(0)
    results = [jax.jit(make_grad_fn(replace(job.plan, attention=kind), job.graphdef))(
        state.params, batch) for kind in ("cudnn", "blocked")]
    (loss, grads), (ref_loss, ref_grads) = results
    assert abs(float(loss) - float(ref_loss)) < 1e-5 * abs(float(ref_loss))
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        g, r = np.asarray(g), np.asarray(r)
        assert np.max(np.abs(g - r)) <= 1e-5 * np.max(np.abs(r)) + 1e-12


def test_packed_documents_on_a_gpu_plan_the_pallas_kernel(tmp_path):
    """`gpu_1b` with a tokenizer that ends its documents, planned for an H100 node: the Pallas
    kernel; in a pipeline, cuDNN's dense mask, with a one-line warning that says why."""
    from helpers import bpe_dir

    tok = f"data.tokenizer={bpe_dir(tmp_path / 'tok')}"
    plan = Plan.resolve(config.load("configs/gpu_1b.yaml", [tok]), topology="h100x8")
    assert plan.eot is not None and plan.attention == "pallas"
    piped = Plan.resolve(config.load("configs/gpu_1b.yaml", [
        tok, "mesh.stage=2", "mesh.data=1", "train.microbatches=2"]), topology="h100x8")
    assert piped.attention == "cudnn"
    line, = [x for x in piped.describe().splitlines() if x.startswith("documents")]
    assert "dense T x T mask" in line and "warning: pallas does not run inside a pipeline" in line


@pytest.mark.parametrize("name", ["gpu_1b", "gpu_3b", "gpu_8b"])
def test_gpu_benchmarks_plan_bf16_and_cudnn(name):
    """The GPU benchmark configs, planned for an H100 node: bf16 compute over fp32 master
    weights and the cuDNN kernel (their head dims, 64 and 128, fit it before Hopper too)."""
    plan = Plan.resolve(config.load(f"configs/{name}.yaml"), topology="h100x8")
    m = plan.cfg.model
    assert (m.dtype, m.param_dtype, plan.attention) == ("bfloat16", "float32", "cudnn")


@pytest.fixture
def interpreted(monkeypatch):
    """The Pallas kernel through Pallas's interpreter: its plumbing runs on a CPU."""
    monkeypatch.setattr(attention, "INTERPRET", True)


@pytest.mark.parametrize("with_documents,e", [(True, 16), (False, 16), (False, 12)])
def test_pallas_kernel_equals_the_blocked_one(interpreted, with_documents, e):
    """The Pallas-Triton kernel (interpreted) with GQA and, or not, document ids equals the
    blocked kind, forward and gradients, over T = 256: two of its query blocks and eight of
    its backward blocks, the diagonal and the blocks skipped above it; with values narrower
    than the heads (e = 12: MLA's), padded for the call."""
    b, t, k, g, h = 2, 256, 2, 3, 16
    q, kk, v = (jax.random.normal(key, shape) for key, shape in zip(
        jax.random.split(jax.random.key(0), 3), [(b, t, k, g, h), (b, t, k, h), (b, t, k, e)]))
    ends = np.random.default_rng(0).random((b, t)) < 0.03
    segments = jnp.asarray(np.cumsum(ends, axis=1), jnp.int32) if with_documents else None

    def grads(kernel):
        f = lambda *a: jnp.sum(jnp.sin(kernel(*a, segments=segments)))  # noqa: E731
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, kk, v)

    got, want = grads(attention.flash_attention), grads(causal_attention)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, w in zip(got[1], want[1]):
        assert np.max(np.abs(a - w)) <= 1e-5 * np.max(np.abs(w))


@pytest.mark.parametrize("overrides,words", [
    ({"kv_heads": 2, "seq": 4}, "do not divide by mesh.seq = 4"),
    ({"kv_heads": 4, "seq": 2, "branched": True}, "ZB-H1"),
    ({"kv_heads": 4, "seq": 2, "stage": 2, "tensor": 2}, "mesh.tensor = 1")])
def test_ulysses_that_cannot_run_is_refused(overrides, words):
    with pytest.raises(ConfigError, match=words) as e:
        choose("auto", **{**GPU, "context": "ulysses", **overrides})
    assert e.value.field == "parallel.context"


def test_ulysses_runs_the_kernel_of_the_whole_sequence_and_no_zigzag():
    """On a plan: Ulysses over seq 2 keeps the positions in order and runs, per device, the
    kernel a one-device plan would (blocked here), said in the plan's first lines."""
    from helpers import small_config
    from spmd3d.plan import Plan

    plan = Plan.resolve(small_config(data=4, seq=2, extra=["parallel.context=ulysses"]),
                        jax.devices()[:8])
    assert (plan.attention, plan.attention_local, plan.seq_order) == ("ulysses", "blocked", None)
    assert "attention ulysses (each device's heads over the whole sequence: blocked)" in \
        plan.describe()
