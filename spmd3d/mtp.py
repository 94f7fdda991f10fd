"""Multi-token prediction (DeepSeek-V3 §2.2; transformers' `MtpLayer`), `model.mtp_layers`.

After the stack, depth k = 1..K predicts the token k + 1 positions ahead. Its input at
position i is the previous depth's state (for k = 1 the main model's final-normed state, what
transformers hands its MTP layers) and the embedding of token i + k, each RMS-normed,
concatenated [embedding; state] and projected back to the model width (`eh_proj`). A layer of
the stack's own kind (MLA and MoE for DeepSeek-V3) runs on that, and its output, normed
(`post_norm`: the checkpoint's `shared_head.norm`), is the depth's state: the input of the
model's head (shared, as is the embedding) and of the next depth. The loss adds
`mtp_loss_weight` / K times the depths' summed cross-entropies to the summed loss, so the
step's mean divides both by the main loss's labels (Megatron's normalisation); a depth's label
counts only within the document of its position (packed documents).

The step reports the depths' mean cross-entropy as `mtp_loss`: each depth's sum arrives as the
gradient of a zero probe (`untrained.Untrained`'s protocol). Per device MTP costs K layers'
weights and their activations for the backward, and K more head-and-loss passes of the
microbatch; off (K = 0), the model holds nothing of it.

The depths run where the head does (`forward.after_stack`), with the head's weights, which
then hold the embedding and the depths' stack too (`Transformer.head_weights`): after the
stack; in a 1F1B or ZB-H1 pipeline on the last stage, per microbatch, inside the schedule;
after GPipe's, one slot of every stage at a time (an MoE depth's balancing statistics are a
microbatch's, as the stack's are).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .layers import RMSNorm, param, rms_norm, use
from .sharding import constrain, use_param
from .untrained import Untrained


class Probe(Untrained):
    """A depth's zero probe, whose gradient is the depth's summed cross-entropy."""

    @classmethod
    def advance(cls, old, observed, scale, plan):
        return {"probe": old["probe"]}, {"mtp_loss": jnp.mean(observed["probe"]) * scale}


class Stats(nnx.Module):
    def __init__(self):
        self.probe = Probe(jnp.zeros((1,), jnp.float32), axes=("mtp",))


class Depth(nnx.Module):
    """One MTP depth: `combine` makes its layer's input, calling it runs the layer (`block`,
    built by `block(cfg, rngs)`: the stack's kind) as the stack's layers run."""

    def __init__(self, cfg, rngs: nnx.Rngs, block):
        d, eps, dtype = cfg.d_model, cfg.norm_eps, cfg.param_dtype
        self.dtype = cfg.dtype
        self.enorm, self.hnorm = RMSNorm(d, eps, dtype), RMSNorm(d, eps, dtype)
        # [embedding; state] -> d_model: its input halves, the width ZeRO shards, and the
        # residual stream's width (whole)
        self.eh_proj = param(rngs, (2, d, d), ("gate_up", "embed", "norm"), cfg.init_std, dtype)
        self.block = block(cfg, rngs)
        self.post_norm = RMSNorm(d, eps, dtype)
        self.stats = Stats()

    def combine(self, state_btd, embedded_btd):
        res = ("batch", "res_length", "embed")
        x = jnp.stack([self.enorm(embedded_btd), self.hnorm(state_btd)], axis=2)
        with jax.named_scope("eh_proj"):
            y = jnp.einsum("btcd,cde->bte", x, use(self.eh_proj, self.dtype))
        return constrain(y, res)

    def __call__(self, x_btd, pos, ops):
        return self.block(x_btd, pos, ops)


def targets(ids_bt1, labels_bt, segments_bt, depths: int):
    """(ids, labels), K [B, T] each, of a block's token ids[B, T+1] (`forward.token_ids`)
    and main labels: what depth k embeds at position i (token i + k) and
    what it predicts (token i + k + 1: the main labels k further on), -1 past the end, where the
    main label is not trained on, and (packed documents) where position i + k is in another
    document than position i."""
    ids, t = ids_bt1, labels_bt.shape[1]
    out_ids, out_labels = [], []
    for k in range(1, depths + 1):
        out_ids.append(ids[:, k:k + t] if k == 1 else jnp.pad(ids[:, k:], ((0, 0), (0, k - 1))))
        labels = jnp.pad(labels_bt[:, k:], ((0, 0), (0, k)), constant_values=-1)
        if segments_bt is not None:
            ahead = jnp.pad(segments_bt[:, k:], ((0, 0), (0, k)), constant_values=-1)
            labels = jnp.where(ahead == segments_bt, labels, -1)
        out_labels.append(labels)
    return tuple(out_ids), tuple(out_labels)


def loss_sum(model, weights, x_btd, ids, labels, rope, layer, chunk: int):
    """The depths' weighted summed cross-entropy (plus their probes, zero) after the stack's
    output x (before the final norm), with the head's stored `weights` (`model.head_weights`:
    the final norm, head, embedding and the depths' stack); `ids` and `labels`: K [B, T] each
    (`targets`); `layer`: `model.layer(remat, ops, model.mtp)`."""
    cfg = model.cfg
    names = model.final_norm.scale.get_metadata("axes")  # the final norm, with `weights`
    state = rms_norm(x_btd, use_param(weights["scale"], names, jnp.float32), cfg.norm_eps)
    graphdef = nnx.graphdef(model.mtp)
    total = jnp.zeros((), jnp.float32)
    for k in range(cfg.mtp_layers):
        params = jax.tree.map(lambda a: a[k], weights["mtp"])
        depth = nnx.merge(graphdef, params)
        with jax.named_scope(f"mtp{k + 1}"):
            # (an id of -1: a padding row's, whose labels are all -1)
            embedded = model.embed_tokens(jnp.maximum(ids[k], 0), weights["embed"])
            y = layer(params, depth.combine(state, embedded), rope)
            ce = model.loss_with({"scale": depth.post_norm.scale[...], "head": weights["head"]},
                                 y, labels[k], chunk)[0]
        total += cfg.mtp_loss_weight / cfg.mtp_layers * ce + depth.stats.probe[0] * \
            jax.lax.stop_gradient(ce)
        state = depth.post_norm(y)
    return total
