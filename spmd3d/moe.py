"""Mixture-of-Experts, all but the parameters (`model.MoE` holds those): which experts each
token goes to and with what weight, the balancing terms a router is trained with, the layer's
compute on the mesh (`experts_layer`) and the step's side of the router state (statistics, the
bias rule). docs/moe.md has the design.

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

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from . import grouped
from .manual import all_gather, per_device, psum, psum_scatter, vary
from .mesh import EXPERT, TENSOR
from .sharding import current_layout
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


def grouped_ffn(x_nd, gate_up_edcf, down_efd, weights_nk, experts_nk, first: int = 0,
                kernel: str = "ragged", weight_grad: str = "xla"):
    """y[N, D]: each token through its chosen experts among the local ones (global ids
    first .. first + E_local - 1), weighted; others contribute zero. Dropless: the N k
    assignments sorted by expert, grouped matmuls (`grouped.matmul(kernel, weight_grad)`) over
    the groups, then put back in token order and summed over each token's k."""
    ragged_dot = grouped.matmul("ragged" if kernel == "auto" else kernel,
                                "xla" if weight_grad == "auto" else weight_grad)
    n, k = experts_nk.shape
    e_local, d = gate_up_edcf.shape[0], x_nd.shape[-1]
    local = experts_nk.reshape(-1) - first
    mine = (local >= 0) & (local < e_local)
    key = jnp.where(mine, local, e_local)  # the other devices' assignments sort last
    # a token chooses an expert once, so at most min(k, E_local) of its k are ours: the
    # buffers hold that many rows per token, not k (half of them at Mixtral's top-2, one
    # expert per device)
    order = jnp.argsort(key, stable=True)[:n * min(k, e_local)]
    sizes = jnp.zeros((e_local + 1,), jnp.int32).at[key].add(1)[:e_local]
    rows = x_nd[order // k]  # [R, D], grouped by expert
    # gate and up apart: merging [2, F] into one dim would move F's shards (over `tensor`)
    gate, up = (ragged_dot(rows, gate_up_edcf[:, :, c], sizes) for c in (0, 1))
    y = ragged_dot(jax.nn.silu(gate) * up, down_efd, sizes)  # [R, D]; 0 past the groups
    w = jnp.where(mine, weights_nk.reshape(-1), 0.0)[order].astype(y.dtype)
    return jnp.zeros((n, d), y.dtype).at[order // k].add(y * w[:, None])


def capacity(factor: float, assignments: int, num_experts: int) -> int:
    """Assignments an expert takes at most: `factor` x its even share (at least 1)."""
    return max(1, math.ceil(factor * assignments / num_experts))


def slots(experts_nk, first: int, e_local: int, cap: int):
    """(slot[N, k]: local expert x cap + its rank among the expert's assignments, or -1 where
    the assignment is another device's or over capacity; the assignments dropped). Ranks go
    first choices first, then by token (GShard's priority: a token loses its second expert
    before another token loses its first)."""
    n, k = experts_nk.shape
    local = (experts_nk - first).T.reshape(-1)  # choice-major
    mine = (local >= 0) & (local < e_local)
    onehot = ((local[:, None] == jnp.arange(e_local)) & mine[:, None]).astype(jnp.int32)
    rank = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)
    keep = mine & (rank < cap)
    slot = jnp.where(keep, local * cap + rank, -1).reshape(k, n).T
    return slot, jnp.sum(mine & ~keep).astype(jnp.float32)


def capacity_ffn(x_nd, gate_up_edcf, down_efd, weights_nk, slot_nk, cap: int):
    """`grouped_ffn` with each local expert's assignments in a fixed [cap, D] buffer (`slots`):
    plain batched matmuls, the same shapes whatever the routing (what a GPU without grouped
    matmul kernels runs well); an assignment without a slot contributes zero."""
    n, k = slot_nk.shape
    e_local, d = gate_up_edcf.shape[0], x_nd.shape[-1]
    flat = slot_nk.reshape(-1)
    kept = flat >= 0
    where = jnp.where(kept, flat, e_local * cap)  # the assignments without a slot: one more row
    rows = x_nd[jnp.arange(n * k) // k]  # each assignment's token
    buffer = jnp.zeros((e_local * cap + 1, d), x_nd.dtype).at[where].set(rows)
    buffer = buffer[:-1].reshape(e_local, cap, d)
    gate, up = (jnp.einsum("ecd,edf->ecf", buffer, gate_up_edcf[:, :, c]) for c in (0, 1))
    out = jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, down_efd).reshape(-1, d)
    y = jnp.where(kept[:, None], out[jnp.minimum(where, e_local * cap - 1)], 0)
    return jnp.einsum("nkd,nk->nd", y.reshape(n, k, d), weights_nk.astype(y.dtype))


def experts_layer(x_btd, router_de, gate_up_edcf, down_efd, bias_e, probe_s, *,
                  routing: Routing, aux_weight: float, z_weight: float,
                  capacity_factor: float = 0.0, kernel: str = "ragged",
                  weight_grad: str = "xla"):
    """The routed experts of an MoE layer: y[B, T, D] for x[B, T, D] (the weights as used:
    cast, and laid out by the compute rules: experts over `expert`, their hidden dim over
    `tensor`).

    Per device (a shard_map manual over the axes that split tokens and the tensor axis; inside
    a pipeline's, those already manual stay so): each device routes its own tokens. With
    expert parallelism the tokens and their choices are all-gathered over `expert` (one of the
    batch's axes), each device runs its experts on the assignments that chose them, and the
    outputs are reduce-scattered back, each token's sum over the devices holding its experts:
    exact and dropless, one all-gather and one reduce-scatter of the tokens per layer. Under
    tensor parallelism each device holds a slice of every expert's hidden dim; their partial
    outputs are summed over `tensor` last, once per token (Megatron's row-parallel sum): left
    to the compiler, the sum comes before the reduce-scatter and the weighting, over every
    gathered assignment, k x expert times the bytes."""
    # inside a pipeline's shard_map `tensor` stays automatic (`per_device`): the compiler then
    # sums over it before the reduce-scatter, every gathered assignment (docs/moe.md)
    shards = per_device(current_layout(), x_btd, extra="mlp")
    tokens, t_axis = shards.tokens, shards.extra
    e_axis = EXPERT if EXPERT in tokens else None
    how = (aux_weight, z_weight, tokens)

    def local(x, router, gate_up, down, bias, probe):
        b, t, d = x.shape
        x = x.reshape(-1, d)
        router, probe = vary(router, tokens), vary(probe, tokens)
        # fp32 operands, as DeepSeek-V3's gate and Megatron's `moe_router_dtype=fp32`: the
        # logits decide discrete choices, and a bf16 input or weight ties and flips them
        logits = jnp.einsum("nd,de->ne", x.astype(jnp.float32), router)
        experts = choose(logits, routing, bias)
        first, mine, e_local = 0, experts, gate_up.shape[0]
        if e_axis is not None:  # every assignment of the group, and which experts are ours
            mine = jax.lax.all_gather(experts, e_axis, tiled=True)
            first = jax.lax.axis_index(e_axis) * e_local
        dropped, slot = 0.0, None
        if capacity_factor > 0:
            cap = capacity(capacity_factor, mine.size, bias.shape[0])
            slot, dropped = slots(mine, first, e_local, cap)
        weights = weigh(balanced(logits, probe, experts, dropped, how), experts, routing)
        if t_axis is not None:  # before the gather: the backward sums one token's gradient
            # (and the weights', in fp32: they meet the experts' outputs, which vary over
            # `tensor`, cast to the compute dtype)
            x, weights = vary(x, t_axis), vary(weights, t_axis)
        if e_axis is not None:
            x, weights = all_gather(x, e_axis), all_gather(weights, e_axis)
        gate_up, down = vary(gate_up, tokens), vary(down, tokens)
        y = (grouped_ffn(x, gate_up, down, weights, mine, first, kernel, weight_grad)
             if slot is None else
             capacity_ffn(x, gate_up, down, weights, slot, cap))
        if e_axis is not None:
            y = psum_scatter(y, e_axis)
        if t_axis is not None:
            y = psum(y, t_axis)
        return y.reshape(b, t, d)

    e = e_axis if e_axis in shards.axes else None  # the experts' weights: entered split
    specs = (shards.spec(None), P(), P(e, None, None, t_axis), P(e, t_axis, None), P(), P())
    return shards(local, specs, shards.spec(None))(x_btd, router_de, gate_up_edcf, down_efd,
                                                    bias_e, probe_s)


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
        stats_ls = stats_ls[jnp.asarray(active)]
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


def traffic(m, expert: int, tensor: str, tokens: int, c: int, forwards: float, restaged: float,
            backwards: float, recomputes: bool) -> list[tuple[str, str, str, float]]:
    """What MoE layers move in a step, per device, for the planner (`plan.estimate.transfers`):
    (what, kind, mesh axis, bytes), counted as the compiled step's are; read from the HLO of
    Mixtral 8x22B's compiled step and the MoE layouts of `tests/test_estimate.py`. `m`: the
    model config; `expert`: the expert degree; `tensor`: how the layer meets a tensor split,
    "" (none), "manual" (its shard_map sums the experts' outputs over `tensor` itself, and the
    transpose its inputs' gradients, in fp32: `manual.psum`) or "auto" (inside a pipeline it
    keeps `tensor` automatic); `tokens`: a microbatch's on a device; `c`: the compute dtype's
    bytes; the layer passes a device runs: `forwards`, `restaged` (whole-stage recomputes),
    `backwards`; `recomputes`: whether a layer's backward recomputes its forward."""
    f32, out = 4, []
    if tensor == "manual":  # the extra bytes of summing a narrow float in fp32
        out.append(("experts' sums, in fp32", "reduce", TENSOR,
                    tokens * m.d_model * (f32 - c) * (forwards + backwards)))
    if tensor == "auto":
        # the compiler reduces the experts' partial sums over every gathered assignment,
        # [R, D] with R = expert x tokens x min(k, local experts), where the MLP's own
        # reduction would be: forward once, backward twice (the inputs' gradients of gate and
        # up) and once more where the backward recomputes the outputs (the router weights'
        # gradient needs them)
        rows = expert * tokens * min(m.experts_per_token, m.num_experts // expert)
        out.append(("experts' partial sums", "reduce", TENSOR, rows * m.d_model * c
                    * (forwards + restaged + backwards * (2 + recomputes))))
    if expert > 1:
        # the tokens all-gathered over `expert` (with their choices: k weights and ids), the
        # outputs reduce-scattered back, the backward the transposes; the reduce-scatters
        # sum a narrow float in fp32 (`manual.psum_scatter`, `manual.all_gather`)
        gathered = expert * tokens * m.d_model * c
        summed = expert * tokens * m.d_model * max(c, f32)
        choices = expert * tokens * m.experts_per_token * (f32 + 4)
        out += [("tokens to the experts", "gather", EXPERT, (gathered + choices)
                 * (forwards + restaged + backwards * recomputes)),
                # (a recompute drops it: the backward needs the experts' outputs, not sums)
                ("experts' outputs back", "reduce-scatter", EXPERT,
                 summed * (forwards + restaged)),
                ("tokens' gradients back", "reduce-scatter", EXPERT,
                 (summed + expert * tokens * m.experts_per_token * f32) * backwards),
                ("outputs' gradients to the experts", "gather", EXPERT, gathered * backwards)]
    return out
