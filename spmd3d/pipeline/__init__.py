"""Pipeline parallelism over the `stage` mesh axis: microbatched schedules inside one program.

A schedule is a table (`table.build`): the operation each stage runs in each slot, and the
buffer slot every value waits in. GPipe, 1F1B (interleaved with circular repeats) and ZB-H1
are three tables; one runtime (`run`) executes any of them, with one stage worker (`worker`)
for the forward that stashes, the backward in place and W. `Schedule` replays the table for
every figure the planner and the logs use (ticks, bubble, in-flight passes, shifts, FLOPs).
Here also: the order the stacked layers are stored in.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from .table import build


@dataclass(frozen=True)
class Schedule:
    stages: int  # p
    microbatches: int  # m
    repeats: int = 1  # v
    kind: str = "gpipe"  # gpipe | 1f1b | zb_h1

    def table(self):
        return build(self.kind, self.stages, self.microbatches, self.repeats)

    @property
    def ticks(self) -> int:
        """Slots that compute: GPipe's forward slots (as many backward ones mirror them),
        1F1B's slots of a forward and a backward lane, ZB-H1's slots of one F, B or W."""
        return self.table().ticks

    @property
    def head_inside(self) -> bool:
        """Whether the loss head runs inside the schedule, on the last stage per microbatch
        (1F1B, ZB-H1), or after it, spread over the stages (GPipe)."""
        return self.table().mode != "autodiff"

    @property
    def mode(self) -> str:
        """How the table runs (`table.Table.mode`): autodiff, lockstep or switch."""
        return self.table().mode

    @property
    def recomputes_stage(self) -> bool:
        """Whether the backward redoes each stage's forward from its input whatever the remat
        policy: an autodiff table with v > 1 picks its chunk by a traced index, which it
        checkpoints rather than save a copy of a chunk's weights per slot (`run.forward`)."""
        return self.mode == "autodiff" and self.repeats > 1

    @property
    def saved_passes(self) -> int:
        """Passes whose residuals a stage holds at the backward's start: every slot's under
        autodiff (bubbles included), else the stash's."""
        return self.ticks if self.mode == "autodiff" else self.in_flight

    @property
    def forwards(self) -> int:
        """Chunk forwards a stage computes, bubbles included (as many backwards)."""
        return self.table().forwards()

    @property
    def head_runs(self) -> int:
        """Slots a stage's loop holds the head's conditional in: a lockstep table's phases
        with a last virtual stage's forward in them, a switch's last-stage forwards."""
        table = self.table()
        if table.mode == "switch":
            return int((table.op("dy_to") >= 0).sum())
        return sum(e - b for b, e, _, head in table.phases() if head)

    def shifts(self) -> int:
        """Microbatch-sized values moved between neighbouring stages per step."""
        return sum(self.table().shifts().values())

    @property
    def flops_ratio(self) -> float:
        """Per-device layer FLOPs times p over those without a pipeline: (v·m + p − 1)/(v·m)
        for the lockstep schedules (every stage computes at every slot of a lane's phases);
        1 for ZB-H1, whose idle slots compute nothing."""
        return self.table().flops_ratio

    @property
    def bubble(self) -> float:
        """The idle fraction of each stage's time: (p - 1)/(v·m + p - 1) in lockstep;
        ZB-H1's idle slots, p - 1 of 3vm + p - 1 when m >= p."""
        return self.table().bubble

    @property
    def theory(self) -> str:
        """The closed form `bubble` replays: a switch's idle slots cost one unit of three."""
        return "(p-1)/(3*v*m+p-1)" if self.mode == "switch" else "(p-1)/(v*m+p-1)"

    @property
    def in_flight(self) -> int:
        """Passes whose residuals a stage keeps at once (the table's stash slots): all v m
        under GPipe; 1F1B's stage 0 keeps min(2p - 1, m); ZB-H1 keeps a pass from its forward
        to its W, min(p, m) microbatches (v p chunk passes interleaved)."""
        return self.table().in_flight

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
