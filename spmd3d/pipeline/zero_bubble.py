"""Zero-bubble ZB-H1 (Qi et al. 2023): the backward split into B and W, W filling the bubble.

A layer's backward is two pieces of work: B, the input's gradient (which the stage before
waits for), and W, the weights' gradient (which nobody waits for). B is the layer
differentiated with respect to its input and to zero taps added to its projections' outputs
(`model.Taps`): the taps' cotangents are the projections' output gradients dy, and XLA drops
the x^T dy products B does not return. W is later the vjp of the projections alone at (x, dy).
Deferring W lets each B go back to the stage before at once, so the cool-down's cotangents
stream back one stage per slot while the deferred W's fill what were idle slots.

The schedule is a table: each stage runs an ordered list of operations (V - s forwards, then
for each pass its B, the W deferred by s passes, and the next forward), each as soon as what it
needs has arrived. With v chunks per stage (`parallel.pipeline_repeats`; chunk c of stage s is
virtual stage c p + s of V = v p, as interleaved 1F1B) a pass is one chunk of one microbatch,
and a stage runs its passes in interleaved 1F1B's order: microbatches in groups of p, each
group through chunks 0..v-1 forward and v-1..0 backward. With unit costs per chunk operation
that takes 3vm + p - 1 slots (`zb_table`) against 1F1B's lockstep 3(vm + p - 1), and every
stage holds at most V passes between a forward and its W: p stages' worth of activations, 1F1B's
peak (interleaved 1F1B keeps 2V - 1). Unlike the lockstep schedules each device runs its own
operation in a slot (`lax.switch` over idle/F/B/W, nothing computed in an idle slot), then four
`ppermute`s move what was sent: activations ahead (stage p - 1's chunk c on to stage 0's
chunk c + 1), cotangents back, the embedded inputs (a belt bringing microbatch i to stage 0 in
the slot of its first forward) and the input gradients (a belt taking them to the stage that fed
the microbatch in). What arrives before it is used waits in an inbox; residuals, projection
inputs and taps' cotangents wait in a stash. The table gives every value its buffer slot, as
few slots as values live at once (`zb_table`), so buffers hold exactly the table's peak.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..manual import select, store_if, unroll, vary, varying
from . import (Schedule, head_grads, rebuild, rings, run_stages, split_residuals,
               stage_results)
from .zb_table import BACKWARD, FIELDS, FORWARD, zb_table


def _is_projection(path, names) -> bool:
    return any(getattr(k, "key", getattr(k, "name", None)) in names for k in path)


def train(blocks, head, x_in, labels, consts, schedule: Schedule, axis: str, mesh, *, layer,
          split, loss, active, batch_axis, seq_axis, stage_remat, scan=True):
    """(summed loss, (block grads, head grads, input grads)) by ZB-H1, per device in a shard_map
    manual over `axis` (and `batch_axis`, `seq_axis` where given), as `one_f_one_b._train`.
    `split` = (tap_shapes, projection_grads, projection weight names) from the model."""
    tap_shapes, projection_grads, projections = split
    p, m, v = schedule.stages, schedule.microbatches, schedule.repeats
    table = zb_table(p, m, v)
    stash_slots, rows = table.stash_slots, jnp.asarray(table.rows)
    depth = jax.tree.leaves(blocks)[0].shape[0] // (p * v)  # layers per chunk
    ahead, back = rings(p)
    on = None if active is None else jnp.asarray(np.asarray(active).reshape(p, v * depth))
    manual = tuple(a for a in (axis, batch_axis, seq_axis) if a is not None)
    others = tuple(a for a in manual if a != axis)
    unrolled = unroll() or not scan

    def per_stage(stack, head, x_in, labels, consts):
        stack, x_in = jax.tree.map(lambda a: a[0], stack), x_in[0]
        s = jax.lax.axis_index(axis)
        stack = jax.tree.map(lambda a: vary(a, others), stack)
        head = jax.tree.map(lambda a: vary(a, manual), head)
        x0 = x_in[:, 0]

        def weights(k):
            return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, k, 0, False), stack)

        taps = tap_shapes(weights(0), x0, consts)
        zeros = {k: vary(jnp.zeros(v.shape, v.dtype), manual) for k, v in taps.items()}
        box = {}

        def forward(x, c):
            """Chunk c's layers from x: (y, [residuals stacked per layer], the projections'
            inputs stacked per layer)."""
            def body(x, j):
                k = c * depth + j
                w = weights(k)
                y, vjp_fn, inputs = jax.vjp(
                    lambda w, x, z: layer(w, x, consts, None if on is None else on[s, k], z),
                    w, x, zeros, has_aux=True)
                stashed, where = split_residuals(vjp_fn, (w, consts, zeros))
                box.setdefault("vjp", (where, jax.tree.structure(vjp_fn)))
                box["varying"] = [varying(jax.typeof(r)) for r in stashed]
                return y, (stashed, inputs)

            return jax.lax.scan(body, x, jnp.arange(depth), unroll=unrolled)

        def backward(ct, residuals, c, grads):
            """Chunk c's B, last layer first: (the input's cotangent, the taps' cotangents
            stacked per layer, `grads` with the norms' gradients added in place)."""
            where, treedef = box["vjp"]

            def body(carry, j):
                ct, grads = carry
                k = c * depth + j
                stashed = [jax.lax.dynamic_index_in_dim(r, j, 0, False) for r in residuals]
                d_w, dx, d_taps = rebuild(treedef, where, stashed, (weights(k), consts, zeros))(ct)
                grads = _add_at(grads, d_w, k, lambda path: not _is_projection(path, projections))
                return (dx, grads), d_taps

            (dx, grads), d_taps = jax.lax.scan(body, (ct, grads), jnp.arange(depth), reverse=True,
                                               unroll=unrolled)
            return dx, d_taps, grads

        def weight_grads(inputs, d_taps, c, grads):
            """Chunk c's W: each layer's projection weights' gradient, added in place."""
            def body(grads, j):
                k = c * depth + j
                pick = lambda a: jax.lax.dynamic_index_in_dim(a, j, 0, False)  # noqa: E731
                d_w = projection_grads(weights(k), jax.tree.map(pick, inputs),
                                       jax.tree.map(pick, d_taps))
                return _add_at(grads, d_w, k, lambda path: _is_projection(path, projections)), None

            return jax.lax.scan(body, grads, jnp.arange(depth), unroll=unrolled)[0]

        # stash buffers shaped by one traced forward: residuals (or the input alone under
        # stage remat), projection inputs and taps' cotangents, each [stash_slots, depth, ...]
        _, (res_shapes, in_shapes) = jax.eval_shape(lambda x: forward(x, 0), x0)
        if stage_remat:
            res_shapes, box["varying"] = [jax.ShapeDtypeStruct(x0.shape, x0.dtype)], [
                varying(jax.typeof(x0))]
        stash = [vary(jnp.zeros((stash_slots,) + r.shape, r.dtype), vma | {axis})
                 for r, vma in zip(res_shapes, box["varying"])]

        def ring(tree):
            return jax.tree.map(lambda r: vary(jnp.zeros((stash_slots,) + r.shape, r.dtype),
                                                manual), tree)

        inputs_stash = ring(in_shapes)
        taps_stash = ring(jax.tree.map(lambda z: jax.ShapeDtypeStruct((depth,) + z.shape, z.dtype),
                                       zeros))

        def get(buffer, slot):
            return jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, slot, 0, False), buffer)

        def put_if(pred, buffer, slot, value):
            return jax.tree.map(lambda b, v: store_if(pred, b, slot, v, 0), buffer, value)

        def nothing(buffer):  # zeros shaped (and varying) as one slot of `buffer`
            return jax.tree.map(lambda b: jnp.zeros_like(b[0]), buffer)

        # The operations see one slot of each buffer and return one slot's worth: the
        # buffers are read before the switch and written after it. XLA:CPU copies every
        # buffer a conditional inside a loop updates in place (a whole stash, or the stage's
        # gradient, per slot), so none goes through the switch. Each returns (y to send
        # ahead, dx to send back, residuals, projection inputs, taps' cotangents, gradient of
        # the stage's layers, of the head, loss, the last stage's dloss/dy).
        def result(y=None, dx=None, residuals=None, inputs=None, d_taps=None, d_stack=None,
                   d_head=None, total=None, dy=None):
            def pick(v, like):  # a slot's worth, varying as the buffer it goes to (a
                # constant residual, as the gathered attention's key positions, is invariant)
                if v is None:
                    return nothing(like)
                return jax.tree.map(lambda a, b: vary(a, varying(jax.typeof(b))), v, like)

            return (pick(y, box_x), pick(dx, box_x), pick(residuals, stash),
                    pick(inputs, inputs_stash), pick(d_taps, taps_stash),
                    g_zero_fn() if d_stack is None else d_stack,
                    jax.tree.map(jnp.zeros_like, g_head0) if d_head is None else d_head,
                    jnp.zeros_like(total0) if total is None else total, pick(dy, box_x))

        def op_forward(i, c, x, ct, held):
            y, (residuals, inputs) = forward(x, c)
            total, dy, d_head = head_grads(loss, head, labels, y, i, (s == p - 1) & (c == v - 1),
                                           manual)
            return result(y=y, residuals=[x] if stage_remat else residuals,
                          inputs=None if stage_remat else inputs, d_head=d_head, total=total,
                          dy=dy)

        def op_backward(i, c, x, ct, held):
            residuals, inputs = held[0], None
            if stage_remat:  # the forward again, from the chunk's input
                _, (residuals, inputs) = forward(residuals[0], c)
            dx, d_taps, d_stack = backward(ct, residuals, c, g_zero_fn())
            return result(dx=dx, inputs=inputs, d_taps=d_taps, d_stack=d_stack)

        def op_weight(i, c, x, ct, held):
            return result(d_stack=weight_grads(held[1], held[2], c, g_zero_fn()))

        def op_idle(i, c, x, ct, held):
            return result()

        def slot(carry, t):
            buffers, belt, dbelt, dx_out = carry
            inbox_x, inbox_ct, stash_, inputs_, taps_, g_stack, g_head, total = buffers
            row = dict(zip(FIELDS, rows[t, s]))
            kind, i, c = row["kind"], jnp.maximum(row["mb"], 0), jnp.maximum(row["chunk"], 0)
            at = jnp.maximum(row["stash"], 0)
            j = row["put"]  # this stage puts its microbatch j p + s on the input belt
            mine = jax.lax.dynamic_index_in_dim(x_in, jnp.maximum(j, 0), 1, keepdims=False)
            belt = select(j >= 0, mine, belt)
            x = select(row["x_at"] < 0, belt, get(inbox_x, jnp.maximum(row["x_at"], 0)))
            held = (get(stash_, at), get(inputs_, at), get(taps_, at))
            (y, dx, residuals, inputs, d_taps, d_stack, d_head, loss_i, dy) = jax.lax.switch(
                kind, [op_idle, op_forward, op_backward, op_weight], i, c, x,
                get(inbox_ct, jnp.maximum(row["ct_at"], 0)), held)
            stash_ = put_if(kind == FORWARD, stash_, at, residuals)
            inputs_ = put_if(kind == (BACKWARD if stage_remat else FORWARD), inputs_, at, inputs)
            taps_ = put_if(kind == BACKWARD, taps_, at, d_taps)
            g_stack = jax.tree.map(jnp.add, g_stack, d_stack)
            g_head = jax.tree.map(jnp.add, g_head, d_head)

            def store(buffer, where, value):  # into slot `where` of an inbox, if >= 0
                return store_if(where >= 0, buffer, jnp.maximum(where, 0), value, 0)

            inbox_ct = store(inbox_ct, row["dy_to"], dy)
            y, ct = jax.lax.ppermute(y, axis, ahead), jax.lax.ppermute(dx, axis, back)
            inbox_x, inbox_ct = store(inbox_x, row["x_to"], y), store(inbox_ct, row["ct_to"], ct)
            # stage 0's B of its first chunk gave microbatch i's input gradient: onto the belt
            # to its stage
            dbelt = select((s == 0) & (kind == BACKWARD) & (c == 0), dx, dbelt)
            keep = row["keep"]
            dx_out = store_if(keep >= 0, dx_out, jnp.maximum(keep, 0), dbelt, 1)
            buffers = (inbox_x, inbox_ct, stash_, inputs_, taps_, g_stack, g_head,
                       total + loss_i)
            return (buffers, jax.lax.ppermute(belt, axis, back),
                    jax.lax.ppermute(dbelt, axis, ahead), dx_out), None

        def g_zero_fn():
            return jax.tree.map(lambda a: vary(jnp.zeros_like(a, jnp.float32), manual), stack)

        small = (jnp.zeros((table.x_slots,) + x0.shape, x0.dtype),
                 jnp.zeros((table.ct_slots,) + x0.shape, x0.dtype), g_zero_fn(),
                 jax.tree.map(jnp.zeros_like, head), jnp.zeros_like(x0, jnp.float32, shape=()),
                 x0, x0, jnp.zeros_like(x_in))
        box_x, box_ct, g_zero, g_head0, total0, belt, dbelt, dx_out = jax.tree.map(
            lambda a: vary(a, manual), small)
        buffers = (box_x, box_ct, stash, inputs_stash, taps_stash, g_zero, g_head0, total0)
        carry = jax.lax.scan(slot, (buffers, belt, dbelt, dx_out), jnp.arange(len(table.rows)),
                             unroll=unroll())[0]
        buffers, _, _, dx_out = carry
        return stage_results(*buffers[5:], dx_out, manual, axis)

    return run_stages(per_stage, blocks, head, x_in, labels, consts, axis, mesh,
                      batch_axis, seq_axis)


def _add_at(grads, d_w, k, chosen):
    """`grads` with layer k's gradient `d_w` added in place, for the leaves `chosen(path)`."""
    def one(path, g, d):
        if not chosen(path):
            return g
        row = jax.lax.dynamic_index_in_dim(g, k, 0, False) + d.astype(g.dtype)
        return jax.lax.dynamic_update_index_in_dim(g, row, k, 0)

    return jax.tree_util.tree_map_with_path(one, grads, d_w)
