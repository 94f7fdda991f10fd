"""Hugging Face MoE and Qwen3 interop against transformers itself: tiny random
MixtralForCausalLM (top-2), Qwen3MoeForCausalLM (top-4, weights not renormalized; and with
a dense layer before the MoE ones, `mlp_only_layers`, or dense layers between them,
`decoder_sparse_step`) and Qwen3ForCausalLM (q/k norms), all GQA, imported: logits equal transformers' in float32, on one
device and on an expert-parallel mesh; exported: reloaded by transformers with every tensor
equal."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
import transformers

from spmd3d import convert
from test_convert import (assert_reloaded_equal, ours_logits, refused_import, run_config,
                          saved_random)

COMMON = dict(vocab_size=256, hidden_size=48, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, head_dim=16, rms_norm_eps=1e-5)
MODELS = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  dict(intermediate_size=64, moe_intermediate_size=32, num_experts=8,
                       num_experts_per_tok=4, norm_topk_prob=False)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(intermediate_size=64)),
    # a dense layer (of intermediate_size) before the MoE ones
    "qwen3_moe_dense": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                        dict(intermediate_size=64, moe_intermediate_size=32, num_experts=8,
                             num_experts_per_tok=4, num_hidden_layers=3, mlp_only_layers=[0])),
    # dense layers between MoE ones: every second layer MoE after two dense ones (entries of a
    # dense and an MoE layer, `model.moe_every`) ...
    "qwen3_moe_step2": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                        dict(intermediate_size=64, moe_intermediate_size=32, num_experts=8,
                             num_experts_per_tok=4, num_hidden_layers=6, decoder_sparse_step=2,
                             mlp_only_layers=[0, 1])),
    # ... and after one, which only mlp_only_layers can say (MoE layers 2 and 4)
    "qwen3_moe_listed": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                         dict(intermediate_size=64, moe_intermediate_size=32, num_experts=8,
                              num_experts_per_tok=4, num_hidden_layers=5,
                              mlp_only_layers=[0, 1, 3])),
}
# (dense_layers, moe_every) each imports as
MIXED = {"qwen3_moe_dense": (1, 1), "qwen3_moe_step2": (2, 2), "qwen3_moe_listed": (1, 2)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{family: (transformers model, its saved directory, its logits on TOKENS)}."""
    out = {}
    for seed, (name, (cls, cfg_cls, fields)) in enumerate(MODELS.items()):
        torch.manual_seed(10 + seed)
        model = getattr(transformers, cls)(getattr(transformers, cfg_cls)(**(COMMON | fields)))
        out[name] = saved_random(model, tmp_path_factory.mktemp(name))
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_import_gives_transformers_logits(models, name):
    _, hf_dir, ref = models[name]
    cfg = run_config(hf_dir)
    assert cfg.model.qk_norm == name.startswith("qwen3")
    assert cfg.model.num_experts == (0 if name == "qwen3" else 8)
    m = cfg.model
    assert (m.dense_layers, m.moe_every) == MIXED.get(name, (0, 1))
    ours = ours_logits(cfg, hf_dir=hf_dir)
    assert np.abs(ours - ref).max() < 1e-4, np.abs(ours - ref).max()


@pytest.mark.parametrize("mesh", [dict(data=4, expert=4), dict(data=2, expert=2, tensor=4)],
                         ids=["expert4", "data2_expert2_tensor4"])
def test_import_onto_an_expert_parallel_mesh_gives_one_device_logits(models, mesh):
    _, hf_dir, ref = models["mixtral"]
    one = ours_logits(run_config(hf_dir), hf_dir=hf_dir)
    full = dict(data=1, stage=1, tensor=1, seq=1, expert=1) | mesh
    many = ours_logits(run_config(hf_dir, full), hf_dir=hf_dir)
    assert np.abs(many - one).max() < 1e-5 and np.abs(many - ref).max() < 1e-4


@pytest.mark.parametrize("name", list(MODELS))
def test_export_reloads_every_tensor_equal(models, name, tmp_path):
    model, hf_dir, ref = models[name]
    convert.import_hf(hf_dir, tmp_path / "run", run_config(hf_dir), jax.devices()[:1])
    convert.export_hf(tmp_path / "run", tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["architectures"] == [MODELS[name][0]]
    if name.startswith("qwen3_moe"):  # which layers are MoE, said as the original says it
        theirs = model.config
        assert (exported["decoder_sparse_step"], exported["mlp_only_layers"]) == (
            theirs.decoder_sparse_step, list(theirs.mlp_only_layers))
    reloaded = getattr(transformers, MODELS[name][0]).from_pretrained(tmp_path / "out").eval()
    assert_reloaded_equal(model, reloaded, ref)


@pytest.mark.parametrize("case,blamed", [
    ("deepseek_v2", "model_type"), ("deepseek_v3_fields", "kv_lora_rank"),
    ("top_k", "model.experts_per_token"), ("expert_split", "mesh.expert"),
    ("dense_layers", "mlp_only_layers"), ("no_moe_layer", "mlp_only_layers"),
    ("capacity", "model.capacity_factor")])
def test_bad_moe_input_is_one_line_and_exit_2(models, case, blamed, tmp_path, capsys):
    change, extra = {}, []
    if case.startswith("deepseek"):  # V2's routing is not built; V3's fields are missing
        change["model_type"] = case[:11]
    elif case == "top_k":
        change["num_experts_per_tok"] = 9
    elif case == "expert_split":
        extra += ["mesh.data=3", "mesh.expert=3"]
    elif case == "dense_layers":
        change["mlp_only_layers"] = [1]  # after the last MoE layer
    elif case == "no_moe_layer":  # layers 2, 5, ... of 2
        change["decoder_sparse_step"] = 3
    elif case == "capacity":  # 0 is dropless; below it nothing could be kept
        extra += ["model.capacity_factor=-1"]
    assert blamed in refused_import(models["qwen3_moe"][1], tmp_path, capsys, change, extra)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe_step2"])
def test_generation_with_the_cache_is_transformers_greedy(models, name):
    """The KV cache with MoE layers (and with dense layers between them, an entry's layers
    each with their own rows): greedy continuations equal transformers' own generate."""
    from spmd3d import generate

    model, hf_dir, _ = models[name]
    plan, graphdef, params, _ = generate.load(hf_dir, ["train.seq_len=32", "mesh.tensor=1"])
    prompts = [[5, 17, 99], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    ours = generate.Generator(plan, graphdef, params).generate(prompts, 12)
    for prompt, new in zip(prompts, ours):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                 min_new_tokens=12)
        assert out[0, len(prompt):].tolist() == new
