"""ZB-H1's table (`zero_bubble`): the operation each stage runs in each slot, and the buffer
slot of every value a stage stashes or receives. Plain numpy, worked out once per (p, m, v)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

IDLE, FORWARD, BACKWARD, WEIGHT = 0, 1, 2, 3
# a table row per slot and stage: the operation (kind, microbatch, chunk); the stash slot of its
# pass; the inbox slots its forward reads the activation from (-1: the input belt) and its
# backward the cotangent from; the inbox slots what arrives at the slot's end goes to
# (activation, cotangent; -1: nothing) and the last virtual stage's loss gradient; the input
# slot put on the belt and the slot an input gradient is kept in (-1: none)
FIELDS = ("kind", "mb", "chunk", "stash", "x_at", "ct_at", "x_to", "ct_to", "dy_to", "put",
          "keep")


def passes(p: int, m: int, v: int, backward: bool = False) -> list[tuple[int, int]]:
    """(microbatch, chunk) in the order each stage runs its forwards (or backwards): groups of
    p microbatches, each through chunks 0..v-1 (backward: v-1..0)."""
    chunks = range(v - 1, -1, -1) if backward else range(v)
    return [(i, c) for g in range(0, m, p) for c in chunks for i in range(g, min(g + p, m))]


def stage_order(p: int, m: int, s: int, v: int = 1) -> list[tuple[int, int, int]]:
    """Stage s's operations in order, (kind, microbatch, chunk): V - s forwards, then for each
    pass its B, the W of the pass s before (stage s defers its W's by s, so the last stage's
    B's go back at once and stage 0, which waits longest, defers none), and the next forward;
    the deferred W's at the end."""
    forwards, backwards = passes(p, m, v), passes(p, m, v, backward=True)
    warm = min(v * p - s, len(forwards))
    ops = [(FORWARD, i, c) for i, c in forwards[:warm]]
    waiting = []
    for k, (i, c) in enumerate(backwards):
        ops.append((BACKWARD, i, c))
        waiting.append((i, c))
        if len(waiting) > s:
            ops.append((WEIGHT, *waiting.pop(0)))
        if warm + k < len(forwards):
            ops.append((FORWARD, *forwards[warm + k]))
    return ops + [(WEIGHT, i, c) for i, c in waiting]


def _colour(spans: dict) -> tuple[dict, int]:
    """({key: slot}, slots) for values live over spans {key: (stored, last read)}, in slots: a
    slot is free again from the slot its value is last read in (a slot reads its buffers
    before it stores), and taking spans by their start, the fewest slots: as many as values
    are live at once."""
    free, slot_of = [], {}
    for key, (stored, read) in sorted(spans.items(), key=lambda kv: kv[1]):
        k = next((k for k, f in enumerate(free) if f <= stored), len(free))
        free[k:k + 1] = [read]
        slot_of[key] = k
    return slot_of, max(len(free), 1)


def _per_stage(spans: dict) -> tuple[dict, int]:
    """`_colour` on each stage's spans (keyed (stage, ...)): each stage its own buffer, as many
    slots as the fullest stage's."""
    slot_of, slots = {}, 1
    for s in sorted({key[0] for key in spans}):
        one, k = _colour({key: span for key, span in spans.items() if key[0] == s})
        slot_of.update(one)
        slots = max(slots, k)
    return slot_of, slots


@dataclass(frozen=True)
class Table:
    rows: np.ndarray  # [slots, p, len(FIELDS)] int32
    stash_slots: int
    x_slots: int  # activations waiting for their forward
    ct_slots: int  # cotangents waiting for their backward

    def field(self, name: str) -> np.ndarray:
        return self.rows[..., FIELDS.index(name)]


@lru_cache(maxsize=256)
def zb_table(p: int, m: int, v: int = 1) -> Table:
    """Each stage's `stage_order` run as soon as possible (a forward one slot after the virtual
    stage before ran it, a B one slot after the virtual stage after ran its B, or after the
    last virtual stage's own forward, which computed the loss; a W after its B), then p - 1
    idle slots for the last input gradients to reach their stages; with every value's slot."""
    def before(s, c):  # the stage and chunk of the virtual stage before, None for the first
        return None if s == c == 0 else ((s - 1, c) if s else (p - 1, c - 1))

    def after(s, c):
        return None if (s, c) == (p - 1, v - 1) else ((s + 1, c) if s < p - 1 else (0, c + 1))

    orders = [stage_order(p, m, s, v) for s in range(p)]
    done, pos, ops = {}, [0] * p, []
    while any(pos[s] < len(orders[s]) for s in range(p)):
        t, row = len(ops), []
        for s in range(p):
            kind, i, c = orders[s][pos[s]] if pos[s] < len(orders[s]) else (IDLE, -1, -1)
            ran = lambda k, at: at is None or done.get((k, *at, i), t) < t  # noqa: E731
            ready = {IDLE: True, FORWARD: ran(FORWARD, before(s, c)),
                     BACKWARD: ran(FORWARD, (s, c)) and ran(BACKWARD, after(s, c)),
                     WEIGHT: ran(BACKWARD, (s, c))}[kind]
            row.append((kind, i, c) if ready else (IDLE, -1, -1))
        for s, (kind, i, c) in enumerate(row):
            if kind != IDLE:
                done[(kind, s, c, i)] = t
                pos[s] += 1
        ops.append(row)
    n = len(ops) + p - 1
    rows = np.full((n, p, len(FIELDS)), -1, np.int32)
    rows[..., 0] = IDLE
    rows[:len(ops), :, :3] = ops

    every = [(s, c, i) for s in range(p) for c in range(v) for i in range(m)]
    # a pass waits in the stash from its forward to its W; an activation in the inbox from the
    # end of the slot the virtual stage before ran its forward; a cotangent from the end of the
    # slot the one after ran its B, or (the last virtual stage's) its own forward's
    stash, stash_slots = _per_stage(
        {(s, c, i): (done[(FORWARD, s, c, i)], done[(WEIGHT, s, c, i)]) for s, c, i in every})
    x_box, x_slots = _per_stage(
        {(s, c, i): (done[(FORWARD, *before(s, c), i)], done[(FORWARD, s, c, i)])
         for s, c, i in every if before(s, c)})
    ct_box, ct_slots = _per_stage(
        {(s, c, i): (done[(BACKWARD, *after(s, c), i)] if after(s, c) else
                     done[(FORWARD, s, c, i)], done[(BACKWARD, s, c, i)]) for s, c, i in every})

    def put(t, s, name, value):
        rows[t, s, FIELDS.index(name)] = value

    for (kind, s, c, i), t in done.items():
        key = (s, c, i)
        put(t, s, "stash", stash[key])
        if kind == FORWARD:
            put(t, s, "x_at", x_box.get(key, -1))
            if after(s, c):  # what it sends arrives on the stage after, for its chunk
                nxt = after(s, c)
                put(t, nxt[0], "x_to", x_box[(*nxt, i)])
            else:  # the loss's gradient, kept for this pass's B
                put(t, s, "dy_to", ct_box[key])
            if (s, c) == (0, 0):  # stage i mod p put microbatch i on the belt i mod p ago
                put(t - i % p, i % p, "put", i // p)
        if kind == BACKWARD:
            put(t, s, "ct_at", ct_box[key])
            if before(s, c):
                prev = before(s, c)
                put(t, prev[0], "ct_to", ct_box[(*prev, i)])
            else:  # its input gradient reaches stage i mod p i mod p slots later
                put(t + i % p, i % p, "keep", i // p)
    return Table(rows, stash_slots, x_slots, ct_slots)
