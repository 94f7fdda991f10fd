"""Mixture-of-Experts on 8 simulated devices equals one device (float32, dropless): losses
at every step and every gradient leaf, with a shared expert, the balancing loss, the z-loss
and the bias on, for experts split 8 ways, 4 ways x 2 replicas, with tensor + SP, with the
sequence over the ring, in every pipeline schedule (GPipe, circular GPipe, 1F1B, interleaved
1F1B, ZB-H1), the capacity path split 4 ways, and ZeRO-3 over the replicas (and over HSDP's
groups), under every remat policy; and a checkpoint written at one expert-parallel degree
resumed at another; DeepSeek-V3's router (sigmoid, group-limited) with experts split 4 ways
and with tensor + SP under ZeRO-3. Every layout accumulates 2 microbatches, as the reference
does (the balancing loss is a microbatch's)."""

from dataclasses import replace

import jax
import numpy as np
import pytest

from helpers import (assert_grads_match, assert_losses_match, by_layout, devices_for, job_for,
                     max_rel_diff, reference_run, small_config, start_state, train_losses)
from spmd3d import checkpoint
from spmd3d.train import train

MOE = ("model.num_experts=8", "model.experts_per_token=2", "model.d_ff_expert=64",
       "model.shared_experts=1",
       "model.router_aux_loss_coef=0.01", "model.router_z_loss_coef=0.001",
       "model.router_bias_rate=0.01", "train.steps=4", "optim.decay_steps=4")
L4 = ("model.num_layers=4",)
# every remat policy among them: none, save_dots, full, and a whole stage's; every schedule
LAYOUTS = {
    "ep8": dict(data=8, extra=("mesh.expert=8",)),
    # ZeRO-3 over the replicas: each expert's weights split over the 2 devices that hold it
    "ep4_x2_zero3": dict(data=8, zero=3, remat="full", extra=("mesh.expert=4",)),
    # HSDP: ZeRO-3 over a group of data 2 x expert 2, two copies of it
    "ep2_hsdp2_zero3": dict(data=8, zero=3, extra=("mesh.expert=2", "mesh.replicate=2")),
    "ep2_dp4_tp2_sp": dict(data=4, tensor=2, sp=True, remat="save_dots",
                           extra=("mesh.expert=2",)),
    "ep4_ring2": dict(data=4, seq=2, remat="full", extra=("mesh.expert=4",)),
    "ep2_1f1b": dict(data=4, stage=2, remat="stage",
                     extra=("mesh.expert=2", "parallel.pipeline_schedule=1f1b")),
    "ep2_tp2_sp_zb_h1": dict(data=2, stage=2, tensor=2, sp=True, remat="full",
                             extra=("mesh.expert=2", "parallel.pipeline_schedule=zb_h1")),
    "ep2_gpipe": dict(data=4, stage=2, extra=("mesh.expert=2",)),
    # circular GPipe and interleaved 1F1B: two chunks of one layer per stage (a 4-layer model)
    "ep2_circular_gpipe": dict(data=4, stage=2, remat="stage",
                               extra=("mesh.expert=2", "parallel.pipeline_repeats=2", *L4)),
    "ep2_tp2_interleaved_1f1b": dict(data=2, stage=2, tensor=2, extra=(
        "mesh.expert=2", "parallel.pipeline_schedule=1f1b", "parallel.pipeline_repeats=2", *L4)),
    # the capacity path with room for every token (capacity factor E / k) is the dropless layer
    "ep4_capacity": dict(data=8, extra=("mesh.expert=4", "model.capacity_factor=4")),
}


def moe_config(extra=(), **layout):
    return small_config(micro=2, **layout, extra=MOE + tuple(extra))


@pytest.fixture(scope="module")
def reference():
    return reference_run(moe_config())


@pytest.mark.parametrize("name", by_layout(LAYOUTS))
def test_moe_layouts_match_one_device(reference, name):
    cfg = moe_config(**LAYOUTS[name])
    if cfg.model.num_layers != 2:
        reference = reference_run(moe_config(extra=L4))
    assert_grads_match(cfg, reference[1], untrained=("blocks/mlp/bias",))
    assert_losses_match(cfg, reference[0], grads_too=True)


# DeepSeek-V3's router: sigmoid scores, a token's experts from its 2 best of 4 groups, weights
# times 2.5, balanced by the bias alone (which moves the choices step by step)
DEEPSEEK = ("model.router_score=sigmoid", "model.router_groups=4", "model.router_topk_groups=2",
            "model.router_scale=2.5", "model.router_aux_loss_coef=0")
DEEPSEEK_LAYOUTS = {
    "deepseek_ep4_x2": dict(data=8, extra=("mesh.expert=4", *DEEPSEEK)),
    "deepseek_ep2_tp2_sp_zero3": dict(data=4, tensor=2, sp=True, zero=3,
                                      extra=("mesh.expert=2", *DEEPSEEK)),
}


@pytest.mark.parametrize("name", by_layout(DEEPSEEK_LAYOUTS))
def test_deepseek_routing_matches_one_device(name):
    reference = reference_run(moe_config(extra=DEEPSEEK))
    cfg = moe_config(**DEEPSEEK_LAYOUTS[name])
    assert_grads_match(cfg, reference[1], untrained=("blocks/mlp/bias",))
    assert_losses_match(cfg, reference[0], grads_too=True)


# dense layers between MoE ones (Qwen3-MoE's decoder_sparse_step 2, Llama 4's every other
# layer): each entry of the stack a dense layer, then an MoE one; with a pipeline, a dense
# layer first (its own stack, before the pipeline) and 3 entries over 2 stages (uneven: 2 + 1)
EVERY2 = ("model.num_layers=4", "model.moe_every=2")
DENSE_EVERY2 = ("model.num_layers=7", "model.dense_layers=1", "model.moe_every=2")
INTERLEAVED_LAYOUTS = {
    "every2_ep2_dp4_tp2_sp_zero3": dict(data=4, tensor=2, sp=True, zero=3, remat="save_dots",
                                        extra=("mesh.expert=2", *EVERY2)),
    "every2_ep2_tp2_sp_zb_h1": dict(data=2, stage=2, tensor=2, sp=True, remat="full", extra=(
        "mesh.expert=2", "parallel.pipeline_schedule=zb_h1", *EVERY2)),
    "dense_every2_ep2_seq2_1f1b_uneven": dict(data=2, stage=2, seq=2, extra=(
        "mesh.expert=2", "parallel.pipeline_schedule=1f1b", *DENSE_EVERY2)),
}


@pytest.mark.parametrize("name", by_layout(INTERLEAVED_LAYOUTS))
def test_dense_layers_between_moe_ones_match_one_device(name):
    layout = INTERLEAVED_LAYOUTS[name]
    reference = reference_run(moe_config(extra=[e for e in layout["extra"]
                                                if e.startswith("model.")]))
    cfg = moe_config(**layout)
    assert cfg.model.stacked_layers == (2 if "model.num_layers=4" in layout["extra"] else 3)
    assert_grads_match(cfg, reference[1], untrained=("blocks/mlp/bias",))
    assert_losses_match(cfg, reference[0], grads_too=True)


def test_an_entry_of_the_stack_holds_its_dense_layers_before_its_moe_one():
    """With moe_every 3: each entry's dense layers (`before0`, `before1`) of width d_ff beside
    its MoE layer, the stack 2 entries deep, and the losses' mean over its 2 MoE layers."""
    from spmd3d.model import abstract_model

    cfg = moe_config(extra=("model.num_layers=7", "model.dense_layers=1", "model.moe_every=3"))
    m = replace(cfg.model, dtype="float32")
    params = abstract_model(m)[1]
    assert params["blocks"]["before1"]["mlp"]["w_down"].shape == (2, m.d_ff, m.d_model)
    assert params["blocks"]["mlp"]["w_down"].shape == (2, 8, 64, m.d_model)
    assert "before2" not in params["blocks"] and params["dense"]["mlp"]["w_down"].shape[0] == 1
    assert m.layer_params == m.attention_params * 3 + 2 * 3 * m.d_model * m.d_ff + (
        3 * m.d_model * 64 * 9 + m.d_model * 8)


@pytest.mark.parametrize("change", ["model.moe_every=3", "model.mtp_layers=1"])
def test_interleaving_mistakes_name_their_field(change):
    from spmd3d.config import ConfigError

    with pytest.raises(ConfigError) as e:  # 4 layers are not entries of 3; MTP's depth is one
        moe_config(extra=("model.num_layers=4", "model.moe_every=2" if "mtp" in change
                          else "model.num_experts=8", change))
    assert e.value.field == change.split("=")[0], str(e.value)


def test_router_state_is_kept_but_not_optimized(reference):
    """The bias and the statistics probe are parameters (checkpointed, laid out by the rules)
    that the optimizer keeps no moments for."""
    job = job_for(moe_config(**LAYOUTS["ep4_x2_zero3"]))
    opt_paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(job.abstract.opt)}
    assert any("w_gate_up" in p for p in opt_paths)
    assert not any("bias" in p or "probe" in p for p in opt_paths), opt_paths
    param_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(job.abstract.params)]
    assert sum("bias" in p or "probe" in p for p in param_paths) == 2


def test_checkpoint_resumes_at_another_expert_parallel_degree(tmp_path, reference):
    """2 steps with experts split 8 ways, 2 more split 2 ways with tensor 2 and 2 ZB-H1 stages: the
    losses are the uninterrupted one-device run's (the bias, trained by its own rule, comes
    back from the checkpoint: without it the routing, and the loss, would differ)."""
    run = tmp_path / "run"
    quiet = (f"run.dir={run}", "run.eval_every=0", "run.sample_every=0")
    # the layouts above (their compiled steps come from the compilation cache)
    legs = [moe_config(**LAYOUTS["ep8"] | dict(extra=("mesh.expert=8", "train.steps=2", *quiet))),
            moe_config(**LAYOUTS["ep2_tp2_sp_zb_h1"] | dict(extra=(
                "mesh.expert=2", "parallel.pipeline_schedule=zb_h1", *quiet)))]
    got = []
    for leg in legs:
        got += [r["loss"] for r in train(leg, devices=devices_for(leg))]
    assert max_rel_diff(got, reference[0]) < 1e-4, (got, reference[0])
    # the bias the resumed run ends with is the uninterrupted one-device run's
    _, _, state = train_losses(moe_config())
    want = np.asarray(state.params["blocks"]["mlp"]["bias"][...])
    arrays, _ = checkpoint.read(run, ["params/blocks/mlp/bias"])
    assert np.any(want) and np.array_equal(arrays["params/blocks/mlp/bias"], want)


def test_capacity_with_room_for_all_is_dropless_and_reports_what_it_drops(reference):
    """capacity_factor = E / k: an expert has a slot for every token, nothing is dropped and
    the losses are the dropless ones (batched matmuls instead of grouped ones); at 1.0 with
    the experts split 4 ways the step reports the share it dropped."""
    roomy = moe_config(extra=("model.capacity_factor=4",))
    losses, _, _ = train_losses(roomy)
    assert max_rel_diff(losses, reference[0]) < 1e-5, (losses, reference[0])
    tight = moe_config(data=8, extra=("mesh.expert=4", "model.capacity_factor=1"))
    job = job_for(tight)
    _, metrics = job.step_fn(start_state(tight), job.global_batch(0))
    assert 0 < float(metrics["moe_dropped"]) < 0.5, float(metrics["moe_dropped"])
