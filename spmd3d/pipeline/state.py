"""What a schedule's loop carries per device, and where it runs: the named buffers of a stage
(inboxes, stash, belts, sums) with their bookkeeping as methods, and `Placement`, the facts
every slot shares. `run.train` builds them; `executor.Executor` runs a slot's operations.

Every buffer is slot-major: slot i of each leaf is `buffer[i]`; a slot index of -1 means "none"
(a read gives slot 0's value, which the table never uses; a write does nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..manual import select, store_if, vary, varying
from .table import FORWARD, FULL, Table


def rings(p: int) -> tuple[list, list]:
    """`ppermute` pairs one stage ahead and one stage back round the ring of p stages."""
    return [(s, (s + 1) % p) for s in range(p)], [(s, (s - 1) % p) for s in range(p)]


def take(buffer, slot):
    """Slot `slot` (-1: any) of every leaf of a slot-major buffer."""
    slot = jnp.maximum(slot, 0)
    return jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, slot, 0, False), buffer)


def put(pred, buffer, slot, value, axis: int = 0):
    """`value` into slot `slot` of every leaf of `buffer` if `pred` (and the slot is >= 0)."""
    return jax.tree.map(lambda b, a: store_if(pred & (slot >= 0), b, jnp.maximum(slot, 0), a,
                                              axis), buffer, value)


def overwrite(buffer, slot, value):
    """`value` into slot `slot` (-1: slot 0, as `take` read it) of every leaf of `buffer`."""
    return jax.tree.map(lambda b, a: jax.lax.dynamic_update_index_in_dim(
        b, a, jnp.maximum(slot, 0), 0), buffer, value)


def feed_belt(x_in, feed, slot):
    """The input belt after this stage put its input slot `slot` (>= 0) on it."""
    mine = jax.lax.dynamic_index_in_dim(x_in, jnp.maximum(slot, 0), 1, keepdims=False)
    return select(slot >= 0, mine, feed)


@dataclass(frozen=True)
class Placement:
    """Where a lockstep or switch table runs: its stage axis (`axis`), every manual axis of the
    shard_map (`manual`: the stage's, and the data and ring axes that split the tokens), the
    layers of a chunk, and whether a pass stashes only its input (`stage_remat`)."""

    table: Table
    axis: str
    manual: tuple
    depth: int
    stage_remat: bool

    @property
    def others(self) -> tuple:
        """The manual axes besides the stage's: what the weights turn varying over."""
        return tuple(a for a in self.manual if a != self.axis)

    @property
    def cut(self) -> bool:
        """Whether the backward is split into B and W (a switch table)."""
        return self.table.mode == "switch"

    def rings(self) -> tuple[list, list]:
        return rings(self.table.stages)


class Inboxes(NamedTuple):
    x: jax.Array  # [x slots, mb, T, D]: activations waiting for their forward
    ct: jax.Array  # [ct slots, mb, T, D]: cotangents waiting for their backward


class Stash(NamedTuple):
    residuals: list  # [stash slots, layers per chunk, ...] leaves (stage remat: the input)
    inputs: object  # split: the projections' inputs, waiting for W ({} otherwise)
    taps: object  # split: the projections' output cotangents, waiting for W


class Belts(NamedTuple):
    feed: jax.Array  # the input belt, one stage back per slot
    give: jax.Array  # the input gradients' belt, one stage ahead per slot
    kept: jax.Array  # [mb, n, T, D]: the input gradients of the microbatches this stage fed


class Sums(NamedTuple):
    grads: object  # the stage's layers' gradients, fp32
    head: object  # the head's
    total: jax.Array  # the summed loss


class Done(NamedTuple):
    """What one operation hands back, a slot's worth (zeros where it has nothing)."""
    y: jax.Array  # sent ahead
    dx: jax.Array  # sent back
    residuals: list
    inputs: object
    taps: object
    grads: object
    head: object
    total: jax.Array
    dy: jax.Array  # the loss's gradient (the last virtual stage)


class State(NamedTuple):
    inbox: Inboxes
    stash: Stash
    belts: Belts
    sums: Sums

    @classmethod
    def initial(cls, where: Placement, worker, layout, x0, x_in, head, grad_zeros) -> "State":
        """Empty buffers of the table's slot counts, each varying over the manual axes (a
        stash leaf as its value does, and over the stage axis); `layout` the layer's vjp
        (`Worker.prepare`), x0 one microbatch, `grad_zeros()` the zero fp32 gradients."""
        table, manual, depth = where.table, where.manual, where.depth

        def zeros(shapes, vma=None):  # a buffer of stash slots per value, varying as it does
            vma = vma or [frozenset(manual)] * len(jax.tree.leaves(shapes))
            leaves, tree = jax.tree.flatten(shapes)
            return tree.unflatten([vary(jnp.zeros((table.stash_slots,) + r.shape, r.dtype),
                                        set(a) | {where.axis}) for r, a in zip(leaves, vma)])

        # what a pass stashes: its input alone under stage remat (the backward redoes the
        # forward), else its layers' residuals; split, also what its W waits for
        if where.stage_remat:
            residuals = zeros([jax.ShapeDtypeStruct(x0.shape, x0.dtype)],
                              [varying(jax.typeof(x0))])
        else:
            residuals = zeros([jax.ShapeDtypeStruct((depth,) + r.shape, r.dtype)
                               for r in layout.shapes], layout.vma)
        inputs = taps = {}
        if where.cut:
            inputs = zeros(jax.eval_shape(lambda x: worker.forward(x, 0, True)[2], x0))
            taps = zeros(jax.tree.map(lambda z: jax.ShapeDtypeStruct((depth,) + z.shape, z.dtype),
                                      worker.zeros))
        small = (jnp.zeros((table.x_slots,) + x0.shape, x0.dtype),
                 jnp.zeros((table.ct_slots,) + x0.shape, x0.dtype), x0, x0, jnp.zeros_like(x_in),
                 jax.tree.map(jnp.zeros_like, head), jnp.zeros_like(x0, jnp.float32, shape=()))
        box_x, box_ct, feed, give, kept, head0, total0 = jax.tree.map(
            lambda a: vary(a, manual), small)
        return cls(Inboxes(box_x, box_ct), Stash(residuals, inputs, taps),
                   Belts(feed, give, kept), Sums(grad_zeros(), head0, total0))

    def operands(self, op, feed):
        """(x, ct, held): the slots operation `op` reads: its input (off the belt, or its inbox
        slot), its cotangent, and its stash slot of each stashed kind."""
        x = select(op["x_at"] < 0, feed, take(self.inbox.x, op["x_at"]))
        ct = take(self.inbox.ct, op["ct_at"])
        return x, ct, tuple(take(buffer, op["stash"]) for buffer in self.stash)

    def record(self, op, out: Done, kinds: tuple, head_on: bool, where: Placement) -> "State":
        """The state after a lane (which runs `kinds`) wrote operation `op`'s results `out`:
        a forward's stash and, with the head, the loss's gradient into the cotangent inbox and
        the head's sums; split, what W waits for; the layers' gradients (added in place by a
        full backward, summed otherwise)."""
        kind, at = op["kind"], op["stash"]
        inbox, stash, sums = self.inbox, self.stash, self.sums
        if where.cut:  # each branch hands back every stash slot (`Executor.done`)
            stash = Stash(*(overwrite(b, at, v) for b, v in
                            zip(stash, (out.residuals, out.inputs, out.taps))))
        elif FORWARD in kinds:
            stash = stash._replace(residuals=put(kind == FORWARD, stash.residuals, at,
                                                 out.residuals))
        if FORWARD in kinds:
            if head_on:  # the loss's gradient, for this pass's backward
                inbox = inbox._replace(ct=put(kind == FORWARD, inbox.ct, op["dy_to"], out.dy))
                sums = sums._replace(head=jax.tree.map(jnp.add, sums.head, out.head),
                                     total=sums.total + out.total)
        if FULL in kinds:  # added in place by the backward
            sums = sums._replace(grads=out.grads)
        elif where.cut:
            sums = sums._replace(grads=jax.tree.map(jnp.add, sums.grads, out.grads))
        return self._replace(inbox=inbox, stash=stash, sums=sums)

    def shift(self, end, y, dx, feed, give, where: Placement) -> "State":
        """The slot's end: what it sent ahead (`y`) and back (`dx`) arrives at the neighbours'
        inboxes, the belts move one stage (the input belt back, the input gradients' ahead),
        and the input gradient on this stage's belt, if it fed that microbatch, is kept."""
        ahead, back = where.rings()
        inbox = self.inbox
        if y is not None:
            inbox = inbox._replace(x=put(True, inbox.x, end["x_to"],
                                         jax.lax.ppermute(y, where.axis, ahead)))
            feed = jax.lax.ppermute(feed, where.axis, back)
        if dx is not None:
            inbox = inbox._replace(ct=put(True, inbox.ct, end["ct_to"],
                                          jax.lax.ppermute(dx, where.axis, back)))
        kept = put(True, self.belts.kept, end["keep"], give, axis=1)
        belts = Belts(feed, jax.lax.ppermute(give, where.axis, ahead), kept)
        return self._replace(inbox=inbox, belts=belts)
