"""Pipeline parallelism over the `stage` mesh axis: a microbatched schedule as one `lax.scan`.

`stage(chunk, x)` applies one chunk of layers and knows nothing of microbatches; the schedule
here owns the ticks, the shift between stages and the bubble.

GPipe order with circular repeats: the L layers form v·p chunks of about L/(v·p) layers, and
chunk k lives on stage k mod p. Work item w = r·m + i is microbatch i in repeat r; stage s
handles it at tick w + s. At each of the v·m + p − 1 ticks every stage runs its chunk on what
it holds (idle stages compute on stale data: the bubble is real compute in SPMD), then
activations shift one stage along the ring with `ppermute`. Stage 0 embeds microbatch t at
tick t of the first repeat, and later takes what came back from the last stage (a wrap-around
slot per microbatch); the last stage computes a microbatch's loss when it leaves its last
repeat. Autodiff of the scan is the backward pipeline. The bubble is (p − 1)/(v·m + p − 1).
"""

from __future__ import annotations

from contextlib import contextmanager
import contextvars
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

_UNROLL = contextvars.ContextVar("spmd3d_unroll", default=False)


@contextmanager
def unrolled_loops(on: bool = True):
    """Trace the tick and layer scans fully unrolled: XLA's cost analysis counts a loop body
    once, so FLOP checks of a schedule need the loops unrolled (tests only: slow to compile)."""
    token = _UNROLL.set(on)
    try:
        yield
    finally:
        _UNROLL.reset(token)


def unroll() -> bool:
    return _UNROLL.get()


@dataclass(frozen=True)
class Schedule:
    stages: int  # p
    microbatches: int  # m
    repeats: int = 1  # v

    @property
    def ticks(self) -> int:
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        return (self.stages - 1) / self.ticks

    def describe(self, order) -> str:
        """The schedule and, per stage, the canonical layers of each of its chunks, from the
        storage order (`layer_order`)."""
        p, v = self.stages, self.repeats
        c = len(order) // (p * v)
        lines = [f"pipeline: p={p} stages, m={self.microbatches} microbatches, v={v} repeats, "
                 f"{self.ticks} ticks, bubble {self.bubble:.1%} (theory (p-1)/(v*m+p-1))"]
        for s in range(p):
            chunks = []
            for r in range(v):
                layers = [i for i in order[(s * v + r) * c:(s * v + r + 1) * c] if i >= 0]
                chunks.append(f"{layers[0]}-{layers[-1]}" if layers else "none")
            lines.append(f"  stage {s}: layers {', '.join(chunks)}")
        return "\n".join(lines)


def layer_order(num_layers: int, stages: int, repeats: int) -> np.ndarray:
    """Storage position -> canonical layer index, -1 for a padding slot. The L layers form
    K = v·p chunks (chunk k on stage k mod p) of c = ceil(L/K) slots; when K does not divide L,
    the last chunk, the first, the second-to-last, the second... each hold one layer fewer
    (so LLaMA-3 405B's 126 layers on 16 stages run 7 on the first and last stage, 8 on the
    others, as Meta ran it: those stages also hold the embedding and the head), the empty slot
    at the chunk's end. Stage s stores its chunks r = 0..v-1 in one contiguous block, so
    splitting the stored stack over `stage` hands every stage exactly its chunks. The identity
    unless v > 1 or K does not divide L."""
    k = stages * repeats
    c = -(-num_layers // k)
    fewer = [k - 1 - i // 2 if i % 2 == 0 else i // 2 for i in range(k * c - num_layers)]
    sizes = [c - (chunk in fewer) for chunk in range(k)]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return np.array([starts[r * stages + s] + j if j < sizes[r * stages + s] else -1
                     for s in range(stages) for r in range(repeats) for j in range(c)])


def reorder_layers(tree, order: np.ndarray, inverse: bool = False):
    """Apply `layer_order` (canonical [L, ...] -> storage, padding slots zero) or its inverse
    to every stacked-block leaf (leaves under a `blocks` key) of a state pytree; other leaves
    pass through."""
    order = np.asarray(order)
    if np.array_equal(order, np.arange(len(order))):
        return tree
    pad = order < 0
    if inverse:  # the storage position of each canonical layer
        index = np.array([np.flatnonzero(order == c)[0] for c in range(int((~pad).sum()))])
    else:
        index = np.where(pad, 0, order)

    def one(path, x):
        if not (any(getattr(k, "key", None) == "blocks" for k in path) and getattr(x, "ndim", 0)):
            return x
        x = jnp.take(x, index, axis=0)
        if inverse or not pad.any():
            return x
        return jnp.where(pad.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.zeros_like(x), x)

    return jax.tree_util.tree_map_with_path(one, tree)


def _varying(x) -> frozenset:
    """The manual axes a traced value varies over (inside a shard_map)."""
    vma = getattr(x, "manual_axis_type", None)
    return frozenset(vma.varying) if vma is not None else frozenset(getattr(x, "vma", ()))


def _vary(x, axes):
    """`x` cast to varying over `axes` (those it does not vary over already)."""
    todo = tuple(a for a in axes if a not in _varying(jax.typeof(x)))
    return jax.lax.pcast(x, todo, to="varying") if todo else x


def run(blocks, io, xs, consts, schedule: Schedule, axis: str, mesh, *, first, stage, last,
        active=None, batch_axis=None, seq_axis=None, stage_remat: bool = False):
    """The summed `last` of every microbatch of `xs`, each carried through all layers by the
    pipeline: the training forward pass, whose autodiff is the backward pipeline.

    `blocks`: the stacked layer parameters in storage order ([L, ...] leaves); `io`: the
    parameters of `first` and `last` (the embedding, head and final norm), whole on every stage;
    `xs`: per-example arrays [B, ...] (tokens and labels), cut into m microbatches (microbatch
    j holds rows j, j+m, ...: each data shard keeps its own rows); `consts`: [1, T, ...] arrays
    (RoPE tables); `active`: None, or which stored layer slots hold a layer (uneven stages:
    `stage` leaves its input unchanged in a padding slot). Stage 0 computes
    `first(blocks, io, xs_mb) -> x` (the embedding) for each microbatch the tick it enters;
    every stage applies `stage(chunk, x, consts, active) -> x` to its chunk of layers; the last
    stage computes `last(blocks, io, x, xs_mb) -> scalar` (head and
    loss) the tick a microbatch leaves its last repeat. So no [m, mb, T, D] buffer of
    activations exists (but the wrap-around slots of a circular pipeline), and one
    microbatch's logits are alive at a time. (`blocks` reach `first` and `last` as this
    stage's local chunks, so that a caller can rebuild its module from `blocks` and `io`.)

    Per-device view inside a shard_map manual over `axis` (the stage axis) and, if given,
    `batch_axis` (the data axis, when the weights are not sharded over it) and `seq_axis` (the
    ring axis, when T is split); other mesh axes stay automatic, so tensor sharding propagates
    through unchanged. With the data axis manual, the weights turn data-varying once, before
    the tick loop: the transpose of that cast is the one gradient all-reduce over data, after
    the backward loop, instead of one per tick that XLA emits when it sees the data axis
    inside the loop.

    What the backward keeps per tick: with one chunk per stage (v = 1) the chunk is picked
    statically, so its weights are loop-invariant and never saved per tick. With v > 1 the
    chunk is picked by a traced repeat index; saved, that pick would be a copy of a chunk's
    weights per tick, so the pick and the stage are recomputed in the backward from the tick's
    input (a stage-level checkpoint), which `stage_remat` (`parallel.remat=stage`) also asks
    for with v = 1: then each tick keeps only its stage's input.
    """
    p, m, v = schedule.stages, schedule.microbatches, schedule.repeats
    # [L, ...] -> [p, v, c, ...]: stage-major storage, so dim 0 splits over the stage axis
    chunks = jax.tree.map(lambda a: a.reshape((p, v, a.shape[0] // (p * v)) + a.shape[1:]), blocks)
    micro = jax.tree.map(lambda a: a.reshape((a.shape[0] // m, m) + a.shape[1:]).swapaxes(0, 1), xs)
    ring = [(s, (s + 1) % p) for s in range(p)]

    remat = jax.checkpoint_policies.nothing_saveable
    stage_level = stage_remat or v > 1

    on = None if active is None else jnp.asarray(np.asarray(active).reshape(p, v, -1))

    def run_stage(chunks, inp, r, consts):
        chunk = jax.tree.map(lambda a: a[0] if v == 1 else a[r], chunks)
        mask = None if on is None else on[jax.lax.axis_index(axis), r]
        return stage(chunk, inp, consts, mask)

    def per_stage(chunks, io, micro, consts):
        # chunks[1, v, c, ...]: this stage's v chunks; micro[m, mb, ...]: every microbatch
        chunks = jax.tree.map(lambda a: a[0], chunks)
        # `io` turns stage-varying here, once: the transpose of this cast is the one sum over
        # the stages of its gradient, after the backward loop, not one per tick
        io = jax.lax.pcast(io, axis, to="varying")
        if batch_axis is not None:
            chunks, io = jax.lax.pcast((chunks, io), batch_axis, to="varying")
        s = jax.lax.axis_index(axis)

        def pick(i):
            return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False),
                                micro)

        def masked(pred, fn, *args):
            """fn(*args) where `pred` holds on this device, zeros elsewhere. Every stage computes
            it: a per-device `lax.cond` would not, but XLA cannot partition a conditional whose
            backward returns gradients of tensor-sharded weights (the embedding's, the
            head's). In lockstep the cost is FLOPs, not time: each tick lasts as long as the
            stage that runs the head anyway."""
            return jax.tree.map(lambda y: jnp.where(pred, y, jnp.zeros_like(y)), fn(*args))

        def drain(chunks, io, x, i, final):  # the loss of a finished microbatch, or 0
            return masked(final, lambda x, i: last(chunks, io, x, pick(i)), x, i)

        def work(chunks, io, inp, r, consts, i, final):
            out = run_stage(chunks, inp, r, consts)
            return out, drain(chunks, io, out, i, final)

        # What the backward keeps of a tick. Stage-level: its input alone (stage and head are
        # recomputed). Else: the layers' own remat policy, and the head's input and labels.
        if stage_level:
            work = jax.checkpoint(work, prevent_cse=False, policy=remat)
        else:
            drain = jax.checkpoint(drain, prevent_cse=False, policy=remat)
        feed = jax.checkpoint(lambda chunks, io, i: first(chunks, io, pick(i)),
                              prevent_cse=False, policy=remat)  # keeps the tokens alone

        def tick(carry, t):
            held, slots, total = carry
            # stage 0 embeds microbatch t in the first repeat, then takes what came back
            fresh = masked((s == 0) & (t < m), feed, chunks, io, jnp.minimum(t, m - 1))
            inp = jnp.where(s == 0, fresh, held)
            if v > 1:
                back = jax.lax.dynamic_index_in_dim(slots, t % m, 0, keepdims=False)
                inp = jnp.where((s == 0) & (t >= m), back, inp)
            r = jnp.clip((t - s) // m, 0, v - 1)  # this stage's repeat (chunk) at tick t
            # the last stage finishes work item w = t - (p - 1): the loss, once it is final
            w = t - (p - 1)
            final = (s == p - 1) & (w >= (v - 1) * m) & (w < v * m)
            out, loss = work(chunks, io, inp, r, consts, jnp.clip(w - (v - 1) * m, 0, m - 1), final)
            total = total + loss
            held = jax.lax.ppermute(out, axis, ring)
            if v > 1:  # stage 0 files what came back (work item w) for its next repeat
                slot, keep = w % m, (s == 0) & (w >= 0) & (w < (v - 1) * m)
                old = jax.lax.dynamic_index_in_dim(slots, slot, 0, keepdims=False)
                slots = jax.lax.dynamic_update_index_in_dim(slots, jnp.where(keep, held, old),
                                                            slot, 0)
            return (held, slots, total), None

        # carries typed like what the ticks put in them (varying over every manual axis); the
        # embedding computed here for its type only is dead code to XLA
        held = _vary(jnp.zeros_like(first(chunks, io, pick(0))), [axis])
        slots = jnp.zeros_like(held, shape=(m if v > 1 else 1,) + held.shape)
        total = jnp.zeros_like(held, jnp.float32, shape=())
        (_, _, total), _ = jax.lax.scan(tick, (held, slots, total), jnp.arange(schedule.ticks),
                                        unroll=unroll())
        manual = tuple(a for a in (axis, batch_axis, seq_axis) if a is not None)
        return jax.lax.psum(total, manual)

    rows = P(None, batch_axis, seq_axis)  # [m, mb, T, ...]: rows over data, T over the ring
    manual = {a for a in (axis, batch_axis, seq_axis) if a is not None}
    return jax.shard_map(per_stage, mesh=mesh,
                         in_specs=(P(axis), P(), jax.tree.map(lambda _: rows, micro),
                                   P(None, seq_axis)),
                         out_specs=P(), axis_names=manual)(chunks, io, micro, consts)
