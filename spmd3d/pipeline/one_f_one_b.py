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

Interleaved (`parallel.pipeline_repeats` = v > 1): stage s holds v chunks of its layers, chunk c
being virtual stage j = c p + s of V = v p. Microbatches enter in groups of p, one group every
V ticks: microbatch i enters at G(i) = (i div p) V + (i mod p), runs the forward of virtual
stage j at tick G(i) + j and its backward at G(i) + 2V - 2 - j. The forward ring carries stage
p - 1's chunk c on to stage 0's chunk c + 1, the backward ring the other way; each stage still
runs one forward and one backward per tick, of the chunk the tick's closed form names. V - 1
forward-only ticks, v m + p - V full ticks and V - 1 backward-only ticks: v m + p - 1 chunk
forwards per stage, so the bubble is (p - 1)/(v m + p - 1), v times smaller, while the stash
holds 2V - 1 chunk passes (about 2p stage passes' worth) whatever m is. m must be a multiple of
p.

A chunk runs layer by layer in a scan: each layer's forward is `jax.vjp` of the layer (under
its remat policy), its weights indexed in the stage's stack where they are used; what its
backward needs goes into the stash, stacked per layer, except the layer's weights and the RoPE
tables (a residual that *is* one of them is not copied). Under `parallel.remat=stage` a pass
stashes its input alone and the backward redoes the chunk's forward first. The backward scans
the layers the other way, rebuilds each vjp from the stash and the weights, and adds the
layer's weight gradient in place to the stage's fp32 accumulator: no chunk of weights or of
gradients is ever copied (taking the vjp of a whole chunk would hand back a fresh fp32
gradient of the chunk per tick: 3.7 GB more per device for GPT-3 175B at TP8 PP16). The accumulator
is summed over the data and sequence axes once, after the loop; the gradient of each
microbatch's input travels on a belt to the stage that fed it in (the embedding's backward
runs outside, as its forward does).

`loss_and_grads` wraps this in a `jax.custom_vjp` whose forward computes the loss and every
gradient at once and whose backward scales them, so the train step differentiates the pipelined
loss as any other; evaluated without a gradient, the loss comes from the GPipe forward.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ..manual import select, store_if, unroll, vary, varying
from . import (Schedule, head_grads, next_input, rebuild, rings, run_stages, split_residuals,
               stage_results)


def _train(blocks, head, x_in, labels, consts, schedule: Schedule, axis: str, mesh, *, layer,
           loss, active, batch_axis, seq_axis, stage_remat, scan=True):
    """(summed loss, (block grads, head grads, input grads)) by 1F1B, per device in a shard_map
    manual over `axis`, and `batch_axis` and `seq_axis` where given (as `gpipe.run`).

    blocks[L, ...] in storage order (stage s's chunks together); `layer(params, x, consts, on)`
    one layer under its remat policy; head: the head's weights (`loss(head, y, labels)` is a
    microbatch's summed loss); x_in[p, mb, n, T, D]: the embedded microbatches laid out by
    `Schedule.feed`; labels[m, mb, T] on every stage; consts: [1, T, ...] (RoPE tables).

    A chunk's forward and backward run layer by layer, each layer's weights indexed in the
    stage's stack where it is used and each layer's gradient added in place to the stage's
    fp32 accumulator: no copy of a chunk's weights or of its gradient is ever made."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.repeats
    big, span = p * v, 2 * (p * v - 1)  # V virtual stages; a pass's forward-to-backward span
    depth = jax.tree.leaves(blocks)[0].shape[0] // (p * v)  # layers per chunk
    ahead, back = rings(p)
    on = None if active is None else jnp.asarray(np.asarray(active).reshape(p, v * depth))
    manual = tuple(a for a in (axis, batch_axis, seq_axis) if a is not None)
    others = tuple(a for a in manual if a != axis)
    unrolled = unroll() or not scan
    # stash slots: a ring of 2V - 1 (the garbage forwards of the warm-up and the tail then
    # never land on a live slot), or with one chunk and fewer microbatches one slot each and
    # a spare
    slots = 2 * big - 1 if v > 1 else min(2 * p - 1, m + 1)

    def start(i):  # G(i): the tick microbatch i enters virtual stage 0
        return (i // p) * big + i % p

    def forward_at(t, s):  # (microbatch, chunk) of stage s's forward at tick t
        u = t - s
        return (u // big) * p + u % p, (u % big) // p

    def backward_at(t, s):  # (microbatch, chunk) of stage s's backward at tick t
        w = t - span + s + (v - 1) * p
        return (w // big) * p + w % p, v - 1 - (w % big) // p

    def per_stage(stack, head, x_in, labels, consts):
        # stack[1, v * depth, ...]: this stage's layers; x_in[1, mb, n, T, D]: its microbatches
        stack, x_in = jax.tree.map(lambda a: a[0], stack), x_in[0]
        n = x_in.shape[1]
        s = jax.lax.axis_index(axis)
        # device-varying before the loop: each tick's gradients stay local, summed once after
        stack = jax.tree.map(lambda a: vary(a, others), stack)
        head = jax.tree.map(lambda a: vary(a, manual), head)

        def weights(k):  # layer k of the stage's stack, indexed where it is used
            return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, k, 0, False), stack)

        box = {}

        def chunk_forward(x, c):
            """Chunk c's forward from x: (y, the residuals its layers' remat policy keeps,
            stacked per layer [depth, ...]; never a weight or a RoPE table)."""
            def body(x, j):
                k, w = c * depth + j, weights(c * depth + j)
                y, vjp_fn = jax.vjp(
                    lambda w, x: layer(w, x, consts, None if on is None else on[s, k]), w, x)
                stashed, where = split_residuals(vjp_fn, (w, consts))
                seen = box.setdefault("vjp", (where, jax.tree.structure(vjp_fn)))
                assert seen[0] == where, "the layer's residuals changed between traces"
                box["varying"] = [varying(jax.typeof(r)) for r in stashed]
                return y, stashed

            return jax.lax.scan(body, x, jnp.arange(depth), unroll=unrolled)

        def chunk_backward(ct, residuals, c, grads):
            """Chunk c's backward, last layer first: (the input's cotangent, `grads` with each
            layer's weight gradient added in place)."""
            where, treedef = box["vjp"]

            def body(carry, j):
                ct, grads = carry
                k = c * depth + j
                stashed = [jax.lax.dynamic_index_in_dim(r, j, 0, False) for r in residuals]
                d_w, dx = rebuild(treedef, where, stashed, (weights(k), consts))(ct)
                grads = jax.tree.map(lambda g, d: jax.lax.dynamic_update_index_in_dim(
                    g, jax.lax.dynamic_index_in_dim(g, k, 0, False) + d.astype(g.dtype), k, 0),
                    grads, d_w)
                return (dx, grads), None

            return jax.lax.scan(body, (ct, grads), jnp.arange(depth), reverse=True,
                                unroll=unrolled)[0]

        # what a chunk pass stashes: its input alone under stage remat (the backward redoes
        # the forward), else its layers' residuals
        x0 = x_in[:, 0]
        shapes = jax.eval_shape(lambda x: chunk_forward(x, 0)[1], x0)
        if stage_remat:
            shapes, box["varying"] = [x0], [varying(jax.typeof(x0))]
        # each stash buffer varies over the mesh axes its residual does, and over stage
        stash = [vary(jnp.zeros((slots,) + r.shape, r.dtype), vma | {axis})
                 for r, vma in zip(shapes, box["varying"])]

        def slot_of(i, c):  # the slot of microbatch i's forward of chunk c on this stage
            if v > 1:
                return (start(i) + c * p + s) % slots
            if slots == 2 * p - 1:
                return i % slots
            return jnp.where((i >= 0) & (i < m), i, m)  # the spare slot takes the garbage

        def keep_input_grad(dbelt, dx_out, t):
            """Stage s keeps the input gradient on the belt if it fed that microbatch in: the
            one stage 0 finished (its first chunk's backward) s ticks ago."""
            w = t - span - s  # the tick it entered, if it entered then
            i = (w // big) * p + s
            ours = (w >= 0) & (w % big == s) & (i < m)
            return store_if(ours, dx_out, jnp.clip(w // big, 0, n - 1), dbelt, 1)

        def tick(carry, t, fwd: bool, bwd: bool):
            held, ct_in, belt, dbelt, stash, dx_out, g_stack, g_head, total = carry
            if fwd:  # stage 0 takes a fresh microbatch for its first chunk (from the belt)
                i, c = forward_at(t, s)
                coming = next_input(x_in, belt, t, big)
                x = select((s == 0) & (c == 0), coming, held)
                y, residuals = chunk_forward(x, c)
                slot = t % slots if v > 1 else slot_of(t - s, 0)
                stash = [jax.lax.dynamic_update_index_in_dim(b, r, slot, 0)
                         for b, r in zip(stash, [x] if stage_remat else residuals)]
                belt = jax.lax.ppermute(coming, axis, back)
            if bwd:  # the last virtual stage's cotangent is the loss's
                i_b, c_b = backward_at(t, s)
                ct = ct_in
                if fwd:
                    last = (s == p - 1) & (c == v - 1)
                    l, dy, dh = head_grads(loss, head, labels, y, i, last, manual)
                    total = total + l
                    g_head = jax.tree.map(jnp.add, g_head, dh)
                    ct = select((s == p - 1) & (c_b == v - 1), dy, ct_in)
                # a bubble tick: a zero cotangent, so zero gradients, on the residuals of a
                # microbatch this stage did run (never an unwritten slot: 0 x inf is nan)
                valid = (i_b >= 0) & (i_b < m)
                ct = select(valid, ct, jnp.zeros_like(ct))
                slot = slot_of(jnp.clip(i_b, 0, m - 1), c_b)
                stashed = [jax.lax.dynamic_index_in_dim(b, slot, 0, keepdims=False) for b in stash]
                if stage_remat:
                    stashed = chunk_forward(stashed[0], c_b)[1]
                dx, g_stack = chunk_backward(ct, stashed, c_b, g_stack)
                ct_in = jax.lax.ppermute(dx, axis, back)
                # stage 0's dx of its first chunk is microbatch i_b's input gradient: onto
                # the belt to its stage
                dbelt = select((s == 0) & (c_b == 0), dx, dbelt)
            if fwd:
                held = jax.lax.ppermute(y, axis, ahead)
            dx_out = keep_input_grad(dbelt, dx_out, t)
            return (held, ct_in, belt, jax.lax.ppermute(dbelt, axis, ahead), stash, dx_out,
                    g_stack, g_head, total), None

        g_stack = jax.tree.map(lambda a: jnp.zeros_like(a, jnp.float32), stack)
        carry = (x0, x0, x0, x0, jnp.zeros_like(x_in), g_stack,
                 jax.tree.map(jnp.zeros_like, head), jnp.zeros_like(x0, jnp.float32, shape=()))
        carry = jax.tree.map(lambda a: vary(a, manual), carry)
        carry = carry[:4] + (stash,) + carry[4:]

        def phase(carry, begin, end, fwd, bwd):
            step = partial(tick, fwd=fwd, bwd=bwd)
            return jax.lax.scan(step, carry, jnp.arange(begin, end), unroll=unroll())[0]

        last_forward = v * m + p - 1  # one past the last forward tick
        carry = phase(carry, 0, big - 1, True, False)  # warm-up
        carry = phase(carry, big - 1, last_forward, True, True)  # steady
        carry = phase(carry, last_forward, last_forward + big - 1, False, True)  # cool-down
        # the last input gradients still on the belt reach their stages
        end = last_forward + big - 1
        carry = phase(carry, end, end + p - 1, False, False)
        _, _, _, _, _, dx_out, g_stack, g_head, total = carry
        return stage_results(g_stack, g_head, total, dx_out, manual, axis)

    return run_stages(per_stage, blocks, head, x_in, labels, consts, axis, mesh,
                      batch_axis, seq_axis)


def loss_and_grads(blocks, head, x_in, labels, consts, schedule: Schedule, axis: str, mesh, *,
                   layer, loss, forward, active=None, batch_axis=None, seq_axis=None,
                   stage_remat: bool = False, scan: bool = True, split=None):
    """The summed loss of every microbatch through the pipeline and the loss head, as a
    function of (blocks, head, x_in) whose gradient is computed by 1F1B (`_train`), or by
    ZB-H1 (`zero_bubble.train`, which needs the model's `split` of the backward).
    `forward(blocks, head, x_in)` is the same loss without a gradient (the GPipe forward)."""
    kw = dict(labels=labels, consts=consts, schedule=schedule, axis=axis, mesh=mesh,
              layer=layer, loss=loss, active=active, batch_axis=batch_axis, seq_axis=seq_axis,
              stage_remat=stage_remat, scan=scan)
    if schedule.kind == "zb_h1":
        from .zero_bubble import train as zb_train

        train = partial(zb_train, split=split, **kw)
    else:
        train = partial(_train, **kw)

    @jax.custom_vjp
    def pipelined(blocks, head, x_in):
        return forward(blocks, head, x_in)

    def scaled(grads, ct):  # the gradients, times the loss's cotangent
        return jax.tree.map(lambda g: (ct * g).astype(g.dtype), grads)

    pipelined.defvjp(train, scaled)
    return pipelined(blocks, head, x_in)
