"""Static checks of the model's fields, alone and against the mesh's degrees (`config.validate`
runs them with the rest): the attention (grouped-query or latent), RoPE and the experts. Each
mistake raises `ConfigError(field, message)`, one line."""

from __future__ import annotations

from .schema import (ATTENTION_KERNELS, DTYPES, EXPERT_KERNELS, EXPERT_WEIGHT_GRADS, FP8_RECIPES,
                     ROPE_SCALINGS, ConfigError, MeshConfig, ModelConfig)


def need(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise ConfigError(field, message)


def divides(field: str, value: int, by: int, what: str) -> None:
    need(value % by == 0, field, f"{value} is not divisible by {what} = {by}")


def validate_model(m: ModelConfig, mesh: MeshConfig) -> None:
    for name in ("num_layers", "d_model", "num_heads", "num_kv_heads", "d_ff", "vocab_size"):
        need(getattr(m, name) > 0, f"model.{name}", "must be positive")
    need(m.dtype == "auto" or m.dtype in DTYPES, "model.dtype",
         f"must be auto or one of {', '.join(DTYPES)}")
    need(m.param_dtype in DTYPES, "model.param_dtype", f"must be one of {', '.join(DTYPES)}")
    need(m.attention in ATTENTION_KERNELS, "model.attention",
         f"must be one of {', '.join(ATTENTION_KERNELS)}")
    need(m.head_dim >= 0, "model.head_dim", "must be >= 0")
    need(m.attention_tile >= 1, "model.attention_tile", "must be >= 1")
    need(m.fp8 in FP8_RECIPES, "model.fp8", f"must be one of {', '.join(FP8_RECIPES)}")
    need(m.fp8_history >= 1, "model.fp8_history", "must be >= 1")
    need(m.fp8_margin >= 0, "model.fp8_margin", "must be >= 0")
    divides("model.num_heads", m.num_heads, m.num_kv_heads, "model.num_kv_heads")
    if not m.head_dim:
        divides("model.d_model", m.d_model, m.num_heads, "model.num_heads")
    if m.is_mla:
        _mla(m)
    else:
        need(m.dim_per_head % 2 == 0, "model.head_dim", "rotary embeddings need an even head dim")
    need(m.rope_scaling in ROPE_SCALINGS, "model.rope_scaling",
         f"must be one of {', '.join(ROPE_SCALINGS)}")
    if m.rope_scaling == "yarn":
        need(m.rope_factor > 0 and m.rope_original_max_len > 0, "model.rope_factor",
             "rope_factor and rope_original_max_len must be positive")
        need(m.rope_beta_fast > m.rope_beta_slow > 0, "model.rope_beta_fast",
             "must be greater than model.rope_beta_slow, and both positive")
    if m.rope_scaling == "llama3":
        need(m.rope_factor > 0 and m.rope_original_max_len > 0, "model.rope_factor",
             "rope_factor and rope_original_max_len must be positive")
        need(m.rope_high_freq_factor > m.rope_low_freq_factor, "model.rope_high_freq_factor",
             "must be greater than model.rope_low_freq_factor")
    need(m.mtp_layers >= 0, "model.mtp_layers", "must be >= 0 (0: off)")
    need(m.mtp_loss_weight >= 0, "model.mtp_loss_weight", "must be >= 0")
    _moe(m, mesh)


def _mla(m) -> None:
    """Multi-head latent attention's fields (`mla.py`)."""
    for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        need(getattr(m, name) > 0, f"model.{name}", "must be positive with MLA")
    need(m.q_lora_rank >= 0, "model.q_lora_rank", "must be >= 0")
    need(m.qk_rope_head_dim % 2 == 0, "model.qk_rope_head_dim",
         "rotary embeddings need an even width")
    need(m.num_kv_heads == m.num_heads, "model.num_kv_heads",
         f"MLA has a key and a value per head: set it to model.num_heads ({m.num_heads})")
    need(m.head_dim == 0, "model.head_dim", "MLA's heads are qk_nope_head_dim + "
         "qk_rope_head_dim wide (values v_head_dim): leave it 0")
    need(not m.qk_norm, "model.qk_norm", "MLA normalizes its latents, not its heads")
    need(m.fp8 == "off", "model.fp8", "FP8 projections are not built for MLA's")


def _moe(m, mesh) -> None:
    need(m.num_experts >= 0, "model.num_experts", "must be >= 0 (0: a dense MLP)")
    need(m.dense_layers == 0 or m.is_moe and 0 < m.dense_layers < m.num_layers,
         "model.dense_layers", f"{m.dense_layers}: dense layers before the MoE ones need "
         f"model.num_experts > 0 and fewer than model.num_layers = {m.num_layers}")
    need(m.moe_every >= 1, "model.moe_every", "must be >= 1 (1: every layer MoE)")
    need(m.moe_every == 1 or m.is_moe and (m.num_layers - m.dense_layers) % m.moe_every == 0,
         "model.moe_every", f"{m.moe_every}: dense layers between MoE ones need "
         f"model.num_experts > 0 and model.num_layers - model.dense_layers "
         f"({m.num_layers - m.dense_layers}) a multiple of it")
    need(m.moe_every == 1 or not m.mtp_layers, "model.mtp_layers",
         "multi-token prediction's depth is one layer of the stack's kind: not with "
         "model.moe_every > 1")
    need(mesh.expert > 0, "mesh.expert", "must be positive")
    if not m.is_moe:
        need(mesh.expert == 1, "mesh.expert", "expert parallelism needs model.num_experts > 0")
        return
    need(0 < m.experts_per_token <= m.num_experts, "model.experts_per_token",
         f"{m.experts_per_token} must be in [1, model.num_experts = {m.num_experts}]")
    need(m.d_ff_expert >= 0, "model.d_ff_expert", "must be >= 0 (0: d_ff)")
    need(m.shared_experts >= 0, "model.shared_experts", "must be >= 0")
    for name in ("router_aux_loss_coef", "router_z_loss_coef", "router_bias_rate",
                 "capacity_factor"):
        need(getattr(m, name) >= 0, f"model.{name}", "must be >= 0 (0: off" +
             (", dropless)" if name == "capacity_factor" else ")"))
    need(m.expert_kernel in EXPERT_KERNELS, "model.expert_kernel",
         f"must be one of {', '.join(EXPERT_KERNELS)}")
    need(m.expert_weight_grad in EXPERT_WEIGHT_GRADS, "model.expert_weight_grad",
         f"must be one of {', '.join(EXPERT_WEIGHT_GRADS)}")
    divides("model.num_experts", m.num_experts, mesh.expert, "mesh.expert")
    divides("model.d_ff_expert", m.expert_width, mesh.tensor, "mesh.tensor")
    need(m.router_score in ("softmax", "sigmoid"), "model.router_score",
         "must be softmax or sigmoid")
    need(m.router_score == "softmax" or not m.router_aux_loss_coef, "model.router_aux_loss_coef",
         "the load-balancing loss is the softmax router's; a sigmoid router balances with "
         "model.router_bias_rate")
    need(m.router_groups >= 1, "model.router_groups", "must be >= 1")
    divides("model.num_experts", m.num_experts, m.router_groups, "model.router_groups")
    per_group = m.num_experts // m.router_groups
    need(m.router_groups == 1 or per_group >= 2, "model.router_groups",
         "a group is ranked by its two best experts: at least 2 experts a group")
    need(1 <= m.router_topk_groups <= m.router_groups
         and m.router_topk_groups * per_group >= m.experts_per_token, "model.router_topk_groups",
         f"must be in [1, model.router_groups] and hold model.experts_per_token experts "
         f"({per_group} a group)")
    need(m.router_scale > 0, "model.router_scale", "must be positive")
