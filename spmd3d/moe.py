"""Mixture-of-Experts routing: which experts each token goes to, with what weight, and the
balancing terms a router is trained with.

Conventions of the models we import, in fp32 whatever the compute dtype (a router's logits
decide discrete choices; bf16 ties and flips them):

* `renormalize=True` (Mixtral; Qwen3-MoE with `norm_topk_prob`): softmax over all experts,
  the top k kept and divided by their sum -- the softmax of the top-k logits;
* `renormalize=False` (Qwen3-MoE without it): the top k of the softmax over all experts, as
  they are (they sum to less than one).

`bias` (DeepSeek-V3's auxiliary-loss-free balancing) is added to the scores for the choice
only; the weights stay the unbiased probabilities. The balancing terms are the Switch
Transformer's load-balancing loss as transformers computes it (`load_balancing_loss`: the
experts' share of the top-k assignments times their mean probability, times the expert count;
a model scales it by `router_aux_loss_coef`) and ST-MoE's router z-loss (`z_loss`); `imbalance`
is the step's metric, the most loaded expert's assignments over the mean.

Shapes: logits[T, E] (tokens flattened), weights and experts [T, k].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(logits_te, k: int, renormalize: bool = True, bias_e=None):
    """(weights[T, k] fp32, experts[T, k] int32) of router logits, best first."""
    probs = jax.nn.softmax(logits_te.astype(jnp.float32), axis=-1)
    scores = probs if bias_e is None else probs + bias_e.astype(jnp.float32)
    _, experts = jax.lax.top_k(scores, k)
    weights = jnp.take_along_axis(probs, experts, axis=-1)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


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


def imbalance(experts_tk, num_experts: int):
    """The most loaded expert's assignments over the mean (1: perfectly even)."""
    load = expert_load(experts_tk, num_experts)
    return jnp.max(load) / jnp.mean(load)
