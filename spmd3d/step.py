"""The train state, its shardings, and the pure train step `(state, batch) -> (state, metrics)`.

The step composes the model's parts with the plan's schedule: embed -> the layer stack (one
`lax.scan`, or the pipeline over `stage`) -> head and loss. Layout of one step on the mesh
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

from . import attention, pipeline
from .model import Transformer, abstract_model
from .optim import lr_schedule, make_optimizer
from .plan import Plan
from .sharding import activation_rules, constrain, shardings_for


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: nnx.State  # fp32 master weights, stacked layers in the plan's storage order
    opt: optax.OptState  # Adam moments (and count), laid out like the parameters


def _state(plan: Plan, params, rules):
    tx = make_optimizer(plan.cfg.optim)
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
    tx = make_optimizer(cfg.optim)

    def init():
        model = Transformer(cfg.model, nnx.Rngs(params=cfg.train.seed))
        params = reorder(nnx.state(model), plan, to_canonical=False)
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))

    return jax.jit(init, out_shardings=shardings)


def init_state(plan: Plan, shardings: TrainState) -> TrainState:
    with jax.set_mesh(plan.mesh):
        return init_fn(plan, shardings)()


# ---------------------------------------------------------------------------------------------
# forward: the model's parts composed with the schedule

def _layer_remat(policy: str) -> str:
    """The per-layer remat policy: `stage` checkpoints whole stages and, while the backward
    recomputes one, keeps each layer's input alone (each layer is then recomputed again for
    its own backward): the least memory -- one stage input per tick, one layer's working set --
    for two extra forward passes. Inside the recompute, keeping every layer's residuals instead
    would hold a whole stage's attention scores at once (LLaMA-3 405B at seq 8192, TP8 PP16:
    59 GB of temporaries per device against 19 GB this way)."""
    return "full" if policy == "stage" else policy


def _pipelined_loss(plan: Plan, graphdef, params, inputs, labels, positions):
    """Summed loss through the pipeline: stage 0 embeds each microbatch, the stages apply their
    layers, the last stage runs the head and the loss. Besides `stage`, the data axis (unless
    ZeRO-3 splits the weights over it: gradients are then reduced once, not per tick) and the
    ring axis go manual inside it; inside, the rules drop those axes and attention runs the
    per-device ring (a nested shard_map would mix the two levels' manual axes)."""
    rules, par = plan.rules, plan.cfg.parallel
    inner, batch_axis, seq_axis = rules.compute, None, None
    if not rules.params_over_batch:
        inner, batch_axis = inner.with_(batch=None), inner["batch"]
    if plan.attention == "ring":
        seq_axis = inner["length"]
        res = inner["res_length"]
        res = tuple(a for a in res if a != seq_axis) if isinstance(res, tuple) else None
        inner = inner.with_(length=None, res_length=res[0] if res else None)
    attend = attention.select(plan.attention, seq_axis, plan.mesh, manual=True)
    model = nnx.merge(graphdef, params)
    stage = model.layers(_layer_remat(par.remat), par.scan_layers, attend)
    rope = model.rope(positions)
    io = nnx.State({k: v for k, v in params.items() if k != "blocks"})

    def local_model(blocks, io):  # this stage's view: its chunks as the blocks
        return nnx.merge(graphdef, nnx.State({**io, "blocks": blocks}))

    def first(blocks, io, xs):
        return local_model(blocks, io).embed_tokens(xs[0], one_hot=True)

    def last(blocks, io, x, xs):
        return local_model(blocks, io).loss(x, xs[1])[0]

    grads = inner if batch_axis is not None else rules.grads  # no manual axis in them
    # inside the pipeline's shard_map, constraints resolve against its context mesh
    with activation_rules(inner, None, grads):
        return pipeline.run(params["blocks"], io, (inputs, labels), rope, plan.schedule,
                            rules.compute["layers"], plan.mesh, first=first, stage=stage,
                            last=last, active=plan.active, batch_axis=batch_axis,
                            seq_axis=seq_axis,
                            stage_remat=par.remat == "stage")


def loss_sum(plan: Plan, graphdef, params, tokens_bt1):
    """Summed next-token cross-entropy (fp32) over a [B, T+1] token block, and the count."""
    inputs, labels = tokens_bt1[:, :-1], tokens_bt1[:, 1:]
    positions = np.arange(inputs.shape[1])
    if plan.seq_order is not None:  # zig-zag under ring attention: a permutation
        positions = np.asarray(plan.seq_order)
        inputs, labels = inputs[:, positions], labels[:, positions]
    if plan.pipelined:
        return _pipelined_loss(plan, graphdef, params, inputs, labels, positions), labels.size
    # storage order is canonical without a pipeline
    model, par = nnx.merge(graphdef, params), plan.cfg.parallel
    attend = attention.select(plan.attention, plan.rules.compute["length"], plan.mesh)
    run = model.layers(_layer_remat(par.remat), par.scan_layers, attend)
    if par.remat == "stage":  # the whole stack is the one stage: keep only its input
        run = jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable,
                             prevent_cse=False)
    x = run(nnx.state(model.blocks), model.embed_tokens(inputs), model.rope(positions))
    return model.loss(x, labels)


def make_grad_fn(plan: Plan, graphdef):
    """`(params, tokens[B, T+1]) -> (mean loss, grads)`, accumulating over `plan.accum_steps`
    microbatches (with a pipeline, the pipeline takes the microbatches).

    The loss is the mean over every token of the global batch whatever the microbatching, and
    gradients leave in the gradient rules' layout (ZeRO-2/3: sharded over data).
    """
    rules, mesh, m = plan.rules, plan.mesh, plan.accum_steps
    value_and_grad = jax.value_and_grad(lambda p, t: loss_sum(plan, graphdef, p, t), has_aux=True)

    def constrain_grads(g):
        return jax.lax.with_sharding_constraint(g, shardings_for(g, rules.grads, mesh))

    def grads_and_loss(params, tokens):
        count = tokens.shape[0] * (tokens.shape[1] - 1)
        with activation_rules(rules.compute, mesh, rules.grads):
            if m == 1:
                (total, _), g = value_and_grad(params, tokens)
                g = constrain_grads(g)
            else:
                # microbatch j holds rows j, j+m, j+2m, ...: each data shard keeps its own rows
                micro = tokens.reshape(tokens.shape[0] // m, m, -1).swapaxes(0, 1)

                def accumulate(carry, tokens_mb):
                    g_acc, l_acc = carry
                    (l, _), g = value_and_grad(params, constrain(tokens_mb, ("batch", None)))
                    return (constrain_grads(jax.tree.map(jnp.add, g_acc, g)), l_acc + l), None

                zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
                carry = (constrain_grads(zeros), jnp.zeros((), jnp.float32))
                (g, total), _ = jax.lax.scan(accumulate, carry, micro)
        return total / count, jax.tree.map(lambda x: x / count, g)

    return grads_and_loss


def make_train_step(plan: Plan, graphdef, shardings: TrainState):
    """The pure train step, jitted with explicit in/out shardings and the state donated.

    The learning rate is a function of the step count held in the state, applied here: the
    optimizer's own state is then only Adam's (count and moments), whatever the schedule."""
    cfg, rules, mesh = plan.cfg, plan.rules, plan.mesh
    tx = make_optimizer(cfg.optim)
    lr_at = lr_schedule(cfg.optim, cfg.train.steps)
    grads_and_loss = make_grad_fn(plan, graphdef)

    def train_step(state: TrainState, tokens):
        loss, grads = grads_and_loss(state.params, tokens)
        grad_norm = optax.tree.norm(grads)
        # ZeRO-1+: each data shard updates only its slice of the moments and the weights
        grads = jax.lax.with_sharding_constraint(grads, shardings_for(grads, rules.opt, mesh))
        updates, opt = tx.update(grads, state.opt, state.params)
        lr = lr_at(state.step)
        params = jax.tree.map(lambda p, u: p - (lr * u).astype(p.dtype), state.params, updates)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr}
        return TrainState(state.step + 1, params, opt), metrics

    return jax.jit(train_step, in_shardings=(shardings, plan.batch_sharding),
                   out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)


def compile_step(plan: Plan, step_fn, abstract: TrainState, shardings: TrainState):
    """AOT-compile a train step from abstract shapes (nothing allocated): (compiled, seconds)."""
    import time

    from .store import abstract_like

    t = plan.cfg.train
    batch = jax.ShapeDtypeStruct((t.global_batch, t.seq_len + 1), np.int32,
                                 sharding=plan.batch_sharding)
    start = time.perf_counter()
    compiled = step_fn.lower(abstract_like(abstract, shardings), batch).compile()
    return compiled, time.perf_counter() - start
