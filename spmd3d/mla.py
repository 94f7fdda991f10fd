"""Multi-head latent attention (MLA: DeepSeek-V2, V3), as transformers' `DeepseekV3Attention`
computes it.

Names: N heads, C the KV latent (`kv_lora_rank`), Q the query latent (`q_lora_rank`; none
when 0), P the no-position part of a query/key head (`qk_nope_head_dim`), R the rotary part
(`qk_rope_head_dim`), E the value head (`v_head_dim`).

    queries   c_q = norm(x . W_qd) [B, T, Q]      q = c_q . W_qu [B, T, N, P+R]  (or x . W_q)
    keys      x . W_kvd -> c_kv [B, T, C] (normed) and k_r [B, T, R], one rotary key shared by
              every head;  c_kv . W_kvu -> k_p [B, T, N, P] and v [B, T, N, E]
    attention per head over [k_p, rope(k_r)] with queries [q_p, rope(q_r)], scaled by
              (P + R)^-1/2 (with YaRN, times m^2: `rope.yarn_mscale`), values of width E;
              out . W_o

Training runs it in that expanded form, through any attention kernel (blocked, the ring, the
gather, Ulysses; cuDNN and Pallas with the values padded to P + R): K = N kv heads of one
query each, the value head narrower than the key's. The heads split over `tensor`; the down
projections W_qd, W_kvd and the latents are replicated over it (Megatron's and MaxText's
choice: their outputs are small, a [T, Q + C + R] latent against [T, D]), so each tensor
shard computes them whole and the backward all-reduces the latents' gradients, not the
model width's. ZeRO shards the up projections by their latent dim (`latent_embed`).

Decoding (`Ops.cached`), the cache holds [c_kv, rope(k_r)], C + R numbers per position and
layer, not N (P + R + E); attention runs absorbed: q_p . W_kvu's key part turns each query
into the latent space, scores against the cached latent as one shared kv head, and the
output's latent goes through W_kvu's value part, so no key or value is ever expanded.

DeepSeek checkpoints lay each rotary part out as interleaved pairs (x0, x1), (x2, x3), ...;
transformers de-interleaves them before rotating halves. The importer permutes those weight
columns once (`hf.py`), so this module rotates halves as LLaMA does and scores equal theirs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig
from .layers import RMSNorm, param, project, use
from .ops import Ops
from .rope import Positions, apply_rope, yarn_mscale
from .sharding import constrain

LATENT_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, which both latent norms keep


class LatentAttention(nnx.Module):
    # every projection MLA may have; `q` or `q_down` + `q_up`, as `q_lora_rank` says
    PROJECTIONS = {"q": ("w_q", "btd,dnh->btnh"), "q_down": ("w_q_down", "btd,dq->btq"),
                   "q_up": ("w_q_up", "btq,qnh->btnh"), "kv_down": ("w_kv_down", "btd,dc->btc"),
                   "kv_up": ("w_kv_up", "btc,cnh->btnh"), "o": ("w_o", "btnh,nhd->btd")}

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, n, std, pd = cfg.d_model, cfg.num_heads, cfg.init_std, cfg.param_dtype
        self.dtype = cfg.dtype
        self.nope, self.rank = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        # DeepSeek's YaRN scales the scores by m(mscale_all_dim)^2 (`yarn_apply_mscale`)
        m = yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
        self.gain = m * m if cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim else 1.0
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        heads = ("heads", "head_dim")
        if cfg.q_lora_rank:
            self.w_q = None
            self.w_q_down = param(rngs, (d, cfg.q_lora_rank), ("embed", "latent"), std, pd)
            self.q_norm = RMSNorm(cfg.q_lora_rank, LATENT_EPS, pd, "latent", "latent_norm")
            self.w_q_up = param(rngs, (cfg.q_lora_rank, n, qk), ("latent_embed", *heads), std, pd)
        else:
            self.w_q = param(rngs, (d, n, qk), ("embed", *heads), std, pd)
            self.w_q_down = self.q_norm = self.w_q_up = None
        self.w_kv_down = param(rngs, (d, self.rank + cfg.qk_rope_head_dim), ("embed", "latent"),
                               std, pd)
        self.kv_norm = RMSNorm(self.rank, LATENT_EPS, pd, "latent", "latent_norm")
        self.w_kv_up = param(rngs, (self.rank, n, self.nope + cfg.v_head_dim),
                             ("latent_embed", *heads), std, pd)
        self.w_o = param(rngs, (n, cfg.v_head_dim, d), (*heads, "embed"),
                         std / (2 * cfg.num_layers) ** 0.5, pd)

    def __call__(self, x_btd, pos: Positions, ops: Ops):
        if self.w_q is None:
            q = project(self, "q_up", self.q_norm(project(self, "q_down", x_btd, ops)), ops)
        else:
            q = project(self, "q", x_btd, ops)
        latent = project(self, "kv_down", x_btd, ops)
        c_kv, k_r = jnp.split(latent, [self.rank], axis=-1)
        c_kv = self.kv_norm(c_kv)
        q_p, q_r = jnp.split(q, [self.nope], axis=-1)
        q_r, k_r = apply_rope(q_r, pos.cos, pos.sin), apply_rope(k_r, pos.cos, pos.sin)
        scale = q.shape[-1] ** -0.5 * self.gain
        if ops.cached:
            out = self._absorbed(q_p, q_r, c_kv, k_r, ops, scale)
        else:
            kv = project(self, "kv_up", c_kv, ops)
            k_p, v = jnp.split(kv, [self.nope], axis=-1)
            k = jnp.concatenate([k_p, jnp.broadcast_to(k_r[:, :, None], k_p.shape[:3] +
                                                       k_r.shape[-1:])], axis=-1)
            # K = N kv heads of one query head each: the kernels' GQA shapes
            q = jnp.concatenate([q_p, q_r], axis=-1)[:, :, :, None]
            q = constrain(q if self.gain == 1 else q * jnp.asarray(self.gain, q.dtype),
                          ("batch", "length", "kv_heads", "q_per_kv", "head_dim"))
            k = constrain(k, ("batch", "length", "kv_heads", "head_dim"))
            v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
            with jax.named_scope("kernel"):
                out = (ops.attend(q, k, v) if pos.segments is None else
                       ops.attend(q, k, v, pos.segments))
                out = constrain(out, ("batch", "length", "kv_heads", "q_per_kv", "head_dim"))
            out = out[:, :, :, 0]
        return project(self, "o", out, ops)

    def _absorbed(self, q_p, q_r, c_kv, k_r, ops: Ops, scale):
        """Decoding: attention over the cached latents [c_kv, k_r] as one kv head of N query
        heads, each query's no-position part taken into the latent space by W_kvu's key part,
        the output's latent out by its value part."""
        w_k, w_v = jnp.split(use(self.w_kv_up, self.dtype), [self.nope], axis=-1)
        cached = ops.keep(jnp.concatenate([c_kv, k_r], axis=-1))[:, :, None]  # [B, S, 1, C+R]
        q = jnp.concatenate([jnp.einsum("btnh,cnh->btnc", q_p, w_k), q_r], axis=-1)
        out = ops.attend(q[:, :, None], cached, cached[..., :self.rank], scale=scale)
        return jnp.einsum("btnc,cnh->btnh", out[:, :, 0], w_v)
