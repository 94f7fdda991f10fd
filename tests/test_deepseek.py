"""Multi-head latent attention (`mla.py`) against transformers' DeepSeek-V3 and against one
device.

transformers: tiny random `DeepseekV3ForCausalLM`s (query latent or none; MoE with DeepSeek's
group-limited sigmoid router, a shared expert and a nonzero correction bias, or every layer
dense), imported: logits equal to transformers' in float32, on one device and split over
tensor and experts; exported: reloaded with every tensor equal. The rotary dims go through
the importer's de-interleaving, so a wrong permutation shows in the logits.

One device: MLA with the DeepSeek router on 8 simulated devices (experts split, tensor + SP,
the ring, Ulysses, 1F1B, ZB-H1, ZeRO-3) gives the one-device losses and gradients.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
import transformers

from helpers import assert_grads_match, assert_losses_match, by_layout, reference_run, small_config
from spmd3d import convert, generate
from test_convert import (assert_reloaded_equal, ours_logits, refused_import, run_config,
                          saved_random)

HF = dict(vocab_size=256, hidden_size=64, num_attention_heads=4,
          num_key_value_heads=4, intermediate_size=96, kv_lora_rank=24, qk_nope_head_dim=16,
          qk_rope_head_dim=8, v_head_dim=12, rms_norm_eps=1e-6, max_position_embeddings=64)
# DeepSeek-V3's long context: YaRN, its scores scaled by m(mscale_all_dim)^2 and here (mscale
# != mscale_all_dim) its cos and sin too
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
            beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=1.0)
HF_MODELS = {
    # DeepSeek-V3's shape: a query latent, a dense layer, then MoE ones (8 experts in 4 groups,
    # the best 2 groups, top 2), a shared expert, weights renormalized and scaled; YaRN
    "deepseek_moe": dict(q_lora_rank=32, n_routed_experts=8, n_shared_experts=1,
                         moe_intermediate_size=32, num_experts_per_tok=2, n_group=4,
                         topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                         num_hidden_layers=3, first_k_dense_replace=1,
                         rope_parameters=YARN),
    # DeepSeek-V2-Lite's attention: queries straight from the model width; dense layers
    "mla_dense": dict(q_lora_rank=None, num_hidden_layers=2, first_k_dense_replace=2,
                      n_routed_experts=8),
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """{name: (transformers model, its saved directory, its logits on TOKENS)}."""
    out = {}
    for seed, (name, fields) in enumerate(HF_MODELS.items()):
        torch.manual_seed(20 + seed)
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**HF, **fields))
        out[name] = saved_random(model, tmp_path_factory.mktemp(name))
    return out


@pytest.mark.parametrize("name", list(HF_MODELS))
def test_import_gives_transformers_logits(hf_models, name):
    _, hf_dir, ref = hf_models[name]
    cfg = run_config(hf_dir)
    assert cfg.model.is_mla and cfg.model.is_moe == (name == "deepseek_moe")
    assert cfg.model.rope_scaling == ("yarn" if name == "deepseek_moe" else "none")
    assert cfg.model.dense_layers == (1 if name == "deepseek_moe" else 0)
    ours = ours_logits(cfg, hf_dir=hf_dir)
    assert np.abs(ours - ref).max() < 1e-4, np.abs(ours - ref).max()


def test_import_onto_tensor_and_experts_gives_one_device_logits(hf_models):
    _, hf_dir, ref = hf_models["deepseek_moe"]
    mesh = dict(data=2, stage=1, tensor=4, seq=1, expert=2)
    many = ours_logits(run_config(hf_dir, mesh), hf_dir=hf_dir)
    assert np.abs(many - ref).max() < 1e-4, np.abs(many - ref).max()


@pytest.mark.parametrize("name", list(HF_MODELS))
def test_export_reloads_every_tensor_equal(hf_models, name, tmp_path):
    model, hf_dir, ref = hf_models[name]
    convert.import_hf(hf_dir, tmp_path / "run", run_config(hf_dir), jax.devices()[:1])
    convert.export_hf(tmp_path / "run", tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["architectures"] == ["DeepseekV3ForCausalLM"]
    reloaded = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert_reloaded_equal(model, reloaded, ref)


PROMPTS = [[5, 17, 99], [1, 2, 3, 4, 5, 6, 7, 8, 9], [200]]


# ------------------------------------------------------------------------------ one device
MLA = ("model.num_kv_heads=16", "model.kv_lora_rank=32", "model.q_lora_rank=48",
       "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8", "model.v_head_dim=12")
# DeepSeek-V3's MoE: sigmoid scores, 8 experts in 4 groups (a token's from its best 2), top 2,
# weights times 2.5, a shared expert, balanced by the selection bias
DEEPSEEK = ("model.num_experts=8", "model.experts_per_token=2", "model.d_ff_expert=64",
            "model.shared_experts=1", "model.router_score=sigmoid", "model.router_groups=4",
            "model.router_topk_groups=2", "model.router_scale=2.5",
            "model.router_bias_rate=0.01", "train.steps=4", "optim.decay_steps=4")
LAYOUTS = {
    "ds_ep4_tp2_sp_zero3": dict(data=4, tensor=2, sp=True, zero=3, remat="save_dots",
                                extra=("mesh.expert=4",)),
    "ds_ep2_ring2_tp2": dict(data=2, seq=2, tensor=2, remat="full", extra=("mesh.expert=2",)),
    "ds_ep2_ulysses2_tp2": dict(data=2, seq=2, tensor=2, extra=(
        "mesh.expert=2", "parallel.context=ulysses")),
    "ds_ep2_1f1b_tp2": dict(data=2, stage=2, tensor=2, remat="stage", extra=(
        "mesh.expert=2", "parallel.pipeline_schedule=1f1b")),
    "ds_ep2_zb_h1_tp2_sp": dict(data=2, stage=2, tensor=2, sp=True, remat="full", extra=(
        "mesh.expert=2", "parallel.pipeline_schedule=zb_h1")),
}


def deepseek_config(extra=(), **layout):
    return small_config(micro=2, **layout, extra=MLA + DEEPSEEK + tuple(extra))


@pytest.mark.parametrize("name", by_layout(LAYOUTS))
def test_mla_with_deepseek_routing_matches_one_device(name):
    reference = reference_run(deepseek_config())
    cfg = deepseek_config(**LAYOUTS[name])
    assert_grads_match(cfg, reference[1], untrained=("blocks/mlp/bias",))
    assert_losses_match(cfg, reference[0], grads_too=True)


# DeepSeek's first dense layer before 3 MoE ones: the dense stack runs where the embedding
# does (before the pipeline, on every stage), the 3 MoE layers over 2 stages (uneven: 2 + 1);
# with a pipeline, the weights outside it split over the stages too (as the preset has them)
MIXED = ("model.num_layers=4", "model.dense_layers=1", "parallel.tables_over_stage=true")
MIXED_LAYOUTS = {
    "mixed_ep4_tp2_sp_zero3": dict(data=4, tensor=2, sp=True, zero=3,
                                   extra=("mesh.expert=4", *MIXED)),
    "mixed_ep2_tp2_1f1b": dict(data=2, stage=2, tensor=2, remat="full", extra=(
        "mesh.expert=2", "parallel.pipeline_schedule=1f1b", *MIXED)),
    # the dense layer runs the ring, the pipelined ones ZB-H1's gather
    "mixed_ep2_seq2_zb_h1": dict(data=2, stage=2, seq=2, extra=(
        "mesh.expert=2", "parallel.pipeline_schedule=zb_h1", *MIXED)),
    "mixed_dp2_seq2_gpipe_zero3": dict(data=2, stage=2, seq=2, zero=3, extra=(
        "mesh.expert=2", *MIXED)),
}


@pytest.mark.parametrize("name", by_layout(MIXED_LAYOUTS))
def test_dense_layers_before_moe_ones_match_one_device(name):
    reference = reference_run(deepseek_config(extra=MIXED))
    cfg = deepseek_config(**MIXED_LAYOUTS[name])
    assert cfg.model.stacked_layers == 3
    assert_grads_match(cfg, reference[1], untrained=("blocks/mlp/bias",))
    assert_losses_match(cfg, reference[0], grads_too=True)


@pytest.mark.parametrize("tensor", [1, 4], ids=["one_device", "tensor4"])
def test_generation_caches_the_latent_and_equals_transformers_greedy(hf_models, tensor):
    """Greedy decoding from the latent cache (attention absorbed) gives transformers' tokens;
    the cache holds C + R numbers a position and layer, whole on every tensor shard."""
    model, hf_dir, _ = hf_models["deepseek_moe"]
    plan, graphdef, params, _ = generate.load(hf_dir, ["train.seq_len=40",
                                                       f"mesh.tensor={tensor}"])
    gen = generate.Generator(plan, graphdef, params)
    (shape, _), = gen.layout(3)
    assert shape == (3, 3, 40, HF["kv_lora_rank"] + HF["qk_rope_head_dim"])
    ours = gen.generate(PROMPTS, 16)
    for prompt, new in zip(PROMPTS, ours):
        with torch.no_grad():
            theirs = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                    min_new_tokens=16)
        assert new == theirs[0, len(prompt):].tolist()


@pytest.mark.parametrize("change,blamed", [
    (dict(rope_interleave=False), "rope_interleave"),
    (dict(model_type="deepseek_v2"), "model_type")])
def test_unsupported_deepseek_variants_are_refused_in_one_line(hf_models, change, blamed,
                                                               tmp_path, capsys):
    assert blamed in refused_import(hf_models["deepseek_moe"][1], tmp_path, capsys, change)


@pytest.mark.parametrize("change,blamed", [
    ("model.num_kv_heads=8", "model.num_kv_heads"), ("model.head_dim=32", "model.head_dim"),
    ("model.qk_rope_head_dim=7", "model.qk_rope_head_dim"), ("model.fp8=delayed", "model.fp8"),
    ("model.kv_lora_rank=36", "model.kv_lora_rank")])
def test_mla_config_mistakes_name_their_field(change, blamed):
    from spmd3d.config import ConfigError

    with pytest.raises(ConfigError) as e:  # kv_lora_rank 36 does not split over ZeRO's 8
        small_config(data=8, zero=1, extra=MLA + (change,))
    assert e.value.field == blamed, str(e.value)


def test_dense_layers_before_a_pipeline_mask_packed_documents():
    """Packed documents through the dense layer (before the pipeline, the ring over seq 2) and
    the 1F1B stages: one device's loss and gradients (1e-5)."""
    from test_documents import _loss_and_grads, packed_batch

    even = ("model.num_layers=5", "model.dense_layers=1",  # gradients in the same slots
            "parallel.tables_over_stage=true")
    cfg = deepseek_config(data=2, stage=2, seq=2, extra=(
        "mesh.expert=2", "parallel.pipeline_schedule=1f1b", *even))
    batch = packed_batch(cfg.train.global_batch, cfg.train.seq_len + 1)
    ref_loss, ref = _loss_and_grads(deepseek_config(extra=even), batch)
    loss, grads = _loss_and_grads(cfg, batch)
    assert abs(loss - ref_loss) <= 1e-5 * ref_loss
    for k, g in grads.items():
        assert np.max(np.abs(g - ref[k])) <= 1e-5 * np.max(np.abs(ref[k])), k
