"""Where a step's time goes: a `jax.profiler` trace of a few steps, summed per operation.

`python -m spmd3d.bench ... --profile=DIR` writes the trace (DIR/plugins/profile/<run>/
perfetto_trace.json.gz opens in ui.perfetto.dev; the .xplane.pb in xprof) and prints this
summary. Two kinds of trace:

* XLA:CPU names each operation's event after its HLO instruction, on the host's threads: the
  events are matched to the compiled step's instructions by name. Durations are summed over all
  threads; simulated devices share the host's cores, so their sum exceeds the wall time: read
  the shares, not the absolute numbers, there.
* A GPU's trace has one event per kernel on the device's streams (processes `/device:...`),
  with the HLO instruction that launched it in `args.hlo_op`. XLA:GPU runs most of a step as
  CUDA graphs (`command_buffer_N`), which name no instruction, so kernels are summed by kernel
  name and sorted by it: cuBLAS/nvjet/CUTLASS GEMMs are matmuls, cuDNN's fused attention
  (`sdpa`, `flash`) attention, NCCL kernels collectives. Seen on an H100 (jax 0.11.2): an
  fp32 `xmma_gemm_f32f32_tf32` in the head's backward, which `vocab.head_logits` removed.

A collective's time includes waiting for the last device of its group to arrive.
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


_KERNELS = (("collectives", ("nccl",)), ("attention", ("sdpa", "flash", "fmha")),
            ("matmuls", ("gemm", "nvjet", "xmma", "cutlass", "cublas")))


def category(name: str, opcode: str) -> str:
    base = opcode.removesuffix("-start").removesuffix("-done")
    if base in KINDS:
        return "collectives"
    if opcode in ("dot", "convolution") or name.startswith(_MATMUL_NAMES):
        return "matmuls"
    if opcode == "kernel":  # a GPU kernel that no single instruction names
        low = name.lower()
        return next((c for c, keys in _KERNELS if any(k in low for k in keys)), "other")
    return "other"


def _device_kernels(events: list) -> list:
    """The kernel events on accelerator streams (empty for a CPU trace)."""
    devices = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and str(e.get("args", {}).get("name", "")).startswith("/device:")}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in devices
            and "hlo_op" in e.get("args", {})]


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
    kernels = _device_kernels(events)
    if kernels:  # a GPU: per instruction where one launched it, else per kernel name
        for e in kernels:
            op = e["args"]["hlo_op"]
            name = op if op in known and known[op][0] not in _CONTAINERS else e["name"]
            per_op[name] += e.get("dur", 0) * 1e-6 / steps
    else:  # XLA:CPU: events named after instructions
        for e in events:
            name = e.get("name")
            if e.get("ph") == "X" and name in known and known[name][0] not in _CONTAINERS:
                per_op[name] += e.get("dur", 0) * 1e-6 / steps
    known = {n: known.get(n, ("kernel", "")) for n in per_op}  # a kernel no instruction names
    total = sum(per_op.values())
    by_category = Counter()
    for name, seconds in per_op.items():
        by_category[category(name, known[name][0])] += seconds
    return {
        "trace": str(path),
        "op_seconds_per_step": total,
        "device": bool(kernels),
        "by_category": dict(by_category.most_common()),
        "top": [{"name": n, "opcode": known[n][0], "shape": known[n][1], "seconds": s}
                for n, s in per_op.most_common(top)],
    }


def format_summary(p: dict) -> list[str]:
    total = p["op_seconds_per_step"] or 1.0
    cats = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in p["by_category"].items())
    lines = [f"  profile     {p['trace']}",
             f"  op time     {p['op_seconds_per_step'] * 1e3:.0f} ms per step (summed over "
             f"{'device streams' if p.get('device') else 'all threads'}): "
             f"{cats or 'no events matched the step (see spmd3d/profile.py)'}"]
    for op in p["top"]:
        name = op["name"] if len(op["name"]) <= 48 else op["name"][:47] + "~"
        lines.append(f"    {100 * op['seconds'] / total:5.1f}%  {name:<32} "
                     f"{op['opcode']:<12} {op['shape'][:48]}")
    return lines
