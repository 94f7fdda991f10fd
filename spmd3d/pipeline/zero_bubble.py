"""Zero-bubble ZB-H1 (Qi et al. 2023): the backward split into B and W, W filling the bubble.

A layer's backward is two pieces of work: B, the input's gradient (which the stage before
waits for), and W, the weights' gradient (which nobody waits for). B is the layer
differentiated with respect to its input and to zero taps added to its projections' outputs
(`model.Taps`): the taps' cotangents are the projections' output gradients dy, and XLA drops
the x^T dy products B does not return. W is later the vjp of the projections alone at (x, dy).
Deferring W lets each B go back to the stage before at once, so the cool-down's cotangents
stream back one stage per slot while the deferred W's fill what were idle slots.

The schedule is a table: each stage runs an ordered list of operations (p - s forwards, then
for each microbatch i its B, the W deferred by s microbatches, and the next forward), each as
soon as what it needs has arrived. With unit costs that takes 3m + p - 1 slots against the
3m + 3(p - 1) of 1F1B's lockstep ticks (`zb_h1_table`), and every stage holds at most p
microbatches between a forward and its W, 1F1B's peak. Unlike the lockstep schedules each
device runs its own operation in a slot (`lax.switch` over idle/F/B/W, nothing computed in an
idle slot), then four `ppermute`s move what was sent: activations ahead, cotangents back, the
embedded inputs (a belt bringing microbatch i to stage 0 in the slot of its forward) and the
input gradients (a belt taking them to the stage that fed the microbatch in). What arrives
before it is used waits in a small inbox; residuals, projection inputs and taps' cotangents
wait in stashes of p slots (the microbatch modulo their size: no two live ones meet, checked
when the table is built).
"""

from __future__ import annotations

from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from . import (Schedule, _select, _store_if, _vary, _varying, head_grads, rebuild, rings,
               run_stages, split_residuals, stage_results, unroll)

IDLE, FORWARD, BACKWARD, WEIGHT = 0, 1, 2, 3


def stage_order(p: int, m: int, s: int) -> list[tuple[int, int]]:
    """Stage s's operations in order, (kind, microbatch): p - s forwards, then for each
    microbatch its B, the W of the microbatch s before (stage s defers its W's by s, so the
    last stage's B's go back at once and stage 0, which waits longest, defers none), and the
    next forward; the deferred W's at the end."""
    ops = [(FORWARD, i) for i in range(min(p - s, m))]
    waiting = []
    for i in range(m):
        ops.append((BACKWARD, i))
        waiting.append(i)
        if len(waiting) > s:
            ops.append((WEIGHT, waiting.pop(0)))
        if i + p - s < m:
            ops.append((FORWARD, i + p - s))
    return ops + [(WEIGHT, i) for i in waiting]


def _smallest_ring(intervals) -> int:
    """The fewest slots k such that live intervals {microbatch: (first, last)} of one stage
    never share microbatch mod k while both live."""
    for k in range(1, len(intervals) + 1):
        seen = {}
        for i, (a, b) in intervals.items():
            seen.setdefault(i % k, []).append((a, b))
        if all(a2 > b1 or a1 > b2 for spans in seen.values()
               for n, (a1, b1) in enumerate(spans) for a2, b2 in spans[n + 1:]):
            return k
    return max(len(intervals), 1)


@lru_cache(maxsize=64)
def zb_h1_table(p: int, m: int):
    """(ops[n, p, 2] of (kind, microbatch) per slot and stage, inbox slots, stash slots): each
    stage's `stage_order` run as soon as possible (a forward one slot after the stage before
    ran it, a B one slot after the stage after ran its B, or after the last stage's own
    forward, which computed the loss; a W after its B), then p - 1 idle slots for the last
    input gradients to reach their stages."""
    orders = [stage_order(p, m, s) for s in range(p)]
    done, pos, rows, t = {}, [0] * p, [], 0
    while any(pos[s] < len(orders[s]) for s in range(p)):
        row = []
        for s in range(p):
            op = orders[s][pos[s]] if pos[s] < len(orders[s]) else (IDLE, -1)
            kind, i = op
            ready = {IDLE: True,
                     FORWARD: s == 0 or done.get((FORWARD, s - 1, i), t) < t,
                     BACKWARD: done.get((FORWARD, s, i), t) < t and (
                         s == p - 1 or done.get((BACKWARD, s + 1, i), t) < t),
                     WEIGHT: done.get((BACKWARD, s, i), t) < t}[kind]
            row.append(op if ready else (IDLE, -1))
        for s, (kind, i) in enumerate(row):
            if kind != IDLE:
                done[(kind, s, i)] = t
                pos[s] += 1
        rows.append(row)
        t += 1
    rows += [[(IDLE, -1)] * p] * (p - 1)
    ops = np.array(rows, np.int32)

    # inbox: from arrival (the slot after it was sent; the last stage's own loss) to use
    inbox = max(_smallest_ring({i: (done[(FORWARD, s - 1, i)], done[(FORWARD, s, i)])
                                for i in range(m)}) for s in range(1, p))
    inbox = max([inbox] + [_smallest_ring({i: (done[(BACKWARD, s + 1, i)], done[(BACKWARD, s, i)])
                                           for i in range(m)}) for s in range(p - 1)])
    stash = max(_smallest_ring({i: (done[(FORWARD, s, i)], done[(WEIGHT, s, i)])
                                for i in range(m)}) for s in range(p))
    return ops, inbox, stash


def _tables(p: int, m: int):
    """Per slot and stage, as int32 arrays [n, p]: the kind and microbatch of the operation;
    the microbatch whose activation (cotangent) arrives from the stage before (after), -1 for
    none; the input slot a stage puts on the input belt; the slot it keeps an input gradient
    in."""
    ops, _, _ = zb_h1_table(p, m)
    kind, mb = ops[..., 0], ops[..., 1]
    n = len(ops)
    got_x = np.full((n, p), -1, np.int32)
    got_x[:, 1:] = np.where(kind[:, :-1] == FORWARD, mb[:, :-1], -1)
    got_ct = np.full((n, p), -1, np.int32)
    got_ct[:, :-1] = np.where(kind[:, 1:] == BACKWARD, mb[:, 1:], -1)
    put = np.full((n, p), -1, np.int32)
    keep = np.full((n, p), -1, np.int32)
    for t in range(n):
        if kind[t, 0] == FORWARD:  # stage i mod p put microbatch i on the belt i mod p ago
            i = mb[t, 0]
            put[t - i % p, i % p] = i // p
        if kind[t, 0] == BACKWARD:  # its input gradient reaches stage i mod p then
            i = mb[t, 0]
            keep[t + i % p, i % p] = i // p
    return [jnp.asarray(a) for a in (kind, mb, got_x, got_ct, put, keep)]


def _is_projection(path, names) -> bool:
    return any(getattr(k, "key", getattr(k, "name", None)) in names for k in path)


def train(blocks, head, x_in, labels, consts, schedule: Schedule, axis: str, mesh, *, layer,
          split, loss, active, batch_axis, seq_axis, stage_remat, scan=True):
    """(summed loss, (block grads, head grads, input grads)) by ZB-H1, per device in a shard_map
    manual over `axis` (and `batch_axis`, `seq_axis` where given), as `one_f_one_b._train`.
    `split` = (tap_shapes, projection_grads, projection weight names) from the model."""
    tap_shapes, projection_grads, projections = split
    p, m = schedule.stages, schedule.microbatches
    _, inbox_slots, stash_slots = zb_h1_table(p, m)
    tables = _tables(p, m)
    n_slots = int(tables[0].shape[0])
    depth = jax.tree.leaves(blocks)[0].shape[0] // p
    ahead, back = rings(p)
    on = None if active is None else jnp.asarray(np.asarray(active).reshape(p, depth))
    manual = tuple(a for a in (axis, batch_axis, seq_axis) if a is not None)
    others = tuple(a for a in manual if a != axis)
    unrolled = unroll() or not scan

    def per_stage(stack, head, x_in, labels, consts):
        stack, x_in = jax.tree.map(lambda a: a[0], stack), x_in[0]
        s = jax.lax.axis_index(axis)
        stack = jax.tree.map(lambda a: _vary(a, others), stack)
        head = jax.tree.map(lambda a: _vary(a, manual), head)
        x0 = x_in[:, 0]

        def weights(k):
            return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, k, 0, False), stack)

        taps = tap_shapes(weights(0), x0, consts)
        zeros = {k: _vary(jnp.zeros(v.shape, v.dtype), manual) for k, v in taps.items()}
        box = {}

        def forward(x):
            """The stage's layers from x: (y, [residuals stacked per layer], the projections'
            inputs stacked per layer)."""
            def body(x, k):
                w = weights(k)
                y, vjp_fn, inputs = jax.vjp(
                    lambda w, x, z: layer(w, x, consts, None if on is None else on[s, k], z),
                    w, x, zeros, has_aux=True)
                stashed, where = split_residuals(vjp_fn, (w, consts, zeros))
                box.setdefault("vjp", (where, jax.tree.structure(vjp_fn)))
                box["varying"] = [_varying(jax.typeof(r)) for r in stashed]
                return y, (stashed, inputs)

            return jax.lax.scan(body, x, jnp.arange(depth), unroll=unrolled)

        def backward(ct, residuals, grads):
            """B, last layer first: (the input's cotangent, the taps' cotangents stacked per
            layer, `grads` with the norms' gradients added in place)."""
            where, treedef = box["vjp"]

            def body(carry, k):
                ct, grads = carry
                stashed = [jax.lax.dynamic_index_in_dim(r, k, 0, False) for r in residuals]
                d_w, dx, d_taps = rebuild(treedef, where, stashed, (weights(k), consts, zeros))(ct)
                grads = _add_at(grads, d_w, k, lambda path: not _is_projection(path, projections))
                return (dx, grads), d_taps

            (dx, grads), d_taps = jax.lax.scan(body, (ct, grads), jnp.arange(depth), reverse=True,
                                               unroll=unrolled)
            return dx, d_taps, grads

        def weight_grads(inputs, d_taps, grads):
            """W: each layer's projection weights' gradient, added in place."""
            def body(grads, k):
                pick = lambda a: jax.lax.dynamic_index_in_dim(a, k, 0, False)  # noqa: E731
                d_w = projection_grads(weights(k), jax.tree.map(pick, inputs),
                                       jax.tree.map(pick, d_taps))
                return _add_at(grads, d_w, k, lambda path: _is_projection(path, projections)), None

            return jax.lax.scan(body, grads, jnp.arange(depth), unroll=unrolled)[0]

        # stash buffers shaped by one traced forward: residuals (or the input alone under
        # stage remat), projection inputs and taps' cotangents, each [stash_slots, depth, ...]
        _, (res_shapes, in_shapes) = jax.eval_shape(forward, x0)
        if stage_remat:
            res_shapes, box["varying"] = [jax.ShapeDtypeStruct(x0.shape, x0.dtype)], [
                _varying(jax.typeof(x0))]
        stash = [_vary(jnp.zeros((stash_slots,) + r.shape, r.dtype), vma | {axis})
                 for r, vma in zip(res_shapes, box["varying"])]

        def ring(tree):
            return jax.tree.map(lambda r: _vary(jnp.zeros((stash_slots,) + r.shape, r.dtype),
                                                manual), tree)

        inputs_stash = ring(in_shapes)
        taps_stash = ring(jax.tree.map(lambda z: jax.ShapeDtypeStruct((depth,) + z.shape, z.dtype),
                                       zeros))

        def get(buffer, slot):
            return jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, slot, 0, False), buffer)

        def put_if(pred, buffer, slot, value):
            return jax.tree.map(lambda b, v: _store_if(pred, b, slot, v, 0), buffer, value)

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
                return jax.tree.map(lambda a, b: _vary(a, _varying(jax.typeof(b))), v, like)

            return (pick(y, box_x), pick(dx, box_x), pick(residuals, stash),
                    pick(inputs, inputs_stash), pick(d_taps, taps_stash),
                    g_zero_fn() if d_stack is None else d_stack,
                    jax.tree.map(jnp.zeros_like, g_head0) if d_head is None else d_head,
                    jnp.zeros_like(total0) if total is None else total, pick(dy, box_x))

        def op_forward(i, x, ct, held):
            y, (residuals, inputs) = forward(x)
            total, dy, d_head = head_grads(loss, head, labels, y, i, s == p - 1, manual)
            return result(y=y, residuals=[x] if stage_remat else residuals,
                          inputs=None if stage_remat else inputs, d_head=d_head, total=total,
                          dy=dy)

        def op_backward(i, x, ct, held):
            residuals, inputs = held[0], None
            if stage_remat:  # the forward again, from the stage's input
                _, (residuals, inputs) = forward(residuals[0])
            dx, d_taps, d_stack = backward(ct, residuals, g_zero_fn())
            return result(dx=dx, inputs=inputs, d_taps=d_taps, d_stack=d_stack)

        def op_weight(i, x, ct, held):
            return result(d_stack=weight_grads(held[1], held[2], g_zero_fn()))

        def op_idle(i, x, ct, held):
            return result()

        kind_t, mb_t, got_x_t, got_ct_t, put_t, keep_t = tables

        def slot(carry, t):
            buffers, belt, dbelt, dx_out = carry
            inbox_x, inbox_ct, stash_, inputs_, taps_, g_stack, g_head, total = buffers
            kind, i = kind_t[t, s], jnp.maximum(mb_t[t, s], 0)
            at, box = i % stash_slots, i % inbox_slots
            j = put_t[t, s]  # this stage puts its microbatch j p + s on the input belt
            mine = jax.lax.dynamic_index_in_dim(x_in, jnp.maximum(j, 0), 1, keepdims=False)
            belt = _select(j >= 0, mine, belt)
            x = _select(s == 0, belt, get(inbox_x, box))
            held = (get(stash_, at), get(inputs_, at), get(taps_, at))
            (y, dx, residuals, inputs, d_taps, d_stack, d_head, loss_i, dy) = jax.lax.switch(
                kind, [op_idle, op_forward, op_backward, op_weight], i, x, get(inbox_ct, box),
                held)
            stash_ = put_if(kind == FORWARD, stash_, at, residuals)
            inputs_ = put_if(kind == (BACKWARD if stage_remat else FORWARD), inputs_, at, inputs)
            taps_ = put_if(kind == BACKWARD, taps_, at, d_taps)
            g_stack = jax.tree.map(jnp.add, g_stack, d_stack)
            g_head = jax.tree.map(jnp.add, g_head, d_head)
            inbox_ct = _store_if((kind == FORWARD) & (s == p - 1), inbox_ct, box, dy, 0)
            y, ct = jax.lax.ppermute(y, axis, ahead), jax.lax.ppermute(dx, axis, back)
            got = got_x_t[t, s]
            inbox_x = _store_if(got >= 0, inbox_x, jnp.maximum(got, 0) % inbox_slots, y, 0)
            got = got_ct_t[t, s]
            inbox_ct = _store_if(got >= 0, inbox_ct, jnp.maximum(got, 0) % inbox_slots, ct, 0)
            # stage 0's B gave microbatch i's input gradient: onto the belt to its stage
            dbelt = _select((s == 0) & (kind == BACKWARD), dx, dbelt)
            keep = keep_t[t, s]
            dx_out = _store_if(keep >= 0, dx_out, jnp.maximum(keep, 0), dbelt, 1)
            buffers = (inbox_x, inbox_ct, stash_, inputs_, taps_, g_stack, g_head,
                       total + loss_i)
            return (buffers, jax.lax.ppermute(belt, axis, back),
                    jax.lax.ppermute(dbelt, axis, ahead), dx_out), None

        def g_zero_fn():
            return jax.tree.map(lambda a: _vary(jnp.zeros_like(a, jnp.float32), manual), stack)

        small = (jnp.zeros((inbox_slots,) + x0.shape, x0.dtype), g_zero_fn(),
                 jax.tree.map(jnp.zeros_like, head), jnp.zeros_like(x0, jnp.float32, shape=()),
                 x0, x0, jnp.zeros_like(x_in))
        box_x, g_zero, g_head0, total0, belt, dbelt, dx_out = jax.tree.map(
            lambda a: _vary(a, manual), small)
        buffers = (box_x, box_x, stash, inputs_stash, taps_stash, g_zero, g_head0, total0)
        carry = jax.lax.scan(slot, (buffers, belt, dbelt, dx_out), jnp.arange(n_slots),
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
