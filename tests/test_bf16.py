"""bfloat16 on several devices: every axis trains and gives the 1-device bf16 numbers.

bf16 keeps 8 bits of mantissa (unit roundoff u = 2^-8 = 0.0039), and the layouts sum their
matmuls and gradients in other orders than one device does, so they agree to about u, not to
float32's 1e-5. Measured on these layouts: losses within 1e-4 relative over 3 steps, gradient
leaves within 1.5 u of their largest value. The bounds keep a margin above that: 1e-3 for the
losses (the first step moves the loss by 0.7, so a gradient 1 % off moves the next loss by
about that), 4 u for the gradients.

An MoE layer's expert gradients pass through more bf16 roundings (gate, up, their product,
the routing weights, the gathered outputs): measured against the fp32 gradient, the one-device
bf16 run's expert weights are 3.7 u off (`w_gate_up`, of its largest value) and experts split
8 ways 4.4 u off, the two 4.4 u apart; every other leaf within 3 u. So the MoE layouts'
gradients are held to 8 u, as far from each other as two bf16 runs of the layer may each be
from the truth.

Every bf16 dot sums in fp32, as on a GPU: on jax 0.12 only with conftest's XLA:CPU flag,
without which one device's `w_down` gradient was 5.1 u off fp32 (its dot's partial sums
rounded to bf16) and 5.6 u off the layouts, which were 1.5 u off fp32.

Multi-token prediction's router (DeepSeek's shape, experts split 2 ways with tensor 2, SP, the
ring and ZeRO-3) is noisier still: its gradient sits at the end of the main stack and of the
depth's own. Of its largest value, one device's bf16 gradient is 19.7 u off fp32 (33.5 with
the blocked kernel before its score tiles), the layout's 36.3 u, plain data parallelism over 8
(no expert, tensor or ring) 32.5 u, and any of them with or without the ring or tensor 36-38
u: its roundoff, not a layout's. Every other leaf of that layout is within 10 u of fp32 and 6
u of one device. So where a layout differs from one device by more than the bound, it must be
about as close to the fp32 truth as the bf16 runs whose only difference is roundoff are: within
half again the farther of one device's and data parallelism's distance (`_check`'s `truth`),
never a leaf off by more than its own roundoff explains.

A gradient that a shard_map sums over a manual axis is summed in fp32 (`manual.vary`): in
bf16 XLA:CPU's all-reduce-promotion pass aborted the compile (its reducer's root was the
sharding constraint's copy, "Invalid binary instruction opcode copy").
"""

import re

import jax
import numpy as np
import pytest

from helpers import (first_grads, job_for, max_rel_diff, reference_run, run_with_grads,
                     small_config)
from spmd3d.store import abstract_like

BF16 = ["model.dtype=bfloat16", "train.steps=3", "model.num_layers=4"]
U = 2**-8  # bf16's unit roundoff

LAYOUTS = {  # one per axis and ZeRO stage, and each schedule over stage
    "dp8_zero1": dict(data=8, zero=1),
    "dp8_zero3": dict(data=8, zero=3),
    "dp4_tp2_sp": dict(data=4, tensor=2, sp=True),
    "dp4_seq2": dict(data=4, seq=2),
    "dp4_pp2_gpipe": dict(data=4, stage=2, micro=2),
    "dp2_pp2_tp2_1f1b_zero3": dict(data=2, stage=2, tensor=2, micro=2, zero=3,
                                   extra=["parallel.pipeline_schedule=1f1b"]),
    "dp2_pp2_seq2_zb_h1": dict(data=2, stage=2, seq=2, micro=2,
                               extra=["parallel.pipeline_schedule=zb_h1"]),
    # the ring's steps in score tiles of 2 (8 local tokens), and Ulysses with tensor and SP
    "dp2_seq4_tiles2": dict(data=2, seq=4, extra=["model.attention_tile=2"]),
    "ulysses_dp2_tp2_seq2_sp": dict(data=2, tensor=2, seq=2, sp=True,
                                    extra=["parallel.context=ulysses"]),
    # HSDP (ZeRO-3 over groups of 2, 2 copies) with tensor 2 and the layer inputs offloaded
    "hsdp2x2_tp2_zero3_offload": dict(data=4, tensor=2, zero=3, remat="offload",
                                      extra=["mesh.replicate=2"]),
}


# Mixture-of-Experts (test_moe_layouts' model, 2 microbatches as its reference): experts split
# 8 ways, 4 ways x ZeRO-3, with tensor + SP, the capacity path (with room for every token, so
# that it is the dropless layer) and a 1F1B pipeline. Each aborted XLA:CPU's compile before the
# layer's gathers and reduce-scatters over `expert` summed in fp32 (`manual.all_gather`,
# `manual.psum_scatter`) and the routing weights met the experts' outputs varying over
# `tensor` in fp32 (the broadcast's transpose was a bf16 sum over `tensor`).
MOE = ["model.num_experts=8", "model.experts_per_token=2", "model.d_ff_expert=64",
       "model.shared_experts=1", "model.router_aux_loss_coef=0.01",
       "model.router_z_loss_coef=0.001", "model.router_bias_rate=0.01", "train.microbatches=2"]
MOE_LAYOUTS = {
    "moe_ep8": dict(data=8, extra=["mesh.expert=8"]),
    "moe_ep4_x2_zero3": dict(data=8, zero=3, remat="full", extra=["mesh.expert=4"]),
    "moe_ep2_dp4_tp2_sp": dict(data=4, tensor=2, sp=True, extra=["mesh.expert=2"]),
    "moe_ep4_capacity": dict(data=8, extra=["mesh.expert=4", "model.capacity_factor=4"]),
    "moe_ep2_pp2_1f1b": dict(data=4, stage=2, extra=["mesh.expert=2",
                                                     "parallel.pipeline_schedule=1f1b"]),
}


# DeepSeek-V3's shape (MLA, the group-limited sigmoid router, a shared expert): experts split
# 2 ways with tensor 2 + SP, the ring over seq 2 and ZeRO-3
DEEPSEEK = MOE[:4] + ["model.router_score=sigmoid", "model.router_groups=4",
                      "model.router_topk_groups=2", "model.router_scale=2.5",
                      "model.router_bias_rate=0.01", "train.microbatches=2",
                      "model.num_kv_heads=16", "model.kv_lora_rank=32", "model.q_lora_rank=48",
                      "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8",
                      "model.v_head_dim=12"]
# (layout, the model's own changes, in the reference too): with a multi-token prediction depth,
# and a dense layer before 3 MoE ones, run slot by slot before a 1F1B pipeline whose stages
# split the tables outside it
DEEPSEEK_LAYOUTS = {
    "deepseek_mtp_ep2_tp2_sp_seq2_zero3": (dict(data=2, tensor=2, seq=2, sp=True, zero=3,
                                                extra=["mesh.expert=2"]),
                                           ["model.mtp_layers=1"]),
    "deepseek_dense_first_ep2_pp2_tp2_1f1b": (dict(data=2, stage=2, tensor=2, remat="full",
                                                   extra=["mesh.expert=2",
                                                          "parallel.pipeline_schedule=1f1b",
                                                          "parallel.tables_over_stage=true"]),
                                              ["model.num_layers=4", "model.dense_layers=1"]),
}

GRADS = ("dp8_zero3", "dp2_pp2_seq2_zb_h1", "moe_ep4_x2_zero3", "ulysses_dp2_tp2_seq2_sp",
         "hsdp2x2_tp2_zero3_offload", "deepseek_mtp_ep2_tp2_sp_seq2_zero3",
         "deepseek_dense_first_ep2_pp2_tp2_1f1b")  # every leaf at step 0


def cfg(extra=(), **kw):
    return small_config(**kw, extra=BF16 + list(extra))


def moe_cfg(extra=(), **kw):
    return cfg(extra=MOE + list(extra), **kw)


@pytest.fixture(scope="module")
def reference():
    return reference_run(cfg())


@pytest.fixture(scope="module")
def moe_reference():
    return reference_run(moe_cfg())


def reducer_dtypes(job):
    """The element type of every all-reduce's and reduce-scatter's reducer in the lowered step
    (before XLA's passes: what XLA:CPU's all-reduce promotion sees)."""
    t = job.cfg.train
    batch = jax.ShapeDtypeStruct((t.global_batch, t.seq_len + 1), np.int32,
                                 sharding=job.plan.batch_sharding)
    text = job.step_fn.lower(abstract_like(job.abstract, job.shardings), batch).as_text()
    return re.findall(r'"stablehlo\.(?:all_reduce|reduce_scatter)".*\n\s*\^bb0\(%\w+: tensor<(\w+)>',
                      text)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bf16_matches_one_device(reference, name):
    _check(cfg(**LAYOUTS[name]), reference, name in GRADS, 4 * U)


@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_bf16_moe_matches_one_device(moe_reference, name):
    _check(moe_cfg(**MOE_LAYOUTS[name]), moe_reference, name in GRADS, 8 * U)


@pytest.mark.parametrize("name", list(DEEPSEEK_LAYOUTS))
def test_bf16_deepseek_matches_one_device(name):
    def deepseek(extra=(), **kw):
        return cfg(extra=DEEPSEEK + list(extra), **kw)

    layout, model = DEEPSEEK_LAYOUTS[name]
    truth = None
    if name in GRADS:  # the fp32 gradients, and plain data parallelism's in bf16
        truth = (first_grads(deepseek(model + ["model.dtype=float32"]))[1],
                 first_grads(deepseek(model, data=8))[1])
    _check(deepseek(**{**layout, "extra": layout["extra"] + model}),
           reference_run(deepseek(model)), name in GRADS, 8 * U, truth)


def test_bf16_dense_layers_between_moe_ones_match_one_device():
    """Entries of a dense and an MoE layer (`model.moe_every`), experts split 2 ways, in ZB-H1
    with tensor 2 + SP (the dense layers' W apart from B); every leaf at step 0."""
    model = ["model.num_layers=4", "model.moe_every=2"]
    _check(moe_cfg(data=2, stage=2, tensor=2, sp=True, extra=[
        "mesh.expert=2", "parallel.pipeline_schedule=zb_h1", *model]),
        reference_run(moe_cfg(model)), True, 8 * U)


def _check(c, reference, grads_too, bound, truth=None):
    """`truth`: (one device's fp32 gradients, plain data parallelism's in bf16); a leaf that
    differs from one device's bf16 gradient by more than `bound` must be within 1.5 times the
    farther of the two bf16 runs' distance from the fp32 ones (module docstring)."""
    # first, before anything compiles: no gradient is summed over devices in bf16
    job = job_for(c)
    dtypes = reducer_dtypes(job)
    assert dtypes and "bf16" not in dtypes, dtypes
    ref_losses, (ref_loss, ref_grads) = reference
    # one compiled step gives the losses and step 0's gradients (`helpers.run_with_grads`)
    losses, (loss, grads) = run_with_grads(c)
    assert job.mesh.size == 8 and ref_losses[-1] < ref_losses[0] - 0.3
    assert max_rel_diff(losses, ref_losses) < 1e-3, (losses, ref_losses)
    if grads_too:
        assert abs(loss - ref_loss) / ref_loss < 1e-3 and grads.keys() == ref_grads.keys()
        for k, g in grads.items():
            if np.max(np.abs(g - ref_grads[k])) <= bound * np.max(np.abs(ref_grads[k])):
                continue
            assert truth is not None, k
            fp32, plain = truth
            noise = max(np.max(np.abs(x[k] - fp32[k])) for x in (ref_grads, plain))
            assert np.max(np.abs(g - fp32[k])) <= 1.5 * noise, k
