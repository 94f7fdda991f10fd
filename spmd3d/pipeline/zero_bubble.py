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
from jax.sharding import PartitionSpec as P

from . import (Schedule, _select, _store_if, _vary, _varying, head_grads, rebuild, rings,
               split_residuals, unroll)

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
    stacks = jax.tree.map(lambda a: a.reshape((p, a.shape[0] // p) + a.shape[1:]), blocks)
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

        def put(buffer, slot, value):
            return jax.tree.map(lambda b, v: jax.lax.dynamic_update_index_in_dim(b, v, slot, 0),
                                buffer, value)

        def get(buffer, slot):
            return jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, slot, 0, False), buffer)

        def op_forward(state, i, x):
            inbox_x, inbox_ct, stash, inputs_stash, taps_stash, g_stack, g_head, total = state
            x = _select(s == 0, x, get(inbox_x, i % inbox_slots))
            y, (residuals, inputs) = forward(x)
            slot = i % stash_slots
            stash = put(stash, slot, [x] if stage_remat else residuals)
            if not stage_remat:
                inputs_stash = put(inputs_stash, slot, inputs)
            l, dy, dh = head_grads(loss, head, labels, y, i, s == p - 1, manual)
            inbox_ct = _store_if(s == p - 1, inbox_ct, i % inbox_slots, dy, 0)
            state = (inbox_x, inbox_ct, stash, inputs_stash, taps_stash, g_stack,
                     jax.tree.map(jnp.add, g_head, dh), total + l)
            return state, y, jnp.zeros_like(y)

        def op_backward(state, i, x):
            inbox_x, inbox_ct, stash, inputs_stash, taps_stash, g_stack, g_head, total = state
            slot = i % stash_slots
            residuals = get(stash, slot)
            if stage_remat:  # the forward again, from the stage's input
                _, (residuals, inputs) = forward(residuals[0])
                inputs_stash = put(inputs_stash, slot, inputs)
            dx, d_taps, g_stack = backward(get(inbox_ct, i % inbox_slots), residuals, g_stack)
            taps_stash = put(taps_stash, slot, d_taps)
            state = (inbox_x, inbox_ct, stash, inputs_stash, taps_stash, g_stack, g_head, total)
            return state, jnp.zeros_like(dx), dx

        def op_weight(state, i, x):
            inbox_x, inbox_ct, stash, inputs_stash, taps_stash, g_stack, g_head, total = state
            slot = i % stash_slots
            g_stack = weight_grads(get(inputs_stash, slot), get(taps_stash, slot), g_stack)
            state = (inbox_x, inbox_ct, stash, inputs_stash, taps_stash, g_stack, g_head, total)
            return state, jnp.zeros_like(x), jnp.zeros_like(x)

        def op_idle(state, i, x):
            return state, jnp.zeros_like(x), jnp.zeros_like(x)

        kind_t, mb_t, got_x_t, got_ct_t, put_t, keep_t = tables

        def slot(carry, t):
            state, belt, dbelt, dx_out = carry
            kind, i = kind_t[t, s], mb_t[t, s]
            j = put_t[t, s]  # this stage puts its microbatch j p + s on the input belt
            mine = jax.lax.dynamic_index_in_dim(x_in, jnp.maximum(j, 0), 1, keepdims=False)
            belt = _select(j >= 0, mine, belt)
            state, y, dx = jax.lax.switch(kind, [op_idle, op_forward, op_backward, op_weight],
                                          state, jnp.maximum(i, 0), belt)
            y, ct = jax.lax.ppermute(y, axis, ahead), jax.lax.ppermute(dx, axis, back)
            inbox_x, inbox_ct = state[0], state[1]
            got = got_x_t[t, s]
            inbox_x = _store_if(got >= 0, inbox_x, jnp.maximum(got, 0) % inbox_slots, y, 0)
            got = got_ct_t[t, s]
            inbox_ct = _store_if(got >= 0, inbox_ct, jnp.maximum(got, 0) % inbox_slots, ct, 0)
            # stage 0's B gave microbatch i's input gradient: onto the belt to its stage
            dbelt = _select((s == 0) & (kind == BACKWARD), dx, dbelt)
            keep = keep_t[t, s]
            dx_out = _store_if(keep >= 0, dx_out, jnp.maximum(keep, 0), dbelt, 1)
            state = (inbox_x, inbox_ct) + state[2:]
            return (state, jax.lax.ppermute(belt, axis, back),
                    jax.lax.ppermute(dbelt, axis, ahead), dx_out), None

        box_x = jnp.zeros((inbox_slots,) + x0.shape, x0.dtype)
        g_stack = jax.tree.map(lambda a: jnp.zeros_like(a, jnp.float32), stack)
        small = (box_x, box_x, g_stack, jax.tree.map(jnp.zeros_like, head),
                 jnp.zeros_like(x0, jnp.float32, shape=()), x0, x0, jnp.zeros_like(x_in))
        box_x, box_ct, g_stack, g_head, total, belt, dbelt, dx_out = jax.tree.map(
            lambda a: _vary(a, manual), small)
        state = (box_x, box_ct, stash, inputs_stash, taps_stash, g_stack, g_head, total)
        carry = (state, belt, dbelt, dx_out)
        carry = jax.lax.scan(slot, carry, jnp.arange(n_slots), unroll=unroll())[0]
        state, _, _, dx_out = carry
        g_stack, g_head, total = state[5:]
        g_stack = jax.lax.psum(g_stack, others) if others else g_stack
        return (jax.lax.psum(total, manual), jax.tree.map(lambda a: a[None], g_stack),
                jax.lax.psum(g_head, manual), dx_out[None])

    buffer = P(axis, batch_axis, None, seq_axis)  # [p, mb, n, T, D]
    total, g_stack, g_head, dx = jax.shard_map(
        per_stage, mesh=mesh, axis_names=set(manual),
        in_specs=(P(axis), P(), buffer, P(None, batch_axis, seq_axis), P(None, seq_axis)),
        out_specs=(P(), P(axis), P(), buffer))(stacks, head, x_in, labels, consts)
    g_blocks = jax.tree.map(lambda g, b: g.reshape(b.shape).astype(b.dtype), g_stack, blocks)
    return total, (g_blocks, jax.tree.map(lambda g, h: g.astype(h.dtype), g_head, head), dx)


def _add_at(grads, d_w, k, chosen):
    """`grads` with layer k's gradient `d_w` added in place, for the leaves `chosen(path)`."""
    def one(path, g, d):
        if not chosen(path):
            return g
        row = jax.lax.dynamic_index_in_dim(g, k, 0, False) + d.astype(g.dtype)
        return jax.lax.dynamic_update_index_in_dim(g, row, k, 0)

    return jax.tree_util.tree_map_with_path(one, grads, d_w)
