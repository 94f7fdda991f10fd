"""Hugging Face LLaMA, Qwen3, Mixtral and Qwen3-MoE <-> spmd3d: config fields, and every weight's
name and layout both ways.

A LLaMA-family directory holds `config.json` and `*.safetensors` (one file, or several listed by
`model.safetensors.index.json`). Its weights map onto the checkpoint schema's keys (`store.py`):

    model.embed_tokens.weight [V, D]                     -> embed [V, D]
    model.layers.i.self_attn.{q,k,v}_proj.weight         -> blocks/attn/w_qkv [L, D, K, G+2, H]
    model.layers.i.self_attn.o_proj.weight [D, K*G*H]    -> blocks/attn/w_o [L, K, G, H, D]
    model.layers.i.mlp.{gate,up}_proj.weight [F, D]      -> blocks/mlp/w_gate_up [L, D, 2, F]
    model.layers.i.mlp.down_proj.weight [D, F]           -> blocks/mlp/w_down [L, F, D]
    model.layers.i.{input,post_attention}_layernorm      -> blocks/{attn,mlp}_norm/scale [L, D]
    model.norm.weight, lm_head.weight [V, D]             -> final_norm/scale, head [D, V]

Query head j belongs to kv head j // G in both (transformers' `repeat_kv`), and both rotate the
(first half, second half) pairs of a head, so the fused weight is a reshape and a transpose: no
permutation. A tied checkpoint (no `lm_head`) is untied: the head starts as the embedding's
transpose and trains on its own; an export writes both.

Numpy only (no jax, no torch). The safetensors files are read and written a tensor at a time
(`hf_files.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .hf_files import Files, HFError
from .schema import ModelConfig

# ------------------------------------------------------------------------------------- config
FAMILIES = ("llama", "mistral", "qwen3", "mixtral", "qwen3_moe")
# model types people will try that need features not built, with what is missing
NOT_BUILT = {"deepseek_v3": "multi-head latent attention (MLA)", "deepseek_v2": "MLA",
             "qwen2_moe": "the shared expert's gate", "gpt_oss": "attention sinks and biases"}


def model_fields(hf: dict, where: str = "config.json") -> dict:
    """`model.*` fields from a transformers `config.json` of a family this model computes
    (LLaMA, Mistral, Qwen3; Mixtral and Qwen3-MoE); what it cannot compute the same way
    (biases, other activations, sliding windows, other RoPE scalings, dense layers among MoE
    ones) is refused with an `HFError` naming the field."""
    def refuse(name, why):
        raise HFError(f"{where}: {name}", why)

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
    elif rope_kind != "default":
        refuse("rope_scaling", f"rope_type {rope_kind!r} is not supported (default or llama3)")
    if kind == "mixtral":
        if hf.get("router_jitter_noise"):
            refuse("router_jitter_noise", "router noise is not supported")
        fields.update(num_experts=hf["num_local_experts"], d_ff_expert=hf["intermediate_size"],
                      router_renormalize=True)
    elif kind == "qwen3_moe":
        if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
            refuse("mlp_only_layers", "dense layers among the MoE ones are not supported "
                                      "(every layer's MLP is MoE)")
        # transformers 5 spells Qwen3-MoE's expert count as Mixtral's, 4 as `num_experts`
        experts = hf.get("num_local_experts") or hf["num_experts"]
        fields.update(num_experts=experts, d_ff_expert=hf["moe_intermediate_size"],
                      router_renormalize=bool(hf.get("norm_topk_prob", False)))
    if kind in ("mixtral", "qwen3_moe"):
        fields.update(experts_per_token=hf["num_experts_per_tok"],
                      router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)))
    return fields


def family(cfg: ModelConfig) -> str:
    """The transformers family an export writes: Qwen3 when the heads are q/k-normed (Qwen3-MoE
    for MoE), else LLaMA (Mixtral for MoE)."""
    if cfg.is_moe:
        return "qwen3_moe" if cfg.qk_norm else "mixtral"
    return "qwen3" if cfg.qk_norm else "llama"


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def exportable(cfg: ModelConfig) -> None:
    """Raises HFError where no transformers family holds `cfg`'s model."""
    deepseek = cfg.is_moe and (cfg.router_score != "softmax" or cfg.router_groups > 1
                               or cfg.router_scale != 1.0)
    why = ("shared experts are in none of Mixtral, Qwen3-MoE" if cfg.shared_experts else
           "DeepSeek-V3's routing (model.router_score, router_groups, router_scale) is in "
           "none of Mixtral, Qwen3-MoE" if deepseek else
           "Mixtral renormalizes the top-k weights (model.router_renormalize=false is "
           "Qwen3-MoE's, with model.qk_norm=true)" if family(cfg) == "mixtral"
           and not cfg.router_renormalize else "")
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
                   decoder_sparse_step=1, mlp_only_layers=[],
                   router_aux_loss_coef=cfg.router_aux_loss_coef)
    if kind.startswith("qwen3"):
        out.update(use_sliding_window=False, sliding_window=None)
    if "dtype" in out:  # transformers 5 writes `dtype`, 4 reads `torch_dtype`
        out["dtype"] = dtype
    out.setdefault("max_position_embeddings", cfg.rope_original_max_len)
    out["rope_scaling"] = None if cfg.rope_scaling == "none" else {
        "rope_type": "llama3", "factor": cfg.rope_factor,
        "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
        "original_max_position_embeddings": cfg.rope_original_max_len}
    return out


# ------------------------------------------------------------------------------------ weights
@dataclass(frozen=True)
class Weight:
    """One parameter: its checkpoint key (under `params/`), the HF tensors it is made of (for
    stacked ones, per layer: `{}` is the layer's index), and the two conversions of one layer."""

    key: str
    names: tuple[str, ...]
    to_ours: Callable  # (list of HF arrays, ModelConfig) -> our array
    to_hf: Callable  # (our array, ModelConfig) -> list of HF arrays, in `names`' order

    @property
    def stacked(self) -> bool:
        return self.key.startswith("blocks/")

    def hf_names(self, layer: int | None = None) -> list[str]:
        return [n.format(layer) for n in self.names]


def _qkv_in(ts, cfg):
    q, k, v = ts
    kv, h, d = cfg.num_kv_heads, cfg.dim_per_head, cfg.d_model
    g = cfg.num_heads // kv
    fused = np.concatenate([q.reshape(kv, g, h, d), k.reshape(kv, 1, h, d),
                            v.reshape(kv, 1, h, d)], axis=1)  # [K, G+2, H, D]
    return fused.transpose(3, 0, 1, 2)


def _qkv_out(w, cfg):
    t, g, d = w.transpose(1, 2, 3, 0), cfg.num_heads // cfg.num_kv_heads, cfg.d_model
    return [t[:, :g].reshape(-1, d), t[:, g].reshape(-1, d), t[:, g + 1].reshape(-1, d)]


_LAYER = "model.layers.{}."
_T = lambda ts, cfg: ts[0].T  # noqa: E731 -- [out, in] <-> [in, out]
_T_OUT = lambda w, cfg: [w.T]  # noqa: E731
_SAME = lambda ts, cfg: ts[0]  # noqa: E731
_SAME_OUT = lambda w, cfg: [w]  # noqa: E731

LLAMA = (
    Weight("embed", ("model.embed_tokens.weight",), _SAME, _SAME_OUT),
    Weight("blocks/attn_norm/scale", (_LAYER + "input_layernorm.weight",), _SAME, _SAME_OUT),
    Weight("blocks/attn/w_qkv", tuple(_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"),
           _qkv_in, _qkv_out),
    Weight("blocks/attn/w_o", (_LAYER + "self_attn.o_proj.weight",),
           lambda ts, cfg: ts[0].T.reshape(cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads,
                                           cfg.dim_per_head, cfg.d_model),
           lambda w, cfg: [w.reshape(-1, cfg.d_model).T]),
    Weight("blocks/mlp_norm/scale", (_LAYER + "post_attention_layernorm.weight",), _SAME,
           _SAME_OUT),
    Weight("blocks/mlp/w_gate_up", (_LAYER + "mlp.gate_proj.weight", _LAYER + "mlp.up_proj.weight"),
           lambda ts, cfg: np.stack([ts[0].T, ts[1].T], axis=1),
           lambda w, cfg: [w[:, 0].T, w[:, 1].T]),
    Weight("blocks/mlp/w_down", (_LAYER + "mlp.down_proj.weight",), _T, _T_OUT),
    Weight("final_norm/scale", ("model.norm.weight",), _SAME, _SAME_OUT),
    Weight("head", ("lm_head.weight",), _T, _T_OUT),
)
WEIGHTS = LLAMA  # a LLaMA's (`weights` gives any model's)

# an MoE layer's experts, per family: (module prefix, router, gate, up, down) names
_EXPERTS = {"mixtral": ("block_sparse_moe.", "gate", "w1", "w3", "w2"),
            "qwen3_moe": ("mlp.", "gate", "gate_proj", "up_proj", "down_proj")}


def _moe_weights(cfg: ModelConfig) -> tuple:
    """A Mixtral or Qwen3-MoE layer's router and experts: E tensors per stacked weight, each
    expert's [F, D] (gate, up) and [D, F] (down) to and from our [E, D, 2, F] and [E, F, D].
    The router state (selection bias, statistics probe) is ours alone: zeros on import,
    not exported."""
    prefix, router, gate, up, down = _EXPERTS[family(cfg)]
    e = cfg.num_experts
    each = [_LAYER + f"{prefix}experts.{j}." for j in range(e)]
    return (
        Weight("blocks/mlp/router", (_LAYER + f"{prefix}{router}.weight",), _T, _T_OUT),
        Weight("blocks/mlp/w_gate_up",
               tuple(f"{x}{gate}.weight" for x in each) + tuple(f"{x}{up}.weight" for x in each),
               lambda ts, cfg: np.stack([np.stack([g.T, u.T], axis=1)
                                         for g, u in zip(ts[:e], ts[e:])]),
               lambda w, cfg: [w[j, :, 0].T for j in range(e)] + [w[j, :, 1].T for j in range(e)]),
        Weight("blocks/mlp/w_down", tuple(f"{x}{down}.weight" for x in each),
               lambda ts, cfg: np.stack([t.T for t in ts]), lambda w, cfg: [t.T for t in w]),
        Weight("blocks/mlp/bias", (), _zeros(e), _NONE),
        Weight("blocks/mlp/probe", (), _zeros(e + 3), _NONE),  # moe.stats_size
    )


def _zeros(shape):  # our own state's conversion: zeros on import ...
    return lambda ts, cfg: np.zeros(shape, np.float32)


def _NONE(w, cfg):  # ... and nothing on export
    return []


def _fp8_weights(cfg: ModelConfig) -> tuple:
    """FP8's scaling state (`ModelConfig.fp8_state`), ours alone: zeros on import (no
    history), not exported."""
    return tuple(Weight(f"blocks/{key}", (), _zeros(shape), _NONE)
                 for key, shape in cfg.fp8_state.items())


def weights(cfg: ModelConfig) -> tuple:
    """Every parameter's conversion for `cfg`'s model (its family: `family`)."""
    out = [w for w in LLAMA if not (cfg.is_moe and w.key.startswith("blocks/mlp/"))]
    if cfg.qk_norm:
        out += [Weight(f"blocks/attn/{n}", (_LAYER + f"self_attn.{n}.weight",), _SAME, _SAME_OUT)
                for n in ("q_norm", "k_norm")]
    return (tuple(out) + (_moe_weights(cfg) if cfg.is_moe else ())
            + _fp8_weights(cfg))


# -------------------------------------------------------------------------- safetensors files
class Reader(Files):
    """A HF directory: its `config.json` and its tensors by name (`hf_files.Files`)."""

    def __init__(self, directory: str | Path):
        if not (Path(directory) / "config.json").is_file():
            raise HFError("HF_DIR", f"{directory} has no config.json (not a transformers model)")
        super().__init__(directory)
        self.config = json.loads((self.dir / "config.json").read_text())

    def layer(self, w: Weight, cfg: ModelConfig, layer: int | None = None,
              dtype=np.float32) -> np.ndarray:
        """Weight `w` (of one layer when stacked) in our layout, as `dtype`."""
        names = w.hf_names(layer)
        if w.key == "head" and names[0] not in self:  # tied: the head is the embedding
            names = ["model.embed_tokens.weight"]
        return np.ascontiguousarray(w.to_ours([self[n].astype(dtype, copy=False)
                                               for n in names], cfg))
