"""Does the compiled step fit a device? Asked after compiling, before anything is allocated.

`check(plan, compiled)` compares what one device needs -- `memory_analysis()`: arguments,
temporaries and the outputs not aliased to donated arguments -- with what a device has: the
backend's own limit (`memory_stats()["bytes_limit"]` on a GPU), or on CPU the host's available
memory shared by its simulated devices, or else the topology's `device_memory_gb`. A layout
that needs more is refused with one line (`DoesNotFit`, exit status 2) that gives the need by
kind, what a device has and what to change. An out-of-memory error that still happens while
the step runs becomes `OutOfMemory` (one line, exit status 1): the step, the bytes asked for
and the compiled estimate.
"""

from __future__ import annotations

import os
import re

from .cli import Failure
from .config import ConfigError
from .units import human


class DoesNotFit(ConfigError):
    """The compiled step needs more memory per device than a device has (exit status 2)."""

    def __init__(self, message: str):
        super().__init__("memory", message)


class OutOfMemory(Failure):
    """The device ran out of memory while the step ran (exit status 1, one line)."""


def needed_bytes(compiled) -> dict:
    """Per-device bytes of a compiled step: arguments, temporaries, outputs not aliased to a
    donated argument, and their sum."""
    from . import hlo

    m = hlo.memory(compiled)
    outputs = max(m["output_bytes"] - m["alias_bytes"], 0)
    return {"arguments": m["argument_bytes"], "temporaries": m["temp_bytes"],
            "outputs": outputs, "total": m["argument_bytes"] + m["temp_bytes"] + outputs}


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def device_limit(plan) -> tuple[int, str]:
    """(bytes one device has, where that figure comes from)."""
    import jax

    devices = jax.local_devices()
    device = devices[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if stats.get("bytes_limit"):
            return int(stats["bytes_limit"]), f"{device.device_kind}'s limit"
    else:
        available = _host_available()
        if available:
            return available // len(devices), (f"the host's available {human(available)} over "
                                                f"{len(devices)} CPU devices")
    topo = plan.topology
    return int(topo.device_memory_gb * 1e9), f"topology {topo.name}"


def _kinds(plan, need: dict) -> dict:
    """The compiled need by kind: the step's arguments (and unaliased outputs), its fp32
    gradients (exact, from their shardings) and the rest of its temporaries."""
    from .footprint import state_terms

    grads = min(state_terms(plan)["gradients"], need["temporaries"])
    return {"parameters and optimizer state": need["arguments"] + need["outputs"],
            "gradients": grads, "activations": need["temporaries"] - grads}


def _advice(plan, largest: str) -> str:
    cfg = plan.cfg
    par, mesh = cfg.parallel, cfg.mesh
    tips = []
    if largest == "parameters and optimizer state":
        if par.zero_stage < 3:
            tips.append(f"parallel.zero_stage={par.zero_stage + 1} or higher")
        tips.append("more mesh.tensor or mesh.stage")
    elif largest == "gradients":
        if par.zero_stage < 2:
            tips.append("parallel.zero_stage=2")
        tips.append("more mesh.tensor or mesh.stage")
    else:
        offload = plan.schedule is None or par.pipeline_schedule == "gpipe"  # its stash: host
        if par.remat in ("none", "save_dots", "offload_dots"):
            tips.append("parallel.remat=full" + (" or stage" if plan.schedule else "")
                        + (" or offload" if offload else ""))
        elif par.remat == "full" and offload:
            tips.append("parallel.remat=offload (layer inputs in host memory)")
        if plan.rows_per_microbatch > 1:
            tips.append("more train.microbatches (fewer rows at a time)")
        if mesh.seq == 1:
            tips.append("mesh.seq (ring attention)")
        if plan.schedule and plan.rules.params_over_batch and par.zero3_gather == "step":
            tips.append("parallel.zero3_gather=tick")
        if plan.schedule:
            tips.append("more mesh.stage")
        tips.append(f"a smaller parallel.loss_chunk (now {par.loss_chunk})")
        tips.append(f"a smaller train.seq_len (now {cfg.train.seq_len})")
    return ", ".join(tips[:-1]) + (" or " if len(tips) > 1 else "") + tips[-1]


def check(plan, compiled) -> dict:
    """Raises `DoesNotFit` if the compiled step needs more than a device has; else returns
    the need (`needed_bytes`) with the limit and its source."""
    need = needed_bytes(compiled)
    limit, source = device_limit(plan)
    need.update(limit=limit, limit_source=source)
    if need["total"] <= limit:
        return need
    kinds = _kinds(plan, need)
    largest = max(kinds, key=kinds.get)
    what = largest
    if largest == "activations":
        what = f"activations at seq_len {plan.cfg.train.seq_len}"
    parts = ", ".join(f"{k} {human(v)}" for k, v in kinds.items() if v)
    raise DoesNotFit(f"this layout needs {human(need['total'])} per device ({parts}: mostly "
                     f"{what}); a device has {human(limit)} ({source}); try "
                     f"{_advice(plan, largest)} (python -m spmd3d.plan CONFIG --compile "
                     "shows where it goes; run.memory_check=false skips this check)")


def is_oom(error: BaseException) -> bool:
    return "RESOURCE_EXHAUSTED" in str(error) or "Out of memory" in str(error)


def out_of_memory(error: BaseException, step: int, need: dict | None) -> OutOfMemory:
    """The one-line `OutOfMemory` for an allocation that failed at `step`."""
    asked = re.search(r"allocat\w*\s+(\d+)\s*bytes", str(error))
    what = f"could not allocate {human(int(asked.group(1)))}" if asked else "ran out of memory"
    estimate = (f"; the compiled step needs {human(need['total'])} per device of "
                f"{human(need['limit'])}" if need else "")
    return OutOfMemory(f"out of memory at step {step}: the device {what}{estimate} (the "
                       "allocator's own needs and fragmentation come on top); the last "
                       "checkpoint is untouched")
