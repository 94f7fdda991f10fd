"""Where a step's time goes: a `jax.profiler` trace of a few steps, summed per HLO instruction.

`python -m spmd3d.bench ... --profile=DIR` writes the trace (DIR/plugins/profile/<run>/
perfetto_trace.json.gz opens in ui.perfetto.dev; the .xplane.pb in xprof) and prints this
summary. Trace events are matched to the compiled step's instructions by name: XLA:CPU names
each operation's event after its instruction, so on other backends, whose kernels carry other
names, the summary may come out empty while the trace is still there.

Durations are summed over all threads. Simulated devices share the host's cores, so their sum
exceeds the wall time: read the shares, not the absolute numbers, there. A collective's time
includes waiting for the last device of its group to arrive.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

from .hlo import KINDS, instructions

# a loop, a branch or a call contains the events of the instructions it runs
_CONTAINERS = ("while", "conditional", "call")
_MATMUL_NAMES = ("ynn", "xnn", "onednn", "gemm", "cublas", "dot", "convolution")


def category(name: str, opcode: str) -> str:
    base = opcode.removesuffix("-start").removesuffix("-done")
    if base in KINDS:
        return "collectives"
    if opcode in ("dot", "convolution") or name.startswith(_MATMUL_NAMES):
        return "matmuls"
    return "other"


def trace_file(log_dir: str | Path) -> Path:
    """The newest perfetto trace under a `jax.profiler.trace(log_dir, create_perfetto_trace=True)`."""
    found = sorted(Path(log_dir).glob("plugins/profile/*/perfetto_trace.json.gz"),
                   key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir}")
    return found[-1]


def summarize(path: str | Path, hlo_text: str, steps: int, top: int = 8) -> dict:
    """Seconds per step by category (matmuls, collectives, other) and the `top` instructions
    by time, from the trace at `path` of `steps` runs of the compiled module `hlo_text`."""
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    known = instructions(hlo_text)
    per_op = Counter()
    for e in events:
        name = e.get("name")
        if e.get("ph") == "X" and name in known and known[name][0] not in _CONTAINERS:
            per_op[name] += e.get("dur", 0) * 1e-6 / steps
    total = sum(per_op.values())
    by_category = Counter()
    for name, seconds in per_op.items():
        by_category[category(name, known[name][0])] += seconds
    return {
        "trace": str(path),
        "op_seconds_per_step": total,
        "by_category": dict(by_category.most_common()),
        "top": [{"name": n, "opcode": known[n][0], "shape": known[n][1], "seconds": s}
                for n, s in per_op.most_common(top)],
    }


def format_summary(p: dict) -> list[str]:
    total = p["op_seconds_per_step"] or 1.0
    cats = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in p["by_category"].items())
    lines = [f"  profile     {p['trace']}",
             f"  op time     {p['op_seconds_per_step'] * 1e3:.0f} ms per step over all threads: "
             f"{cats or 'no events matched the step (see spmd3d/profile.py)'}"]
    for op in p["top"]:
        lines.append(f"    {100 * op['seconds'] / total:5.1f}%  {op['name']:<32} "
                     f"{op['opcode']:<12} {op['shape'][:48]}")
    return lines
