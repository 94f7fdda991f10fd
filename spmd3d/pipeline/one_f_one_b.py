"""The 1F1B schedule: one forward and one backward per tick, the loss head on the last stage.

GPipe differentiates its forward tick loop, so the backward starts only after the last forward
and every stage keeps what the backward needs of all m microbatches. Here the schedule runs the
backward itself, inside the same per-device tick loop. Stage s runs the forward of microbatch i
at tick i + s and its backward at tick i + 2(p - 1) - s: the last stage computes the loss of a
microbatch, its gradient and the stage's backward in the tick its forward ends, and each
cotangent reaches the stage before one tick later. A stage therefore keeps the residuals of at
most 2(p - 1 - s) + 1 microbatches (2p - 1 on stage 0), in a ring of stash slots, whatever m is.

The ticks run as three scans of one tick function: p - 1 forward-only ticks (warm-up), m ticks
of a forward and a backward, and p - 1 backward-only ticks (cool-down), so every stage computes
m + p - 1 forwards and as many backwards: GPipe's FLOPs and bubble, (p - 1)/(m + p - 1).

A forward is `jax.vjp` of the stage; what its backward needs (the residuals the per-layer remat
policy keeps, the stage's input alone under `parallel.remat=stage`) goes into the stash, except
the stage's weights, which stay where they are (a residual that *is* a weight is not copied).
The backward rebuilds the vjp from the stash and the weights. Weight gradients accumulate in
fp32 per device and are summed over the data and sequence axes once, after the loop; the
gradient of each microbatch's input travels on a belt to the stage that fed it in (the
embedding's backward runs outside, as its forward does).

`loss_and_grads` wraps this in a `jax.custom_vjp` whose forward computes the loss and every
gradient at once and whose backward scales them, so the train step differentiates the pipelined
loss as any other; evaluated without a gradient, the loss comes from the GPipe forward.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from . import Schedule, _select, _store_if, _vary, _varying, next_input, rings, unroll


def _split_residuals(vjp_fn, chunk):
    """(residuals to stash, where): the vjp's leaves that are not one of `chunk`'s leaves (a
    weight kept as a residual is the very same value), and for each leaf the index of the
    weight it is (None: stashed)."""
    weights = {id(w): k for k, w in enumerate(jax.tree.leaves(chunk))}
    leaves = jax.tree.leaves(vjp_fn)
    where = tuple(weights.get(id(leaf)) for leaf in leaves)
    return [leaf for leaf, k in zip(leaves, where) if k is None], where


def _rebuild(treedef, where, stashed, chunk):
    """The vjp function of a stashed forward, its weights taken from `chunk`."""
    weights, stashed = jax.tree.leaves(chunk), iter(stashed)
    return jax.tree.unflatten(treedef, [next(stashed) if k is None else weights[k] for k in where])


def _train(blocks, head, x_in, labels, consts, schedule: Schedule, axis: str, mesh, *, stage,
           loss, active, batch_axis, seq_axis, stage_remat):
    """(summed loss, (block grads, head grads, input grads)) by 1F1B, per device in a shard_map
    manual over `axis`, and `batch_axis` and `seq_axis` where given (as `gpipe.run`).

    blocks[L, ...] in storage order; head: the head's weights (`loss(head, y, labels)` is a
    microbatch's summed loss); x_in[p, mb, n, T, D]: the embedded microbatches laid out by
    `Schedule.feed`; labels[m, mb, T] on every stage; consts: [1, T, ...] (RoPE tables)."""
    p, m = schedule.stages, schedule.microbatches
    chunks = jax.tree.map(lambda a: a.reshape((p, a.shape[0] // p) + a.shape[1:]), blocks)
    ahead, back = rings(p)
    on = None if active is None else jnp.asarray(np.asarray(active).reshape(p, -1))
    manual = tuple(a for a in (axis, batch_axis, seq_axis) if a is not None)
    others = tuple(a for a in manual if a != axis)
    # stash slots: a ring of 2p - 1 (the garbage forwards of the warm-up and the tail then
    # never land on a live slot), or with fewer microbatches one slot each and a spare
    slots = min(2 * p - 1, m + 1)

    def per_stage(chunk, head, x_in, labels, consts):
        # chunk[1, c, ...]: this stage's layers; x_in[1, mb, n, T, D]: the microbatches it feeds
        chunk, x_in = jax.tree.map(lambda a: a[0], chunk), x_in[0]
        n = x_in.shape[1]
        s = jax.lax.axis_index(axis)
        # device-varying before the loop: each tick's gradients stay local, summed once after
        chunk = jax.tree.map(lambda a: _vary(a, others), chunk)
        head = jax.tree.map(lambda a: _vary(a, manual), head)
        mask = None if on is None else on[s]

        def forward(chunk, x):
            return stage(chunk, x, consts, mask)

        if stage_remat:
            forward = jax.checkpoint(forward, prevent_cse=False,
                                     policy=jax.checkpoint_policies.nothing_saveable)
        box = {}

        def probe(chunk, x):
            y, vjp_fn = jax.vjp(forward, chunk, x)
            stashed, box["where"] = _split_residuals(vjp_fn, chunk)
            box["treedef"] = jax.tree.structure(vjp_fn)
            box["varying"] = [_varying(jax.typeof(r)) for r in stashed]
            return stashed

        shapes = jax.eval_shape(probe, chunk, x_in[:, 0])
        treedef, where = box["treedef"], box["where"]
        # each stash buffer varies over the mesh axes its residual does, and over stage (its
        # slot is: RoPE tables, the same on every stage, are stashed too)
        stash = [_vary(jnp.zeros((slots,) + r.shape, r.dtype), vma | {axis})
                 for r, vma in zip(shapes, box["varying"])]

        def slot_of(i):
            if slots == 2 * p - 1:
                return i % slots
            return jnp.where((i >= 0) & (i < m), i, m)  # the spare slot takes the garbage

        def head_grads(y, i):
            """On the last stage: (loss, dloss/dy, dloss/dhead) of microbatch i's output."""
            lab = jax.lax.dynamic_index_in_dim(labels, jnp.clip(i, 0, m - 1), 0, keepdims=False)
            lab = _vary(jnp.where((i >= 0) & (i < m), lab, -1), manual)  # -1: not counted

            def last():
                total, vjp_fn = jax.vjp(lambda h, y: loss(h, y, lab), head, y)
                d_head, d_y = vjp_fn(jnp.ones_like(total))
                return total, d_y, d_head

            def other():
                return (jnp.zeros_like(y, jnp.float32, shape=()), jnp.zeros_like(y),
                        jax.tree.map(jnp.zeros_like, head))

            return jax.lax.cond(s == p - 1, last, other)

        def keep_input_grad(dbelt, dx_out, t):
            """Stage s keeps the input gradient on the belt if it fed that microbatch in: the
            one stage 0 finished s ticks ago."""
            i = t - s - 2 * (p - 1)
            ours = (i >= 0) & (i < m) & (i % p == s)
            return _store_if(ours, dx_out, jnp.clip(i // p, 0, n - 1), dbelt, 1)

        def tick(carry, t, fwd: bool, bwd: bool):
            held, ct_in, belt, dbelt, stash, dx_out, g_chunk, g_head, total = carry
            if fwd:  # microbatch t - s; stage 0 takes microbatch t from the belt (as GPipe)
                coming = next_input(x_in, belt, t, p)
                y, vjp_fn = jax.vjp(forward, chunk, _select(s == 0, coming, held))
                stashed, check = _split_residuals(vjp_fn, chunk)
                assert check == where, "the stage's residuals changed between traces"
                slot = slot_of(t - s)
                stash = [jax.lax.dynamic_update_index_in_dim(b, r, slot, 0)
                         for b, r in zip(stash, stashed)]
                belt = jax.lax.ppermute(coming, axis, back)
            if bwd:  # microbatch t - 2(p - 1) + s; the last stage's cotangent is the loss's
                i = t - 2 * (p - 1) + s
                ct = ct_in
                if fwd:
                    l, dy, dh = head_grads(y, t - (p - 1))
                    total = total + l
                    g_head = jax.tree.map(jnp.add, g_head, dh)
                    ct = _select(s == p - 1, dy, ct_in)
                # a bubble tick: a zero cotangent, so zero gradients, on the residuals of a
                # microbatch this stage did run (never an unwritten slot: 0 x inf is nan)
                ct = _select((i >= 0) & (i < m), ct, jnp.zeros_like(ct))
                slot = slot_of(jnp.clip(i, 0, m - 1))
                stashed = [jax.lax.dynamic_index_in_dim(b, slot, 0, keepdims=False) for b in stash]
                d_chunk, dx = _rebuild(treedef, where, stashed, chunk)(ct)
                g_chunk = jax.tree.map(lambda g, d: g + d.astype(g.dtype), g_chunk, d_chunk)
                ct_in = jax.lax.ppermute(dx, axis, back)
                # stage 0's dx is microbatch i's input gradient: onto the belt to its stage
                dbelt = _select(s == 0, dx, dbelt)
            if fwd:
                held = jax.lax.ppermute(y, axis, ahead)
            dx_out = keep_input_grad(dbelt, dx_out, t)
            return (held, ct_in, belt, jax.lax.ppermute(dbelt, axis, ahead), stash, dx_out,
                    g_chunk, g_head, total), None

        x0 = x_in[:, 0]
        g_chunk = jax.tree.map(lambda a: jnp.zeros_like(a, jnp.float32), chunk)
        carry = (x0, x0, x0, x0, jnp.zeros_like(x_in), g_chunk,
                 jax.tree.map(jnp.zeros_like, head), jnp.zeros_like(x0, jnp.float32, shape=()))
        carry = jax.tree.map(lambda a: _vary(a, manual), carry)
        carry = carry[:4] + (stash,) + carry[4:]

        def phase(carry, start, stop, fwd, bwd):
            step = partial(tick, fwd=fwd, bwd=bwd)
            return jax.lax.scan(step, carry, jnp.arange(start, stop), unroll=unroll())[0]

        carry = phase(carry, 0, p - 1, True, False)  # warm-up
        carry = phase(carry, p - 1, m + p - 1, True, True)  # steady
        carry = phase(carry, m + p - 1, m + 2 * (p - 1), False, True)  # cool-down
        # the last input gradients still on the belt reach their stages
        carry = phase(carry, m + 2 * (p - 1), m + 3 * (p - 1), False, False)
        _, _, _, _, _, dx_out, g_chunk, g_head, total = carry
        g_chunk = jax.lax.psum(g_chunk, others) if others else g_chunk
        return (jax.lax.psum(total, manual), jax.tree.map(lambda a: a[None], g_chunk),
                jax.lax.psum(g_head, manual), dx_out[None])

    buffer = P(axis, batch_axis, None, seq_axis)  # [p, mb, n, T, D]
    total, g_chunks, g_head, dx = jax.shard_map(
        per_stage, mesh=mesh, axis_names=set(manual),
        in_specs=(P(axis), P(), buffer, P(None, batch_axis, seq_axis), P(None, seq_axis)),
        out_specs=(P(), P(axis), P(), buffer))(chunks, head, x_in, labels, consts)
    g_blocks = jax.tree.map(lambda g, b: g.reshape(b.shape).astype(b.dtype), g_chunks, blocks)
    return total, (g_blocks, jax.tree.map(lambda g, h: g.astype(h.dtype), g_head, head), dx)


def loss_and_grads(blocks, head, x_in, labels, consts, schedule: Schedule, axis: str, mesh, *,
                   stage, loss, forward, active=None, batch_axis=None, seq_axis=None,
                   stage_remat: bool = False):
    """The summed loss of every microbatch through the pipeline and the loss head, as a
    function of (blocks, head, x_in) whose gradient is computed by 1F1B (`_train`).
    `forward(blocks, head, x_in)` is the same loss without a gradient (the GPipe forward)."""
    train = partial(_train, labels=labels, consts=consts, schedule=schedule, axis=axis,
                    mesh=mesh, stage=stage, loss=loss, active=active, batch_axis=batch_axis,
                    seq_axis=seq_axis, stage_remat=stage_remat)

    @jax.custom_vjp
    def pipelined(blocks, head, x_in):
        return forward(blocks, head, x_in)

    def scaled(grads, ct):  # the gradients, times the loss's cotangent
        return jax.tree.map(lambda g: (ct * g).astype(g.dtype), grads)

    pipelined.defvjp(train, scaled)
    return pipelined(blocks, head, x_in)
