"""`python -m spmd3d.plan [CONFIG.yaml] [key=value ...] [--compile] [--json]`: the plan of a
config on its cluster, and with `--compile` what its step needs per device (`footprint.py`)."""

from __future__ import annotations

import sys
from dataclasses import replace

from .. import cli
from ..mesh import load_topology
from . import Plan


COMMAND = cli.Command(
    prog="python -m spmd3d.plan",
    usage="[CONFIG.yaml] [key=value ...] [--compile] [--json]",
    description=("The plan of a config on its topology (mesh.topology), without its devices: "
                 "the mesh, ZeRO stage, pipeline schedule. --compile compiles the real train "
                 "step for the layout's real device count on simulated CPU devices, from "
                 "abstract shapes, and prints per-device memory (arguments, temporaries, "
                 "outputs, and by kind) and the collectives per mesh axis. Exit status 0 done, "
                 "2 bad configuration (one line), 1 anything else."),
    flags=(cli.Flag("--compile", help="compile the step at full size and report memory and "
                                      "collectives"),
           cli.Flag("--json", help="the last stdout line is the report as one JSON object")),
)


def _run(args: cli.Args) -> int:
    from .. import footprint
    from . import estimate

    cfg = args.load_config()
    topology = load_topology(cfg.mesh.topology, "gpu")  # planning is for the cluster
    plan = Plan.resolve(cfg, topology=topology)
    print(f"plan of {args.config or 'the built-in demo'} on {topology.name} "
          f"({topology.num_devices} devices of {topology.device_memory_gb:g} GB): "
          f"{plan.num_devices} devices")
    print(plan.describe(), flush=True)
    record = {"config": args.config, "plan": {"mesh": dict(plan.mesh.shape),
                                              "devices": plan.num_devices}}
    compiled = None
    if args.flags.get("--compile"):
        from ..api import simulate

        compile_cfg, cut = footprint.compiled_layout(plan.cfg, plan.num_devices)
        simulate(plan.num_devices // cut)
        record.update(footprint.measure(plan.cfg, topology))
        # the analytic figures of what was compiled (its dtype stand-in and kernel) to compare
        compiled_plan = Plan.resolve(replace(compile_cfg, mesh=plan.cfg.mesh,
                                             train=plan.cfg.train), topology=topology)
        record["estimate_of_compiled"] = estimate.estimate(compiled_plan)
        compiled = record
    record["estimate"] = estimate.estimate(plan)  # after any compile: it may trace shapes
    lines = footprint.format_report(record) if compiled else []
    lines += estimate.format_estimate(record["estimate"], plan)
    if compiled:
        lines += ["the compiled step's own analytic figures (its compiled dtype and kernel)"]
        lines += estimate.format_estimate(record["estimate_of_compiled"], compiled_plan,
                                          compiled)[:4]
    return cli.report("\n".join(lines), record, bool(args.flags.get("--json")))


def main(argv: list[str] | None = None) -> int:
    return cli.run(COMMAND, argv, _run)


if __name__ == "__main__":
    sys.exit(main())
