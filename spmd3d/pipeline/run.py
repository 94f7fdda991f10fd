"""Run a schedule's table (`table.Table`) per device, inside one shard_map over the stages.

Every schedule moves its values the same way, slot by slot, as its table says: a stage puts
each of its embedded microbatches on the input belt (moving one stage back per slot) in time
for stage 0's first forward of it; what a forward sends arrives at the next stage at the
slot's end and waits in an inbox slot, as does a cotangent sent back; a pass's residuals wait
in a stash slot from its forward to its backward; the input gradient stage 0's first chunk
hands back travels on a belt one stage ahead per slot to the stage that fed the microbatch in
(GPipe: the output travels back to the stage that runs its loss). Every buffer has the table's
number of slots, as many as values are live at once.

- `forward` (GPipe, `Table.mode` autodiff): forwards in lockstep; autodiff of the slot loop is
  the backward. The head and the loss run outside, spread over the stages.
- `train` (1F1B: lockstep lanes; ZB-H1: a switch): the backward runs inside the same loop,
  the loss head on the last stage, and the gradients come out of the loop, wrapped by
  `loss_and_grads` in a `jax.custom_vjp` so that the train step differentiates the pipelined
  loss as any other.

Inside the shard_map the stage axis is manual, and so are the data and ring axes where given
(the weights must not be split over them); other mesh axes stay automatic, so tensor
sharding propagates through unchanged. The weights turn varying over the data and ring axes
once, before the loop: the transpose of that cast is the one gradient all-reduce over them,
after the loop, instead of one per slot and layer.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from ..manual import select, unroll, vary, varying
from ..sharding import flat_axes as _flat, stack_specs
from ..untrained import Untrained
from .executor import Executor, zero_grads
from .state import Placement, State, feed_belt, put, rings, take
from .table import END, FORWARD, OP, Table
from .worker import Worker, consts_of, stage_results


def forward(blocks, x_in, consts, table: Table, axis: str, mesh, *, stage, active=None,
            batch_axis=None, seq_axis=None, stage_remat: bool = False, segments=None):
    """Every microbatch of `x_in` carried through all layers by an autodiff table (GPipe):
    the training forward pass, whose autodiff is the backward pipeline.

    `x_in`, and what comes back, are [p, mb, n, T, D] buffers split over the stage axis:
    stage s holds the microbatches `Schedule.feed()[:, s]` of the input and
    `Schedule.collect()[:, s]` of the output (slot j at [s, :, j]). `blocks`: the stacked
    layers in storage order ([L, ...] leaves); `consts`: `Positions`, the RoPE tables
    [1, T, ...]; `active`: None, or which stored layer slots hold a layer; `segments`: None,
    or packed documents' ids per microbatch [m, mb, T]. Every stage applies `stage(chunk, x,
    consts, active) -> x` to one chunk at every slot (consts with the microbatch's ids).

    What the backward keeps per slot: with one chunk per stage the chunk is picked statically,
    so its weights are loop-invariant and never saved per slot. With v > 1 the chunk is picked
    by a traced index; saved, that pick would be a copy of a chunk's weights per slot, so the
    pick and the stage are recomputed in the backward from the slot's input (a stage-level
    checkpoint), which `stage_remat` also asks for with v = 1. The belts and inboxes move by
    linear operations only, so the backward keeps nothing of them per slot."""
    p, v = table.stages, table.repeats
    chunks = jax.tree.map(lambda a: a.reshape((p, v, a.shape[0] // (p * v)) + a.shape[1:]), blocks)
    ahead, back = rings(p)
    on = None if active is None else jnp.asarray(np.asarray(active).reshape(p, v, -1))
    ops, ends = jnp.asarray(table.ops[:, :, 0]), jnp.asarray(table.ends)

    def run_stage(chunks, x, c, consts):
        chunk = jax.tree.map(lambda a: a[0] if v == 1 else a[c], chunks)
        mask = None if on is None else on[jax.lax.axis_index(axis), c]
        return stage(chunk, x, consts, mask)

    if stage_remat or v > 1:
        run_stage = jax.checkpoint(run_stage, prevent_cse=False,
                                   policy=jax.checkpoint_policies.nothing_saveable)

    def per_stage(chunks, x_in, consts, segments):
        # chunks[1, v, c, ...]: this stage's v chunks; x_in[1, mb, n, T, D]: its microbatches
        chunks, x_in = jax.tree.map(lambda a: a[0], chunks), x_in[0]
        chunks = jax.tree.map(lambda a: vary(a, _flat(batch_axis, seq_axis)), chunks)
        s = jax.lax.axis_index(axis)

        def tick(carry, t):
            inbox, feed, ret, out = carry
            op, end = dict(zip(OP, ops[t, s])), dict(zip(END, ends[t, s]))
            feed = feed_belt(x_in, feed, end["put"])
            x = select(op["x_at"] < 0, feed, take(inbox, op["x_at"]))
            c = jnp.maximum(op["chunk"], 0)
            y = run_stage(chunks, x, c, consts_of(consts, segments, op["mb"]))
            # the last virtual stage's output goes on the belt back to the stage keeping it
            ret = select((op["kind"] == FORWARD) & (s == p - 1) & (c == v - 1), y, ret)
            out = put(True, out, end["keep"], ret, axis=1)
            feed, ret = jax.lax.ppermute(jnp.stack([feed, ret]), axis, back)
            inbox = put(True, inbox, end["x_to"], jax.lax.ppermute(y, axis, ahead))
            return (inbox, feed, ret, out), None

        x0 = x_in[:, 0]
        carry = (jnp.zeros_like(x0, shape=(table.x_slots,) + x0.shape), x0, x0,
                 jnp.zeros_like(x_in))
        carry = jax.tree.map(lambda a: vary(a, [axis]), carry)
        out = jax.lax.scan(tick, carry, jnp.arange(table.ticks), unroll=unroll())[0][3]
        return out[None]

    buffer = P(axis, batch_axis, None, seq_axis)  # [p, mb, n, T, D]
    manual = set(_flat(axis, batch_axis, seq_axis))
    specs = stack_specs(chunks, axis, 2, manual)
    return jax.shard_map(per_stage, mesh=mesh, in_specs=(
        specs, buffer, P(None, seq_axis), P(None, batch_axis, seq_axis)),
        out_specs=buffer, axis_names=manual)(chunks, x_in, consts, segments)


def train(blocks, head, x_in, labels, consts, table: Table, axis: str, mesh, *, layer, loss,
          active, batch_axis, seq_axis, stage_remat, scan=True, split=None, segments=None):
    """(summed loss, (block grads, head grads, input grads)) by a lockstep or switch table.

    blocks[L, ...] in storage order (stage s's chunks together); `layer(params, x, consts,
    on[, zeros])` one layer under its remat policy; head: the head's weights (`loss(head, y,
    labels, consts)` is a microbatch's summed loss, with its layers' `consts`); x_in[p, mb, n,
    T, D]: the embedded microbatches laid out by `Schedule.feed`; labels: [m, mb, T] leaves on
    every stage; consts: `Positions` [1, T, ...];
    segments: None or packed documents' ids [m, mb, T], as the labels; `split` the model's
    tapped ops (`ops.split`), which a switch table's B and W need."""
    p, v = table.stages, table.repeats
    depth = jax.tree.leaves(blocks)[0].shape[0] // (p * v)  # layers per chunk
    on = None if active is None else jnp.asarray(np.asarray(active).reshape(p, v * depth))
    where = Placement(table, axis, _flat(axis, batch_axis, seq_axis), depth, stage_remat)
    manual = where.manual
    ops, ends = jnp.asarray(table.ops), jnp.asarray(table.ends)

    def per_stage(stack, head, x_in, labels, consts, segments):
        # stack[1, v * depth, ...]: this stage's layers; x_in[1, mb, n, T, D]: its microbatches
        stack, x_in = jax.tree.map(lambda a: a[0], stack), x_in[0]
        s = jax.lax.axis_index(axis)
        # the stage axis, and the experts' where they are split over it
        own = jax.tree.map(lambda a: varying(jax.typeof(a)) | {axis}, stack)
        head_own = jax.tree.map(lambda a: varying(jax.typeof(a)), head)
        # device-varying before the loop: each slot's gradients stay local, summed once after
        stack = jax.tree.map(lambda a: vary(a, where.others), stack)
        head = jax.tree.map(lambda a: vary(a, manual), head)
        x0 = x_in[:, 0]
        worker = Worker(stack, consts_of(consts, segments, 0), layer, depth, on, s, manual,
                        split if where.cut else None, unroll() or not scan)
        layout = worker.prepare(x0, where.cut)
        state = State.initial(where, worker, layout, x0, x_in, head,
                              partial(zero_grads, stack, manual))
        run = Executor(where, s, worker, loss, head, x_in, labels, consts, segments, stack,
                       state, ops, ends)
        for begin, stop, lanes_on, head_on in table.phases():
            state = jax.lax.scan(partial(run.slot, lanes_on=lanes_on,
                                         head_on=head_on or where.cut),
                                 state, jnp.arange(begin, stop), unroll=unroll())[0]
        return stage_results(*state.sums, state.belts.kept, manual, axis, own, head_own)

    # each stage gets its [L/p, ...] share of `blocks` (storage order) and of the buffers
    stacks = jax.tree.map(lambda a: a.reshape((p, a.shape[0] // p) + a.shape[1:]), blocks)
    buffer = P(axis, batch_axis, None, seq_axis)  # [p, mb, n, T, D]
    specs, head_specs = stack_specs(stacks, axis, 1, manual), stack_specs(head, None, 0, manual)
    per_mb = P(None, batch_axis, seq_axis)
    total, g_stack, g_head, dx = jax.shard_map(
        per_stage, mesh=mesh, axis_names=set(manual),
        in_specs=(specs, head_specs, buffer, jax.tree.map(lambda _: per_mb, labels),
                  P(None, seq_axis), per_mb),
        out_specs=(P(), specs, head_specs, buffer))(stacks, head, x_in, labels, consts,
                                                     segments)
    # gradients cast back to the parameters' dtypes
    g_blocks = jax.tree.map(lambda g, b: g.reshape(b.shape).astype(b.dtype), g_stack, blocks)
    return total, (g_blocks, jax.tree.map(lambda g, h: g.astype(h.dtype), g_head, head), dx)


def loss_and_grads(blocks, head, x_in, labels, consts, table: Table, axis: str, mesh, *,
                   forward, **kw):
    """The summed loss of every microbatch through the pipeline and the loss head, as a
    function of (blocks, head, x_in) whose gradient `train` computes by the table's own
    backward; `forward(blocks, head, x_in)` is the same loss without a gradient (the GPipe
    forward)."""
    @jax.custom_vjp
    def pipelined(blocks, head, x_in):
        return forward(blocks, head, x_in)

    def scaled(grads, ct):  # the gradients, times the loss's cotangent; not the statistics
        # that untrained state observes as its probes' gradients (the step scales those)
        def one(g):
            if isinstance(g, Untrained):
                return g
            return jax.tree.map(lambda a: (ct * a).astype(a.dtype), g)

        return jax.tree.map(one, grads, is_leaf=lambda x: isinstance(x, nnx.Variable))

    pipelined.defvjp(partial(train, labels=labels, consts=consts, table=table, axis=axis,
                             mesh=mesh, **kw), scaled)
    return pipelined(blocks, head, x_in)
