"""Pipeline parallelism over the `stage` mesh axis: a microbatched schedule as one `lax.scan`.

`stage(chunk, x)` applies one chunk of layers and knows nothing of microbatches; the schedule
here owns the ticks, the shift between stages and the bubble.

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

    def feed(self) -> np.ndarray:
        """[n, p]: the microbatch stage s holds in input slot j (-1: none), n = ceil(m/p):
        microbatch i on stage i mod p, so that stage 0 finds it on the belt at tick i."""
        p, m = self.stages, self.microbatches
        i = np.arange(-(-m // p) * p).reshape(-1, p)
        return np.where(i < m, i, -1)

    def collect(self) -> np.ndarray:
        """[n, p]: the microbatch stage s keeps in output slot j (-1: none): the belt carries
        microbatch i back from the last stage for as many ticks as later microbatches remain
        to finish, at most p - 1, so it stops at stage p - 1 - (m - 1 - i) mod p."""
        p, m = self.stages, self.microbatches
        j, s = np.arange(-(-m // p))[:, None], np.arange(p)[None, :]
        i = m - 1 - (j * p + p - 1 - s)
        return np.where(i >= 0, i, -1)

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


def _select(pred, a, b):
    """`a` where the scalar `pred` holds, else `b`: the predicate stays a scalar (jnp.where
    would broadcast it, and the backward would keep that [mb, T, D] mask per tick)."""
    return jax.tree.map(lambda x, y: jax.lax.select_n(pred, y, x), a, b)


def _store_if(pred, buffer, slot, value, axis: int):
    """`buffer` with `value` in `slot` along `axis` where `pred` holds, as it was elsewhere."""
    old = jax.lax.dynamic_index_in_dim(buffer, slot, axis, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, _select(pred, value, old), slot, axis)


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
    through unchanged. With the data axis manual, the weights turn data-varying once, before
    the tick loop: the transpose of that cast is the one gradient all-reduce over data, after
    the backward loop, instead of one per tick that XLA emits when it sees the data axis
    inside the loop.

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
    ahead = [(s, (s + 1) % p) for s in range(p)]
    back = [(s, (s - 1) % p) for s in range(p)]
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
        if batch_axis is not None:
            chunks = jax.lax.pcast(chunks, batch_axis, to="varying")
        s = jax.lax.axis_index(axis)
        keep = jnp.asarray(schedule.collect())  # [n, p] microbatch kept at (slot, stage)

        def tick(carry, t):
            held, belt, slots, out = carry
            # every p ticks each stage puts its next microbatch on the belt: stage 0 finds
            # microbatch t there at tick t
            mine = jax.lax.dynamic_index_in_dim(x_in, jnp.minimum(t // p, n - 1), 1,
                                                keepdims=False)
            coming = _select(t % p == 0, mine, belt[0])
            inp = _select((s == 0) & (t < m), coming, held)
            if v > 1:  # later repeats: what came back from the last stage
                again = jax.lax.dynamic_index_in_dim(slots, t % m, 0, keepdims=False)
                inp = _select((s == 0) & (t >= m), again, inp)
            r = jnp.clip((t - s) // m, 0, v - 1)  # this stage's repeat (chunk) at tick t
            y = run_stage(chunks, inp, r, consts)
            # the last stage finishes work item t - (p - 1); its last repeat goes on the belt
            done = t - (p - 1) - (v - 1) * m
            going = _select((s == p - 1) & (done >= 0), y, belt[1])
            # the belt holds what the last stage finished p - 1 - s ticks ago: kept if it is
            # the microbatch this stage collects
            i = done - (p - 1 - s)
            slot = jnp.clip((m - 1 - i) // p, 0, n - 1)
            ours = (i >= 0) & (i < m) & (keep[slot, s] == i)
            out = _store_if(ours, out, slot, going, 1)
            belt = jax.lax.ppermute(jnp.stack([coming, going]), axis, back)
            held = jax.lax.ppermute(y, axis, ahead)
            if v > 1:  # stage 0 files what came back (work item w) for its next repeat
                w = t - (p - 1)
                file = (s == 0) & (w >= 0) & (w < (v - 1) * m)
                slots = _store_if(file, slots, w % m, held, 0)
            return (held, belt, slots, out), None

        held = x_in[:, 0]
        carry = (held, jnp.stack([held, held]), jnp.zeros_like(held, shape=(m if v > 1 else 1,) +
                                                               held.shape), jnp.zeros_like(x_in))
        carry = jax.tree.map(lambda a: _vary(a, [axis]), carry)
        (_, _, _, out), _ = jax.lax.scan(tick, carry, jnp.arange(schedule.ticks), unroll=unroll())
        return out[None]

    buffer = P(axis, batch_axis, None, seq_axis)  # [p, mb, n, T, D]
    manual = {a for a in (axis, batch_axis, seq_axis) if a is not None}
    return jax.shard_map(per_stage, mesh=mesh, in_specs=(P(axis), buffer, P(None, seq_axis)),
                         out_specs=buffer, axis_names=manual)(chunks, x_in, consts)
