"""The train state, its shardings, and the pure train step `(state, batch) -> (state, metrics)`.

Layout of one step on the mesh (B global batch, m microbatches):
  batch tokens[B_data, T+1] -> m microbatches, scanned; gradients accumulated in fp32 under the
  gradient rules (ZeRO-2/3: sharded over data, so each microbatch's gradient is
  reduce-scattered, never all-reduced) -> AdamW under the optimizer rules (ZeRO-1+: each data
  shard updates its slice) -> new parameters under the parameter rules (all-gathered back
  where ZeRO < 3).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from .config import Config
from .model import Transformer, abstract_model, sequence_order
from .pipeline import Schedule, layer_order, reorder_layers
from .optim import lr_schedule, make_optimizer
from .sharding import ZeroRules, activation_rules, constrain, shardings_for, zero_rules


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: nnx.State  # fp32 master weights, canonical [L, ...] layout
    opt_state: optax.OptState


def schedule_of(cfg: Config) -> Schedule | None:
    """The pipeline schedule for `mesh.stage > 1`, else None."""
    if cfg.mesh.stage == 1:
        return None
    return Schedule(cfg.mesh.stage, cfg.train.microbatches, cfg.parallel.pipeline_repeats)


def storage_order(cfg: Config) -> np.ndarray:
    """Canonical layer index of each stored layer (see `pipeline.layer_order`)."""
    return layer_order(cfg.model.num_layers, cfg.mesh.stage, cfg.parallel.pipeline_repeats)


def state_shardings(cfg: Config, mesh, rules: ZeroRules | None = None):
    """(graphdef, abstract TrainState, TrainState of NamedShardings) without allocating."""
    rules = rules or zero_rules(cfg.parallel.zero_stage, cfg.parallel.sequence_parallel)
    graphdef, params = abstract_model(cfg.model, cfg.parallel.remat, schedule_of(cfg),
                                      cfg.parallel.scan_layers)
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    abstract = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, jax.eval_shape(tx.init, params))
    shardings = TrainState(
        NamedSharding(mesh, P()),
        shardings_for(params, rules.params, mesh),
        shardings_for(abstract.opt_state, rules.opt, mesh),
    )
    return graphdef, abstract, shardings


def init_state(cfg: Config, mesh, shardings: TrainState) -> TrainState:
    """Initial state, created directly in its shardings (nothing materialized on one device).

    Values depend on `train.seed` and the canonical layout only: JAX's partitionable
    threefry generates the same numbers however the output is sharded, and a circular
    pipeline's storage order is a permutation applied after initialization.
    """
    tx = make_optimizer(cfg.optim, cfg.train.steps)

    @jax.jit
    def init():
        model = Transformer(cfg.model, nnx.Rngs(params=cfg.train.seed), remat=cfg.parallel.remat)
        params = reorder_layers(nnx.state(model), storage_order(cfg))
        state = TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))
        return jax.lax.with_sharding_constraint(state, shardings)

    with jax.set_mesh(mesh):
        return jax.jit(init, out_shardings=shardings)()


def loss_sum(graphdef, params, tokens_bt1):
    """Summed next-token cross-entropy (fp32) over a [B, T+1] token block, and the count."""
    inputs, labels = tokens_bt1[:, :-1], tokens_bt1[:, 1:]
    order = sequence_order(inputs.shape[1])  # zig-zag under ring attention: a permutation
    positions = None
    if order is not None:
        inputs, labels, positions = inputs[:, order], labels[:, order], np.asarray(order)
    logits_btv = nnx.merge(graphdef, params)(inputs, positions)
    logp = jax.nn.log_softmax(logits_btv, axis=-1)
    # a one-hot contraction keeps the vocab dim sharded (a gather would all-gather the logits)
    onehot = constrain(jax.nn.one_hot(labels, logits_btv.shape[-1], dtype=logp.dtype),
                       ("batch", "length", "vocab"))
    nll = -jnp.sum(logp * onehot, axis=-1)
    return jnp.sum(nll), nll.size


def make_grad_fn(cfg: Config, mesh, graphdef, rules: ZeroRules):
    """`(params, tokens[B, T+1]) -> (mean loss, grads)` over `train.microbatches` microbatches
    (accumulated here without a pipeline; with one, the pipeline takes the microbatches).

    The loss is the mean over every token of the global batch whatever the microbatching, and
    gradients leave in the gradient rules' layout (ZeRO-2/3: sharded over data).
    """
    m = 1 if cfg.mesh.stage > 1 else cfg.train.microbatches
    value_and_grad = jax.value_and_grad(lambda p, t: loss_sum(graphdef, p, t), has_aux=True)

    def constrain_grads(g):
        return jax.lax.with_sharding_constraint(g, shardings_for(g, rules.grads, mesh))

    def grads_and_loss(params, tokens):
        count = tokens.shape[0] * (tokens.shape[1] - 1)
        with activation_rules(rules.compute, mesh, rules.grads, rules.params):
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


def make_train_step(cfg: Config, mesh, graphdef, shardings: TrainState,
                    rules: ZeroRules | None = None):
    """The pure train step, jitted with explicit in/out shardings and the state donated."""
    rules = rules or zero_rules(cfg.parallel.zero_stage, cfg.parallel.sequence_parallel)
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    schedule = lr_schedule(cfg.optim, cfg.train.steps)
    grads_and_loss = make_grad_fn(cfg, mesh, graphdef, rules)

    def train_step(state: TrainState, tokens):
        loss, grads = grads_and_loss(state.params, tokens)
        grad_norm = optax.tree.norm(grads)
        # ZeRO-1+: each data shard updates only its slice of the moments and the weights
        grads = jax.lax.with_sharding_constraint(grads, shardings_for(grads, rules.opt, mesh))
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step)}
        return TrainState(state.step + 1, params, opt_state), metrics

    batch_sh = NamedSharding(mesh, rules.compute.spec(("batch", None)))
    return jax.jit(train_step, in_shardings=(shardings, batch_sh),
                   out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)
