"""A LLaMA-style decoder in Flax NNX: RMSNorm, RoPE, grouped-query attention, SwiGLU, untied head.

Shapes live in names: B batch, T/S query/key length, D d_model, K kv heads, G query heads per kv
head, H head dim, F d_ff, V vocab, L layers. Every parameter carries its logical axis names in
its `axes` metadata; `sharding.py` maps them to mesh axes. Parameters are stored in
`param_dtype` (fp32 master weights) and cast to the compute `dtype` where they are used.

The blocks share one parameter tree stacked on a leading `layers` dim ([L, ...], the canonical
layout) and run with `lax.scan`: one compiled block, whatever the depth.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from .config import ModelConfig
from . import pipeline
from .pipeline import Schedule
from .ring import ring_attention, ring_attention_local, zigzag_order
from .sharding import (Param, activation_rules, constrain, current_layout, is_param_relayout,
                       use_param)

# What the backward pass may keep from the forward pass of a layer. Weights as used (cast and,
# under ZeRO-3, all-gathered) are never kept: the backward gathers them again, so a layer's
# full weights live only while it runs (FSDP) instead of all L of them until the backward.
_POLICIES = {
    "none": jax.checkpoint_policies.everything_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
    # keep matmul outputs (no batch dims: the projections, not the attention scores)
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat_policy(name: str):
    base = _POLICIES[name]

    def policy(prim, *args, **params):
        return not is_param_relayout(prim, params) and base(prim, *args, **params)

    return policy


def _use(p: Param, dtype):
    """The value of parameter `p` as a matmul input (see `sharding.use_param`)."""
    return use_param(p[...], p.get_metadata("axes"), dtype)


def _param(rngs: nnx.Rngs, shape, axes, std: float, dtype) -> Param:
    value = std * jax.random.normal(rngs.params(), shape, dtype)
    return Param(value, axes=axes)


class RMSNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig):
        self.eps = cfg.norm_eps
        # `norm`, not `embed`: ZeRO never shards these d_model-sized vectors (it would save
        # nothing and cost a collective per layer)
        self.scale = Param(jnp.ones((cfg.d_model,), cfg.param_dtype), axes=("norm",))

    def __call__(self, x_btd):
        # statistics in fp32 whatever the compute dtype
        x = x_btd.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * _use(self.scale, jnp.float32)).astype(x_btd.dtype)


def rope_tables(positions_bt, head_dim: int, theta: float):
    """cos/sin [B, T, H/2] in fp32 for integer positions [B, T].

    Static positions (numpy) give constant tables. Traced, XLA:CPU fuses cos and sin into
    every consumer and evaluates them once per element of q and k, forward and backward.
    """
    xp = np if isinstance(positions_bt, np.ndarray) else jnp
    freq = theta ** (-xp.arange(0, head_dim, 2, dtype=xp.float32) / head_dim)
    angle = positions_bt.astype(xp.float32)[..., None] * freq
    return xp.cos(angle), xp.sin(angle)


def apply_rope(x, cos_bth, sin_bth):
    """Rotate pairs (first half, second half) of the last dim of x[B, T, ..., H]."""
    extra = x.ndim - 3  # head dims between T and H
    cos = cos_bth.reshape(cos_bth.shape[:2] + (1,) * extra + cos_bth.shape[2:])
    sin = sin_bth.reshape(sin_bth.shape[:2] + (1,) * extra + sin_bth.shape[2:])
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def causal_attention(q_btkgh, k_bskh, v_bskh, block: int = 64):
    """Causal GQA attention; scores and softmax in fp32. -> out[B, T, K, G, H].

    Query block i only looks at key blocks 0..i: the blocks above the diagonal, entirely
    masked, are never computed (about half the score FLOPs and memory at long T). Each query
    block's softmax runs over its whole key prefix, so the result equals dense attention.
    """
    t = q_btkgh.shape[1]
    block = max(block, t // 8)  # at most 8 query blocks: compile time grows with the count
    n = t // block if t % block == 0 and t > block else 1
    size, scale = t // n, q_btkgh.shape[-1] ** -0.5
    # a key block's gradient sums over the query blocks that read it; slicing fp32 copies
    # makes that sum fp32 (in bf16, XLA:CPU converts to fp32 and back around every add)
    dtype = k_bskh.dtype
    k_all, v_all = (k_bskh, v_bskh) if n == 1 else (k_bskh.astype(jnp.float32),
                                                     v_bskh.astype(jnp.float32))
    outs = []
    # a split, not slices: its transpose is one concatenate, not pads and adds
    for i, q in enumerate(jnp.split(q_btkgh, n, axis=1)):
        k = k_all[:, : (i + 1) * size].astype(dtype)
        v = v_all[:, : (i + 1) * size].astype(dtype)
        s = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
        mask = jnp.arange(size)[:, None] + i * size >= jnp.arange((i + 1) * size)[None, :]
        p = jax.nn.softmax(jnp.where(mask, s * scale, -jnp.inf), axis=-1).astype(v.dtype)
        outs.append(jnp.einsum("bkgts,bskh->btkgh", p, v))
    return outs[0] if n == 1 else jnp.concatenate(outs, axis=1)


def _ring():
    """(mesh, axis, size) of the ring the sequence is split over, or None."""
    layout = current_layout()
    if layout is None or layout.compute["length"] is None:
        return None
    mesh = layout.mesh or jax.sharding.get_abstract_mesh()
    axis = layout.compute["length"]
    return (mesh, axis, mesh.shape[axis]) if mesh.shape[axis] > 1 else None


def sequence_order(seq_len: int):
    """Global position of each place of the model's token layout: the zig-zag order when the
    sequence is split over a ring (so causal work is balanced), else None (the identity).
    Inputs, labels and RoPE positions all follow it, so the loss is unchanged."""
    ring = _ring()
    return None if ring is None else zigzag_order(seq_len, ring[2])


def attend(q_btkgh, k_bskh, v_bskh):
    """Causal attention: block-causal on one device, ring attention when T is split."""
    layout = current_layout()
    if layout is not None and layout.ring is not None:  # already per device over the ring
        return ring_attention_local(q_btkgh, k_bskh, v_bskh, *layout.ring)
    ring = _ring()
    if ring is None:
        return causal_attention(q_btkgh, k_bskh, v_bskh)
    mesh, axis, _ = ring
    # nested inside the pipeline's shard_map, `mesh` is the context (abstract) mesh
    return ring_attention(q_btkgh, k_bskh, v_bskh, axis, mesh)


def embed_lookup(table_vd, ids_bt):
    """table[V, D][ids] with the vocab dim possibly split over a mesh axis.

    A plain gather on a vocab-sharded table makes XLA replicate the table (and all-gather the
    gradient); instead each shard looks up the ids it owns, zeros the rest, and one psum over
    the vocab axis combines them (per-device view inside a shard_map manual over that axis).
    """
    layout = current_layout()
    axis = None if layout is None else layout.compute["vocab"]
    mesh = None if layout is None else (layout.mesh or jax.sharding.get_abstract_mesh())
    if axis is None or mesh.shape[axis] == 1:
        return jnp.take(table_vd, ids_bt, axis=0)

    def lookup(table, ids):
        v = table.shape[0]
        local = ids - jax.lax.axis_index(axis) * v
        mine = (local >= 0) & (local < v)
        rows = jnp.take(table, jnp.where(mine, local, 0), axis=0)
        return jax.lax.psum(jnp.where(mine[..., None], rows, 0), axis)

    return jax.shard_map(lookup, mesh=mesh, in_specs=(P(axis, None), P()), out_specs=P(),
                         axis_names={axis})(table_vd, ids_bt)


class Attention(nnx.Module):
    """Q, K and V come from one fused weight [D, K, G+2, H]: per kv head, its G query heads,
    then its key and its value. Splitting `kv_heads` over `tensor` keeps each group whole on one
    device, and one fused matmul means one input-gradient all-reduce instead of three."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, k, h = cfg.d_model, cfg.num_kv_heads, cfg.dim_per_head
        self.g = cfg.num_heads // k
        self.dtype = cfg.dtype
        self.w_qkv = _param(rngs, (d, k, self.g + 2, h), ("embed", "kv_heads", "q_per_kv", "head_dim"),
                            cfg.init_std, cfg.param_dtype)
        out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
        self.w_o = _param(rngs, (k, self.g, h, d), ("kv_heads", "q_per_kv", "head_dim", "embed"),
                          out_std, cfg.param_dtype)

    def __call__(self, x_btd, cos, sin):
        # x[B_data, T, D] · w[D, K_tensor, G+2, H] -> qkv[B_data, T, K_tensor, G+2, H]
        qkv = jnp.einsum("btd,dkch->btkch", x_btd, _use(self.w_qkv, self.dtype))
        # a split (not three slices): its transpose is one concatenate, not pads and adds
        q, k, v = jnp.split(qkv, [self.g, self.g + 1], axis=3)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k[:, :, :, 0], cos, sin)
        v = v[:, :, :, 0]
        q = constrain(q, ("batch", "length", "kv_heads", "q_per_kv", "head_dim"))
        k = constrain(k, ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        with jax.named_scope("attention"):
            # pinned heads-split so that its cotangent is too (the backward stays per head)
            out = constrain(attend(q, k, v), ("batch", "length", "kv_heads", "q_per_kv", "head_dim"))
        # row-parallel: contracting the tensor-split heads all-reduces (or reduce-scatters) y
        return jnp.einsum("btkgh,kghd->btd", out, _use(self.w_o, self.dtype))


class MLP(nnx.Module):
    """SwiGLU; gate and up projections fused as [D, 2, F] (one matmul, one all-reduce)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.dtype = cfg.dtype
        self.w_gate_up = _param(rngs, (cfg.d_model, 2, cfg.d_ff), ("embed", "gate_up", "mlp"),
                                cfg.init_std, cfg.param_dtype)
        self.w_down = _param(rngs, (cfg.d_ff, cfg.d_model), ("mlp", "embed"),
                             cfg.init_std / (2 * cfg.num_layers) ** 0.5, cfg.param_dtype)

    def __call__(self, x_btd):
        # x[B_data, T, D] · w[D, 2, F_tensor] -> h[B_data, T, 2, F_tensor]
        h = jnp.einsum("btd,dcf->btcf", x_btd, _use(self.w_gate_up, self.dtype))
        gate, up = jnp.split(h, 2, axis=2)
        a = jax.nn.silu(gate[:, :, 0]) * up[:, :, 0]
        a = constrain(a, ("batch", "length", "mlp"))
        return jnp.einsum("btf,fd->btd", a, _use(self.w_down, self.dtype))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x_btd, cos, sin):
        # residual stream x[B_data, T_res, D]: T_res is split over tensor too under SP
        # Under SP the norms run on T_res-split activations; entering attention or the MLP
        # all-gathers T (`length` is not split over tensor), and their row-parallel outputs
        # are reduce-scattered back into the residual stream.
        res, full = ("batch", "res_length", "embed"), ("batch", "length", "embed")
        h = constrain(constrain(self.attn_norm(x_btd), res), full)
        x = constrain(x_btd + self.attn(h, cos, sin), res)
        h = constrain(constrain(self.mlp_norm(x), res), full)
        return constrain(x + self.mlp(h), res)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, remat: str = "none",
                 schedule: Schedule | None = None, scan_layers: bool = True):
        self.cfg = cfg
        self.remat = remat
        self.scan_layers = scan_layers  # false: the layer loop is unrolled when traced
        self.schedule = schedule  # a pipeline over the stage axis, or None
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"),
                            cfg.init_std, cfg.param_dtype)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return Block(cfg, rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg)
        self.head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                           cfg.init_std, cfg.param_dtype)

    def __call__(self, tokens_bt, positions_t=None):
        """tokens[B, T] -> logits[B, T, V] in fp32. positions[T] (numpy for constant RoPE tables,
        or traced) default to 0..T-1."""
        cfg = self.cfg
        if positions_t is None:
            positions_t = np.arange(tokens_bt.shape[1])
        with jax.named_scope("embed"):
            x = embed_lookup(_use(self.embed, cfg.param_dtype), tokens_bt).astype(cfg.dtype)
            x = constrain(x, ("batch", "res_length", "embed"))
        cos, sin = rope_tables(positions_t[None], cfg.dim_per_head, cfg.rope_theta)  # [1, T, H/2]

        graphdef, stacked = nnx.split(self.blocks)

        def stage_fn(chunk, x, rope):  # a chunk of stacked layers [c, ...] applied in order
            def layer(x, params):
                return nnx.merge(graphdef, params)(x, *rope), None

            layer = jax.checkpoint(layer, policy=remat_policy(self.remat), prevent_cse=False)
            unroll = pipeline.unroll() or not self.scan_layers
            return jax.lax.scan(layer, x, chunk, unroll=unroll)[0]

        layout = current_layout()
        if self.schedule is None or self.schedule.stages == 1 or layout is None:
            x = stage_fn(stacked, x, (cos, sin))
        else:
            x = self._pipelined(stage_fn, stacked, x, (cos, sin), layout)

        with jax.named_scope("head"):
            x = self.final_norm(x)
            logits = jnp.einsum("btd,dv->btv", x, _use(self.head, cfg.dtype),
                                preferred_element_type=jnp.float32)
            return constrain(logits, ("batch", "length", "vocab"))

    def _pipelined(self, stage_fn, stacked, x, rope, layout):
        """Run the stack through the pipeline. Besides `stage`, the data axis (unless ZeRO-3
        splits the weights over it: gradients are then reduced once, not per tick) and the
        ring axis go manual inside it; inside, rules drop those axes and attention uses the
        per-device ring directly (a nested shard_map would mix the two levels' manual axes)."""
        mesh = layout.mesh or jax.sharding.get_abstract_mesh()
        inner, batch_axis, seq_axis, ring = layout.compute, None, None, None
        if not layout.params_use_batch_axis:
            inner, batch_axis = inner.with_(batch=None), inner["batch"]
        if _ring() is not None:
            seq_axis = inner["length"]
            res = inner["res_length"]
            res = tuple(a for a in res if a != seq_axis) if isinstance(res, tuple) else None
            inner = inner.with_(length=None, res_length=res[0] if res else None)
            ring = (seq_axis, mesh.shape[seq_axis])
        grads = inner if batch_axis is not None else layout.grads  # no manual axis in them
        # inside the pipeline's shard_map, constraints resolve against its context mesh
        with activation_rules(inner, None, grads, ring=ring):
            return pipeline.run(stage_fn, stacked, x, rope, self.schedule,
                                layout.compute["layers"], mesh, batch_axis, seq_axis)


def abstract_model(cfg: ModelConfig, remat: str = "none", schedule: Schedule | None = None,
                   scan_layers: bool = True):
    """(graphdef, State of ShapeDtypeStruct-valued Variables), without allocating anything."""
    return nnx.split(nnx.eval_shape(lambda: Transformer(
        cfg, nnx.Rngs(params=0), remat=remat, schedule=schedule, scan_layers=scan_layers)))
