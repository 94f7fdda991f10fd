"""Pipeline parallelism over the `stage` mesh axis: microbatched schedules inside one program.

`stage(chunk, x)` applies one chunk of layers and knows nothing of microbatches; a schedule owns
the ticks, the shifts between stages and the bubble. Two schedules, one module each:
- `gpipe.run`: every forward tick, then (by autodiff of the tick scan) every backward tick; with
  circular repeats. It saves what the backward needs of all m microbatches.
- `one_f_one_b.loss_and_grads`: one forward and one backward per tick, the loss head on the last
  stage, so a stage keeps at most 2p - 1 microbatches' residuals whatever m is (interleaved
  with repeats).
- `zero_bubble.train` (through `one_f_one_b.loss_and_grads`): ZB-H1, the backward split into
  input and weight gradients, each stage running its own operation per slot from a table
  (interleaved with repeats).
Here: the `Schedule` (its ticks, bubble and in-flight microbatches), the order the stacked layers
are stored in, and the per-device helpers both schedules use.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ..manual import psum, select, vary

@dataclass(frozen=True)
class Schedule:
    stages: int  # p
    microbatches: int  # m
    repeats: int = 1  # v
    kind: str = "gpipe"  # gpipe | 1f1b | zb_h1

    @property
    def ticks(self) -> int:
        """Forward ticks (GPipe: and as many backward ticks), or 1F1B's ticks, each a forward
        and a backward on every stage but the p - 1 forward-only ticks of the warm-up and the
        p - 1 backward-only ticks of the cool-down, or ZB-H1's slots of one chunk's F, B or W
        each (its table's: 3 v m + p - 1 when m >= p)."""
        p, m, v = self.stages, self.microbatches, self.repeats
        if self.kind == "1f1b":  # v p - 1 forward-only, v m + p - v p, v p - 1 backward-only
            return v * m + (v + 1) * p - 2
        if self.kind == "zb_h1":
            return len(self.table().rows) - (p - 1)
        return v * m + p - 1

    def table(self):
        """ZB-H1's operations and buffer slots (`zb_table.zb_table`)."""
        from .zb_table import zb_table

        return zb_table(self.stages, self.microbatches, self.repeats)

    @property
    def flops_ratio(self) -> float:
        """Per-device layer FLOPs times p over those without a pipeline: (v·m + p − 1)/(v·m)
        for the lockstep schedules (every stage computes at every tick; 1F1B's warm-up and
        cool-down hold p - 1 forwards and p - 1 backwards); 1 for ZB-H1, whose idle slots
        compute nothing."""
        v, m = self.repeats, self.microbatches
        if self.kind == "zb_h1":
            return 1.0
        return (v * m + self.stages - 1) / (v * m)

    @property
    def bubble(self) -> float:
        """The idle fraction of each stage's time: (p - 1)/(v·m + p - 1) in lockstep, where
        F, B and W cost alike; ZB-H1's idle slots, p - 1 of 3vm + p - 1 when m >= p."""
        if self.kind == "zb_h1":
            return 1 - 3 * self.repeats * self.microbatches / self.ticks
        return 1 - 1 / self.flops_ratio

    @property
    def theory(self) -> str:
        return "(p-1)/(3*v*m+p-1)" if self.kind == "zb_h1" else "(p-1)/(v*m+p-1)"

    @property
    def in_flight(self) -> int:
        """Passes whose residuals the first stage keeps at once: all m microbatches under
        GPipe (v m chunk passes when circular); in 1F1B's lockstep ticks a microbatch's backward
        reaches stage s 2(p - 1 - s) ticks after its forward, so stage 0 keeps 2p - 1 (or m,
        if fewer); interleaved, 2 v p - 1 chunk passes, each 1/v of the stage's layers. ZB-H1
        keeps a pass from its forward to its W: min(p, m) microbatches, v p chunk passes
        interleaved (its table's peak)."""
        p, m, v = self.stages, self.microbatches, self.repeats
        if self.kind == "1f1b":
            return min(2 * p - 1, m) if v == 1 else 2 * p * v - 1
        if self.kind == "zb_h1":
            return self.table().stash_slots
        return v * m

    @property
    def in_flight_unit(self) -> str:
        return "microbatches" if self.repeats == 1 else "chunk passes"

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
        lines = [f"pipeline: {self.kind}, p={p} stages, m={self.microbatches} microbatches, "
                 f"v={v} repeats, {self.ticks} ticks, bubble {self.bubble:.1%} (theory "
                 f"{self.theory}), {self.in_flight} {self.in_flight_unit} in flight"]
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


def rings(p: int) -> tuple[list, list]:
    """`ppermute` pairs one stage ahead and one stage back round the ring of p stages."""
    return [(s, (s + 1) % p) for s in range(p)], [(s, (s - 1) % p) for s in range(p)]


def next_input(x_in, belt, t, period: int):
    """The input belt at tick t: every `period` ticks each stage puts its next microbatch (slot
    t // period of its share of `x_in`[mb, n, ...]) on the belt, which moves one stage back per
    tick, so stage 0 finds microbatch j p + s there at tick j period + s (`Schedule.feed` puts
    it on stage s): at tick i with period p, as GPipe and 1F1B take them; interleaved 1F1B
    takes p microbatches every p v ticks."""
    n = x_in.shape[1]
    mine = jax.lax.dynamic_index_in_dim(x_in, jnp.minimum(t // period, n - 1), 1, keepdims=False)
    return select(t % period == 0, mine, belt)


def split_residuals(vjp_fn, known):
    """(residuals to stash, where): the vjp's leaves that are not one of `known`'s leaves (the
    layer's weights and the RoPE tables: a residual that is one is the very same value), and
    for each leaf the index of the known value it is (None: stashed)."""
    index = {id(w): k for k, w in enumerate(jax.tree.leaves(known))}
    leaves = jax.tree.leaves(vjp_fn)
    where = tuple(index.get(id(leaf)) for leaf in leaves)
    return [leaf for leaf, k in zip(leaves, where) if k is None], where


def rebuild(treedef, where, stashed, known):
    """The vjp function of a stashed forward, its known values put back."""
    known, stashed = jax.tree.leaves(known), iter(stashed)
    return jax.tree.unflatten(treedef, [next(stashed) if k is None else known[k] for k in where])


def head_grads(loss, head, labels, y, i, last, manual):
    """If `last` (the last virtual stage's forward): (loss, dloss/dy, dloss/dhead) of
    microbatch i's output y (labels[m, ...]; `loss(head, y, labels)` its summed loss), else
    zeros."""
    m = labels.shape[0]
    lab = jax.lax.dynamic_index_in_dim(labels, jnp.clip(i, 0, m - 1), 0, keepdims=False)
    lab = vary(jnp.where((i >= 0) & (i < m), lab, -1), manual)  # -1: not counted

    def compute():
        total, vjp_fn = jax.vjp(lambda h, y: loss(h, y, lab), head, y)
        d_head, d_y = vjp_fn(jnp.ones_like(total))
        return total, d_y, d_head

    def skip():
        return (jnp.zeros_like(y, jnp.float32, shape=()), jnp.zeros_like(y),
                jax.tree.map(jnp.zeros_like, head))

    return jax.lax.cond(last, compute, skip)


def stage_results(g_stack, g_head, total, dx_out, manual: tuple, axis: str):
    """What a schedule's per-stage function returns, its sums done: the stage's layer
    gradients summed over the manual axes but the stage's (once, after the loop), the loss and
    head gradients over all of them."""
    others = tuple(a for a in manual if a != axis)
    g_stack = psum(g_stack, others) if others else g_stack
    return (psum(total, manual), jax.tree.map(lambda a: a[None], g_stack),
            psum(g_head, manual), dx_out[None])


def run_stages(per_stage, blocks, head, x_in, labels, consts, axis: str, mesh, batch_axis,
               seq_axis):
    """(summed loss, (block grads, head grads, input grads)): `per_stage(stack, head, x_in,
    labels, consts)` in a shard_map manual over `axis` (and `batch_axis`, `seq_axis` where
    given), each stage given its [L/p, ...] share of `blocks` in storage order and its share
    of the x_in[p, mb, n, T, D] buffers; gradients cast back to the parameters' dtypes."""
    from jax.sharding import PartitionSpec as P

    p = mesh.shape[axis]
    stacks = jax.tree.map(lambda a: a.reshape((p, a.shape[0] // p) + a.shape[1:]), blocks)
    manual = {a for a in (axis, batch_axis, seq_axis) if a is not None}
    buffer = P(axis, batch_axis, None, seq_axis)  # [p, mb, n, T, D]
    total, g_stack, g_head, dx = jax.shard_map(
        per_stage, mesh=mesh, axis_names=manual,
        in_specs=(P(axis), P(), buffer, P(None, batch_axis, seq_axis), P(None, seq_axis)),
        out_specs=(P(), P(axis), P(), buffer))(stacks, head, x_in, labels, consts)
    g_blocks = jax.tree.map(lambda g, b: g.reshape(b.shape).astype(b.dtype), g_stack, blocks)
    return total, (g_blocks, jax.tree.map(lambda g, h: g.astype(h.dtype), g_head, head), dx)
