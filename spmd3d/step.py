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

from dataclasses import replace
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from . import attention, pipeline
from . import ops as ops_lib
from .manual import without
from .ops import Ops
from .pipeline import run as pipelined
from .model import Transformer, abstract_model
from .optim import lr_schedule, make_optimizer
from .plan import Plan
from .sharding import activation_rules, constrain, flat_axes, mesh_axes, shardings_for, use_param
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


# ---------------------------------------------------------------------------------------------
# forward: the model's parts composed with the schedule

def _layer_remat(policy: str) -> str:
    """The per-layer remat policy: `stage` checkpoints whole stages and, while the backward
    recomputes one, keeps each layer's input alone (each layer is then recomputed again for
    its own backward): the least memory -- one stage input per tick, one layer's working set --
    for two extra forward passes. Inside the recompute, keeping every layer's residuals instead
    would hold a whole stage's attention scores at once (docs/choices.md has the figures)."""
    return "full" if policy == "stage" else policy


def microbatches(a, m: int):
    """[B, ...] -> [m, B/m, ...]: microbatch j holds rows j, j+m, j+2m, ... so that each data
    shard (a block of rows) keeps its own rows in every microbatch."""
    return a.reshape((a.shape[0] // m, m) + a.shape[1:]).swapaxes(0, 1)


def by_slot(micro, schedule: pipeline.Schedule, pad, collect: bool):
    """[m, mb, ...] microbatches -> [n, p, mb, ...] as `schedule.feed()` (or `collect()`)
    places them, `pad` in the empty places: a reshape, with the padding at the end (at the
    front, and the slots reversed, for `collect`), so no data moves between devices."""
    n, p = schedule.feed().shape
    extra = jnp.full((n * p - micro.shape[0],) + micro.shape[1:], pad, micro.dtype)
    a = jnp.concatenate([extra, micro] if collect else [micro, extra])
    a = a.reshape((n, p) + micro.shape[1:])
    return a[::-1] if collect else a


def _gather_blocks(blocks):
    """ZeRO-3 under a pipeline: each stage's layers gathered over data once per step, before
    the schedule, and their gradients reduce-scattered back once, after it. Gathered per layer
    inside the tick loop instead, a stage's weights would cross the data axis three times per
    tick (forward, recompute, backward), a hundred times the bytes at LLaMA-3 405B's preset
    (docs/choices.md). The price: the stage's weights and their gradient accumulator, unsharded
    over data, for the step. Both stay in the parameter dtype:
    the layers cast per tick, so gradients accumulate over the microbatches in fp32, as with
    ZeRO-0 to 2. `parallel.zero3_gather=tick` keeps the per-layer gathers instead."""
    def gather(v):
        names = v.get_metadata("axes")
        return jax.tree.map(lambda a: use_param(a, names, a.dtype), v)

    return jax.tree.map(gather, blocks, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _pipelined_loss(plan: Plan, graphdef, params, inputs, labels, positions, segments=None):
    """Summed loss through the pipeline. The microbatches are laid out over the stages
    ([p, mb, n, T] by `Schedule.feed` and `collect`), so the embedding before the pipeline
    and the head and loss after it run on the whole mesh, each stage taking its share of the
    microbatches: once per microbatch, not once per tick on every stage, and the embedding
    is the plain sharded lookup. In the pipeline, besides `stage`, the data axis (gradients
    are then reduced once, not per tick; under ZeRO-3 once the layers are gathered, see
    `_gather_blocks`, else it stays automatic) and the ring axis go manual; inside, the rules
    drop those axes and attention runs the per-device ring (a nested shard_map would mix the
    two levels' manual axes)."""
    rules, par, schedule = plan.rules, plan.cfg.parallel, plan.schedule
    blocks, batch_axis, seq_axis = params["blocks"], None, None
    once = rules.params_over_batch and par.zero3_gather == "step"
    if once:
        blocks = _gather_blocks(blocks)
    if once or not rules.params_over_batch:
        # (the experts' axis is one of the batch's, expert parallelism: `experts` whole inside)
        batch_axis = rules.compute["batch"]
    if plan.attention in attention.SPLIT:
        seq_axis = rules.compute["length"]
    inner = without(rules.compute, flat_axes(batch_axis, seq_axis))
    ops = Ops(attention.select(plan.attention, seq_axis, plan.mesh, manual=True,
                               tile=plan.cfg.model.attention_tile, local=plan.attention_local))
    model = nnx.merge(graphdef, params)
    stage = model.layers(_layer_remat(par.remat), par.scan_layers, ops)
    axis, (p, m) = rules.compute["layers"], (schedule.stages, schedule.microbatches)
    data = rules.compute["batch"]
    # outside the pipeline, rows of a slot [p * mb] split over stage and data together
    outer = rules.compute.with_(batch=(axis, *mesh_axes(data)))

    def slots(a, pad, collect):  # [B, T] -> [p, mb, n, T], the stages' slots (tokens: small)
        a = jnp.moveaxis(by_slot(microbatches(a, m), schedule, pad, collect), 0, 2)
        spec = P(axis, data, None, rules.compute["length"])
        return jax.lax.with_sharding_constraint(a, NamedSharding(plan.mesh, spec))

    def rows(a):  # [p, mb, n, T, ...] <-> [p * mb * n, T, ...]: rows over (stage, data), no copy
        return a.reshape((-1,) + a.shape[3:])

    def unrows(a, n):
        return a.reshape((p, -1, n) + a.shape[1:])

    tokens, rope = slots(inputs, 0, collect=False), model.rope(positions)
    # packed documents: each microbatch's ids, on every stage ([m, mb, T], as the labels)
    per_mb = NamedSharding(plan.mesh, P(None, data, rules.compute["length"]))
    segments = None if segments is None else jax.lax.with_sharding_constraint(
        microbatches(segments, m), per_mb)
    with activation_rules(outer, plan.mesh, rules.grads):
        x = unrows(model.embed_tokens(rows(tokens)), tokens.shape[2])
    # inside the pipeline's shard_map, constraints resolve against its context mesh
    grads = inner if batch_axis is not None else rules.grads  # no manual axis in them
    where = dict(active=plan.active, batch_axis=batch_axis, seq_axis=seq_axis,
                 stage_remat=par.remat == "stage", segments=segments)

    def gpipe_loss(blocks, head, x):  # the GPipe forward, then the head and loss on every stage
        with activation_rules(inner, None, grads):
            x = pipelined.forward(blocks, x, rope, replace(schedule, kind="gpipe").table(), axis,
                                  plan.mesh, stage=stage, **where)
        with activation_rules(outer, plan.mesh, rules.grads):
            y, labels_out = rows(x), rows(slots(labels, -1, collect=True))
            return model.loss_with(head, y, labels_out, par.loss_chunk)[0]

    if not schedule.head_inside:
        return gpipe_loss(blocks, model.head_weights(), x)
    # 1F1B and ZB-H1: the head runs on the last stage inside the schedule, which needs every
    # label there
    labels_mb = jax.lax.with_sharding_constraint(microbatches(labels, m), per_mb)
    # ZB-H1 splits each layer's backward with the ops tapped
    split = ops_lib.split(model, ops)
    with activation_rules(inner, None, grads):
        return pipelined.loss_and_grads(
            blocks, model.head_weights(), x, labels_mb, rope, schedule.table(), axis, plan.mesh,
            layer=model.layer(_layer_remat(par.remat), ops), scan=par.scan_layers,
            forward=gpipe_loss, split=split, **where,
            loss=lambda head, y, lab: model.loss_with(head, y, lab, par.loss_chunk)[0])


def labelled(tokens_bt1, eot: int | None):
    """(inputs[B, T], labels[B, T], segments[B, T] or None) of a [B, T+1] token block. A token
    stored as -(id + 1) is not trained on as a label (chat data: the prompts'); with packed
    documents ending in `eot`, each input position's document within the window (a document
    holds its end-of-text token), and the label after an end of text (the next document's
    first token, which nothing in the document predicts) is not trained on either, so each
    document trains as it would alone. A label not trained on is -1."""
    ids = jnp.where(tokens_bt1 < 0, -tokens_bt1 - 1, tokens_bt1)
    inputs, labels = ids[:, :-1], jnp.where(tokens_bt1[:, 1:] < 0, -1, ids[:, 1:])
    if eot is None:
        return inputs, labels, None
    ends = (inputs == eot).astype(jnp.int32)
    return inputs, jnp.where(ends > 0, -1, labels), jnp.cumsum(ends, axis=1) - ends


def label_count(plan: Plan, tokens_bt1):
    """How many labels a [B, T+1] token block trains on (`labelled`): a number known when
    compiling without packed documents (no sum over the batch's devices, nothing scaled by a
    value computed in the step)."""
    if plan.eot is None:
        return tokens_bt1.shape[0] * (tokens_bt1.shape[1] - 1)
    return jnp.sum(labelled(tokens_bt1, plan.eot)[1] >= 0)


def loss_sum(plan: Plan, graphdef, params, tokens_bt1):
    """Summed next-token cross-entropy (fp32) over a [B, T+1] token block, and the count."""
    inputs, labels, segments = labelled(tokens_bt1, plan.eot)
    positions = np.arange(inputs.shape[1])
    if plan.seq_order is not None:  # zig-zag under ring attention: a permutation
        positions = np.asarray(plan.seq_order)
        inputs, labels = inputs[:, positions], labels[:, positions]
        segments = None if segments is None else segments[:, positions]
    if plan.pipelined:
        return _pipelined_loss(plan, graphdef, params, inputs, labels, positions,
                               segments), labels.size
    # storage order is canonical without a pipeline
    model, par = nnx.merge(graphdef, params), plan.cfg.parallel
    ops = Ops(attention.select(plan.attention, plan.rules.compute["length"], plan.mesh,
                               tile=plan.cfg.model.attention_tile, local=plan.attention_local))
    run = model.layers(_layer_remat(par.remat), par.scan_layers, ops)
    if par.remat == "stage":  # the whole stack is the one stage: keep only its input
        run = jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable,
                             prevent_cse=False)
    x = run(nnx.state(model.blocks), model.embed_tokens(inputs), model.rope(positions, segments))
    return model.loss(x, labels, par.loss_chunk)


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
