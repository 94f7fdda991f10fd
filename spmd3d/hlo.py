"""Read a compiled step: its collectives (kind, bytes, mesh axes) and per-device memory.

Tests assert on these numbers because, unlike timings, they do not depend on machine load.
Collectives inside a `while` body (the layer scan, microbatch loop) appear once in the text;
each record carries the trip counts of the loops around it, through conditional branches and
calls (a branch is counted as if taken: what the device that takes it moves).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import itertools
import math
import os
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
          "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}
# an instruction's line up to its opcode: `  ROOT %name = shape opcode(`
_HEAD = r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+) = (?P<shape>\([^=]*?\)|\S+) "
_OP = re.compile(_HEAD + r"(?P<kind>" + "|".join(KINDS) + r")(?:-start)?\((?P<rest>.*)$")
_INSTRUCTION = re.compile(_HEAD + r"(?P<opcode>[\w\-]+)\(", re.M)
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


@dataclass(frozen=True)
class Collective:
    kind: str
    bytes: int  # size of the result, per device
    axes: tuple  # mesh axes it communicates over (size-1 axes never listed), () if unknown
    computation: str  # HLO computation holding it (a while body for ops inside a scan)
    trips: int = 1  # times it runs per call: the trip counts of the loops around it


def _shape_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += n * _BYTES.get(dtype, 4)
    return total


def _groups(rest: str):
    # Shardy's form: replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}: device ids laid out
    # as iota over those sizes (or as `device_ids=([dims]T(perm))`, an iota of `dims` transposed,
    # when the mesh is not in device order); a group is the devices that differ along the braced
    # axes.
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:T\(([\d,]+)\))?"
                  r"(?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}", rest)
    if m:
        dims = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [d[0] for d in dims], [int(d[1]) for d in dims]
        ids = np.arange(int(np.prod(sizes)))
        if m.group(3):
            ids = ids.reshape([int(x) for x in m.group(3).split(",")])
            if m.group(4):
                ids = ids.transpose([int(x) for x in m.group(4).split(",")])
        ids = ids.reshape(sizes)
        if m.group(2):
            perm = [int(x) for x in m.group(2).split(",")]
            ids, names = ids.transpose(perm), [names[p] for p in perm]
        chosen = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(5))]
        rest_axes = [i for i in range(len(names)) if i not in chosen]
        ids = ids.transpose(rest_axes + chosen)
        size = int(np.prod([ids.shape[len(rest_axes) + k] for k in range(len(chosen))]))
        return [tuple(g) for g in ids.reshape(-1, size).tolist()]
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if m:
        out_shape = [int(x) for x in m.group(1).split(",")]
        ids = np.arange(int(np.prod(out_shape))).reshape([int(x) for x in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return [tuple(g) for g in ids.reshape(out_shape[0], -1)]
    m = re.search(r"replica_groups=\{(\{[\d,\s]*\}(?:,\s*\{[\d,\s]*\})*)\}", rest)
    if m:
        return [tuple(int(x) for x in g.split(",") if x.strip())
                for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", rest)
    if m:
        return [tuple(int(x) for x in p.split(",")) for p in re.findall(r"\{(\d+,\d+)", m.group(0))]
    return None


def _axes_of(groups, kind: str, mesh_shape: dict) -> tuple:
    """Which mesh axes a collective's device groups span (devices numbered in mesh order)."""
    if not groups:
        return ()
    names = [a for a, n in mesh_shape.items() if n > 1]
    ids = np.arange(int(np.prod(list(mesh_shape.values())))).reshape(list(mesh_shape.values()))
    coords = {int(i): dict(zip(mesh_shape, np.unravel_index(i, ids.shape))) for i in ids.flat}
    if kind == "collective-permute":  # pairs: the axes along which source and target differ
        diff = {a for s, t in groups for a in mesh_shape if coords[s][a] != coords[t][a]}
        return tuple(a for a in names if a in diff)
    want = {frozenset(g) for g in groups}
    for r in range(1, len(names) + 1):
        for subset in itertools.combinations(names, r):
            keep = [i for i, a in enumerate(mesh_shape) if a not in subset]
            moved = np.moveaxis(ids, [list(mesh_shape).index(a) for a in subset],
                                range(len(keep), len(mesh_shape)))
            size = int(np.prod([mesh_shape[a] for a in subset]))
            if {frozenset(g) for g in moved.reshape(-1, size).tolist()} == want:
                return subset
    return ()


_WHILE = re.compile(r"\bwhile\(.*?body=%?([\w.\-]+).*?\"known_trip_count\":\{\"n\":\"(\d+)\"")
# computations run once where they are called: a conditional's branches, a call's body
_CALLED = re.compile(r"(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+)"
                     r"|false_computation=%?([\w.\-]+)|\bcall\(.*?to_apply=%?([\w.\-]+)"
                     r"|\bcalls=%?([\w.\-]+))")


def _walk(hlo_text: str):
    """(lines as (computation, line), trips(computation)): every instruction line with the
    computation holding it, and the times a computation runs per run of the module -- the
    trip counts of the loops around it, through conditional branches, calls and fusions."""
    lines, comp, loops = [], "?", {}
    for line in hlo_text.splitlines():
        line = re.sub(r"/\*.*?\*/", "", line)
        c = _COMP.match(line)
        if c and " = " not in line:
            comp = c.group(1)
            continue
        w = _WHILE.search(line)
        if w:
            loops.setdefault(w.group(1), []).append((comp, int(w.group(2))))
        for called in _CALLED.findall(line):
            for name in re.findall(r"[\w.\-]+", ",".join(called).replace("%", "")):
                loops.setdefault(name, []).append((comp, 1))
        lines.append((comp, line))

    @functools.cache
    def trips(name, depth=0):  # summed over every place the computation is run from
        callers = loops.get(name)
        if not callers or depth > 16:
            return 1
        return sum(n * trips(parent, depth + 1) for parent, n in callers)

    return lines, trips


def collectives(hlo_text: str, mesh_shape: dict) -> list[Collective]:
    """Every collective op of an HLO module text (`compiled.as_text()`), with its loop trips."""
    lines, trips = _walk(hlo_text)
    out = []
    for comp, line in lines:
        m = _OP.match(line)
        if m:
            kind = m.group("kind")
            axes = _axes_of(_groups(m.group("rest")), kind, dict(mesh_shape))
            out.append(Collective(kind, _shape_bytes(m.group("shape")), axes, comp, trips(comp)))
    return out


_DOT = re.compile(_HEAD + r"dot\(%?(?P<lhs>[\w.\-]+),.*lhs_contracting_dims=\{(?P<k>[\d,]*)\}")


def _dims(shape: str) -> list[int]:
    return [int(x) for x in _ARRAY.match(shape).group(2).split(",") if x]


def matmul_flops(hlo_text: str, without: int | None = None) -> float:
    """FLOPs of every dot in an HLO module text, each times the trips of the loops around it:
    2 x the result's elements x the contracted size. Unlike XLA's cost analysis, which counts
    a loop body once, this reads a scanned program as it runs (every branch of a conditional
    counts: meant for the lockstep schedules, whose only conditional is the head's).
    `without`: leave out the dots with a dimension of that size (a vocabulary that no other
    dimension shares: the head's and the loss's dots, forward and backward, leaving a step's
    layers). A dimension a dot contracts is its left operand's, one it keeps is its result's."""
    lines, trips = _walk(hlo_text)
    shapes, total = {}, 0.0
    for comp, line in lines:
        head = re.match(_HEAD, line)
        if head and _ARRAY.match(head.group("shape")):
            shapes[(comp, head.group("name"))] = head.group("shape")
        m = _DOT.match(line)
        if m:
            lhs, out = _dims(shapes[(comp, m.group("lhs"))]), _dims(m.group("shape"))
            if without in lhs + out:
                continue
            contracted = math.prod(lhs[int(k)] for k in m.group("k").split(",") if k)
            total += 2.0 * math.prod(out) * contracted * trips(comp)
    return total


def fp8_gemms(hlo_text: str) -> int:
    """FP8 GEMMs in a compiled GPU module: the cuBLASLt calls XLA rewrote a dequantize ->
    dot into (what MaxText's FP8 test counts), each once however often its loop runs."""
    return hlo_text.count('custom_call_target="__cublas$lt$matmul$f8"')


def instructions(hlo_text: str) -> dict[str, tuple[str, str]]:
    """{instruction name: (opcode, result shape)} of every instruction in an HLO module."""
    return {m["name"]: (m["opcode"], m["shape"]) for m in _INSTRUCTION.finditer(hlo_text)}


def summary(colls: list[Collective]) -> Counter:
    """{(kind, axes): ops executed per call} (ops inside loops counted once per trip)."""
    out = Counter()
    for c in colls:
        out[(c.kind, c.axes)] += c.trips
    return out


def bytes_by_axes(colls: list[Collective]) -> Counter:
    """{(kind, axes): result bytes per device moved per call, loop trips included}."""
    out = Counter()
    for c in colls:
        out[(c.kind, c.axes)] += c.bytes * c.trips
    return out


def flops(compiled) -> float:
    """XLA's count of a compiled function's FLOPs per device (a loop body counted once: trace
    with `manual.unrolled_loops` to count every trip)."""
    analysis = compiled.cost_analysis()
    return float((analysis[0] if isinstance(analysis, list) else analysis)["flops"])


def memory(compiled) -> dict:
    """Per-device bytes of a compiled function: arguments, outputs, temporaries."""
    ma = compiled.memory_analysis()
    return {
        "argument_bytes": int(ma.argument_size_in_bytes),
        "output_bytes": int(ma.output_size_in_bytes),
        "temp_bytes": int(ma.temp_size_in_bytes),
        "alias_bytes": int(ma.alias_size_in_bytes),
        "total_bytes": int(ma.argument_size_in_bytes + ma.output_size_in_bytes
                           + ma.temp_size_in_bytes - ma.alias_size_in_bytes),
    }


# the dumped buffer assignment: `allocation N: size S, ... preallocated-temp:`, its values
# ` value: <id name @0> (size=S,offset=O): shape`; the live ranges: `  name{index}:start-end`
_VALUE = re.compile(r"^ value: <\d+ (?P<name>\S+)(?: \(phi\))? @\S*> "
                    r"\(size=(?P<size>\d+),offset=(?P<at>\d+)\)")
_RANGE = re.compile(r"^\s+(?P<name>\S+\{[^}]*\}):(?P<start>\d+)-(?P<end>\d+)$", re.M)


def dump_options(directory: str) -> dict:
    """Compiler options (`Lowered.compile(compiler_options=...)`) that make XLA write the
    compiled module's buffer assignment and live ranges into `directory`. Compile with them
    inside `uncached()`."""
    return {"xla_dump_to": directory, "xla_dump_hlo_as_text": True}


@contextlib.contextmanager
def uncached():
    """jax's persistent compilation cache off inside: its key leaves out the dump options, so a
    program compiled before (a second `plan --compile` of one layout, with a cache directory
    set) would come back from the cache and XLA would write no dump to read."""
    import jax
    from jax._src import compilation_cache  # jax decides once per process whether to use it

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()


def live_temp_bytes(directory: str) -> int | None:
    """The most bytes of temporaries alive at once in the module XLA dumped into `directory`
    (`dump_options`): its temp buffer's values, each from its definition to its last use in
    the schedule (a loop body's once: its iterations run one after another), a loop's carry
    (XLA's phi values) included, the values that share bytes while alive (one buffer, aliased:
    an update in place, a loop's carry) counted once. The temp buffer itself (`memory`'s
    temp_bytes) is at least this; the rest is how XLA packed the values into it. None where
    the dump has no live ranges."""
    found = [glob.glob(os.path.join(directory, f"*after_optimizations-{kind}.txt"))
             for kind in ("buffer-assignment", "live-range")]
    if not all(len(f) == 1 for f in found):
        return None
    placed, temp = {}, False  # value -> (offset, size) in the temp buffer
    with open(found[0][0]) as f:
        for line in f:
            if line.startswith("allocation "):
                temp = "preallocated-temp" in line
            elif temp and (m := _VALUE.match(line)):
                name = m["name"] if "{" in m["name"] else m["name"] + "{}"
                placed[name] = (int(m["at"]), int(m["size"]))
    spans: dict = {}  # offset -> [[start, end, size]], values alive together there merged
    with open(found[1][0]) as f:
        for m in _RANGE.finditer(f.read()):
            if m["name"] in placed:
                at, size = placed[m["name"]]
                spans.setdefault(at, []).append([int(m["start"]), int(m["end"]), size])
    change: Counter = Counter()
    for intervals in spans.values():
        merged: list = []
        for start, end, size in sorted(intervals):
            if merged and start <= merged[-1][1]:
                merged[-1][1:] = [max(merged[-1][1], end), max(merged[-1][2], size)]
            else:
                merged.append([start, end, size])
        for start, end, size in merged:
            change[start] += size
            change[end + 1] -= size
    live = peak = 0
    for t in sorted(change):
        live += change[t]
        peak = max(peak, live)
    return peak


def bytes_per_axis(colls: list[Collective], mesh_shape: dict) -> dict:
    """{mesh axis: bytes per device per call}, counted the same whatever kind of collective
    XLA chose: a reduction by the bytes it reduces (a reduce-scatter's input, an all-reduce's
    result), a gather by the bytes it gathers (its result), a permute or all-to-all by those
    it moves (its result); loop trips included, and an operation over several axes counted on
    each (what a hierarchical algorithm moves over each). So an all-reduce followed by a
    slice, or a reduce-scatter, or one reduction over two axes, or one over each, count alike:
    `plan.traffic.transfers` is compared with these."""
    out = {a: 0.0 for a in mesh_shape}
    for c in colls:
        group = int(np.prod([mesh_shape[a] for a in c.axes])) if c.axes else 1
        nbytes = c.bytes * (group if c.kind == "reduce-scatter" else 1) * c.trips
        for a in c.axes:
            out[a] += nbytes
    return out
