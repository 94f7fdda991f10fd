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
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..manual import select, store_if, unroll, vary, varying
from ..sharding import flat_axes as _flat, stack_specs
from .table import BACKWARD, END, FORWARD, FULL, IDLE, OP, WEIGHT, Table
from .worker import Worker, consts_of, head_grads, stage_results


def rings(p: int) -> tuple[list, list]:
    """`ppermute` pairs one stage ahead and one stage back round the ring of p stages."""
    return [(s, (s + 1) % p) for s in range(p)], [(s, (s - 1) % p) for s in range(p)]


def _take(buffer, slot):
    """Slot `slot` (-1: any) of every leaf of a slot-major buffer."""
    slot = jnp.maximum(slot, 0)
    return jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, slot, 0, False), buffer)


def _put(pred, buffer, slot, value, axis: int = 0):
    """`value` into slot `slot` of every leaf of `buffer` if `pred` (and the slot is >= 0)."""
    return jax.tree.map(lambda b, a: store_if(pred & (slot >= 0), b, jnp.maximum(slot, 0), a,
                                              axis), buffer, value)


def _feed(x_in, feed, put):
    """The input belt after this stage put its input slot `put` (>= 0) on it."""
    mine = jax.lax.dynamic_index_in_dim(x_in, jnp.maximum(put, 0), 1, keepdims=False)
    return select(put >= 0, mine, feed)


def forward(blocks, x_in, consts, table: Table, axis: str, mesh, *, stage, active=None,
            batch_axis=None, seq_axis=None, stage_remat: bool = False, segments=None):
    """Every microbatch of `x_in` carried through all layers by an autodiff table (GPipe):
    the training forward pass, whose autodiff is the backward pipeline.

    `x_in`, and what comes back, are [p, mb, n, T, D] buffers split over the stage axis:
    stage s holds the microbatches `Schedule.feed()[:, s]` of the input and
    `Schedule.collect()[:, s]` of the output (slot j at [s, :, j]). `blocks`: the stacked
    layers in storage order ([L, ...] leaves); `consts`: [1, T, ...] (RoPE tables); `active`:
    None, or which stored layer slots hold a layer; `segments`: None, or packed documents'
    ids per microbatch [m, mb, T]. Every stage applies `stage(chunk, x, consts, active) -> x`
    to one chunk at every slot (consts: the tables, and the microbatch's ids).

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
            feed = _feed(x_in, feed, end["put"])
            x = select(op["x_at"] < 0, feed, _take(inbox, op["x_at"]))
            c = jnp.maximum(op["chunk"], 0)
            y = run_stage(chunks, x, c, consts_of(consts, segments, op["mb"]))
            # the last virtual stage's output goes on the belt back to the stage keeping it
            ret = select((op["kind"] == FORWARD) & (s == p - 1) & (c == v - 1), y, ret)
            out = _put(True, out, end["keep"], ret, axis=1)
            feed, ret = jax.lax.ppermute(jnp.stack([feed, ret]), axis, back)
            inbox = _put(True, inbox, end["x_to"], jax.lax.ppermute(y, axis, ahead))
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
    ids = () if segments is None else (segments,)
    return jax.shard_map(per_stage, mesh=mesh, in_specs=(
        specs, buffer, P(None, seq_axis), (P(None, batch_axis, seq_axis),) * len(ids)),
        out_specs=buffer, axis_names=manual)(chunks, x_in, consts, ids)


class Inboxes(NamedTuple):
    x: jax.Array  # [x slots, mb, T, D]: activations waiting for their forward
    ct: jax.Array  # [ct slots, mb, T, D]: cotangents waiting for their backward


class Stash(NamedTuple):
    residuals: list  # [stash slots, layers per chunk, ...] leaves (stage remat: the input)
    inputs: object  # split: the projections' inputs, waiting for W ({} otherwise)
    taps: object  # split: the projections' output cotangents, waiting for W


class Belts(NamedTuple):
    feed: jax.Array  # the input belt, one stage back per slot
    give: jax.Array  # the input gradients' belt, one stage ahead per slot
    kept: jax.Array  # [mb, n, T, D]: the input gradients of the microbatches this stage fed


class Sums(NamedTuple):
    grads: object  # the stage's layers' gradients, fp32
    head: object  # the head's
    total: jax.Array  # the summed loss


class State(NamedTuple):
    inbox: Inboxes
    stash: Stash
    belts: Belts
    sums: Sums


class Done(NamedTuple):
    """What one operation hands back, a slot's worth (zeros where it has nothing)."""
    y: jax.Array  # sent ahead
    dx: jax.Array  # sent back
    residuals: list
    inputs: object
    taps: object
    grads: object
    head: object
    total: jax.Array
    dy: jax.Array  # the loss's gradient (the last virtual stage)


def train(blocks, head, x_in, labels, consts, table: Table, axis: str, mesh, *, layer, loss,
          active, batch_axis, seq_axis, stage_remat, scan=True, split=None, segments=None):
    """(summed loss, (block grads, head grads, input grads)) by a lockstep or switch table.

    blocks[L, ...] in storage order (stage s's chunks together); `layer(params, x, consts,
    on[, zeros])` one layer under its remat policy; head: the head's weights (`loss(head, y,
    labels)` is a microbatch's summed loss); x_in[p, mb, n, T, D]: the embedded microbatches
    laid out by `Schedule.feed`; labels[m, mb, T] on every stage; consts: [1, T, ...];
    segments: None or packed documents' ids [m, mb, T], as the labels; `split` the model's
    tapped ops (`ops.split`), which a switch table's B and W need."""
    p, v = table.stages, table.repeats
    depth = jax.tree.leaves(blocks)[0].shape[0] // (p * v)  # layers per chunk
    ahead, back = rings(p)
    on = None if active is None else jnp.asarray(np.asarray(active).reshape(p, v * depth))
    manual = _flat(axis, batch_axis, seq_axis)
    others = tuple(a for a in manual if a != axis)
    cut = table.mode == "switch"  # the backward split into B and W
    ops, ends = jnp.asarray(table.ops), jnp.asarray(table.ends)

    def per_stage(stack, head, x_in, labels, consts, segments):
        # stack[1, v * depth, ...]: this stage's layers; x_in[1, mb, n, T, D]: its microbatches
        stack, x_in = jax.tree.map(lambda a: a[0], stack), x_in[0]
        s = jax.lax.axis_index(axis)
        # the stage axis, and the experts' where they are split over it
        own = jax.tree.map(lambda a: varying(jax.typeof(a)) | {axis}, stack)
        # device-varying before the loop: each slot's gradients stay local, summed once after
        stack = jax.tree.map(lambda a: vary(a, others), stack)
        head = jax.tree.map(lambda a: vary(a, manual), head)
        x0 = x_in[:, 0]
        worker = Worker(stack, consts_of(consts, segments, 0), layer, depth, on, s, manual,
                        split if cut else None, unroll() or not scan)
        layout = worker.prepare(x0, cut)

        def zeros(shapes, vma=None):  # a buffer of stash slots per value, varying as it does
            vma = vma or [frozenset(manual)] * len(jax.tree.leaves(shapes))
            leaves, tree = jax.tree.flatten(shapes)
            return tree.unflatten([vary(jnp.zeros((table.stash_slots,) + r.shape, r.dtype),
                                        set(a) | {axis}) for r, a in zip(leaves, vma)])

        # what a pass stashes: its input alone under stage remat (the backward redoes the
        # forward), else its layers' residuals; split, also what its W waits for
        if stage_remat:
            residuals = zeros([jax.ShapeDtypeStruct(x0.shape, x0.dtype)],
                              [varying(jax.typeof(x0))])
        else:
            residuals = zeros([jax.ShapeDtypeStruct((depth,) + r.shape, r.dtype)
                               for r in layout.shapes], layout.vma)
        inputs = taps = {}
        if cut:
            inputs = zeros(jax.eval_shape(lambda x: worker.forward(x, 0, True)[2], x0))
            taps = zeros(jax.tree.map(lambda z: jax.ShapeDtypeStruct((depth,) + z.shape, z.dtype),
                                      worker.zeros))

        def grad_zeros():
            return jax.tree.map(lambda a: vary(jnp.zeros_like(a, jnp.float32), manual), stack)

        small = (jnp.zeros((table.x_slots,) + x0.shape, x0.dtype),
                 jnp.zeros((table.ct_slots,) + x0.shape, x0.dtype), x0, x0, jnp.zeros_like(x_in),
                 jax.tree.map(jnp.zeros_like, head), jnp.zeros_like(x0, jnp.float32, shape=()))
        box_x, box_ct, feed, give, kept, head0, total0 = jax.tree.map(
            lambda a: vary(a, manual), small)
        state = State(Inboxes(box_x, box_ct), Stash(residuals, inputs, taps),
                      Belts(feed, give, kept), Sums(grad_zeros(), head0, total0))

        def nothing(buffer):  # zeros shaped (and varying) as one slot of `buffer`
            return jax.tree.map(lambda b: jnp.zeros_like(b[0]), buffer)

        like = dict(y=box_x, dx=box_x, residuals=residuals, inputs=inputs, taps=taps, dy=box_x)

        def done(**given) -> Done:
            """An operation's results, each varying as the buffer it goes to (a constant
            residual, as the gathered attention's key positions, is invariant); shaped by the
            buffers before the loop, never by a carried one."""
            out = {}
            for name, buffer in like.items():
                value = given.get(name)
                out[name] = nothing(buffer) if value is None else jax.tree.map(
                    lambda a, b: vary(a, varying(jax.typeof(b))), value, nothing(buffer))
            return Done(grads=given.get("grads", grad_zeros()),
                        head=given.get("head", jax.tree.map(jnp.zeros_like, head0)),
                        total=given.get("total", jnp.zeros_like(total0)), **out)

        # the operations: each sees one slot of each buffer (read before it) and hands back
        # one slot's worth (written after it), so that no buffer passes through a switch
        # (XLA:CPU copies every buffer a conditional inside a loop updates in place)
        def op_forward(op, x, ct, held, head_on=True):
            y, res, ins = worker.forward(x, op["c"], cut, consts_of(consts, segments, op["mb"]))
            if not head_on:
                return done(y=y, residuals=[x] if stage_remat else res)
            total, dy, d_head = head_grads(loss, head, labels, y, op["mb"],
                                           (op["kind"] == FORWARD) & (op["dy_to"] >= 0), manual)
            return done(y=y, residuals=[x] if stage_remat else res,
                        inputs=None if stage_remat else ins, head=d_head, total=total, dy=dy)

        def op_backward(op, x, ct, held, grads=None):
            residuals, inputs = held[0], None
            known = consts_of(consts, segments, op["mb"])
            if stage_remat:  # the forward again, from the chunk's input
                _, residuals, inputs = worker.forward(residuals[0], op["c"], cut, known)
            dx, d_taps, grads = worker.backward(ct, residuals, op["c"],
                                                grad_zeros() if grads is None else grads, cut,
                                                known)
            return done(dx=dx, inputs=inputs, taps=d_taps, grads=grads)

        def op_weight(op, x, ct, held):
            return done(grads=worker.weight(held[1], held[2], op["c"], grad_zeros()))

        def op_idle(op, x, ct, held):
            return done()

        def lane(state, op, feed, lane_index, head_on):
            """One lane's operation: a lockstep lane computes whatever its kind (a bubble
            forward stores nothing, a bubble backward gets a zero cotangent), a switch runs
            only the stage's own."""
            kinds = table.lane_kinds(lane_index)
            x = select(op["x_at"] < 0, feed, _take(state.inbox.x, op["x_at"]))
            ct = _take(state.inbox.ct, op["ct_at"])
            held = tuple(_take(buffer, op["stash"]) for buffer in state.stash)
            if cut:
                branch = jnp.asarray([kinds.index(k) if k in kinds else 0 for k in range(5)])
                fns = {IDLE: op_idle, FORWARD: op_forward, BACKWARD: op_backward,
                       WEIGHT: op_weight}
                return jax.lax.switch(branch[op["kind"]], [fns[k] for k in kinds], op, x, ct, held)
            if FORWARD in kinds:
                return op_forward(op, x, ct, held, head_on)
            ct = select(op["kind"] == FULL, ct, jnp.zeros_like(ct))
            return op_backward(op, x, ct, held, grads=state.sums.grads)

        def slot(state, t, lanes_on, head_on):
            end = dict(zip(END, ends[t, s]))
            feed = _feed(x_in, state.belts.feed, end["put"])
            give, y, dx = state.belts.give, None, None
            for k, on_ in enumerate(lanes_on):
                if not on_:
                    continue
                kinds = table.lane_kinds(k)
                op = dict(zip(OP, ops[t, s, k]))
                op["c"] = jnp.maximum(op["chunk"], 0)
                out = lane(state, op, feed, k, head_on)
                kind, at = op["kind"], op["stash"]
                inbox, stash, sums = state.inbox, state.stash, state.sums
                if FORWARD in kinds:
                    y = out.y
                    stash = stash._replace(residuals=_put(kind == FORWARD, stash.residuals, at,
                                                          out.residuals))
                    if head_on:  # the loss's gradient, for this pass's backward
                        inbox = inbox._replace(ct=_put(kind == FORWARD, inbox.ct, op["dy_to"],
                                                       out.dy))
                        sums = sums._replace(head=jax.tree.map(jnp.add, sums.head, out.head),
                                             total=sums.total + out.total)
                if cut:  # what W waits for
                    stash = stash._replace(
                        inputs=_put(kind == (BACKWARD if stage_remat else FORWARD),
                                    stash.inputs, at, out.inputs),
                        taps=_put(kind == BACKWARD, stash.taps, at, out.taps))
                if FULL in kinds:  # added in place by the backward
                    sums = sums._replace(grads=out.grads)
                elif cut:
                    sums = sums._replace(grads=jax.tree.map(jnp.add, sums.grads, out.grads))
                if {BACKWARD, FULL} & set(kinds):
                    dx = out.dx
                    # stage 0's first chunk's backward gave microbatch i's input gradient:
                    # onto the belt to its stage
                    give = select((s == 0) & ((kind == BACKWARD) | (kind == FULL))
                                  & (op["chunk"] == 0), dx, give)
                state = state._replace(inbox=inbox, stash=stash, sums=sums)
            inbox = state.inbox
            if y is not None:
                inbox = inbox._replace(x=_put(True, inbox.x, end["x_to"],
                                              jax.lax.ppermute(y, axis, ahead)))
                feed = jax.lax.ppermute(feed, axis, back)
            if dx is not None:
                inbox = inbox._replace(ct=_put(True, inbox.ct, end["ct_to"],
                                               jax.lax.ppermute(dx, axis, back)))
            kept = _put(True, state.belts.kept, end["keep"], give, axis=1)
            belts = Belts(feed, jax.lax.ppermute(give, axis, ahead), kept)
            return state._replace(inbox=inbox, belts=belts), None

        for begin, stop, lanes_on, head_on in table.phases():
            state = jax.lax.scan(partial(slot, lanes_on=lanes_on, head_on=head_on or cut),
                                 state, jnp.arange(begin, stop), unroll=unroll())[0]
        return stage_results(*state.sums, state.belts.kept, manual, axis, own)

    # each stage gets its [L/p, ...] share of `blocks` (storage order) and of the buffers
    stacks = jax.tree.map(lambda a: a.reshape((p, a.shape[0] // p) + a.shape[1:]), blocks)
    buffer = P(axis, batch_axis, None, seq_axis)  # [p, mb, n, T, D]
    specs = stack_specs(stacks, axis, 1, manual)
    ids = () if segments is None else (segments,)
    per_mb = P(None, batch_axis, seq_axis)
    total, g_stack, g_head, dx = jax.shard_map(
        per_stage, mesh=mesh, axis_names=set(manual),
        in_specs=(specs, P(), buffer, per_mb, P(None, seq_axis), (per_mb,) * len(ids)),
        out_specs=(P(), specs, P(), buffer))(stacks, head, x_in, labels, consts, ids)
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

    def scaled(grads, ct):  # the gradients, times the loss's cotangent
        return jax.tree.map(lambda g: (ct * g).astype(g.dtype), grads)

    pipelined.defvjp(partial(train, labels=labels, consts=consts, table=table, axis=axis,
                             mesh=mesh, **kw), scaled)
    return pipelined(blocks, head, x_in)
