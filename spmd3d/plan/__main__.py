"""`python -m spmd3d.plan [CONFIG.yaml] [key=value ...] [--compile] [--search ...] [--json]`: the
plan of a config on its cluster, what its step needs per device by arithmetic (`estimate.py`),
with `--compile` the compiled figures beside (`footprint.py`), with `--search` every layout of
its model ranked (`search.py`)."""

from __future__ import annotations

import sys
from dataclasses import replace

from .. import cli
from ..config import ConfigError
from ..mesh import load_topology
from . import Plan

COMMAND = cli.Command(
    prog="python -m spmd3d.plan",
    usage="[CONFIG.yaml] [key=value ...] [--compile] [--search [--devices=N] [--top=K] "
          "[--compile-top=K]] [--calibrate=BENCH.json] [--json]",
    description=("The plan of a config on its topology (mesh.topology), without its devices: "
                 "the mesh, ZeRO stage, pipeline schedule, and by arithmetic the memory per "
                 "device by kind, the collectives per mesh axis, FLOPs, bubble, step time and "
                 "MFU. --compile compiles the real train step for the layout's real device "
                 "count on simulated CPU devices, from abstract shapes, and puts its memory and "
                 "collectives beside. --search ranks every layout of the config's model and "
                 "batch on the topology by predicted step time. Exit status 0 done, 2 bad "
                 "configuration or a layout that does not fit (one line), 1 anything else."),
    flags=(cli.Flag("--compile", help="compile the step at full size and report memory and "
                                      "collectives"),
           cli.Flag("--search", help="rank the layouts of the config's model and batch that fit"),
           cli.Flag("--devices", "int", "--search: devices to lay out (default: the config's "
                    "own, else the topology's)", minimum=1),
           cli.Flag("--top", "int", "--search: layouts in the table (default 10)", minimum=1),
           cli.Flag("--compile-top", "int", "--search: compile the first K and put their "
                                            "compiled memory beside", minimum=0),
           cli.Flag("--calibrate", "str", "take the step-time assumptions (efficiencies) from "
                                          "a `spmd3d.bench --json` record of the real hardware"),
           cli.Flag("--json", help="the last stdout line is the report as one JSON object")),
)


def _compile(plan, topology) -> tuple[dict, object]:
    """(`footprint.measure`'s record with the analytic figures of what it compiled, that plan)."""
    from .. import footprint
    from ..mesh import simulate
    from . import estimate

    compile_cfg, cut = footprint.compiled_layout(plan.cfg, plan.num_devices)
    simulate(plan.num_devices // cut)
    record = footprint.measure(plan.cfg, topology)
    # the analytic figures of what was compiled (its dtype stand-in and kernel) to compare
    compiled_plan = Plan.resolve(replace(compile_cfg, mesh=plan.cfg.mesh, train=plan.cfg.train),
                                 topology=topology)
    record["estimate_of_compiled"] = estimate.estimate(compiled_plan)
    return record, compiled_plan


def _search(args: cli.Args, cfg, topology, record: dict) -> list[str]:
    from . import estimate, search

    try:  # the config's own layout, ranked among the rest when it has as many devices
        own = search.evaluate(cfg, topology)
    except ConfigError:
        own = None
    # by default the config's own device count (the whole topology if it has no layout)
    devices = args.flags.get("--devices", own.plan.num_devices if own else topology.num_devices)
    per_node = topology.devices_per_node
    if devices > topology.num_devices or (devices > per_node and devices % per_node):
        raise ConfigError("--devices", f"{devices} is not a layout of {topology.name}: at most "
                                       f"{topology.num_devices} devices, whole nodes of "
                                       f"{per_node} beyond one node")
    own = own if own is not None and own.plan.num_devices == devices else None
    lines, record["search"], ranked = search.run(cfg, topology, devices,
                                                 args.flags.get("--top", 10), own)
    ranked = ranked[:args.flags.get("--compile-top", 0)]
    if ranked:
        from .. import footprint
        from ..mesh import simulate

        simulate(max(c.plan.num_devices // footprint.compiled_layout(c.plan.cfg, devices)[1]
                     for c in ranked))
        lines.append(f"compiled (the first {len(ranked)}):")
        for i, c in enumerate(ranked):
            compiled, compiled_plan = _compile(c.plan, topology)
            analytic = estimate.estimate(compiled_plan)["memory"]["needed_bytes"]
            record["search"]["top"][i]["compiled_needed_gb"] = compiled["needed_bytes"] / 1e9
            lines.append(f"{i + 1:>4}  needs {compiled['needed_bytes'] / 1e9:.1f} GB compiled "
                         f"(analytic {analytic / 1e9:.1f}, ratio "
                         f"{analytic / compiled['needed_bytes']:.3f}) in "
                         f"{compiled['compile_s']:.0f} s")
    return lines


def _run(args: cli.Args) -> int:
    from .. import footprint
    from . import estimate

    cfg = args.load_config()
    topology = load_topology(cfg.mesh.topology, "gpu")  # planning is for the cluster
    record = {"config": args.config}
    if args.flags.get("--calibrate"):
        from .calibrate import calibrate

        topology, record["calibration"], note = calibrate(args.flags["--calibrate"], topology)
        print(note, flush=True)
    if args.flags.get("--search"):
        lines = _search(args, cfg, topology, record)
        return cli.report("\n".join(lines), record, bool(args.flags.get("--json")))
    plan = Plan.resolve(cfg, topology=topology)
    print(f"plan of {args.config or 'the built-in demo'} on {topology.name} "
          f"({topology.num_devices} devices of {topology.device_memory_gb:g} GB): "
          f"{plan.num_devices} devices")
    print(plan.describe(), flush=True)
    record["plan"] = {"mesh": dict(plan.mesh.shape), "devices": plan.num_devices}
    compiled = None
    if args.flags.get("--compile"):
        compiled, compiled_plan = _compile(plan, topology)
        record.update(compiled)
    record["estimate"] = estimate.estimate(plan)  # after any compile: it may trace shapes
    lines = footprint.format_report(record) if compiled else []
    lines += estimate.format_estimate(record["estimate"], plan)
    if compiled:
        lines += ["the compiled step's own analytic figures (its compiled dtype and kernel)"]
        lines += estimate.format_estimate(record["estimate_of_compiled"], compiled_plan,
                                          compiled)
    cli.report("\n".join(lines), record, bool(args.flags.get("--json")))
    needed = (compiled or record["estimate"]["memory"])["needed_bytes"]
    if needed > topology.device_memory_gb * 1e9:
        raise ConfigError("mesh", f"this layout needs {needed / 1e9:.1f} GB per device "
                                  f"({'compiled' if compiled else 'analytic'}), more than the "
                                  f"{topology.device_memory_gb:g} GB of a {topology.name} "
                                  "device: see --search")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run(COMMAND, argv, _run)


if __name__ == "__main__":
    sys.exit(main())
