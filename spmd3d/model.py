"""A LLaMA-style decoder in Flax NNX: RMSNorm, RoPE, grouped-query attention, SwiGLU, untied head.

Shapes live in names: B batch, T/S query/key length, D d_model, K kv heads, G query heads per kv
head, H head dim, F d_ff, V vocab, L layers. Every parameter carries its logical axis names in
its `axes` metadata; `sharding.py` maps them to mesh axes. Parameters are stored in
`param_dtype` (fp32 master weights) and cast to the compute `dtype` where they are used.

The blocks share one parameter tree stacked on a leading `layers` dim ([L, ...], the canonical
layout) and run with `lax.scan`: one compiled block, whatever the depth.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from . import fp8, mla, moe, mtp, offload, router
from .attention import causal_attention
from .config import DTYPES, ModelConfig
from .layers import RMSNorm, param, project, rms_norm, use
from .manual import per_device, psum, unroll, vary
from .rope import Positions, apply_rope, rope_frequencies, rope_gain, rope_tables
from .swiglu import swiglu
from .ops import Ops
from .vocab import backward_after, embed_lookup, head_logits, loss_chunks
from .sharding import (Param, activation_rules, constrain, current_layout, is_param_relayout,
                       use_param)

# What the backward pass may keep from the forward pass of a layer. Weights as used (cast and,
# under ZeRO-3, all-gathered) are never kept: the backward gathers them again, so a layer's
# full weights live only while it runs (FSDP) instead of all L of them until the backward.
_POLICIES = {
    "none": jax.checkpoint_policies.everything_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # the projections'
}  # outputs; and two that keep in the host's memory what full and save_dots keep (`offload`)


def remat_policy(name: str):
    base = _POLICIES[name] if name in _POLICIES else offload.policy(name)

    return lambda prim, *args, **kw: not is_param_relayout(prim, kw) and base(prim, *args, **kw)


class Attention(nnx.Module):
    """Q, K and V come from one fused weight [D, K, G+2, H]: per kv head, its G query heads,
    then its key and its value. Splitting `kv_heads` over `tensor` keeps each group whole on one
    device, and one fused matmul means one input-gradient all-reduce instead of three."""

    # x[B_data, T, D] · w[D, K_tensor, G+2, H] -> qkv[B_data, T, K_tensor, G+2, H];
    # row-parallel out: contracting the tensor-split heads all-reduces (or reduce-scatters) y
    PROJECTIONS = {"qkv": ("w_qkv", "btd,dkch->btkch"), "o": ("w_o", "btkgh,kghd->btd")}

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, k, h = cfg.d_model, cfg.num_kv_heads, cfg.dim_per_head
        self.g = cfg.num_heads // k
        self.dtype, self.eps = cfg.dtype, cfg.norm_eps
        # Qwen3: RMSNorm over each query and key head before RoPE, one [H] scale each
        self.q_norm = Param(jnp.ones((h,), cfg.param_dtype), axes=("head_dim",)) if cfg.qk_norm else None
        self.k_norm = Param(jnp.ones((h,), cfg.param_dtype), axes=("head_dim",)) if cfg.qk_norm else None
        self.w_qkv = param(rngs, (d, k, self.g + 2, h), ("embed", "kv_heads", "q_per_kv", "head_dim"),
                            cfg.init_std, cfg.param_dtype)
        out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
        self.w_o = param(rngs, (k, self.g, h, d), ("kv_heads", "q_per_kv", "head_dim", "embed"),
                          out_std, cfg.param_dtype)
        self.fp8 = fp8.meta(len(self.PROJECTIONS), cfg)

    def __call__(self, x_btd, pos: Positions, ops: Ops):
        qkv = project(self, "qkv", x_btd, ops)
        # a split (not three slices): its transpose is one concatenate, not pads and adds
        q, k, v = jnp.split(qkv, [self.g, self.g + 1], axis=3)
        k = k[:, :, :, 0]
        if self.q_norm is not None:
            with jax.named_scope("norm"):
                q = rms_norm(q, use(self.q_norm, jnp.float32), self.eps)
                k = rms_norm(k, use(self.k_norm, jnp.float32), self.eps)
        q = apply_rope(q, pos.cos, pos.sin)
        k = apply_rope(k, pos.cos, pos.sin)
        v = v[:, :, :, 0]
        q = constrain(q, ("batch", "length", "kv_heads", "q_per_kv", "head_dim"))
        k = constrain(k, ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        k, v = ops.keep(k), ops.keep(v)  # decoding: the cache, these positions written
        with jax.named_scope("kernel"):
            # pinned heads-split so that its cotangent is too (the backward stays per head)
            out = (ops.attend(q, k, v) if pos.segments is None else
                   ops.attend(q, k, v, pos.segments))
            out = constrain(out, ("batch", "length", "kv_heads", "q_per_kv", "head_dim"))
        return project(self, "o", out, ops)


class MLP(nnx.Module):
    """SwiGLU; gate and up projections fused as [D, 2, F] (one matmul, one all-reduce)."""

    # x[B_data, T, D] · w[D, 2, F_tensor] -> h[B_data, T, 2, F_tensor]; then back to D
    PROJECTIONS = {"gate_up": ("w_gate_up", "btd,dcf->btcf"), "down": ("w_down", "btf,fd->btd")}

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.dtype = cfg.dtype
        self.w_gate_up = param(rngs, (cfg.d_model, 2, cfg.d_ff), ("embed", "gate_up", "mlp"),
                                cfg.init_std, cfg.param_dtype)
        self.w_down = param(rngs, (cfg.d_ff, cfg.d_model), ("mlp", "embed"),
                             cfg.init_std / (2 * cfg.num_layers) ** 0.5, cfg.param_dtype)
        self.fp8 = fp8.meta(len(self.PROJECTIONS), cfg)

    def __call__(self, x_btd, ops: Ops | None = None):
        h = project(self, "gate_up", x_btd, ops)
        gate, up = jnp.split(h, 2, axis=2)
        a = swiglu(gate[:, :, 0], up[:, :, 0])
        a = constrain(a, ("batch", "length", "mlp"))
        return project(self, "down", a, ops)


class MoE(nnx.Module):
    """Mixture-of-Experts feed-forward: a router (fp32 logits) sends each token to its top-k
    of E SwiGLU experts ([E, D, 2, F] and [E, F, D], stacked), whose outputs are summed with
    the router's weights (`moe.experts_layer`), plus optional shared experts every token
    passes through (one SwiGLU of their summed width)."""

    PROJECTIONS: dict = {}  # none tapped for ZB-H1: the experts' gradients come with B

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        e, d, f = cfg.num_experts, cfg.d_model, cfg.expert_width
        self.dtype, self.cfg = cfg.dtype, cfg
        out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
        self.router = param(rngs, (d, e), ("embed", "routes"), cfg.init_std, cfg.param_dtype)
        self.w_gate_up = param(rngs, (e, d, 2, f), ("experts", "expert_embed", "gate_up", "mlp"),
                                cfg.init_std, cfg.param_dtype)
        self.w_down = param(rngs, (e, f, d), ("experts", "mlp", "expert_embed"), out_std,
                             cfg.param_dtype)
        self.bias = router.RouterState(jnp.zeros((e,), jnp.float32), axes=("routes",))
        self.probe = router.RouterState(jnp.zeros((router.stats_size(e),), jnp.float32), axes=("routes",))
        self.shared = (MLP(dataclasses.replace(cfg, d_ff=cfg.shared_experts * f), rngs)
                       if cfg.shared_experts else None)

    def __call__(self, x_btd, ops: Ops | None = None):
        c, L = self.cfg, self.cfg.stacked_layers  # the losses: a mean over the MoE layers
        with jax.named_scope("experts"):
            y = moe.experts_layer(
                x_btd, use(self.router, jnp.float32), use(self.w_gate_up, self.dtype),
                use(self.w_down, self.dtype), self.bias[...], self.probe[...],
                routing=router.Routing.of(c), kernel=c.expert_kernel,
                aux_weight=c.router_aux_loss_coef / L, z_weight=c.router_z_loss_coef / L,
                capacity_factor=c.capacity_factor, weight_grad=c.expert_weight_grad)
        return y if self.shared is None else y + self.shared(x_btd)


class Block(nnx.Module):
    """A layer; with `model.moe_every` = n > 1 an entry: n - 1 dense ones (`before0`...), then it."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.before = cfg.moe_every - 1
        for j in range(self.before):
            setattr(self, f"before{j}", Block(cfg.dense_kind, rngs))
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype)
        self.attn = mla.LatentAttention(cfg, rngs) if cfg.is_mla else Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype)
        self.mlp = MoE(cfg, rngs) if cfg.is_moe else MLP(cfg, rngs)

    def project(self, name: str, x):
        """Projection `name` (`Attention`'s or `MLP`'s; `before0/qkv`: a dense layer's) of x."""
        if "/" in name:
            layer, name = name.split("/", 1)
            return getattr(self, layer).project(name, x)
        return project(self.attn if name in self.attn.PROJECTIONS else self.mlp, name, x)

    def __call__(self, x_btd, pos: Positions, ops: Ops):
        # residual stream x[B_data, T_res, D]: T_res is split over tensor too under SP
        # Under SP the norms run on T_res-split activations; entering attention or the MLP
        # all-gathers T (`length` is not split over tensor), and their row-parallel outputs
        # are reduce-scattered back into the residual stream.
        for j in range(self.before):
            x_btd = getattr(self, f"before{j}")(x_btd, pos, ops.scoped(f"before{j}/"))
        res, full = ("batch", "res_length", "embed"), ("batch", "length", "embed")
        with jax.named_scope("attention"):
            h = constrain(constrain(self.attn_norm(x_btd), res), full)
            x = constrain(x_btd + self.attn(h, pos, ops), res)
        with jax.named_scope("mlp"):
            h = constrain(constrain(self.mlp_norm(x), res), full)
            return constrain(x + self.mlp(h, ops), res)


class Transformer(nnx.Module):
    """The model as math, in three parts the step composes (with a pipeline or without):
    `embed_tokens`, `layers` (the block function over stacked [L, ...] parameters) and `loss`
    (final norm, head and cross-entropy). Calling the model runs all three, one device's way.

    `layer_order` is the order the stacked blocks are stored in (storage position -> canonical
    layer; a circular pipeline keeps each stage's chunks together), part of the graphdef: a
    model merged from stored parameters calls its layers in canonical order, not stored.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, layer_order: tuple | None = None):
        if cfg.dtype not in DTYPES:  # `auto` is the plan's to resolve, once
            raise ValueError(f"model.dtype {cfg.dtype!r}: build the model from a plan's config "
                             "(Plan.resolve picks the compute dtype for the devices)")
        self.cfg = cfg
        order = None if layer_order is None else tuple(int(i) for i in layer_order)
        self.layer_order = None if order == tuple(range(cfg.stacked_layers)) else order  # -1: pad
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"),
                            cfg.init_std, cfg.param_dtype)
        self.blocks = _stack(cfg, cfg.stacked_layers, "layers", rngs)
        # the dense layers before the stack (DeepSeek's first k): a stack of their own, whose
        # leading dim (`dense`) no pipeline splits
        self.dense = (_stack(cfg.dense_kind, cfg.dense_layers, "dense", rngs)
                      if cfg.dense_layers else None)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype)
        self.head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                           cfg.init_std, cfg.param_dtype)
        # multi-token prediction's depths (`model.mtp_layers`): a stack of their own, `mtp`,
        # made last (the rest is initialised the same with it on or off)
        self.mtp = (_stack(cfg, cfg.mtp_layers, "mtp", rngs,
                           functools.partial(mtp.Depth, block=Block))
                    if cfg.mtp_layers else None)

    def embed_tokens(self, tokens_bt, table=None):
        """tokens[B_data, T] -> x[B_data, T_res, D] in the compute dtype (`embed_lookup`), from
        the stored table or the given one (`head_weights()["embed"]`, with MTP)."""
        with jax.named_scope("embed"):
            table = self.embed[...] if table is None else table
            x = embed_lookup(use_param(table, self.embed.get_metadata("axes"),
                                       self.cfg.param_dtype), tokens_bt)
            return constrain(x.astype(self.cfg.dtype), ("batch", "res_length", "embed"))

    def rope(self, positions_t, segments=None) -> Positions:
        """The layers' `Positions`: cos/sin [1, T, H/2] for positions[T] (numpy: constant
        tables), or [B, T, H/2] for positions[B, T]; `segments`: packed documents' ids."""
        positions = positions_t[None] if positions_t.ndim == 1 else positions_t
        gain = rope_gain(self.cfg)  # YaRN's attention factor
        cos, sin = rope_tables(positions, rope_frequencies(self.cfg))
        return Positions(*((cos * gain, sin * gain) if gain != 1 else (cos, sin)), segments)

    def layer(self, remat: str = "none", ops: Ops | None = None, stack=None):
        """`fn(params, x, rope, on=None, zeros=None) -> x`: one layer (of `stack`, default the
        main one) under the remat policy, with `ops` (default: the blocked attention kernel);
        `on` (bool) false makes it a padding slot that passes x through. Given `zeros` (an
        input per projection, shaped as `ops.split`'s `tap_shapes` says) the ops are tapped:
        it returns (x, the projections' inputs) and adds the zeros to the projections'
        outputs."""
        graphdef = nnx.graphdef(self.blocks if stack is None else stack)
        ops = ops or Ops(causal_attention)

        def apply(params, x, rope, on=None, zeros=None):
            x = checkpoint_name(x, offload.NAME)  # what `offload` keeps, on the host
            used = ops if zeros is None else ops.tap(zeros)
            y = nnx.merge(graphdef, params)(x, rope, used)
            y = y if on is None else jnp.where(on, y, x)
            return y if zeros is None else (y, used.inputs)

        return jax.checkpoint(apply, policy=remat_policy(remat), prevent_cse=False)

    def layers(self, remat: str = "none", scan: bool = True, ops: Ops | None = None,
               stack=None):
        """`fn(stacked[c, ...], x, rope, active=None) -> x`: c stacked layers (of `stack`,
        default the main one) applied in their stacked order, each under the remat policy, in
        a `lax.scan` (unrolled when `scan` is false); `active[c]` (bool) marks real layers, a
        padding slot passes x through."""
        one = self.layer(remat, ops, stack)

        def run(stacked, x, rope, active=None):
            def layer(x, slot):
                params, on = slot
                return one(params, x, rope, on), None

            with jax.named_scope("layers"):
                return jax.lax.scan(layer, x, (stacked, active), unroll=unroll() or not scan)[0]

        return run

    def dense_layers(self, remat: str = "none", scan: bool = True, ops: Ops | None = None):
        """`fn(x, rope) -> x`: the dense layers before the stack (`model.dense_layers`), or x
        itself; where the embedding runs (before a pipeline, on every stage)."""
        if self.dense is None:
            return lambda x, rope: x
        run = self.layers(remat, scan, ops, self.dense)
        return lambda x, rope: run(nnx.state(self.dense), x, rope)

    def logits(self, x_btd):
        """x[B_data, T_res, D] -> logits[B_data, T, V_tensor] in fp32."""
        with jax.named_scope("head"):
            x = self.final_norm(x_btd)
            logits = jnp.einsum("btd,dv->btv", x, use(self.head, self.cfg.dtype),
                                preferred_element_type=jnp.float32)
            return constrain(logits, ("batch", "length", "vocab"))

    def loss(self, x_btd, labels_bt, chunk: int = 0):
        """(summed next-token cross-entropy in fp32, count of labels) of the final activations;
        a label < 0 (padding) counts for nothing.

        Vocab-parallel and chunked: the logits stay split over `vocab` (the log-sum-exp and the
        label's logit are sums over it, all-reduces of per-token numbers, never a gather of
        logits), and each device cuts its tokens into `loss_chunks` pieces of at most `chunk`,
        run one after another, each recomputed in the backward: [chunk, V_tensor] fp32 logits
        and their one-hot exist at a time, not [B, T, V]. The pieces loop per device (manual
        over the batch and sequence axes), the head and norm turned device-varying before it:
        their gradients are summed over those axes once, after the loop, not once per piece.
        Equal to the unchunked loss up to float summation order (tests)."""
        return self.loss_with(self.head_weights(), x_btd, labels_bt, chunk)

    def head_weights(self) -> dict:
        """The stored weights the loss after the stack uses: {"scale": final norm [D], "head":
        [D, V]}, and with multi-token prediction the depths' too: "embed" [V, D] (theirs is
        the model's) and "mtp" (their stack's state)."""
        out = {"scale": self.final_norm.scale[...], "head": self.head[...]}
        if self.mtp is not None:
            out.update(embed=self.embed[...], mtp=nnx.state(self.mtp))
        return out

    def loss_with(self, weights, x_btd, labels_bt, chunk: int = 0):
        """`loss` with the head's stored `weights` (`head_weights`) given as arguments: what a
        pipeline schedule that runs the head itself differentiates."""
        eps, f32 = self.cfg.norm_eps, jnp.float32
        names = {k: v.get_metadata("axes") for k, v in (("scale", self.final_norm.scale),
                                                        ("head", self.head))}
        scale = use_param(weights["scale"], names["scale"], f32)
        # cast (and gathered) once, not per piece
        head = use_param(weights["head"], names["head"], self.cfg.dtype)

        def local(x, labels, scale, head):  # one device's tokens, or all of them
            n = loss_chunks(labels.size, chunk)
            x = constrain(x, (None, None, "embed")).reshape((n, -1, x.shape[-1]))

            def piece(total, xl):
                x, labels = xl
                with jax.named_scope("head"):
                    logits = constrain(head_logits(rms_norm(x, scale, eps), head),
                                       (None, "vocab"))
                    logits = checkpoint_name(logits, "logits")
                with jax.named_scope("loss"):
                    lse = jax.nn.logsumexp(logits, axis=-1)
                    # the label's logit as a one-hot contraction: the vocab dim stays split
                    onehot = constrain(jax.nn.one_hot(labels, logits.shape[-1], dtype=f32),
                                       (None, "vocab"))
                    picked = jnp.sum(logits * onehot, axis=-1)
                    return total + jnp.sum(jnp.where(labels >= 0, lse - picked, 0.0)), None

            # the backward keeps the input alone (one piece's logits at a time), or with one
            # piece the logits too (no second head matmul); never the [N, D] normed copies
            policies = jax.checkpoint_policies
            piece = jax.checkpoint(piece, prevent_cse=False, policy=policies.nothing_saveable
                                   if n > 1 else policies.save_only_these_names("logits"))
            total = jnp.zeros_like(labels, f32, shape=())  # typed like the labels (varying)
            return backward_after(jax.lax.scan(piece, total, (x, labels.reshape(n, -1)),
                                               unroll=unroll())[0])

        shards = per_device(current_layout())
        manual = shards.axes
        if not manual:  # one device's tokens are all of them
            return local(x_btd, labels_bt, scale, head), labels_bt.size

        def one_device(x, labels, scale, head):
            # the head's gradient, summed over the token shards, is summed in fp32
            scale, head = vary(scale, manual), vary(head, manual)
            with activation_rules(shards.inner, None):
                return psum(local(x, labels, scale, head), manual)

        total = shards(one_device, (shards.spec(None), shards.spec(), P(), P()),
                       P())(x_btd, labels_bt, scale, head)
        return total, labels_bt.size

    def canonical_blocks(self):
        """The stacked block parameters in canonical layer order."""
        stacked = nnx.state(self.blocks)
        if self.layer_order is None:
            return stacked
        index = np.array([self.layer_order.index(c) for c in range(self.cfg.stacked_layers)])
        return jax.tree.map(lambda a: jnp.take(a, index, axis=0), stacked)

    def __call__(self, tokens_bt, positions_t=None):
        """tokens[B, T] -> logits[B, T, V] in fp32, the layers in canonical order on whatever
        devices the arrays live on. positions[T] (numpy for constant RoPE tables, or traced)
        default to 0..T-1."""
        if positions_t is None:
            positions_t = np.arange(tokens_bt.shape[1])
        rope = self.rope(positions_t)
        x = self.dense_layers()(self.embed_tokens(tokens_bt), rope)
        x = self.layers()(self.canonical_blocks(), x, rope)
        return self.logits(x)


def _stack(cfg: ModelConfig, n: int, name: str, rngs: nnx.Rngs, module=None):
    """n Blocks of `cfg` (or `module(cfg, rngs)`s) stacked on a leading dim named `name`."""
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: name})
    def make(rngs):
        return (module or Block)(cfg, rngs)

    return make(rngs)


def abstract_model(cfg: ModelConfig, layer_order: tuple | None = None):
    """(graphdef, State of ShapeDtypeStruct-valued Variables), without allocating anything."""
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(params=0), layer_order)))
