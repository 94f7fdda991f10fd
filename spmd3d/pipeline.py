"""Pipeline parallelism over the `stage` mesh axis: a microbatched schedule as one `lax.scan`.

`stage_fn(chunk_params, x)` applies one chunk of layers and knows nothing of microbatches; the
schedule here owns the ticks, the shift between stages and the bubble.

GPipe order with circular repeats: the L layers form v·p chunks of c = L/(v·p) layers, and
chunk k lives on stage k mod p. Work item w = r·m + i is microbatch i in repeat r; stage s
handles it at tick w + s. At each of the v·m + p − 1 ticks every stage runs its chunk on what
it holds (idle stages compute on stale data: the bubble is real compute in SPMD), then
activations shift one stage along the ring with `ppermute`. Stage 0 feeds work item t from slot
t mod m of its buffer, which starts as the microbatches and collects what comes back from the
last stage: the next repeat's input and, after the last repeat, the outputs. Autodiff of the
scan is the backward pipeline. The bubble is (p − 1)/(v·m + p − 1).
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

    def describe(self, num_layers: int) -> str:
        p, v = self.stages, self.repeats
        c = num_layers // (p * v)
        lines = [f"pipeline: p={p} stages, m={self.microbatches} microbatches, v={v} repeats, "
                 f"{self.ticks} ticks, bubble {self.bubble:.1%} (theory (p-1)/(v*m+p-1))"]
        for s in range(p):
            chunks = [f"{(r * p + s) * c}-{(r * p + s) * c + c - 1}" for r in range(v)]
            lines.append(f"  stage {s}: layers {', '.join(chunks)}")
        return "\n".join(lines)


def layer_order(num_layers: int, stages: int, repeats: int) -> np.ndarray:
    """Storage position -> canonical layer index. Stage s stores its chunks r = 0..v-1 in one
    contiguous block, so splitting the stored [L, ...] stack over `stage` hands every stage
    exactly its chunks. The identity unless v > 1."""
    c = num_layers // (stages * repeats)
    return np.array([(r * stages + s) * c + j
                     for s in range(stages) for r in range(repeats) for j in range(c)])


def reorder_layers(tree, order: np.ndarray, inverse: bool = False):
    """Apply `layer_order` (canonical -> storage) or its inverse to every stacked-block leaf
    (leaves under a `blocks` key) of a state pytree; other leaves pass through."""
    if np.array_equal(order, np.arange(len(order))):
        return tree
    index = np.argsort(order) if inverse else order

    def one(path, x):
        if any(getattr(k, "key", None) == "blocks" for k in path) and getattr(x, "ndim", 0):
            return jnp.take(x, index, axis=0)
        return x

    return jax.tree_util.tree_map_with_path(one, tree)


def run(stage_fn, stacked, x, consts, schedule: Schedule, axis: str, mesh, batch_axis=None,
        seq_axis=None):
    """Apply all layers to x[B, ...] through the pipeline (storage-ordered `stacked` [L, ...]).

    Per-device view inside a shard_map manual over `axis` (the stage axis) and, if given,
    `batch_axis` (the data axis, when the weights are not sharded over it) and `seq_axis` (the
    ring axis, when T is split); other mesh axes stay automatic, so tensor sharding propagates
    through unchanged. `consts` ([1, T, ...] arrays such as RoPE tables) reach `stage_fn(chunk,
    x, consts)` with their T split like x's. With the data axis
    manual, the weights turn data-varying once, before the tick loop: the transpose of that
    cast is the one gradient all-reduce over data, after the backward loop, instead of one per
    tick that XLA emits when it sees the data axis inside the loop.
    """
    p, m, v = schedule.stages, schedule.microbatches, schedule.repeats
    # [L, ...] -> [p, v, c, ...]: stage-major storage, so dim 0 splits over the stage axis
    chunks = jax.tree.map(lambda a: a.reshape((p, v, a.shape[0] // (p * v)) + a.shape[1:]), stacked)
    # microbatch j holds rows j, j+m, j+2m, ...: each data shard keeps its own rows
    micro = x.reshape((x.shape[0] // m, m) + x.shape[1:]).swapaxes(0, 1)
    ring = [(s, (s + 1) % p) for s in range(p)]

    def per_stage(chunks, buf, consts):
        # chunks[1, v, c, ...]: this stage's v chunks; buf[m, mb, ...]: stage 0's in/out slots
        chunks = jax.tree.map(lambda a: a[0], chunks)
        if batch_axis is not None:
            chunks = jax.lax.pcast(chunks, batch_axis, to="varying")
        s = jax.lax.axis_index(axis)

        def tick(carry, t):
            held, buf = carry
            # stage 0 feeds work item t from slot t mod m; the others run what they received
            inp = jnp.where(s == 0, jax.lax.dynamic_index_in_dim(buf, t % m, 0, keepdims=False), held)
            r = jnp.clip((t - s) // m, 0, v - 1)  # this stage's repeat (chunk) at tick t
            out = stage_fn(jax.tree.map(lambda a: a[r], chunks), inp, consts)
            held = jax.lax.ppermute(out, axis, ring)
            # stage 0 files what came back from the last stage: work item t + 1 - p
            slot, back = (t + 1 - p) % m, (s == 0) & (t + 1 - p >= 0)
            old = jax.lax.dynamic_index_in_dim(buf, slot, 0, keepdims=False)
            buf = jax.lax.dynamic_update_index_in_dim(buf, jnp.where(back, held, old), slot, 0)
            return (held, buf), None

        buf = jax.lax.pcast(buf, axis, to="varying")
        held = jnp.zeros_like(buf[0])
        (_, buf), _ = jax.lax.scan(tick, (held, buf), jnp.arange(schedule.ticks),
                                   unroll=unroll())
        return buf[None]

    io = P(None, batch_axis, seq_axis)  # [m, mb, T, ...]: rows over data, T over the ring
    manual = {a for a in (axis, batch_axis, seq_axis) if a is not None}
    out = jax.shard_map(per_stage, mesh=mesh, in_specs=(P(axis), io, P(None, seq_axis)),
                        out_specs=P(axis, *io), axis_names=manual)(chunks, micro, consts)[0]
    return out.swapaxes(0, 1).reshape(x.shape)
