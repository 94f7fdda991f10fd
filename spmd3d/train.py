"""`python -m spmd3d.train [CONFIG.yaml] [key=value ...] [--explain]`

A thin entry point: config -> plan -> state (fresh or resumed) -> compiled step -> loop; the
pieces live in `runtime.py` (job, restore, records) and below. Importing this module does not
import jax: the device count must be settable first (`mesh.simulated_devices`).
Exit status: 0 done, 2 invalid configuration or input, or a step that cannot fit in a
device's memory (one line, no traceback), 1 anything else (an out-of-memory error at run time:
one line).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from pathlib import Path

from . import cli, dist, elastic, gpu
from . import config as config_lib
from .config import Config
from .mesh import simulate_devices

LOG = logging.getLogger("spmd3d")

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
    """Train per `cfg`; returns the logged metrics records. Messages go to the `spmd3d`
    logger (the command line prints them; a notebook sets its own handler)."""
    import jax
    import yaml

    from .checkpoint import Checkpointer
    from .dist import Preemption
    from .runtime import setup
    from .sharding import describe, format_table

    job = setup(cfg, devices)
    cfg = job.cfg
    lead = jax.process_index() == 0
    run_dir = Path(cfg.run.dir)
    if lead:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config_lib.to_dict(cfg), sort_keys=False))
        LOG.info(f"{job.plan.num_devices} {jax.devices()[0].platform} devices: "
                 f"{job.plan.describe()}")
        if explain or cfg.run.explain:
            LOG.info(format_table(describe(job.abstract.params, job.plan.rules, job.mesh)))

    ckpt = Checkpointer(run_dir / "checkpoints", every=cfg.checkpoint.every,
                        keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_,
                        cleanup_tmp=True)
    preemption = Preemption()
    try:
        return _loop(job, ckpt, preemption, run_dir, lead)
    finally:
        preemption.close()
        ckpt.close()


def _sinks(job, run_dir: Path, lead: bool):
    from .metrics import MetricsLog, Sinks, TensorBoard, Terminal

    if not lead:
        return Sinks()
    sinks = Sinks([Terminal(job.cfg.train.steps), MetricsLog(run_dir / "metrics.jsonl")])
    if job.cfg.run.tensorboard:
        sinks.append(TensorBoard(run_dir / "tensorboard", (job.need or {}).get("total")))
    return sinks


def _samples(job, lead: bool):
    """The sampler of `run.sample_every`, or None (off, or its copy of the parameters would
    not fit beside the training state: a warning, not an error)."""
    from .generate.samples import Samples

    if not job.cfg.run.sample_every:
        return None
    samples = Samples(job.plan)
    if samples.fits(job.need):
        return samples
    if lead:
        LOG.warning(f"warning: no samples: their copy of the parameters needs "
                    f"{samples.bytes / 2**30:.1f} GiB per device beside the state's "
                    f"{job.need['arguments'] / 2**30:.1f} GiB (run.sample_every=0 silences this)")
    return None


def _sample(samples, params, step: int, run_dir: Path, lead: bool) -> None:
    """One sample: printed, and a line of samples.jsonl."""
    import json

    text = samples(params)
    if lead:
        LOG.info(f"sample at step {step}:\n{text}")
        with open(run_dir / "samples.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "text": text}) + "\n")


def _loop(job, ckpt, preemption, run_dir: Path, lead: bool) -> list[dict]:
    import jax

    from . import memory
    from .resume import check_newest, checkpoint_meta, restore_or_init
    from .runtime import step_record

    cfg, t0 = job.cfg, time.perf_counter()
    # what a mistake in the input costs: no compile for a checkpoint of another model or too
    # little held-out data (not found at the first eval), no allocation for a step that
    # cannot fit (the compile refuses it)
    check_newest(job, ckpt)
    if cfg.run.eval_every:
        job.evals  # noqa: B018
    compiled, compile_s = job.compile()
    saved = ckpt.latest_step() is not None
    hosts = dist.host_names()
    state, start, meta = restore_or_init(job, ckpt,
                                         log=LOG.warning if lead else (lambda *a: None))
    if lead:
        LOG.info(f"{'resumed at' if saved else 'starting at'} step {start}; "
                 f"the step compiled in {compile_s:.1f} s")

    samples = _samples(job, lead)
    sinks = _sinks(job, run_dir, lead)
    resized = lead and meta and elastic.record(meta, job.plan, hosts, _last_step(run_dir))
    if resized:
        LOG.info(elastic.describe(resized))
        sinks.event(resized)
    records, t_last, steps_since = [], time.perf_counter(), 0
    every, steps = cfg.run.eval_every, cfg.train.steps

    def save(step, force=False):
        return ckpt.save(step, job.entries(state), checkpoint_meta(job, step, hosts),
                         force=force)

    batch = job.global_batch(start) if start < steps else None
    for step in range(start, steps):
        done = step + 1
        evaluate = every and (done % every == 0 or (done == steps and done >= every))
        sample = samples and done % cfg.run.sample_every == 0
        logged = done % cfg.run.log_every == 0 or done == steps or evaluate or sample
        try:
            state, metrics = compiled(state, batch)  # dispatched: the device works on it...
            if done < steps:  # ...while the host reads and places the next step's batch
                batch = job.global_batch(done)
            if logged:
                metrics = jax.device_get(metrics)  # blocks until this step has finished
        except jax.errors.JaxRuntimeError as e:
            if not memory.is_oom(e):
                raise
            raise memory.out_of_memory(e, step, job.need) from None
        steps_since += 1
        if logged:
            now = time.perf_counter()
            rec = step_record(job, done, metrics, (now - t_last) / steps_since)
            if evaluate:
                rec["eval_loss"] = job.evaluate(state.params)
                rec["eval_perplexity"] = math.exp(min(rec["eval_loss"], 700))
            records.append(rec)
            sinks.write(rec)
            if sample:
                _sample(samples, state.params, done, run_dir, lead)
            t_last, steps_since = time.perf_counter(), 0  # evaluation is not step time
        if done < steps and preemption.stop_at(done):
            save(done, force=True)
            ckpt.wait()
            sinks.close()
            if lead:
                LOG.info(f"preempted: saved step {done}; the same command resumes from it")
            return records
        if ckpt.should_save(done) and done < steps:
            save(done)
    if steps > start or ckpt.latest_step() is None:
        save(steps, force=True)
    ckpt.wait()
    sinks.close()
    if lead:
        _finish(job, run_dir, records, start, time.perf_counter() - t0)
    return records


def _last_step(run_dir: Path) -> int:
    """The last step a run in `run_dir` logged (0: none), before it stopped."""
    from .plot import read_metrics
    from .schema import DataError

    try:
        return max(r["step"] for r in read_metrics(run_dir) if "loss" in r)
    except (DataError, ValueError):
        return 0


def _finish(job, run_dir: Path, records: list[dict], start: int, seconds: float) -> None:
    """The run's picture (`curves.png`) and its one-line summary."""
    from .metrics import duration
    from .plot import plot_runs

    outputs = ["metrics.jsonl", "checkpoints/"] + (["samples.jsonl"] if (run_dir / "samples.jsonl")
                                                   .is_file() else [])
    try:
        plot_runs([run_dir], run_dir / "curves.png")
        outputs.insert(1, "curves.png")
    except Exception as e:  # noqa: BLE001 -- a picture never fails a finished run
        LOG.warning(f"warning: no curves.png ({type(e).__name__}: {e})")
    if job.cfg.run.tensorboard:
        outputs.append("tensorboard/")
    t = job.cfg.train
    steps = t.steps - start
    last = {k: r[k] for r in records for k in ("loss", "eval_loss") if k in r}
    losses = ", ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in last.items())
    LOG.info(f"done: {steps} steps, {steps * job.plan.tokens_per_step:,} tokens in "
             f"{duration(seconds)}{'; final ' + losses if losses else ''}; "
             f"{run_dir}/: {', '.join(outputs)}")


def _run(args: cli.Args) -> int:
    cfg = args.load_config()
    simulate_devices(cfg.mesh.simulated_devices)
    for line in gpu.apply(cfg):  # XLA_FLAGS and the optimization level, before jax starts
        LOG.info(line)
    dist.initialize(cfg)
    if cfg.run.compile_cache:
        import jax

        jax.config.update("jax_compilation_cache_dir", cfg.run.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    train(cfg, explain=bool(args.flags.get("--explain")))
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run(COMMAND, argv, _run)


if __name__ == "__main__":
    sys.exit(main())
