"""The GPipe schedule (with circular repeats) as one `lax.scan` over ticks.

GPipe order with circular repeats: the L layers form v·p chunks of about L/(v·p) layers, and
chunk k lives on stage k mod p. Work item w = r·m + i is microbatch i in repeat r; stage s
handles it at tick w + s. At each of the v·m + p − 1 ticks every stage runs its chunk on what
it holds (idle stages compute on stale data: the bubble is real compute in SPMD), then
activations shift one stage along the ring with `ppermute`. The embedded microbatches come in,
and the finished ones go out, through buffers split over the stages (m/p microbatches each)
and a belt moving the other way round the ring: stage 0 starts microbatch t at tick t of the
first repeat, and later takes what came back from the last stage (a wrap-around slot per
microbatch). The embedding before and the head and loss after run outside, once per
microbatch in all. Autodiff of the scan is the backward pipeline. The bubble is
(p − 1)/(v·m + p − 1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ..manual import select, store_if, unroll, vary
from . import Schedule, next_input, rings


def run(blocks, x_in, consts, schedule: Schedule, axis: str, mesh, *, stage, active=None,
        batch_axis=None, seq_axis=None, stage_remat: bool = False):
    """Every microbatch of `x_in` carried through all layers by the pipeline: the training
    forward pass, whose autodiff is the backward pipeline.

    `x_in`, and what comes back, are [p, mb, n, T, D] buffers split over the stage axis:
    stage s holds the microbatches `Schedule.feed()[:, s]` of the input and
    `Schedule.collect()[:, s]` of the output, m/p each (slot j at [s, :, j]), so the embedding
    before and the head and loss after run once per microbatch in all, spread over the stages,
    instead of once per tick on every stage (see `step._pipelined_loss`). Inside, a belt moving one stage back each
    tick brings stage 0 the microbatch it starts (each stage puts its next one on the belt every
    p ticks) and takes each finished one from the last stage to the stage that keeps it (no
    drain ticks: the stage a microbatch stops at is where the belt has carried it by then).

    `blocks`: the stacked layer parameters in storage order ([L, ...] leaves); `consts`:
    [1, T, ...] arrays (RoPE tables); `active`: None, or which stored layer slots hold a layer
    (uneven stages: `stage` leaves its input unchanged in a padding slot). Every stage applies
    `stage(chunk, x, consts, active) -> x` to its chunk of layers at every tick.

    Per-device view inside a shard_map manual over `axis` (the stage axis) and, if given,
    `batch_axis` (the data axis; the weights must not be split over it) and `seq_axis` (the
    ring axis, when T is split); other mesh axes stay automatic, so tensor sharding propagates
    through unchanged. With the data (and ring) axes manual, the weights turn varying over
    them once, before the tick loop: the transpose of that cast is the one gradient
    all-reduce over them, after the backward loop, instead of one per tick and layer that XLA
    emits when it sees the axis inside the loop (with the ring: 1.5x the seq axis's bytes,
    d_model 1024, p = 2, m = 2).

    What the backward keeps per tick: with one chunk per stage (v = 1) the chunk is picked
    statically, so its weights are loop-invariant and never saved per tick. With v > 1 the
    chunk is picked by a traced repeat index; saved, that pick would be a copy of a chunk's
    weights per tick, so the pick and the stage are recomputed in the backward from the tick's
    input (a stage-level checkpoint), which `stage_remat` (`parallel.remat=stage`) also asks
    for with v = 1: then each tick keeps only its stage's input. The belt and the buffers are
    moved by linear operations only, so the backward keeps nothing of them per tick.
    """
    p, m, v = schedule.stages, schedule.microbatches, schedule.repeats
    # [L, ...] -> [p, v, c, ...]: stage-major storage, so dim 0 splits over the stage axis
    chunks = jax.tree.map(lambda a: a.reshape((p, v, a.shape[0] // (p * v)) + a.shape[1:]), blocks)
    ahead, back = rings(p)
    remat = jax.checkpoint_policies.nothing_saveable
    on = None if active is None else jnp.asarray(np.asarray(active).reshape(p, v, -1))

    def run_stage(chunks, inp, r, consts):
        chunk = jax.tree.map(lambda a: a[0] if v == 1 else a[r], chunks)
        mask = None if on is None else on[jax.lax.axis_index(axis), r]
        return stage(chunk, inp, consts, mask)

    if stage_remat or v > 1:
        run_stage = jax.checkpoint(run_stage, prevent_cse=False, policy=remat)

    def per_stage(chunks, x_in, consts):
        # chunks[1, v, c, ...]: this stage's v chunks; x_in[1, mb, n, T, D]: its microbatches
        chunks, x_in = jax.tree.map(lambda a: a[0], chunks), x_in[0]
        n = x_in.shape[1]
        varying = tuple(a for a in (batch_axis, seq_axis) if a is not None)
        chunks = jax.tree.map(lambda a: vary(a, varying), chunks)
        s = jax.lax.axis_index(axis)
        keep = jnp.asarray(schedule.collect())  # [n, p] microbatch kept at (slot, stage)

        def tick(carry, t):
            held, belt, slots, out = carry
            coming = next_input(x_in, belt[0], t, p)  # stage 0 finds microbatch t at tick t
            inp = select((s == 0) & (t < m), coming, held)
            if v > 1:  # later repeats: what came back from the last stage
                again = jax.lax.dynamic_index_in_dim(slots, t % m, 0, keepdims=False)
                inp = select((s == 0) & (t >= m), again, inp)
            r = jnp.clip((t - s) // m, 0, v - 1)  # this stage's repeat (chunk) at tick t
            y = run_stage(chunks, inp, r, consts)
            # the last stage finishes work item t - (p - 1); its last repeat goes on the belt
            done = t - (p - 1) - (v - 1) * m
            going = select((s == p - 1) & (done >= 0), y, belt[1])
            # the belt holds what the last stage finished p - 1 - s ticks ago: kept if it is
            # the microbatch this stage collects
            i = done - (p - 1 - s)
            slot = jnp.clip((m - 1 - i) // p, 0, n - 1)
            ours = (i >= 0) & (i < m) & (keep[slot, s] == i)
            out = store_if(ours, out, slot, going, 1)
            belt = jax.lax.ppermute(jnp.stack([coming, going]), axis, back)
            held = jax.lax.ppermute(y, axis, ahead)
            if v > 1:  # stage 0 files what came back (work item w) for its next repeat
                w = t - (p - 1)
                file = (s == 0) & (w >= 0) & (w < (v - 1) * m)
                slots = store_if(file, slots, w % m, held, 0)
            return (held, belt, slots, out), None

        held = x_in[:, 0]
        carry = (held, jnp.stack([held, held]), jnp.zeros_like(held, shape=(m if v > 1 else 1,) +
                                                               held.shape), jnp.zeros_like(x_in))
        carry = jax.tree.map(lambda a: vary(a, [axis]), carry)
        (_, _, _, out), _ = jax.lax.scan(tick, carry, jnp.arange(schedule.ticks), unroll=unroll())
        return out[None]

    buffer = P(axis, batch_axis, None, seq_axis)  # [p, mb, n, T, D]
    manual = {a for a in (axis, batch_axis, seq_axis) if a is not None}
    return jax.shard_map(per_stage, mesh=mesh, in_specs=(P(axis), buffer, P(None, seq_axis)),
                         out_specs=buffer, axis_names=manual)(chunks, x_in, consts)
