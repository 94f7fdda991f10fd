"""The train state, its shardings, and the pure train step `(state, batch) -> (state, metrics)`.

The step differentiates the forward (`forward.py`: the model's parts composed with the plan's
schedule) and updates the state. Layout of one step on the mesh
(B global batch, m microbatches):
  batch tokens[B_data, T+1] -> m microbatches, scanned (or fed to the pipeline); gradients
  accumulated in fp32 under the gradient rules (ZeRO-2/3: sharded over data, so each
  microbatch's gradient is reduce-scattered, never all-reduced) -> AdamW under the optimizer
  rules (ZeRO-1+: each data shard updates its slice) -> new parameters under the parameter
  rules (all-gathered back where ZeRO < 3).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from . import pipeline
from .forward import label_count, loss_sum, microbatches
from .model import Transformer, abstract_model
from .optim import lr_schedule, make_optimizer
from .plan import Plan
from .sharding import activation_rules, constrain, shardings_for
from .untrained import advance_untrained, untrained_zeroed


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: nnx.State  # fp32 master weights, stacked layers in the plan's storage order
    opt: optax.OptState  # Adam moments (and count), laid out like the parameters


def _state(plan: Plan, params, rules):
    tx = make_optimizer(plan.cfg.optim, params)
    abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, jax.eval_shape(tx.init, params))
    shardings = TrainState(
        NamedSharding(plan.mesh, P()),
        shardings_for(params, rules.params, plan.mesh),
        shardings_for(abstract.opt, rules.opt, plan.mesh),
    )
    return abstract, shardings


def state_shardings(plan: Plan):
    """(graphdef, abstract TrainState, TrainState of NamedShardings) without allocating: the
    stored state, its stacked layers in the plan's storage order (padded for uneven stages)."""
    graphdef, params = abstract_model(plan.cfg.model, plan.layer_order)
    if plan.padded:
        params = jax.eval_shape(lambda p: reorder(p, plan, to_canonical=False), params)
    return (graphdef, *_state(plan, params, plan.rules))


def canonical_state(plan: Plan):
    """(abstract TrainState, shardings) of the canonical [L, ...] state that checkpoints hold:
    the stored one, but for uneven stages (see `ZeroRules.canonical`)."""
    if not plan.padded:
        return state_shardings(plan)[1:]
    _, params = abstract_model(plan.cfg.model)
    return _state(plan, params, plan.rules.canonical())


def reorder(state, plan: Plan, to_canonical: bool):
    """The stacked layers between the plan's storage order and the canonical [L, ...] order."""
    return pipeline.reorder_layers(state, np.asarray(plan.layer_order), inverse=to_canonical)


def init_fn(plan: Plan, shardings: TrainState):
    """The jitted initializer: `() -> TrainState`, created directly in its shardings (nothing
    materialized on one device).

    Values depend on `train.seed` and the canonical layout only: JAX's partitionable
    threefry generates the same numbers however the output is sharded, and a circular
    pipeline's storage order is a permutation applied after initialization.
    """
    cfg = plan.cfg
    tx = make_optimizer(cfg.optim, abstract_model(cfg.model)[1])

    def init():
        model = Transformer(cfg.model, nnx.Rngs(params=cfg.train.seed))
        params = reorder(nnx.state(model), plan, to_canonical=False)
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))

    return jax.jit(init, out_shardings=shardings)


def make_grad_fn(plan: Plan, graphdef, mean: bool = True):
    """`(params, tokens[B, T+1]) -> (mean loss, grads)`, accumulating over `plan.accum_steps`
    microbatches (with a pipeline, the pipeline takes the microbatches). With `mean=False`,
    `-> (mean loss, grads / s, s)`: the gradients before a division by a count known when
    compiling (s = 1 / count; else s = 1), which the train step leaves to the optimizer.

    The loss is the mean over every label trained on of the global batch whatever the
    microbatching, and gradients leave in the gradient rules' layout (ZeRO-2/3: sharded over
    data). A count known when compiling divides the summed gradients; one the step computes
    (packed documents, chat data) scales the loss instead, so that its backward makes the
    mean's gradients directly: dividing gradient-sized buffers by a value computed in the step
    made XLA keep a copy of them under clipping (+180 MB for 6 layers of d_model 1024).
    """
    rules, mesh, m = plan.rules, plan.mesh, plan.accum_steps
    value_and_grad = jax.value_and_grad(
        lambda p, t, scale: loss_sum(plan, graphdef, p, t)[0] * scale)

    def constrain_grads(g):
        return jax.lax.with_sharding_constraint(g, shardings_for(g, rules.grads, mesh))

    def grads_and_loss(params, tokens):
        count = label_count(plan, tokens)
        known = isinstance(count, int)
        scale = 1.0 if known else 1.0 / count.astype(jnp.float32)
        with activation_rules(rules.compute, mesh, rules.grads, rules.params):
            if m == 1:
                total, g = value_and_grad(params, tokens, scale)
                g = constrain_grads(g)
            else:
                def accumulate(carry, tokens_mb):
                    g_acc, l_acc = carry
                    l, g = value_and_grad(params, constrain(tokens_mb, ("batch", None)), scale)
                    return (constrain_grads(jax.tree.map(jnp.add, g_acc, g)), l_acc + l), None

                zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
                carry = (constrain_grads(zeros), jnp.zeros((), jnp.float32))
                (g, total), _ = jax.lax.scan(accumulate, carry, microbatches(tokens, m))
        if not known:
            return (total, g) if mean else (total, g, 1.0)
        if not mean:
            return total / count, g, 1.0 / count
        return total / count, jax.tree.map(lambda x: x / count, g)

    return grads_and_loss


def make_eval_step(plan: Plan, graphdef, shardings: TrainState):
    """`(params, tokens[B, T+1]) -> mean loss`, jitted in the state's shardings: the train
    step's forward pass alone, over the same microbatches (so it fits where training does)."""
    rules, m = plan.rules, plan.accum_steps

    def eval_step(params, tokens):
        with activation_rules(rules.compute, plan.mesh, rules.grads, rules.params):
            def one(total, tokens_mb):
                tokens_mb = constrain(tokens_mb, ("batch", None))
                return total + loss_sum(plan, graphdef, params, tokens_mb)[0], None

            total = jax.lax.scan(one, jnp.zeros((), jnp.float32), microbatches(tokens, m))[0]
        return total / label_count(plan, tokens)

    return jax.jit(eval_step, in_shardings=(shardings.params, plan.batch_sharding),
                   out_shardings=NamedSharding(plan.mesh, P()))


def make_logits_fn(plan: Plan, graphdef, param_shardings):
    """`(params, tokens[B, T]) -> logits[B, T, V]` in fp32, jitted on the plan's mesh: the
    model's own forward pass (canonical layer order, no schedule) laid out by the plan's rules."""
    def logits(params, tokens):
        with activation_rules(plan.rules.compute, plan.mesh):
            return nnx.merge(graphdef, params)(tokens)

    return jax.jit(logits, in_shardings=(param_shardings, plan.batch_sharding),
                   out_shardings=plan.sharding(("batch", "length", "vocab")))


def make_train_step(plan: Plan, graphdef, shardings: TrainState, with_grads: bool = False):
    """The pure train step, jitted with explicit in/out shardings and the state donated.

    The learning rate is a function of the step count held in the state, applied here: the
    optimizer's own state is then only Adam's (count and moments), whatever the schedule.
    With `with_grads`, the metrics also hold the mean loss's gradients (the untrained state's:
    its statistics), so that a layout's losses and gradients come from one compiled step."""
    cfg, rules, mesh = plan.cfg, plan.rules, plan.mesh
    tx = make_optimizer(cfg.optim, shardings.params)
    lr_at = lr_schedule(cfg.optim, cfg.train.steps)
    grads_and_loss = make_grad_fn(plan, graphdef, mean=False)

    def train_step(state: TrainState, tokens):
        # the gradients of the summed loss and 1 / the count: the norm is taken before the
        # division, which then has no reader but the optimizer's fused update (read by the norm
        # as well, the divided gradients were a buffer of their own)
        loss, observed, grad_scale = grads_and_loss(state.params, tokens)
        # the untrained state's gradients are statistics (the router's, FP8's amaxes): its
        # own types advance it below
        grads = untrained_zeroed(observed)
        grad_norm = optax.tree.norm(grads) * grad_scale
        grads = jax.tree.map(lambda g: g * grad_scale, grads)
        # ZeRO-1+: each data shard updates only its slice of the moments and the weights
        grads = jax.lax.with_sharding_constraint(grads, shardings_for(grads, rules.opt, mesh))
        updates, opt = tx.update(grads, state.opt, state.params, grad_norm=grad_norm)
        lr = lr_at(state.step)
        params = jax.tree.map(lambda p, u: p - (lr * u).astype(p.dtype), state.params, updates)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr}
        if with_grads:
            metrics["grads"] = jax.tree.map(lambda g: g * grad_scale, observed)
        params, observed_metrics = advance_untrained(params, observed, state.params,
                                                     grad_scale, plan)
        metrics.update(observed_metrics)
        return TrainState(state.step + 1, params, opt), metrics

    return jax.jit(train_step, in_shardings=(shardings, plan.batch_sharding),
                   out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)


def compile_step(plan: Plan, step_fn, abstract: TrainState, shardings: TrainState,
                 options: dict | None = None):
    """AOT-compile a train step from abstract shapes (nothing allocated): (compiled, seconds).
    `options`: XLA's compiler options for this compile (`hlo.dump_options`)."""
    import time

    from .store import abstract_like

    t = plan.cfg.train
    batch = jax.ShapeDtypeStruct((t.global_batch, t.seq_len + 1), np.int32,
                                 sharding=plan.batch_sharding)
    start = time.perf_counter()
    compiled = step_fn.lower(abstract_like(abstract, shardings), batch).compile(
        compiler_options=options)
    return compiled, time.perf_counter() - start
