"""A pipeline schedule as a table: what each stage runs in each slot, and where every value it
keeps waits. Plain numpy, built once per (kind, p, m, v); `run` executes any table.

A pass is one microbatch through one chunk of a stage's layers: with v chunks per stage
(`parallel.pipeline_repeats`), chunk c of stage s is virtual stage j = c p + s of V = v p, and
the ring carries stage p - 1's chunk c on to stage 0's chunk c + 1. Each pass has a forward F
and a backward, either whole (FULL: input and weight gradients at once) or split (B, the input
gradient the stage before waits for, and W, the weight gradient nobody waits for). A schedule
places every operation at a (slot, stage, lane); the rest is worked out here the same way for
every kind: the stash slot a pass keeps its residuals in from its F to its last backward, the
inbox slots activations and cotangents wait in between arriving and being used, which stage
puts each microbatch on the input belt and when, and where each input gradient (or, GPipe,
each output) is kept. Buffers get as few slots as values are live at once.

A table runs in one of three ways (`Table.mode`):
- `autodiff` (GPipe): forwards only, in lockstep (every stage computes at every slot, idle
  ones on stale data: the bubble is real compute); autodiff of the slot loop is the backward.
- `lockstep` (1F1B): a forward lane and a whole-backward lane, each run by every stage in every
  slot of the phases where any stage uses it.
- `switch` (ZB-H1): one lane; each stage runs its own operation per slot (`lax.switch`), and
  an idle slot computes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, wraps

import numpy as np

IDLE, FORWARD, BACKWARD, WEIGHT, FULL = range(5)
# per lane: the operation (kind, microbatch, chunk); its pass's stash slot; the inbox slots its
# forward reads the activation from (-1: the input belt) and its backward the cotangent from;
# the cotangent inbox slot the last virtual stage's forward puts the loss's gradient in
OP = ("kind", "mb", "chunk", "stash", "x_at", "ct_at", "dy_to")
# per slot and stage, at the slot's end: the inbox slots what arrives goes to (activation from
# the stage before, cotangent from the stage after; -1: nothing); the input slot this stage
# puts on the input belt; the slot it keeps what the return belt holds in (-1: none)
END = ("x_to", "ct_to", "put", "keep")
KINDS = ("gpipe", "1f1b", "zb_h1")
COST = {IDLE: 0, FORWARD: 1, BACKWARD: 1, WEIGHT: 1, FULL: 2}  # units of one chunk's forward


def _once(method):
    """A figure replayed from the table, computed once per table: tables never change and
    `build` caches them, so a search of thousands of layouts replays each once."""

    @wraps(method)
    def memo(self, *args):
        cache = self.__dict__.setdefault("_figures", {})
        key = (method.__name__, args)
        if key not in cache:
            cache[key] = method(self, *args)
        return cache[key]

    return memo


@dataclass(frozen=True)
class Table:
    kind: str
    stages: int  # p
    microbatches: int  # m
    repeats: int  # v
    mode: str  # autodiff | lockstep | switch
    ops: np.ndarray  # [slots, p, lanes, len(OP)] int32
    ends: np.ndarray  # [slots, p, len(END)] int32
    stash_slots: int
    x_slots: int
    ct_slots: int
    drain: int  # the last slots, which only carry input gradients to their stages

    def op(self, name: str) -> np.ndarray:  # [slots, p, lanes]
        return self.ops[..., OP.index(name)]

    def end(self, name: str) -> np.ndarray:  # [slots, p]
        return self.ends[..., END.index(name)]

    @property
    def lanes(self) -> int:
        return self.ops.shape[2]

    @_once
    def lane_kinds(self, lane: int) -> tuple:
        """The operations lane `lane` runs somewhere, IDLE first."""
        return tuple(sorted({IDLE} | set(np.unique(self.op("kind")[:, :, lane]).tolist())))

    @_once
    def phases(self) -> list[tuple[int, int, tuple[bool, ...], bool]]:
        """(begin, end, lanes that compute, whether the head may run): maximal runs of slots
        whose lanes compute alike. A lockstep lane computes on every stage in its phases; the
        head runs (under a conditional) in the phases where a last virtual stage's forward
        ends in it, and in a switch's forward branch."""
        kind, dy = self.op("kind"), self.op("dy_to")
        runs = []
        for t in range(len(self.ops)):
            lanes = tuple(bool((kind[t, :, k] != IDLE).any()) for k in range(self.lanes))
            if runs and runs[-1][2] == lanes:
                runs[-1][1] = t + 1
            else:
                runs.append([t, t + 1, lanes])
        return [(b, e, lanes, bool((dy[b:e] >= 0).any()) and self.mode == "lockstep")
                for b, e, lanes in runs]

    # ------------------------------------------------------------------------------------
    # figures, by replaying the table

    @property
    def ticks(self) -> int:
        """Slots that compute (the drain's only move input gradients)."""
        return len(self.ops) - self.drain

    @_once
    def forwards(self) -> int:
        """Chunk forwards each stage computes: lockstep, at every slot of its forward lane's
        phases (bubbles included); under a switch, its own."""
        if self.mode == "switch":
            return int((self.op("kind") == FORWARD).sum(axis=(0, 2)).max())
        return sum(e - b for b, e, lanes, _ in self.phases() if lanes[0])

    @property
    def flops_ratio(self) -> float:
        """Per-device layer FLOPs times p over those without a pipeline."""
        return self.forwards() / (self.repeats * self.microbatches)

    @property
    @_once
    def bubble(self) -> float:
        """The idle fraction of each stage's time, an F, B or W costing one unit and a whole
        backward two; a slot lasts as long as its costliest stage (autodiff: the backward
        slots mirror the forward ones)."""
        useful = 3 * self.repeats * self.microbatches
        kind = self.op("kind")
        if self.mode == "autodiff":
            return 1 - useful / (3 * self.ticks)
        if self.mode == "switch":
            cost = np.vectorize(COST.get)(kind[:self.ticks]).sum(axis=2).max(axis=1).sum()
            return 1 - useful / int(cost)
        full = {FORWARD: 1, FULL: 2}
        lane_cost = [full[max(self.lane_kinds(k))] for k in range(self.lanes)]
        cost = sum((e - b) * sum(c for c, on in zip(lane_cost, lanes) if on)
                   for b, e, lanes, _ in self.phases())
        return 1 - useful / cost

    @property
    def in_flight(self) -> int:
        """Passes a stage keeps residuals of at once: its stash's slots (autodiff: every
        forward's, until the backward starts)."""
        return self.stash_slots

    @_once
    def shifts(self) -> dict:
        """{name: values moved between neighbouring stages per step}: `ahead` (activations,
        and input gradients on their belt), `back` (cotangents, and the input belt and the
        output belt), each one microbatch's activations (autodiff: forward and backward)."""
        ahead = back = 0
        for b, e, lanes, _ in self.phases():
            kinds = {k for lane, on in enumerate(lanes) if on for k in self.lane_kinds(lane)}
            n = e - b
            ahead += n * ((FORWARD in kinds) + (self.mode != "autodiff"))
            back += n * ((FORWARD in kinds) + bool(kinds & {BACKWARD, FULL})
                         + (self.mode == "autodiff"))
        twice = 2 if self.mode == "autodiff" else 1
        return {"ahead": twice * ahead, "back": twice * back}


def before(p: int, s: int, c: int):
    """(stage, chunk) of the virtual stage before chunk c of stage s, None for the first."""
    return None if s == c == 0 else ((s - 1, c) if s else (p - 1, c - 1))


def after(p: int, v: int, s: int, c: int):
    return None if (s, c) == (p - 1, v - 1) else ((s + 1, c) if s < p - 1 else (0, c + 1))


@lru_cache(maxsize=256)
def build(kind: str, p: int, m: int, v: int = 1) -> Table:
    """The table of schedule `kind` for p stages, m microbatches and v chunks per stage."""
    if kind == "gpipe":
        # work item w = r m + i (microbatch i, repeat r) on stage s at slot w + s
        at = {(FORWARD, s, r, i): (r * m + i + s, 0)
              for s in range(p) for r in range(v) for i in range(m)}
        return _fill(kind, p, m, v, "autodiff", at, v * m + p - 1, lanes=1, drain=0)
    if kind == "1f1b":
        # microbatch i enters virtual stage 0 at G(i) = (i div p) V + i mod p (groups of p,
        # one group every V slots); virtual stage j runs its forward at G(i) + j and its
        # backward at G(i) + 2V - 2 - j: the last one in the slot its forward ends
        big = v * p
        at = {}
        for s, c, i in np.ndindex(p, v, m):
            j, g = c * p + s, (i // p) * big + i % p
            at[(FORWARD, s, c, i)] = (g + j, 0)
            at[(FULL, s, c, i)] = (g + 2 * big - 2 - j, 1)
        return _fill(kind, p, m, v, "lockstep", at, v * m + p - 1 + big - 1, lanes=2,
                     drain=p - 1)
    if kind == "zb_h1":
        return _fill(kind, p, m, v, "switch", *_zb_h1(p, m, v), lanes=1, drain=p - 1)
    raise ValueError(f"unknown pipeline schedule {kind!r}: one of {KINDS}")


def passes(p: int, m: int, v: int, backward: bool = False) -> list[tuple[int, int]]:
    """(microbatch, chunk) in the order each stage runs its forwards (or backwards): groups of
    p microbatches, each through chunks 0..v-1 (backward: v-1..0)."""
    chunks = range(v - 1, -1, -1) if backward else range(v)
    return [(i, c) for g in range(0, m, p) for c in chunks for i in range(g, min(g + p, m))]


def zb_order(p: int, m: int, s: int, v: int = 1) -> list[tuple[int, int, int]]:
    """ZB-H1's stage s in order, (kind, microbatch, chunk): V - s forwards, then for each pass
    its B, the W of the pass s before (stage s defers its W's by s, so the last stage's B's go
    back at once and stage 0, which waits longest, defers none), and the next forward; the
    deferred W's at the end."""
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


def _zb_h1(p: int, m: int, v: int):
    """Each stage's `zb_order` run as soon as possible: a forward one slot after the virtual
    stage before ran it, a B one slot after the virtual stage after ran its B (or after the
    last virtual stage's own forward, which computed the loss), a W after its B."""
    orders = [zb_order(p, m, s, v) for s in range(p)]
    done, pos, t = {}, [0] * p, 0
    while any(pos[s] < len(orders[s]) for s in range(p)):
        ready = []
        for s in range(p):
            if pos[s] == len(orders[s]):
                continue
            kind, i, c = orders[s][pos[s]]
            ran = lambda k, at: at is None or done.get((k, *at, i), (t,))[0] < t  # noqa: E731
            if {FORWARD: ran(FORWARD, before(p, s, c)),
                    BACKWARD: ran(FORWARD, (s, c)) and ran(BACKWARD, after(p, v, s, c)),
                    WEIGHT: ran(BACKWARD, (s, c))}[kind]:
                ready.append((kind, s, c, i))
        for key in ready:
            done[key] = (t, 0)
            pos[key[1]] += 1
        t += 1
    return done, t


def _colour(spans: dict) -> tuple[dict, int]:
    """({key: slot}, slots) for values live over spans {key: (stored, last read)}: a slot is
    free again from its value's last read (a read comes before a store at the same time), and
    taking spans by their start, the fewest slots: as many as values are live at once."""
    free, slot_of = [], {}
    for key, (stored, read) in sorted(spans.items(), key=lambda kv: kv[1]):
        k = next((k for k, f in enumerate(free) if f <= stored), len(free))
        free[k:k + 1] = [read]
        slot_of[key] = k
    return slot_of, max(len(free), 1)


def _per_stage(spans: dict) -> tuple[dict, int]:
    """`_colour` on each stage's spans (keyed (stage, ...)): as many slots as the fullest
    stage needs."""
    slot_of, slots = {}, 1
    for s in sorted({key[0] for key in spans}):
        one, k = _colour({key: span for key, span in spans.items() if key[0] == s})
        slot_of.update(one)
        slots = max(slots, k)
    return slot_of, slots


def _fill(kind, p, m, v, mode, at, ticks, *, lanes, drain) -> Table:
    """The table of operations placed at `at` {(op, stage, chunk, mb): (slot, lane)}: every
    buffer slot, belt and keep worked out from the placement."""
    n = ticks + drain
    ops = np.full((n, p, lanes, len(OP)), -1, np.int32)
    ops[..., 0] = IDLE
    ends = np.full((n, p, len(END)), -1, np.int32)
    for (k, s, c, i), (t, lane) in at.items():
        assert ops[t, s, lane, 0] == IDLE, ("two operations in one place", t, s, lane)
        ops[t, s, lane, :3] = (k, i, c)

    def time(t, lane=None):  # a lane's operation, or (None) the slot's end
        return t * (lanes + 1) + (lanes if lane is None else lane)

    def when(k, s, c, i):
        return time(*at[(k, s, c, i)])

    every = [(s, c, i) for s in range(p) for c in range(v) for i in range(m)]
    split = any(k == WEIGHT for k, *_ in at)
    last = WEIGHT if split else FULL
    # a pass waits in the stash from its forward to its last backward (autodiff: the
    # backward after every forward); an activation in the inbox from the end of the slot the
    # virtual stage before ran its forward; a cotangent from the end of the slot the one
    # after ran its backward, or (the last virtual stage's) from its own forward
    end = time(n)
    stash, stash_slots = _per_stage({key: (when(FORWARD, *key), end if mode == "autodiff"
                                           else when(last, *key)) for key in every})
    b = FULL if mode == "lockstep" else BACKWARD
    x_box, x_slots = _per_stage(
        {(s, c, i): (time(at[(FORWARD, *before(p, s, c), i)][0]), when(FORWARD, s, c, i))
         for s, c, i in every if before(p, s, c)})
    ct_box, ct_slots = ({}, 0) if mode == "autodiff" else _per_stage(
        {(s, c, i): (time(at[(b, *after(p, v, s, c), i)][0]) if after(p, v, s, c) else
                     when(FORWARD, s, c, i), when(b, s, c, i)) for s, c, i in every})

    def put(t, s, lane, name, value):
        if lane is None:
            ends[t, s, END.index(name)] = value
        else:
            ops[t, s, lane, OP.index(name)] = value

    for (k, s, c, i), (t, lane) in at.items():
        key = (s, c, i)
        if mode != "autodiff":
            put(t, s, lane, "stash", stash[key])
        if k == FORWARD:
            put(t, s, lane, "x_at", x_box.get(key, -1))
            nxt = after(p, v, s, c)
            if nxt:  # what it sends arrives on the stage after, for its chunk
                put(t, nxt[0], None, "x_to", x_box[(*nxt, i)])
            elif mode != "autodiff":  # the loss's gradient, kept for this pass's backward
                put(t, s, lane, "dy_to", ct_box[key])
            else:  # the output, on the belt back to the stage that keeps it (`Schedule.collect`)
                back = (m - 1 - i) % p
                put(t + back, p - 1 - back, None, "keep", (m - 1 - i) // p)
            if (s, c) == (0, 0):  # stage i mod p put microbatch i on the belt i mod p ago
                put(t - i % p, i % p, None, "put", i // p)
        if k in (BACKWARD, FULL):
            put(t, s, lane, "ct_at", ct_box[key])
            prev = before(p, s, c)
            if prev:
                put(t, prev[0], None, "ct_to", ct_box[(*prev, i)])
            else:  # its input gradient reaches stage i mod p i mod p slots later
                put(t + i % p, i % p, None, "keep", i // p)
    if mode == "lockstep":
        # a lane every stage computes in its phases: an idle backward reads the stash slot
        # last stored on its stage (finite values; an unwritten slot may hold 0 x inf) with a
        # zero cotangent
        kind, slot = ops[..., 0], ops[..., OP.index("stash")]
        for s in range(p):
            latest = -1
            for t in range(n):
                for lane in range(lanes):
                    if kind[t, s, lane] == FORWARD:
                        latest = slot[t, s, lane]
                    elif kind[t, s, lane] == IDLE and latest >= 0:
                        slot[t, s, lane] = latest
    return Table(kind, p, m, v, mode, ops, ends, v * m if mode == "autodiff" else stash_slots,
                 x_slots if x_box else 0, ct_slots, drain)
