"""`python -m spmd3d.train [CONFIG.yaml] [key=value ...] [--explain]`

A thin entry point: config -> plan -> state (fresh or resumed) -> compiled step -> loop; the
pieces live in `runtime.py` (job, restore, records) and below. Importing this module does not
import jax: the device count must be settable first (`mesh.simulated_devices`).
Exit status: 0 done, 2 invalid configuration or input, or a step that cannot fit in a
device's memory (one line, no traceback), 1 anything else (an out-of-memory error at run time:
one line).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from . import cli, dist
from . import config as config_lib
from .config import Config
from .mesh import simulate_devices

COMMAND = cli.Command(
    prog="python -m spmd3d.train",
    usage="[CONFIG.yaml] [key=value ...] [--explain]",
    description=("Train a transformer on one named mesh (data, stage, tensor, seq). CONFIG.yaml "
                 "defaults to the built-in demo; key=value overrides any field below. A run.dir "
                 "that holds checkpoints resumes from the newest. Exit status 0 done, 2 bad "
                 "configuration or input (one line), 1 anything else."),
    flags=(cli.Flag("--explain", help="print where every parameter lives (run.explain=true)"),),
)


def train(cfg: Config, explain: bool = False, devices=None) -> list[dict]:
    """Train per `cfg`; returns the logged metrics records."""
    import jax
    import yaml

    from .checkpoint import Checkpointer
    from .runtime import Preemption, setup
    from .sharding import describe, format_table

    job = setup(cfg, devices)
    cfg = job.cfg
    lead = jax.process_index() == 0
    run_dir = Path(cfg.run.dir)
    if lead:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config_lib.to_dict(cfg), sort_keys=False))
        print(f"{job.plan.num_devices} {jax.devices()[0].platform} devices: "
              f"{job.plan.describe()}", flush=True)
        if explain or cfg.run.explain:
            print(format_table(describe(job.abstract.params, job.plan.rules, job.mesh)), flush=True)

    ckpt = Checkpointer(run_dir / "checkpoints", every=cfg.checkpoint.every,
                        keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_,
                        cleanup_tmp=True)
    preemption = Preemption()
    try:
        return _loop(job, ckpt, preemption, run_dir, lead)
    finally:
        preemption.close()
        ckpt.close()


def _loop(job, ckpt, preemption, run_dir: Path, lead: bool) -> list[dict]:
    import jax

    from . import memory
    from .metrics import MetricsLog, format_line
    from .runtime import checkpoint_meta, restore_or_init, step_record

    cfg = job.cfg
    compiled, compile_s = job.compile()  # refuses a step that cannot fit, before allocating
    state, start = restore_or_init(job, ckpt, log=print if lead else (lambda *a: None))
    if lead:
        print(f"{'resumed at' if start else 'starting at'} step {start}; compiled in {compile_s:.1f} s",
              flush=True)

    log = MetricsLog(run_dir / "metrics.jsonl" if lead else None)
    records, t_last, steps_since = [], time.perf_counter(), 0

    def save(step, force=False):
        return ckpt.save(step, job.entries(state), checkpoint_meta(job, step), force=force)

    for step in range(start, cfg.train.steps):
        try:
            memory.fake_oom(step)
            state, metrics = compiled(state, job.global_batch(step))
            if (step + 1) % cfg.run.log_every == 0 or step + 1 == cfg.train.steps:
                metrics = jax.device_get(metrics)  # blocks until this step has finished
        except jax.errors.JaxRuntimeError as e:
            if not memory.is_oom(e):
                raise
            raise memory.out_of_memory(e, step, job.need) from None
        steps_since += 1
        done = step + 1
        if done % cfg.run.log_every == 0 or done == cfg.train.steps:
            now = time.perf_counter()
            rec = step_record(job, done, metrics, (now - t_last) / steps_since)
            t_last, steps_since = now, 0
            records.append(rec)
            log.write(rec)
            if lead:
                print(format_line(rec, cfg.train.steps), flush=True)
        if done < cfg.train.steps and preemption.stop_at(done):
            save(done, force=True)
            ckpt.wait()
            log.close()
            if lead:
                print(f"preempted: saved step {done}; the same command resumes from it", flush=True)
            return records
        if ckpt.should_save(done) and done < cfg.train.steps:
            save(done)
    if cfg.train.steps > start or ckpt.latest_step() is None:
        save(cfg.train.steps, force=True)
    ckpt.wait()
    log.close()
    return records


def _run(args: cli.Args) -> int:
    cfg = args.load_config()
    simulate_devices(cfg.mesh.simulated_devices)
    dist.initialize(cfg)
    train(cfg, explain=bool(args.flags.get("--explain")))
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run(COMMAND, argv, _run)


if __name__ == "__main__":
    sys.exit(main())
