"""A table's slot on one stage, per device: one small executor per operation kind (forward,
backward, weight, idle), a lane that picks among them, and the slot that runs its lanes and
moves the buffers (`state.State`), as PyTorch's pipelining runtime dispatches on an action's
kind. `run.train` scans `Executor.slot` over each phase of the table.

Each operation sees one slot of each buffer (read before it) and hands back one slot's worth
(`Done`, written after it), so that no buffer passes through a switch: XLA:CPU copies every
buffer a conditional inside a loop updates in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..manual import select, vary, varying
from .state import Done, Placement, State, feed_belt
from .table import BACKWARD, END, FORWARD, FULL, IDLE, OP, WEIGHT
from .worker import consts_of, head_grads


def zero_grads(stack, manual):
    """Zero fp32 gradients of a stage's stack, varying over the manual axes."""
    return jax.tree.map(lambda a: vary(jnp.zeros_like(a, jnp.float32), manual), stack)


class Executor:
    """Stage `s`'s operations on the buffers of `State`: `worker` runs its layers, `loss(head,
    y, labels, consts)` a microbatch's summed loss; x_in[mb, n, T, D] the microbatches this stage
    feeds in; `like`, the loop's initial state, shapes what an operation hands back; `ops`
    and `ends` the table's arrays."""

    def __init__(self, where: Placement, s, worker, loss, head, x_in, labels, consts, segments,
                 stack, like: State, ops, ends):
        self.where, self.s, self.worker, self.loss = where, s, worker, loss
        self.head, self.x_in, self.labels = head, x_in, labels
        self.consts, self.segments = consts, segments
        self.stack, self.like, self.ops, self.ends = stack, like, ops, ends

    def grad_zeros(self):
        return zero_grads(self.stack, self.where.manual)

    def done(self, held=None, **given) -> Done:
        """An operation's results, each varying as the buffer it goes to (a constant residual,
        as the gathered attention's key positions, is invariant); shaped by the buffers before
        the loop, never by a carried one. In a switch, a stash slot the operation does not
        write is handed back as it was read (`held`, `State.operands`), so that the slot is
        written whatever the branch, without a second read of it to keep."""
        like = self.like
        buffers = dict(y=like.inbox.x, dx=like.inbox.x, residuals=like.stash.residuals,
                       inputs=like.stash.inputs, taps=like.stash.taps, dy=like.inbox.x)
        kept = dict(zip(like.stash._fields, held)) if self.where.cut else {}
        out = {}
        for name, buffer in buffers.items():
            nothing = jax.tree.map(lambda b: jnp.zeros_like(b[0]), buffer)
            value = given.get(name, kept.get(name))
            out[name] = nothing if value is None else jax.tree.map(
                lambda a, b: vary(a, varying(jax.typeof(b))), value, nothing)
        return Done(grads=given.get("grads", self.grad_zeros()),
                    head=given.get("head", jax.tree.map(jnp.zeros_like, like.sums.head)),
                    total=given.get("total", jnp.zeros_like(like.sums.total)), **out)

    def _consts(self, op):
        return consts_of(self.consts, self.segments, op["mb"])

    # the operations: (op, x, ct, held) -> Done ------------------------------------------------
    def forward(self, op, x, ct, held, head_on=True):
        where = self.where
        y, res, ins = self.worker.forward(x, op["c"], where.cut, self._consts(op))
        # what the pass stashes (W's inputs: from B under stage remat, which redoes this)
        kept = {"residuals": [x]} if where.stage_remat else {"residuals": res, "inputs": ins}
        if not head_on:
            return self.done(held, y=y, **kept)
        total, dy, d_head = head_grads(self.loss, self.head, self.labels, y,
                                       self._consts(op), op["mb"],
                                       (op["kind"] == FORWARD) & (op["dy_to"] >= 0),
                                       where.manual)
        return self.done(held, y=y, head=d_head, total=total, dy=dy, **kept)

    def backward(self, op, x, ct, held, grads=None):
        residuals, inputs, cut = held[0], None, self.where.cut
        known = self._consts(op)
        if self.where.stage_remat:  # the forward again, from the chunk's input
            _, residuals, inputs = self.worker.forward(residuals[0], op["c"], cut, known)
        dx, d_taps, grads = self.worker.backward(
            ct, residuals, op["c"], self.grad_zeros() if grads is None else grads, cut, known)
        redone = {} if inputs is None else {"inputs": inputs}  # split, under stage remat
        return self.done(held, dx=dx, taps=d_taps, grads=grads, **redone)

    def weight(self, op, x, ct, held):
        return self.done(held, grads=self.worker.weight(held[1], held[2], op["c"],
                                                        self.grad_zeros()))

    def idle(self, op, x, ct, held):
        return self.done(held)

    # a lane, a slot ------------------------------------------------------------------------
    def lane(self, state: State, op, feed, lane: int, head_on: bool) -> Done:
        """One lane's operation: a lockstep lane computes whatever its kind (a bubble forward
        stores nothing, a bubble backward gets a zero cotangent), a switch runs only the
        stage's own."""
        kinds = self.where.table.lane_kinds(lane)
        x, ct, held = state.operands(op, feed)
        if self.where.cut:
            branch = jnp.asarray([kinds.index(k) if k in kinds else 0 for k in range(5)])
            run = {IDLE: self.idle, FORWARD: self.forward, BACKWARD: self.backward,
                   WEIGHT: self.weight}
            return jax.lax.switch(branch[op["kind"]], [run[k] for k in kinds], op, x, ct, held)
        if FORWARD in kinds:
            return self.forward(op, x, ct, held, head_on)
        ct = select(op["kind"] == FULL, ct, jnp.zeros_like(ct))
        return self.backward(op, x, ct, held, grads=state.sums.grads)

    def slot(self, state: State, t, lanes_on: tuple, head_on: bool):
        """Slot `t` on this stage: the input belt takes this stage's microbatch if it feeds
        one now, each lane runs its operation and writes its results, then everything sent
        moves one stage."""
        where, s = self.where, self.s
        end = dict(zip(END, self.ends[t, s]))
        feed = feed_belt(self.x_in, state.belts.feed, end["put"])
        give, y, dx = state.belts.give, None, None
        for k, on in enumerate(lanes_on):
            if not on:
                continue
            kinds = where.table.lane_kinds(k)
            op = dict(zip(OP, self.ops[t, s, k]))
            op["c"] = jnp.maximum(op["chunk"], 0)
            out = self.lane(state, op, feed, k, head_on)
            if FORWARD in kinds:
                y = out.y
            if {BACKWARD, FULL} & set(kinds):
                dx = out.dx
                # stage 0's first chunk's backward gave microbatch i's input gradient: onto
                # the belt to its stage
                give = select((s == 0) & ((op["kind"] == BACKWARD) | (op["kind"] == FULL))
                              & (op["chunk"] == 0), dx, give)
            state = state.record(op, out, kinds, head_on, where)
        return state.shift(end, y, dx, feed, give, where), None
