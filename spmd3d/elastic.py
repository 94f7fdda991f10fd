"""Elastic continuation: after a lost host the job goes on with the hosts that are left, on the
same global batch, so the data and the loss curve are the ones the full job would have had.

A step's batch is a pure function of the step and a checkpoint restores onto any mesh, so a
smaller job only has to keep the global batch: `resize` shrinks `mesh.data` to the devices
left (the other axes stay) and raises the microbatches accumulated one after another (a
pipeline's microbatches) until a device holds no more rows at a time than before. The
launcher (`launch/local.sh --elastic`, or the SLURM and Kubernetes scripts at each restart)
asks it, before every start, how many processes to start and with which overrides:

    python -m spmd3d.elastic [CONFIG.yaml] [key=value ...] --processes P --local-devices D
        [--of N] [--restart K]

prints `P' key=value ...` (the processes to start, at most P, and the overrides), or one line
saying why the run cannot go on and exits 1. `--of N`: the processes the job started with
(its full size, where `mesh.data` is -1); `--restart K`: the restarts so far, at most
`dist.max_restarts`. When hosts come back, the next start asks again and grows the mesh.

The restarted run records the resize (`record`): one log line and one `metrics.jsonl` record
with the time, the hosts before and after, the old and new mesh and microbatches, and the
steps recomputed (the last step the stopped run logged, less the checkpoint's). The launcher
says which hosts it lost; the hosts left out are those the layout could not use.
"""

from __future__ import annotations

import math
import sys
import time

from .config import Config, ConfigError, override
from .mesh import split_over_hosts


def resize(cfg: Config, processes: int, local_devices: int, full_processes: int | None = None,
           restart: int = 0) -> tuple[int, dict]:
    """(processes to start, {dotted key: value} overrides) for `processes` live ones of
    `local_devices` devices each, keeping `cfg`'s global batch and, at most, its rows per
    device at a time; the most processes that can be used. ConfigError naming `dist.*` when
    too few are left, or the restarts are spent."""
    d, m, t = cfg.dist, cfg.mesh, cfg.train
    if restart > d.max_restarts:
        raise ConfigError("dist.max_restarts", f"restart {restart} of a run allowed "
                          f"{d.max_restarts}; not restarting")
    inner = m.stage * m.tensor * m.seq
    full = m.data if m.data > 0 else (full_processes or processes) * local_devices // inner
    rows = t.global_batch // (full * t.microbatches)  # a data replica's rows per microbatch
    why = []
    for p in range(processes, max(d.min_processes, 1) - 1, -1):
        devices = p * local_devices
        data = devices // inner
        if devices % inner or not 1 <= data <= full:
            why.append(f"{p}: {devices} devices are not a multiple of stage x tensor x seq = "
                       f"{inner} up to data {full}")
            continue
        if t.global_batch % data:
            why.append(f"{p}: train.global_batch {t.global_batch} does not split over data {data}")
            continue
        # HSDP: a ZeRO group's devices stay together; whole groups are dropped
        group = full // m.replicate if m.replicate > 1 else 1
        if data % group:
            why.append(f"{p}: data {data} is not whole ZeRO groups of {group} (mesh.replicate)")
            continue
        micro = math.ceil(t.global_batch / (data * rows))
        while t.global_batch % (data * micro):
            micro += 1
        try:
            new = override(cfg, mesh=dict(data=data, replicate=data // group),
                           train=dict(microbatches=micro))
            split_over_hosts(new.mesh.sizes(), local_devices, p, m.allow_cross_host, m.inside)
        except ConfigError as e:
            why.append(f"{p}: {e}")
            continue
        return p, {"mesh.data": data, "train.microbatches": micro,
                   **({"mesh.replicate": data // group} if m.replicate > 1 else {})}
    raise ConfigError("dist.min_processes", f"{processes} processes of {local_devices} devices "
                      f"left, and no layout of at least {max(d.min_processes, 1)} keeps "
                      f"stage {m.stage} x tensor {m.tensor} x seq {m.seq} and the global batch "
                      f"({'; '.join(why[:2]) or 'none to try'})")


def record(meta: dict, plan, hosts: list[str], last_step: int) -> dict | None:
    """The resize record of a run restored from a checkpoint written with `meta` (the
    checkpoint's `resume.checkpoint_meta`), now on `plan`'s mesh with processes on `hosts`, the
    run before it having reached `last_step`; None where the hosts are the same."""
    before = meta.get("config", {})
    micro = (before.get("train", {}).get("microbatches"), plan.cfg.train.microbatches)
    mesh = dict(plan.mesh.shape)
    old_hosts = meta.get("hosts") or []
    if meta.get("processes") == len(hosts) and old_hosts in ([], hosts):
        return None  # the same hosts (another mesh on them is a resume, not a resize)
    return {"event": "resize", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "step": int(meta["step"]), "processes": [meta.get("processes"), len(hosts)],
            "hosts": [old_hosts, hosts], "mesh": meta.get("mesh"), "new_mesh": mesh,
            "microbatches": list(micro), "steps_lost": max(0, last_step - int(meta["step"]))}


def describe(rec: dict) -> str:
    """The record's log line."""
    old, new = (", ".join(h) or "?" for h in rec["hosts"])
    return (f"resized: {rec['processes'][0]} processes ({old}) -> {rec['processes'][1]} ({new}), "
            f"mesh {rec['mesh']} -> {rec['new_mesh']}, microbatches {rec['microbatches'][0]} -> "
            f"{rec['microbatches'][1]} (the global batch kept); resumed at step {rec['step']}, "
            f"{rec['steps_lost']} steps recomputed")


COMMAND_FLAGS = (("--processes", 1, "the processes alive now (required)"),
                 ("--local-devices", 1, "devices per process (required)"),
                 ("--of", 1, "the processes the job started with (its full size)"),
                 ("--restart", 0, "restarts so far (at most dist.max_restarts)"))


def main(argv: list[str] | None = None) -> int:
    from . import cli

    command = cli.Command(
        prog="python -m spmd3d.elastic",
        usage="[CONFIG.yaml] [key=value ...] --processes=P --local-devices=D [--of=N] "
              "[--restart=K]",
        description=("How many of P live processes of D devices an elastic job restarts on, "
                     "and the overrides that keep its global batch: prints 'P2 key=value ...', "
                     "or one line saying why it cannot go on and exits 1."),
        flags=tuple(cli.Flag(n, "int", h, minimum=low) for n, low, h in COMMAND_FLAGS))

    def run(args: cli.Args) -> int:
        cfg = args.load_config()
        for name in ("--processes", "--local-devices"):
            if name not in args.flags:
                raise ConfigError(name, "is required")
        try:
            p, overrides = resize(cfg, args.flags["--processes"], args.flags["--local-devices"],
                                  args.flags.get("--of"), args.flags.get("--restart", 0))
        except ConfigError as e:
            print(f"elastic: cannot go on: {e}", file=sys.stderr)
            return 1
        print(" ".join([str(p)] + [f"{k}={v}" for k, v in overrides.items()]))
        return 0

    return cli.run(command, argv, run)


if __name__ == "__main__":
    sys.exit(main())
