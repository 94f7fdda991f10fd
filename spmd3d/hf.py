"""Hugging Face LLaMA, Qwen3, Mixtral, Qwen3-MoE and DeepSeek-V3 <-> spmd3d: every weight's
name and layout both ways (`hf_config.py`: the config's fields).

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

DeepSeek-V3 (`mla.py`): `self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}` -> `blocks/attn/{w_q_down, q_norm,
w_q_up | w_q, w_kv_down, kv_norm, w_kv_up, w_o}`, the rotary dims de-interleaved
(`_rope_order`); its router's `e_score_correction_bias` is our selection bias, its
`shared_experts` our `blocks/mlp/shared`.

Numpy only (no jax, no torch). The safetensors files are read and written a tensor at a time
(`hf_files.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from .hf_config import family
from .hf_files import Files, HFError
from .schema import ModelConfig

# ------------------------------------------------------------------------------------ weights
@dataclass(frozen=True)
class Weight:
    """One parameter: its checkpoint key (under `params/`), the HF tensors it is made of (for
    stacked ones, per layer: `{}` is the layer's index), and the two conversions of one layer."""

    key: str
    names: tuple[str, ...]
    to_ours: Callable  # (list of HF arrays, ModelConfig) -> our array
    to_hf: Callable  # (our array, ModelConfig) -> list of HF arrays, in `names`' order
    first: int = 0  # a stacked weight: the HF layer of its row 0 ...
    stride: int = 1  # ... and of row i: first + i * stride (`model.moe_every`)

    @property
    def stacked(self) -> bool:
        return self.key.startswith(("blocks/", "dense/", "mtp/"))

    def hf_names(self, layer: int | None = None) -> list[str]:
        return [n.format(None if layer is None else layer * self.stride + self.first)
                for n in self.names]


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

def _rope_order(r: int):
    """(ours from theirs, theirs from ours): DeepSeek's rotary dims lie in interleaved pairs,
    which transformers de-interleaves (evens, then odds) before rotating halves; ours are
    stored de-interleaved."""
    ours = np.r_[np.arange(0, r, 2), np.arange(1, r, 2)]
    return ours, np.argsort(ours)


def _rope_last(w, cfg, axis: int, way: int):
    """w with its last R entries along `axis` reordered (`_rope_order`'s `way`: 0 to ours)."""
    r = cfg.qk_rope_head_dim
    keep, rot = np.split(w, [w.shape[axis] - r], axis=axis)
    return np.concatenate([keep, np.take(rot, _rope_order(r)[way], axis=axis)], axis=axis)


def _heads(width: int, rope: bool):
    """The conversions of a linear [N * width, in] <-> our [in, N, width], a head's last R
    dims reordered where `rope`."""
    def to_ours(ts, cfg):
        w = ts[0].reshape(cfg.num_heads, width, -1)
        return (_rope_last(w, cfg, 1, 0) if rope else w).transpose(2, 0, 1)

    def to_hf(w, cfg):
        w = w.transpose(1, 2, 0)
        return [(_rope_last(w, cfg, 1, 1) if rope else w).reshape(cfg.num_heads * width, -1)]

    return to_ours, to_hf


def _mla_weights(cfg: ModelConfig) -> tuple:
    """DeepSeek-V3's attention (`mla.py`): its [out, in] linears to our [in, ...] weights,
    the rotary dims of the queries and of the shared key de-interleaved (`_rope_order`)."""
    a, qk = _LAYER + "self_attn.", cfg.dim_per_head
    q = ((Weight("blocks/attn/w_q_down", (a + "q_a_proj.weight",), _T, _T_OUT),
          Weight("blocks/attn/q_norm/scale", (a + "q_a_layernorm.weight",), _SAME, _SAME_OUT),
          Weight("blocks/attn/w_q_up", (a + "q_b_proj.weight",), *_heads(qk, True)))
         if cfg.q_lora_rank else
         (Weight("blocks/attn/w_q", (a + "q_proj.weight",), *_heads(qk, True)),))
    return q + (
        Weight("blocks/attn/w_kv_down", (a + "kv_a_proj_with_mqa.weight",),
               lambda ts, cfg: _rope_last(ts[0], cfg, 0, 0).T,
               lambda w, cfg: [_rope_last(w.T, cfg, 0, 1)]),
        Weight("blocks/attn/kv_norm/scale", (a + "kv_a_layernorm.weight",), _SAME, _SAME_OUT),
        Weight("blocks/attn/w_kv_up", (a + "kv_b_proj.weight",),
               *_heads(cfg.qk_nope_head_dim + cfg.v_head_dim, False)),
        Weight("blocks/attn/w_o", (a + "o_proj.weight",),
               lambda ts, cfg: ts[0].T.reshape(cfg.num_heads, cfg.v_head_dim, cfg.d_model),
               lambda w, cfg: [w.reshape(-1, cfg.d_model).T]))


# an MoE layer's experts, per family: (module prefix, router, gate, up, down) names
_EXPERTS = {"mixtral": ("block_sparse_moe.", "gate", "w1", "w3", "w2"),
            "qwen3_moe": ("mlp.", "gate", "gate_proj", "up_proj", "down_proj"),
            "deepseek_v3": ("mlp.", "gate", "gate_proj", "up_proj", "down_proj")}


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
        # DeepSeek-V3's selection bias is its e_score_correction_bias; elsewhere ours alone
        Weight("blocks/mlp/bias", (_LAYER + f"{prefix}{router}.e_score_correction_bias",),
               _SAME, _SAME_OUT) if family(cfg) == "deepseek_v3" else
        Weight("blocks/mlp/bias", (), _zeros(e), _NONE),
        Weight("blocks/mlp/probe", (), _zeros(e + 3), _NONE),  # router.stats_size
    ) + _shared(cfg, prefix)


def _shared(cfg: ModelConfig, prefix: str) -> tuple:
    """The shared experts (DeepSeek-V3's `shared_experts`: one SwiGLU of their summed width)
    as a dense MLP's weights."""
    if not cfg.shared_experts:
        return ()
    there = _LAYER + f"{prefix}shared_experts."
    return tuple(Weight(w.key.replace("mlp/", "mlp/shared/"),
                        tuple(n.replace(_LAYER + "mlp.", there) for n in w.names), w.to_ours,
                        w.to_hf) for w in LLAMA if w.key.startswith("blocks/mlp/"))


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
    """Every parameter's conversion for `cfg`'s model (its family: `family`): the main
    stack's layers from HF layer `dense_layers` on, the dense ones before it (`dense/`) from
    layer 0. With `moe_every` = n, entry i of the stack is HF layers k + n i .. k + n i + n - 1:
    its dense layers (`blocks/before{j}/`), then its own."""
    k, n, dense = cfg.dense_layers, cfg.moe_every, _layer_weights(cfg.dense_kind)
    out = [w for w in LLAMA if not w.stacked] + [replace(w, first=k + n - 1, stride=n)
                                                 for w in _layer_weights(cfg)]
    out += [replace(w, key=f"blocks/before{j}/" + w.key[len("blocks/"):], first=k + j, stride=n)
            for j in range(n - 1) for w in dense]
    if k:
        out += [replace(w, key="dense/" + w.key[len("blocks/"):]) for w in dense]
    return tuple(out) + _mtp_weights(cfg)


def _mtp_weights(cfg: ModelConfig) -> tuple:
    """Multi-token prediction's depths (`mtp/`), DeepSeek-V3's layers `num_layers` on: each
    one of the stack's layers (its weights named as the layers' are) with its two input norms,
    its [embedding; state] projection and its head's norm. The checkpoint's copies of the
    embedding and head in those layers are the model's own (not read, not written)."""
    if not cfg.mtp_layers or family(cfg) != "deepseek_v3":  # (the only family that has them)
        return ()
    block = [replace(w, key="mtp/block/" + w.key[len("blocks/"):], first=cfg.num_layers)
             for w in _layer_weights(cfg)]
    d = cfg.d_model
    return tuple(block) + tuple(
        Weight(f"mtp/{ours}/scale", (_LAYER + f"{theirs}.weight",), _SAME, _SAME_OUT,
               first=cfg.num_layers)
        for ours, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"),
                             ("post_norm", "shared_head.norm"))) + (
        Weight("mtp/eh_proj", (_LAYER + "eh_proj.weight",),  # [d, 2d] <-> [2, d, d]
               lambda ts, cfg: ts[0].T.reshape(2, d, d),
               lambda w, cfg: [w.reshape(2 * d, d).T], first=cfg.num_layers),
        Weight("mtp/stats/probe", (), _zeros((1,)), _NONE))


def _layer_weights(cfg: ModelConfig) -> tuple:
    """One layer's conversions, under `blocks/`."""
    out = [w for w in LLAMA if w.stacked and not (cfg.is_moe and w.key.startswith("blocks/mlp/"))
           and not (cfg.is_mla and w.key.startswith("blocks/attn/"))]
    out += _mla_weights(cfg) if cfg.is_mla else ()
    if cfg.qk_norm:
        out += [Weight(f"blocks/attn/{n}", (_LAYER + f"self_attn.{n}.weight",), _SAME, _SAME_OUT)
                for n in ("q_norm", "k_norm")]
    return tuple(out) + (_moe_weights(cfg) if cfg.is_moe else ()) + _fp8_weights(cfg)


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
