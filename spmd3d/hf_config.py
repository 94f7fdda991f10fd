"""Hugging Face `config.json` <-> `model.*` fields, for the families this model computes:
LLaMA, Mistral, Qwen3, Mixtral, Qwen3-MoE and DeepSeek-V3 (`hf.py` maps their weights). What
it cannot compute the same way is refused on import with the field's name; what no family
holds is refused on export (`exportable`)."""

from __future__ import annotations

from .hf_files import HFError
from .schema import ModelConfig

FAMILIES = ("llama", "mistral", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3")
# model types people will try that need features not built, with what is missing
NOT_BUILT = {"deepseek_v2": "its softmax group routing", "qwen2_moe": "the shared expert's gate",
             "gpt_oss": "attention sinks and biases"}


def model_fields(hf: dict, where: str = "config.json") -> dict:
    """`model.*` fields from a transformers `config.json` of a family this model computes
    (LLaMA, Mistral, Qwen3; Mixtral, Qwen3-MoE and DeepSeek-V3); what it cannot compute the
    same way (biases, other activations, sliding windows, other RoPE scalings, dense layers
    among MoE ones) or a field it needs and does not find is refused with an `HFError` naming
    the field."""
    def refuse(name, why):
        raise HFError(f"{where}: {name}", why)

    try:
        return _fields(hf, refuse)
    except KeyError as missing:
        refuse(missing.args[0], f"is missing (a {hf.get('model_type')} config needs it)")


def _fields(hf: dict, refuse) -> dict:
    kind = hf.get("model_type")
    if kind in NOT_BUILT:
        refuse("model_type", f"{kind!r} needs {NOT_BUILT[kind]}, which spmd3d does not have")
    if kind not in FAMILIES:
        refuse("model_type", f"{kind!r} is not supported ({', '.join(FAMILIES)})")
    for name in ("attention_bias", "mlp_bias"):
        if hf.get(name):
            refuse(name, "biases are not supported (spmd3d's LLaMA has none)")
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", f"{hf['hidden_act']!r} is not supported (SwiGLU uses silu)")
    if hf.get("sliding_window") and hf.get("use_sliding_window", True):
        refuse("sliding_window", "sliding-window attention is not supported")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    rope = dict(hf.get("rope_parameters") or {})  # transformers 5 keeps theta and scaling here
    rope.update(hf.get("rope_scaling") or {})
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_kind = rope.get("rope_type", rope.get("type", "default"))
    fields = dict(num_layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], num_heads=heads,
                  num_kv_heads=hf.get("num_key_value_heads") or heads,
                  d_ff=hf["intermediate_size"], vocab_size=hf["vocab_size"],
                  head_dim=0 if head_dim * heads == hf["hidden_size"] else head_dim,
                  rope_theta=float(theta), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                  rope_scaling="none", qk_norm=kind in ("qwen3", "qwen3_moe"))
    if rope_kind == "llama3":
        fields.update(rope_scaling="llama3", rope_factor=float(rope["factor"]),
                      rope_low_freq_factor=float(rope["low_freq_factor"]),
                      rope_high_freq_factor=float(rope["high_freq_factor"]),
                      rope_original_max_len=int(rope["original_max_position_embeddings"]))
    elif rope_kind == "yarn":
        for name, ok in (("attention_factor", None), ("truncate", True)):
            if rope.get(name, ok) != ok:
                refuse(f"rope_scaling.{name}", f"{rope[name]!r} is not supported with yarn")
        fields.update(rope_scaling="yarn", rope_factor=float(rope["factor"]),
                      rope_original_max_len=int(rope["original_max_position_embeddings"]),
                      rope_beta_fast=float(rope.get("beta_fast") or 32),
                      rope_beta_slow=float(rope.get("beta_slow") or 1),
                      rope_mscale=float(rope.get("mscale") or 0),
                      rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0))
    elif rope_kind != "default":
        refuse("rope_scaling", f"rope_type {rope_kind!r} is not supported (default, llama3 "
                               "or yarn)")
    if kind == "mixtral":
        if hf.get("router_jitter_noise"):
            refuse("router_jitter_noise", "router noise is not supported")
        fields.update(num_experts=hf["num_local_experts"], d_ff_expert=hf["intermediate_size"],
                      router_renormalize=True)
    elif kind == "qwen3_moe":
        # transformers 5 spells Qwen3-MoE's expert count as Mixtral's, 4 as `num_experts`
        experts = hf.get("num_local_experts") or hf["num_experts"]
        fields.update(_mixed_layers(hf, refuse), num_experts=experts,
                      d_ff_expert=hf["moe_intermediate_size"],
                      router_renormalize=bool(hf.get("norm_topk_prob", False)))
    elif kind == "deepseek_v3":
        fields.update(_deepseek_fields(hf, refuse))
    if kind in ("mixtral", "qwen3_moe"):
        fields.update(experts_per_token=hf["num_experts_per_tok"],
                      router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)))
    return fields


def _mixed_layers(hf: dict, refuse) -> dict:
    """Qwen3-MoE's dense and MoE layers (layer i is MoE unless in `mlp_only_layers`, and only
    if i + 1 is a multiple of `decoder_sparse_step`) as `dense_layers` k and `moe_every` n:
    layers k + n - 1, k + 2n - 1, ..., the last one, MoE, the others dense."""
    layers, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step") or 1
    dense = set(hf.get("mlp_only_layers") or [])
    moe = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    n = moe[1] - moe[0] if len(moe) > 1 else 1
    k = moe[0] - (n - 1) if moe else -1
    if k < 0 or moe != list(range(k + n - 1, layers, n)):
        refuse("mlp_only_layers", f"MoE layers {moe} (mlp_only_layers {sorted(dense)}, "
                                  f"decoder_sparse_step {step}) are not every n-th layer after "
                                  "the first dense ones up to the last layer")
    return dict(dense_layers=k, moe_every=n)


def _deepseek_fields(hf: dict, refuse) -> dict:
    """DeepSeek-V3's MLA and routing fields (`DeepseekV3Config`)."""
    if not hf.get("rope_interleave", True):
        refuse("rope_interleave", "false is not supported (DeepSeek's checkpoints interleave)")
    layers, dense = hf["num_hidden_layers"], hf.get("first_k_dense_replace") or 0
    out = dict(kv_lora_rank=hf["kv_lora_rank"], q_lora_rank=hf.get("q_lora_rank") or 0,
               qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
               v_head_dim=hf["v_head_dim"], num_kv_heads=hf["num_attention_heads"], head_dim=0,
               # (taken where the checkpoint holds the depths' weights: `convert.import_config`)
               mtp_layers=hf.get("num_nextn_predict_layers") or 0)
    if dense < layers:  # the first `dense` layers dense, the rest MoE
        out.update(dense_layers=dense, num_experts=hf["n_routed_experts"], d_ff_expert=hf["moe_intermediate_size"],
                   shared_experts=hf.get("n_shared_experts") or 0,
                   experts_per_token=hf["num_experts_per_tok"], router_score="sigmoid",
                   router_groups=hf.get("n_group") or 1,
                   router_topk_groups=hf.get("topk_group") or 1,
                   router_scale=float(hf.get("routed_scaling_factor", 1.0)),
                   router_renormalize=bool(hf.get("norm_topk_prob", True)))
    return out


def family(cfg: ModelConfig) -> str:
    """The transformers family an export writes: DeepSeek-V3 with MLA, Qwen3 when the heads
    are q/k-normed (Qwen3-MoE for MoE), else LLaMA (Mixtral for MoE)."""
    if cfg.is_mla:
        return "deepseek_v3"
    if cfg.is_moe:
        return "qwen3_moe" if cfg.qk_norm else "mixtral"
    return "qwen3" if cfg.qk_norm else "llama"


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM"}


def exportable(cfg: ModelConfig) -> None:
    """Raises HFError where no transformers family holds `cfg`'s model."""
    deepseek = cfg.is_moe and (cfg.router_score != "softmax" or cfg.router_groups > 1
                               or cfg.router_scale != 1.0)
    why = ("DeepSeek-V3 routes its experts by sigmoid scores (model.router_score)"
           if cfg.is_mla and cfg.is_moe and cfg.router_score != "sigmoid" else
           "DeepSeek-V3's dense layers all come first (model.moe_every)"
           if cfg.is_mla and cfg.moe_every > 1 else "" if cfg.is_mla
           else "shared experts are in none of Mixtral, Qwen3-MoE" if cfg.shared_experts else
           "DeepSeek-V3's routing (model.router_score, router_groups, router_scale) is in "
           "none of Mixtral, Qwen3-MoE (DeepSeek-V3 has MLA: model.kv_lora_rank)" if deepseek
           else "Mixtral renormalizes the top-k weights (model.router_renormalize=false is "
           "Qwen3-MoE's, with model.qk_norm=true)" if family(cfg) == "mixtral"
           and not cfg.router_renormalize else "Mixtral has no dense layers (model.dense_layers"
           ", moe_every: Qwen3-MoE's, with model.qk_norm=true)" if family(cfg) == "mixtral"
           and (cfg.dense_layers or cfg.moe_every > 1) else "")
    if why:
        raise HFError("model", f"cannot be exported: {why}")


def hf_config(cfg: ModelConfig, base: dict | None = None, dtype: str = "float32") -> dict:
    """A transformers `config.json` for `cfg`: `base` (the imported model's own, keeping its
    token ids and the like) with every field this model decides overwritten."""
    out = {k: v for k, v in (base or {}).items()
           if k not in ("rope_parameters", "rope_scaling", "auto_map", "quantization_config")}
    heads, d, kind = cfg.num_heads, cfg.d_model, family(cfg)
    out.update(architectures=[ARCHITECTURES[kind]], model_type=kind, hidden_size=d,
               num_hidden_layers=cfg.num_layers, num_attention_heads=heads,
               num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.dim_per_head,
               intermediate_size=cfg.d_ff, vocab_size=cfg.vocab_size, hidden_act="silu",
               rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, attention_bias=False,
               mlp_bias=False, tie_word_embeddings=False, torch_dtype=dtype)
    if kind == "mixtral":
        out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                   intermediate_size=cfg.expert_width, router_jitter_noise=0.0,
                   router_aux_loss_coef=cfg.router_aux_loss_coef, sliding_window=None)
    elif kind == "qwen3_moe":
        out.update(num_experts=cfg.num_experts, num_local_experts=cfg.num_experts,
                   num_experts_per_tok=cfg.experts_per_token,
                   moe_intermediate_size=cfg.expert_width, norm_topk_prob=cfg.router_renormalize,
                   **_sparse_step(cfg),
                   router_aux_loss_coef=cfg.router_aux_loss_coef)
    elif kind == "deepseek_v3":
        out.update(_deepseek_config(cfg))
    if kind.startswith("qwen3"):
        out.update(use_sliding_window=False, sliding_window=None)
    if "dtype" in out:  # transformers 5 writes `dtype`, 4 reads `torch_dtype`
        out["dtype"] = dtype
    out.setdefault("max_position_embeddings", cfg.rope_original_max_len)
    out["rope_scaling"] = None if cfg.rope_scaling == "none" else {
        "rope_type": cfg.rope_scaling, "factor": cfg.rope_factor,
        "original_max_position_embeddings": cfg.rope_original_max_len} | ({
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor} if cfg.rope_scaling == "llama3" else {
            "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow} | {
            k: v for k, v in (("mscale", cfg.rope_mscale),
                              ("mscale_all_dim", cfg.rope_mscale_all_dim)) if v})
    return out


def _sparse_step(cfg: ModelConfig) -> dict:
    """`_mixed_layers` the other way: the step when it says which layers are MoE (k a
    multiple of n), else every dense layer listed."""
    k, n = cfg.dense_layers, cfg.moe_every
    if k % n == 0:
        return dict(decoder_sparse_step=n, mlp_only_layers=list(range(k)))
    dense = [i for i in range(cfg.num_layers) if i < k or (i - k) % n != n - 1]
    return dict(decoder_sparse_step=1, mlp_only_layers=dense)


def _deepseek_config(cfg: ModelConfig) -> dict:
    """A `DeepseekV3Config`'s MLA and MoE fields for `cfg`: the first `dense_layers` dense,
    the rest MoE (or all dense)."""
    out = dict(kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank or None,
               qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
               v_head_dim=cfg.v_head_dim, head_dim=cfg.qk_rope_head_dim, rope_interleave=True,
               first_k_dense_replace=cfg.dense_layers if cfg.is_moe else cfg.num_layers,
               num_nextn_predict_layers=cfg.mtp_layers)
    if cfg.is_moe:
        out.update(n_routed_experts=cfg.num_experts, moe_intermediate_size=cfg.expert_width,
                   n_shared_experts=cfg.shared_experts, num_experts_per_tok=cfg.experts_per_token,
                   n_group=cfg.router_groups, topk_group=cfg.router_topk_groups,
                   routed_scaling_factor=cfg.router_scale, norm_topk_prob=cfg.router_renormalize)
    return out
