"""A Mixture-of-Experts router: which experts each token goes to and with what weight, the
balancing terms it is trained with, and the step's side of its state (statistics, the bias
rule). `moe.py` runs the experts on the mesh; docs/moe.md has the design.

Conventions of the models we import, in fp32 whatever the compute dtype (a router's logits
decide discrete choices; bf16 ties and flips them):

* `renormalize=True` (Mixtral; Qwen3-MoE with `norm_topk_prob`): softmax over all experts,
  the top k kept and divided by their sum -- the softmax of the top-k logits;
* `renormalize=False` (Qwen3-MoE without it): the top k of the softmax over all experts, as
  they are (they sum to less than one).

DeepSeek-V3's (`Routing` with `score="sigmoid"`, `groups`, `topk_groups`, `scale`): sigmoid
scores; the experts in `groups` groups, a token's k chosen from its `topk_groups` best groups
(a group ranked by the sum of its two best scores); the chosen scores renormalized (its
`norm_topk_prob`) and multiplied by `scale` (its `routed_scaling_factor`).

`bias` (DeepSeek-V3's auxiliary-loss-free balancing) is added to the scores for the choice
only (the groups' ranking included); the weights stay the unbiased scores. The balancing terms
are the Switch Transformer's load-balancing loss as transformers computes it
(`load_balancing_loss`: the experts' share of the top-k assignments times their mean probability, times the expert count;
a model scales it by `router_aux_loss_coef`) and ST-MoE's router z-loss (`z_loss`); `imbalance`
is the step's metric, the most loaded expert's assignments over the mean.

Shapes: logits[T, E] (tokens flattened), weights and experts [T, k].
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .untrained import Untrained


@dataclass(frozen=True)
class Routing:
    """How a router's logits choose and weigh a token's experts (the module's docstring)."""

    k: int
    renormalize: bool = True
    score: str = "softmax"  # or "sigmoid"
    groups: int = 1
    topk_groups: int = 1
    scale: float = 1.0

    @classmethod
    def of(cls, m) -> "Routing":
        """A model config's routing (`model.experts_per_token`, `model.router_*`)."""
        return cls(m.experts_per_token, m.router_renormalize, m.router_score, m.router_groups,
                   m.router_topk_groups, m.router_scale)

    def scores(self, logits_te):
        """[T, E] fp32: the softmax or the sigmoid of the logits."""
        logits = logits_te.astype(jnp.float32)
        return jax.nn.sigmoid(logits) if self.score == "sigmoid" else jax.nn.softmax(logits, -1)


def route(logits_te, routing: Routing, bias_e=None):
    """(weights[T, k] fp32, experts[T, k] int32) of router logits: `choose`, then `weigh`
    (the layer runs the two apart, the balancing terms between them)."""
    experts = choose(logits_te, routing, bias_e)
    return weigh(logits_te, experts, routing), experts


def expert_load(experts_tk, num_experts: int):
    """[E]: top-k assignments per expert (fp32 counts)."""
    return jnp.zeros((num_experts,), jnp.float32).at[experts_tk.reshape(-1)].add(1.0)


def load_balancing_loss(logits_te, experts_tk):
    """E * sum_e (assignments to e / T) * (mean probability of e): k when the assignments and
    the probability spread evenly, E when the same experts take every token and one of them
    all the probability."""
    t, e = logits_te.shape
    probs = jax.nn.softmax(logits_te.astype(jnp.float32), axis=-1)
    share = expert_load(experts_tk, e) / t
    return e * jnp.sum(share * jnp.mean(probs, axis=0))


def z_loss(logits_te):
    """ST-MoE's router z-loss: the mean squared log-sum-exp of the logits (keeps them small,
    so that the softmax stays in fp32's comfortable range)."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits_te.astype(jnp.float32), axis=-1)))


def imbalance(load_e):
    """The most loaded expert's assignments over the mean (1: perfectly even), over the last
    axis of `load` (`expert_load`'s, or a layer's row of the step's statistics)."""
    return jnp.max(load_e, axis=-1) / jnp.mean(load_e, axis=-1)


# ---------------------------------------------------------------------------------------------
# the layer's compute: routing, the balancing terms' gradients, the experts

STATS_EXTRA = 3  # a layer's statistics: E expert loads, then these (aux, z, dropped)


def stats_size(num_experts: int) -> int:
    return num_experts + STATS_EXTRA


def choose(logits_te, routing: Routing, bias_e=None):
    """experts[T, k] int32: the top k of the scores (plus the selection-only bias), best
    first; with groups, from the token's `topk_groups` best groups alone."""
    scores = jax.lax.stop_gradient(routing.scores(logits_te))
    if bias_e is not None:
        scores = scores + jax.lax.stop_gradient(bias_e).astype(jnp.float32)
    if routing.groups > 1:
        t, e = scores.shape
        grouped = scores.reshape(t, routing.groups, e // routing.groups)
        rank = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, groups]
        best = jax.lax.top_k(rank, routing.topk_groups)[1]
        keep = jnp.zeros(rank.shape, bool).at[jnp.arange(t)[:, None], best].set(True)
        scores = jnp.where(jnp.repeat(keep, e // routing.groups, axis=1), scores, -jnp.inf)
    return jax.lax.top_k(scores, routing.k)[1].astype(jnp.int32)


def weigh(logits_te, experts_tk, routing: Routing):
    """weights[T, k] fp32 of the chosen experts (the module's conventions)."""
    weights = jnp.take_along_axis(routing.scores(logits_te), experts_tk, axis=-1)
    if routing.renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * routing.scale if routing.scale != 1.0 else weights


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def balanced(logits_te, probe_s, experts_tk, dropped, how):
    """`logits` as they are. Differentiated, their cotangent gains the balancing terms' own
    (`how` = (aux weight, z weight, token axes)) and `probe`'s cotangent is the layer's
    statistics: this device's expert loads, the load-balancing loss times its token count,
    its tokens' summed squared log-sum-exp, and the assignments its experts `dropped` (over
    capacity).

    This is how the terms join the loss without the layer returning anything more than its
    output (Megatron's MoEAuxLossAutoScaler does the same): whatever runs the layer -- a layer
    scan, a pipeline's ticks, accumulated microbatches -- sums `probe`'s gradient over tokens,
    devices and microbatches as it sums every other gradient, and the step divides all of them
    by the step's token count. So with the weights given per token (`_fwd`), the objective is
    the mean cross-entropy plus aux weight x the mean over microbatches of each layer's
    load-balancing loss (over the microbatch's tokens on every device) plus z weight x the
    mean z-loss over every token, each layer counted once; the statistics come out as loads
    per token, the microbatches' mean balancing loss and the mean z-loss."""
    return logits_te


def _balanced_fwd(logits_te, probe_s, experts_tk, dropped, how):
    _, _, axes = how
    t, e = logits_te.shape
    probs = jax.nn.softmax(logits_te, axis=-1)
    lse = jax.nn.logsumexp(logits_te, axis=-1)
    load = expert_load(experts_tk, e)
    total, tokens, mean_probs = jax.lax.psum((load, jnp.float32(t), jnp.sum(probs, axis=0)), axes)
    share = total / tokens  # assignments per token
    aux = e * jnp.sum(share * mean_probs / tokens)
    stats = jnp.concatenate([load, jnp.stack([aux * t, jnp.sum(lse * lse),
                                              jnp.asarray(dropped, jnp.float32)])])
    return logits_te, (probs, lse, share, stats)


def _balanced_bwd(how, residuals, g_te):
    aux_weight, z_weight, axes = how
    probs, lse, share, stats = residuals
    e = probs.shape[-1]
    # A backward given a zero cotangent gives zero, as a linear one does: a lockstep
    # pipeline runs backwards on its bubbles' padding with a zero cotangent and adds what
    # they give. So the terms count for a microbatch whose cotangent is non-zero anywhere.
    real = (jax.lax.psum(jnp.any(g_te != 0).astype(jnp.float32), axes) > 0).astype(jnp.float32)
    # per token (see `balanced`): d aux / d probs[t, e] x the microbatch's tokens = E share_e
    g_probs = aux_weight * e * jnp.broadcast_to(share, probs.shape)
    g_aux = probs * (g_probs - jnp.sum(probs * g_probs, axis=-1, keepdims=True))
    g_z = z_weight * 2.0 * lse[:, None] * probs
    return (g_te + (real * (g_aux + g_z)).astype(g_te.dtype), (real * stats).astype(g_te.dtype),
            None, None)


balanced.defvjp(_balanced_fwd, _balanced_bwd)


# ---------------------------------------------------------------------------------------------
# the step's side: the router's state, statistics out of the gradients, the bias rule

class RouterState(Untrained):
    """A router's per-layer vector that is state but not trained by the optimizer: the
    selection-only expert bias (updated by the step's rule, `update_bias`) and the statistics
    probe, a zero whose gradient is the layer's routing statistics (`balanced`). Both are kept
    in checkpoints like the weights."""

    @classmethod
    def advance(cls, old, observed, scale, plan):
        """The step's routing metrics from the statistics (the probe's gradient divided by the
        step's tokens: [L, E + 3] per layer, in storage order), and the bias moved by its
        rule; the probe stays zero."""
        stats = observed["probe"] * scale
        rate = plan.cfg.model.router_bias_rate
        return ({"bias": update_bias(old["bias"], stats, rate), "probe": old["probe"]},
                step_metrics(stats, plan.active))


def step_metrics(stats_ls, active=None) -> dict:
    """The step's routing metrics from the statistics of its real layers: the balancing loss
    and z-loss (mean over layers), the worst layer's imbalance (its most loaded expert's
    assignments over the mean) and the dropped share of assignments."""
    if active is not None:
        stats_ls = stats_ls[np.flatnonzero(active)]  # static: the padding slots are known
    loads, extra = stats_ls[:, :-STATS_EXTRA], stats_ls[:, -STATS_EXTRA:]
    return {"moe_aux_loss": jnp.mean(extra[:, 0]), "moe_z_loss": jnp.mean(extra[:, 1]),
            "moe_imbalance": jnp.max(imbalance(loads)),
            "moe_dropped": jnp.sum(extra[:, 2]) / jnp.sum(loads)}


def update_bias(bias_le, stats_ls, rate: float):
    """DeepSeek-V3's auxiliary-loss-free balancing: each layer's expert bias moves by `rate`
    towards the under-loaded experts, b_e += rate * sign(mean load - load_e), from the step's
    loads; outside the optimizer (no moments, no weight decay, no learning rate)."""
    loads = stats_ls[:, :-STATS_EXTRA]
    return bias_le + rate * jnp.sign(jnp.mean(loads, axis=1, keepdims=True) - loads)
