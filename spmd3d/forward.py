"""The forward pass of a step: the model's parts composed with the plan's schedule. Embed ->
the dense layers before the stack (if any) -> the layer stack (one `lax.scan`, or the pipeline
over `stage`) -> head and loss, summed over a [B, T+1] token block (`loss_sum`); how a block's
tokens become inputs, labels and packed documents' ids (`labelled`)."""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from . import attention, mtp, pipeline
from . import ops as ops_lib
from .manual import psum, unroll, vary, without
from .ops import Ops
from .pipeline import run as pipelined
from .plan import Plan
from .sharding import activation_rules, flat_axes, mesh_axes, stack_specs, use_param


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


def _outer_ops(plan: Plan) -> Ops:
    """The ops of layers outside a pipeline's shard_map (all of them without a pipeline; the
    dense ones before it): the plan's attention kernel, the ring where it is ZB-H1's gather
    (which runs only inside)."""
    kind = "ring" if plan.attention == "gather" else plan.attention
    return Ops(attention.select(kind, plan.rules.compute["length"], plan.mesh,
                                tile=plan.cfg.model.attention_tile, local=plan.attention_local))


def _slot_map(plan: Plan, fn, weights, slots, rope, summed: bool = False):
    """`fn(weights, slot, rope, ops)` on each of n slots (a pytree of [n, rows, T, ...]
    leaves: the rows over `stage` and the batch's axes) one at a time, per device, manual
    over the rows' axes and the ring's, as a pipeline's stage runs (`ops`: its attention,
    the ring's per-device kernel): a slot's working set at a time, and the weights'
    gradient summed over those axes once, not once per slot. `summed`: `fn` returns a number,
    summed over the slots and the devices, and `weights` may hold stacks ([K, ...]: MTP's
    depths), whose expert weights keep their experts split where that axis is manual
    (`stack_specs`); else `fn` returns the slot's new first leaf, with `weights` whole."""
    rules = plan.rules
    seq_axis = rules.compute["length"] if plan.attention in attention.SPLIT else None
    rows_axes = flat_axes(rules.compute["layers"], rules.compute["batch"])
    manual = rows_axes + mesh_axes(seq_axis)
    inner = without(rules.compute, manual)
    ops = Ops(attention.select(plan.attention, seq_axis, plan.mesh, manual=True,
                               tile=plan.cfg.model.attention_tile, local=plan.attention_local))
    tokens = P(None, rows_axes, seq_axis)
    specs = stack_specs(weights, None, 0, manual) if summed else P()

    def per_device(weights, slots, rope):
        weights = jax.tree.map(lambda a: vary(a, manual), weights)  # summed at the boundary
        with activation_rules(inner, None, inner):
            out = jax.lax.map(lambda slot: fn(weights, slot, rope, ops), slots)
        return psum(jnp.sum(out), manual) if summed else out

    return jax.shard_map(per_device, mesh=plan.mesh, axis_names=set(manual),
                         in_specs=(specs, jax.tree.map(lambda _: tokens, slots),
                                   P(None, seq_axis)),
                         out_specs=P() if summed else tokens)(weights, slots, rope)


def _dense_by_slot(plan: Plan, model, x, rope, segments):
    """The dense layers before a pipeline on x[n, rows, T, D]: n slots of rows, the rows over
    `stage` and the batch's axes. Layer by layer: each layer's weights are gathered once (over
    `stage`, where the tables outside the pipeline are split, and ZeRO-3's data; in the
    parameter dtype, so that the slots' gradients sum in it), then run on one slot at a time
    (`_slot_map`). Under a remat policy each layer keeps its input alone; its backward gathers
    again, runs the slots forward and back (each slot's layer recomputed by its own policy)
    and reduces the gradient. Gathered and reduced inside the slot loop instead, the weights
    crossed `stage` once per slot and pass: 64.5 GB of gathers and 25.4 GB of reductions a
    step at DeepSeek-V3's preset."""
    par = plan.cfg.parallel

    def one(params, slot, rope, ops):
        x, seg = slot
        return model.layer(_layer_remat(par.remat), ops, model.dense)(
            params, x, rope._replace(segments=seg))

    def layer(x, params):
        return _slot_map(plan, one, _gather_blocks(params), (x, segments), rope), None

    if par.remat != "none":
        layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable,
                               prevent_cse=False)
    with jax.named_scope("dense_layers"):
        return jax.lax.scan(layer, x, nnx.state(model.dense),
                            unroll=unroll() or not par.scan_layers)[0]


def _pipelined_loss(plan: Plan, graphdef, params, inputs, targets, positions, segments=None):
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

    def by_slots(a):  # [p, mb, n, T, ...] <-> [n, p * mb, T, ...]: one slot of every stage
        a = jnp.moveaxis(a, 2, 0)
        return a.reshape((a.shape[0], -1) + a.shape[3:])

    def unslots(a):
        return jnp.moveaxis(a.reshape((a.shape[0], p, -1) + a.shape[2:]), 0, 2)

    tokens, rope = slots(inputs, 0, collect=False), model.rope(positions)
    # packed documents: each microbatch's ids, on every stage ([m, mb, T], as the labels)
    per_mb = NamedSharding(plan.mesh, P(None, data, rules.compute["length"]))
    segments_bt = segments
    segments = None if segments is None else jax.lax.with_sharding_constraint(
        microbatches(segments, m), per_mb)
    with activation_rules(outer, plan.mesh, rules.grads):
        x = unrows(model.embed_tokens(rows(tokens)), tokens.shape[2])
        if model.dense is not None:  # the dense layers before the stack, where the embedding
            # runs: one slot of every stage at a time
            seg = None if segments_bt is None else by_slots(slots(segments_bt, 0, False))
            x = unslots(_dense_by_slot(plan, model, by_slots(x), rope, seg))
    # inside the pipeline's shard_map, constraints resolve against its context mesh
    # (no manual axis in them: the tables outside the pipeline split over `stage` are used
    # inside it whole, the head's gradient summed by the shard_map)
    grads = inner if batch_axis is not None else without(rules.grads, flat_axes(axis, seq_axis))
    where = dict(active=plan.active, batch_axis=batch_axis, seq_axis=seq_axis,
                 stage_remat=par.remat == "stage", segments=segments)

    depths = _depths(model, par)

    def gpipe_loss(blocks, head, x):  # the GPipe forward, then the head and loss on every stage
        with activation_rules(inner, None, grads):
            x = pipelined.forward(blocks, x, rope, replace(schedule, kind="gpipe").table(), axis,
                                  plan.mesh, stage=stage, **where)
        with activation_rules(outer, plan.mesh, rules.grads):
            out = jax.tree.map(lambda a: slots(a, -1, collect=True), targets)
            total = model.loss_with(head, rows(x), rows(out["labels"]), par.loss_chunk)[0]
        if depths is None:
            return total
        # multi-token prediction's depths one slot of every stage at a time (an MoE layer's
        # balancing statistics are a microbatch's, as in the stack)
        seg = None if segments_bt is None else by_slots(slots(segments_bt, 0, collect=True))
        return total + _slot_map(
            plan, lambda w, slot, rope, ops: depths(w, slot[0], slot[1], rope._replace(
                segments=slot[2]), ops),
            head, (by_slots(x), jax.tree.map(by_slots, out), seg), rope, summed=True)

    if not schedule.head_inside:
        return gpipe_loss(blocks, model.head_weights(), x)
    # 1F1B and ZB-H1: the head runs on the last stage inside the schedule, which needs every
    # label there
    targets_mb = jax.tree.map(
        lambda a: jax.lax.with_sharding_constraint(microbatches(a, m), per_mb), targets)
    # ZB-H1 splits each layer's backward with the ops tapped
    split = ops_lib.split(model, ops)
    with activation_rules(inner, None, grads):
        return pipelined.loss_and_grads(
            blocks, model.head_weights(), x, targets_mb, rope, schedule.table(), axis,
            plan.mesh, layer=model.layer(_layer_remat(par.remat), ops), scan=par.scan_layers,
            forward=gpipe_loss, split=split, loss=after_stack(model, par, ops), **where)


def token_ids(tokens_bt1):
    """The ids of a token block, a token stored as -(id + 1) (not trained on as a label) too."""
    return jnp.where(tokens_bt1 < 0, -tokens_bt1 - 1, tokens_bt1)


def labelled(tokens_bt1, eot: int | None):
    """(inputs[B, T], labels[B, T], segments[B, T] or None) of a [B, T+1] token block. A token
    stored as -(id + 1) is not trained on as a label (chat data: the prompts'); with packed
    documents ending in `eot`, each input position's document within the window (a document
    holds its end-of-text token), and the label after an end of text (the next document's
    first token, which nothing in the document predicts) is not trained on either, so each
    document trains as it would alone. A label not trained on is -1."""
    ids = token_ids(tokens_bt1)
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


def _depths(model, par):
    """`loss(weights, y, targets, rope, ops)`: multi-token prediction's depths' summed loss
    after the stack's output y (`mtp.loss_sum`), their layers run with `ops`; None when off."""
    if model.mtp is None:
        return None

    def loss(weights, y, targets, rope, ops):
        return mtp.loss_sum(model, weights, y, targets["ids"], targets["ahead"], rope,
                            model.layer(_layer_remat(par.remat), ops, model.mtp),
                            par.loss_chunk)

    return loss


def after_stack(model, par, ops: Ops):
    """`loss(weights, y, targets, rope) -> summed loss` of the stack's output y: the head's
    next-token loss, and multi-token prediction's depths' (`_depths`), with the head's stored
    `weights` (`model.head_weights`), `targets` as `_targets` makes them and `rope` the
    `Positions` of y's tokens (the depths' layers use them). The one loss wherever the head
    runs: after the stack, or per microbatch on a 1F1B or ZB-H1 pipeline's last stage (after
    GPipe's, the depths run per slot: `_pipelined_loss`)."""
    depths = _depths(model, par)

    def loss(weights, y, targets, rope):
        total = model.loss_with(weights, y, targets["labels"], par.loss_chunk)[0]
        return total if depths is None else total + depths(weights, y, targets, rope, ops)

    return loss


def _targets(plan: Plan, tokens_bt1, labels, segments) -> dict:
    """What the loss after the stack compares with, [B, T] leaves: {"labels"}, and with
    multi-token prediction the depths' "ids" and "ahead" labels (K each, `mtp.targets`)."""
    depths = plan.cfg.model.mtp_layers
    if not depths:
        return {"labels": labels}
    ids, ahead = mtp.targets(token_ids(tokens_bt1), labels, segments, depths)
    return {"labels": labels, "ids": ids, "ahead": ahead}


def loss_sum(plan: Plan, graphdef, params, tokens_bt1):
    """Summed next-token cross-entropy (fp32) over a [B, T+1] token block, and the count."""
    inputs, labels, segments = labelled(tokens_bt1, plan.eot)
    targets = _targets(plan, tokens_bt1, labels, segments)
    positions = np.arange(inputs.shape[1])
    if plan.seq_order is not None:  # zig-zag under ring attention: a permutation
        positions = np.asarray(plan.seq_order)
        inputs = inputs[:, positions]
        segments = None if segments is None else segments[:, positions]
        targets = jax.tree.map(lambda a: a[:, positions], targets)
    if plan.pipelined:
        return _pipelined_loss(plan, graphdef, params, inputs, targets, positions,
                               segments), labels.size
    # storage order is canonical without a pipeline
    model, par, ops = nnx.merge(graphdef, params), plan.cfg.parallel, _outer_ops(plan)
    run = model.layers(_layer_remat(par.remat), par.scan_layers, ops)
    if par.remat == "stage":  # the whole stack is the one stage: keep only its input
        run = jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable,
                             prevent_cse=False)
    rope = model.rope(positions, segments)
    x = model.dense_layers(_layer_remat(par.remat), par.scan_layers, ops)(
        model.embed_tokens(inputs), rope)
    x = run(nnx.state(model.blocks), x, rope)
    return after_stack(model, par, ops)(model.head_weights(), x, targets, rope), labels.size
