"""Multi-token prediction (`mtp.py`) against transformers' `MtpModel` and against one device.

transformers: a tiny random DeepSeek-V3 checkpoint with one MTP depth stored as its layer L (as
DeepSeek's own checkpoints store it), which transformers' `MtpModel.from_pretrained` loads:
the depth's summed cross-entropy on a batch equals ours after `convert import` (1e-5), and the
export writes the depth's tensors back bit-equal.

One device: DeepSeek-V3's shape with two depths on 8 simulated devices (experts split, tensor +
SP, ZeRO-3; the ring) gives the one-device losses and gradients, the depths' probes (their
cross-entropies) included; off, the model holds none of it and the loss is the main one.
"""

from __future__ import annotations

import json
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from helpers import (assert_grads_match, assert_losses_match, by_layout, job_for, reference_run,
                     small_config, start_state)
from spmd3d import convert, forward, mtp, store
from spmd3d.model import abstract_model
from spmd3d.plan import Plan
from spmd3d.step import canonical_state
from test_convert import run_config, saved_random
from test_deepseek import DEEPSEEK, HF, HF_MODELS, MLA, deepseek_config

MTP = ("model.mtp_layers=2", "model.mtp_loss_weight=0.3")
LAYOUTS = {
    "mtp_ep4_tp2_sp_zero3": dict(data=4, tensor=2, sp=True, zero=3, remat="full",
                                 extra=("mesh.expert=4",)),
    "mtp_ep2_ring2_tp2": dict(data=2, seq=2, tensor=2, extra=("mesh.expert=2",)),
    # in a pipeline: the depths on the last stage after each microbatch's head (1F1B, ZB-H1),
    # or after GPipe's pipeline on every stage's rows
    "mtp_ep2_1f1b_tp2": dict(data=2, stage=2, tensor=2, remat="stage", extra=(
        "mesh.expert=2", "parallel.pipeline_schedule=1f1b")),
    "mtp_ep2_zb_h1_tp2_sp": dict(data=2, stage=2, tensor=2, sp=True, remat="full", extra=(
        "mesh.expert=2", "parallel.pipeline_schedule=zb_h1")),
    "mtp_ep2_gpipe_ring2_zero3": dict(data=2, stage=2, seq=2, zero=3, extra=(
        "mesh.expert=2", "parallel.pipeline_schedule=gpipe")),
}
UNTRAINED = ("blocks/mlp/bias", "mtp/block/mlp/bias")


def mtp_config(extra=(), **layout):
    return small_config(micro=2, **layout, extra=MLA + DEEPSEEK + MTP + tuple(extra))


@pytest.mark.parametrize("name", by_layout(LAYOUTS))
def test_mtp_matches_one_device(name):
    reference = reference_run(mtp_config())
    cfg = mtp_config(**LAYOUTS[name])
    assert_grads_match(cfg, reference[1], untrained=UNTRAINED)
    assert_losses_match(cfg, reference[0], grads_too=True)


def test_mtp_adds_its_weighted_loss_and_off_holds_nothing():
    """The step's loss is the main loss plus the weight times the depths' mean (`mtp_loss`,
    from the probes); off, no `mtp` parameter exists and the loss is the main one alone (the
    step off is `test_deepseek`'s one-device reference; its metrics are read from its trace)."""
    on_job, off_cfg = job_for(mtp_config()), deepseek_config()
    on = on_job.step_fn(start_state(mtp_config()), on_job.global_batch(0))[1]
    off_job = job_for(off_cfg)
    off = jax.eval_shape(off_job.step_fn, off_job.abstract, off_job.global_batch(0))[1]
    assert "mtp_loss" in on and "mtp_loss" not in off
    assert on["mtp_moe_aux_loss"] is not None  # the depths' routers report apart
    off_loss = reference_run(off_cfg)[0][0]
    assert float(on["loss"]) == pytest.approx(off_loss + 0.3 * float(on["mtp_loss"]), rel=1e-5)
    assert not any(k.startswith("mtp/") for k in store.flat(abstract_model(
        Plan.resolve(off_cfg, jax.devices()[:1]).cfg.model)[1]))


def test_targets_stay_inside_each_document():
    """Depth k at position i embeds token i + k and predicts token i + k + 1, and trains on it
    only while position i + k is in position i's document (and its main label is trained)."""
    tokens = jnp.array([[10, 11, 12, 13, 14, 15]])  # T = 5
    labels = jnp.array([[11, 12, -1, 14, 15]])  # the label after an end of text not trained
    segments = jnp.array([[0, 0, 0, 1, 1]])
    ids, ahead = mtp.targets(tokens, labels, segments, 2)
    np.testing.assert_array_equal(ids, [[[11, 12, 13, 14, 15]], [[12, 13, 14, 15, 0]]])
    np.testing.assert_array_equal(ahead, [[[12, -1, -1, 15, -1]], [[-1, -1, -1, -1, -1]]])
    np.testing.assert_array_equal(mtp.targets(tokens, labels, None, 1)[1], [[[12, -1, 14, 15, -1]]])


# ------------------------------------------------------------------------------ transformers
LAYERS = HF_MODELS["deepseek_moe"]["num_hidden_layers"]


@pytest.fixture(scope="module")
def hf_mtp(tmp_path_factory):
    """(transformers' main model, its MtpModel, the directory): DeepSeek-V3's tiny shape saved
    with one more MoE layer, which is the MTP depth's block, and the depth's norms and
    projection beside it under `model.layers.L`."""
    path = tmp_path_factory.mktemp("mtp")
    torch.manual_seed(31)
    fields = {**HF_MODELS["deepseek_moe"], "num_hidden_layers": LAYERS + 1}
    saved_random(transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**HF, **fields)),
                 path)
    file = path / "model.safetensors"
    tensors, rng, d = load_file(file), np.random.RandomState(5), HF["hidden_size"]
    layer = f"model.layers.{LAYERS}."
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[layer + name + ".weight"] = rng.uniform(0.5, 1.5, d).astype(np.float32)
    tensors[layer + "eh_proj.weight"] = (rng.randn(d, 2 * d) * 0.05).astype(np.float32)
    save_file(tensors, file, metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(num_hidden_layers=LAYERS, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(cfg))
    main = transformers.DeepseekV3ForCausalLM.from_pretrained(path).float().eval()
    # where transformers looks for the depths: DeepSeek-V3's layer 61, here layer L
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS}.*"]
    return main, transformers.modeling_layers.MtpModel.from_pretrained(main).float().eval(), path


def test_import_gives_transformers_mtp_loss(hf_mtp):
    main, depth, path = hf_mtp
    tokens = np.random.RandomState(1).randint(0, HF["vocab_size"], (2, 25))
    t = tokens.shape[1] - 1
    with torch.no_grad():  # depth 1 at position i: embeds token i + 1, predicts token i + 2
        state = main(torch.tensor(tokens[:, :t]), output_hidden_states=True).hidden_states[-1]
        hidden = depth.forward_layer(0, state, torch.arange(1, t + 1)[None].expand(2, -1), None,
                                     input_ids=torch.tensor(tokens[:, 1:]))
        logits = depth._project_to_logits(hidden)[:, :-1]
        theirs = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), torch.tensor(tokens[:, 2:]).reshape(-1),
            reduction="sum").item()
    cfg = run_config(path)
    assert cfg.model.mtp_layers == 1 and cfg.train.seq_len == t
    plan = Plan.resolve(cfg, jax.devices()[:1])
    abstract, shardings = canonical_state(plan)
    params = convert.load_params(path, cfg, store.abstract_like(abstract, shardings).params)

    def summed(weight):  # the loss with the depth's cross-entropy times `weight`
        p = Plan.resolve(replace(cfg, model=replace(cfg.model, mtp_loss_weight=weight)),
                         jax.devices()[:1])
        graphdef = abstract_model(p.cfg.model)[0]  # jitted: eager, the two took most of 50 s
        return float(jax.jit(lambda w, t: forward.loss_sum(p, graphdef, w, t)[0])(
            params, jnp.asarray(tokens)))

    assert summed(1.0) - summed(0.0) == pytest.approx(theirs, rel=1e-5)


def test_export_writes_the_depth_back(hf_mtp, tmp_path):
    _, _, path = hf_mtp
    convert.import_hf(path, tmp_path / "run", run_config(path), jax.devices()[:1])
    convert.export_hf(tmp_path / "run", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())[
        "num_nextn_predict_layers"] == 1
    want = load_file(path / "model.safetensors")
    got = {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        got.update(load_file(f))
    depth = [k for k in want if k.startswith(f"model.layers.{LAYERS}.")]
    assert len(depth) > 10 and all(np.array_equal(want[k], got[k]) for k in depth)


@pytest.mark.parametrize("change,blamed", [
    (("model.mtp_layers=-1",), "model.mtp_layers"),
    (("model.mtp_loss_weight=-0.1",), "model.mtp_loss_weight")])
def test_mtp_config_mistakes_name_their_field(change, blamed):
    from spmd3d.config import ConfigError

    with pytest.raises(ConfigError) as e:
        small_config(extra=MLA + DEEPSEEK + MTP + change)
    assert e.value.field == blamed, str(e.value)


def test_uneven_stages_hand_checkpoints_the_depths_split_over_stage_once():
    """Uneven stages: checkpoints hold the canonical state, whose model widths take `stage`
    (`ZeroRules.canonical`); MTP's `eh_proj` [2, D, D] has two, and splits the first."""
    from spmd3d.step import canonical_state

    cfg = mtp_config(data=2, stage=2, tensor=2, extra=(
        "mesh.expert=2", "model.num_layers=4", "model.dense_layers=1",
        "parallel.pipeline_schedule=1f1b", "parallel.tables_over_stage=true"))
    plan = Plan.resolve(cfg, jax.devices())
    assert plan.padded
    leaves = jax.tree_util.tree_flatten_with_path(canonical_state(plan)[1])[0]
    specs = [s.spec for path, s in leaves if "eh_proj" in jax.tree_util.keystr(path)]
    assert len(specs) == 3  # the weights and Adam's two moments
    for spec in specs:
        assert sum("stage" in jax.tree.leaves(tuple(a)) if isinstance(a, tuple) else a == "stage"
                   for a in spec) == 1, spec


def test_tables_over_stage_needs_a_width_the_stages_split():
    from spmd3d.config import ConfigError

    with pytest.raises(ConfigError) as e:  # d_model 76 over 2 stages x ZeRO-3's 4
        small_config(data=4, stage=2, zero=3, micro=2, extra=(
            "parallel.tables_over_stage=true", "model.d_model=76", "model.num_heads=2",
            "model.num_kv_heads=2"))
    assert e.value.field == "model.d_model", str(e.value)
