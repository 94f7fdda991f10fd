"""`python -m spmd3d.train [CONFIG.yaml] [key=value ...] [--explain]`

A thin entry point: config -> devices -> mesh -> state (fresh or resumed) -> compiled step -> loop.
Exit status: 0 done, 2 invalid configuration or input (one line, no traceback), 1 anything else.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from . import config as config_lib
from . import dist
from .config import Config, ConfigError
from .data import DataError
from .mesh import simulate_devices

FLAGS = ("--explain",)


@dataclass
class Job:
    """Everything a training loop (or a benchmark) needs, built from a config."""

    cfg: Config
    mesh: object
    topology: object
    graphdef: object
    abstract: object  # TrainState of ShapeDtypeStructs
    shardings: object  # TrainState of NamedShardings
    batch_sharding: object
    step_fn: object  # jitted train step
    batches: object  # data.TokenBatches

    def global_batch(self, step: int):
        """This process's rows of step `step`, assembled into the global [B, T+1] array."""
        return dist.make_global_batch(self.batches, step, self.batch_sharding,
                                      self.cfg.train.global_batch)

    def reorder(self, state, to_canonical: bool):
        """Between the stored layer order (a circular pipeline keeps each stage's chunks
        together) and the canonical [L, ...] order that checkpoints hold; same shardings."""
        import jax

        from .pipeline import reorder_layers
        from .step import storage_order

        order = storage_order(self.cfg)
        if np.array_equal(order, np.arange(len(order))):
            return state
        fn = jax.jit(lambda s: reorder_layers(s, order, inverse=to_canonical),
                     out_shardings=self.shardings)
        return fn(state)

    def compile(self):
        """AOT-compile the step for this job's shapes and shardings; returns (compiled, seconds)."""
        import jax

        from .checkpoint import abstract_like

        t = self.cfg.train
        state = abstract_like(self.abstract, self.shardings)
        batch = jax.ShapeDtypeStruct((t.global_batch, t.seq_len + 1), np.int32,
                                     sharding=self.batch_sharding)
        start = time.perf_counter()
        compiled = self.step_fn.lower(state, batch).compile()
        return compiled, time.perf_counter() - start


def setup(cfg: Config, devices=None) -> Job:
    """Resolve the mesh against the devices and build the sharded step and the data."""
    import jax
    from jax.sharding import NamedSharding

    from .data import TokenBatches, load_tokens
    from .mesh import load_topology, make_mesh
    from .sharding import zero_rules
    from .step import make_train_step, state_shardings

    devices = jax.devices() if devices is None else devices
    cfg = config_lib.resolve_mesh(cfg, len(devices))
    topology = load_topology(cfg.mesh.topology, devices[0].platform)
    mesh = make_mesh(cfg.mesh.sizes(), devices, cfg.mesh.allow_cross_host)
    rules = zero_rules(cfg.parallel.zero_stage, cfg.parallel.sequence_parallel)
    graphdef, abstract, shardings = state_shardings(cfg, mesh, rules)
    step_fn = make_train_step(cfg, mesh, graphdef, shardings, rules)
    batch_sharding = NamedSharding(mesh, rules.compute.spec(("batch", None)))
    batches = TokenBatches(load_tokens(cfg.data.path, cfg.data.tokenizer), cfg.train.seq_len,
                           cfg.train.seed, cfg.model.vocab_size)
    # read one batch now: bad token ids fail in milliseconds, not after compilation
    batches.batch(0, cfg.train.global_batch)
    return Job(cfg, mesh, topology, graphdef, abstract, shardings, batch_sharding, step_fn, batches)


def flat(tree) -> dict:
    """{'params/blocks/attn/w_qkv': array, ...}: the checkpoint's mesh-independent key space."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p, simple=True, separator="/"): x for p, x in leaves}


def unflat(like, flat_dict: dict):
    import jax

    treedef = jax.tree.structure(like)
    return jax.tree.unflatten(treedef, list(flat_dict[k] for k in flat(like)))


def checkpoint_meta(job: Job, step: int) -> dict:
    """What a checkpoint stores beside the arrays. The data position is the step (batches are a
    function of seed and step) and a run has no other random state."""
    import jax

    return {"step": step, "data_step": step, "seed": job.cfg.train.seed,
            "config": config_lib.to_dict(job.cfg), "mesh": dict(job.mesh.shape),
            "processes": jax.process_count()}


def step_record(job: Job, step: int, metrics: dict, seconds: float) -> dict:
    """One `metrics.jsonl` record from a step's (host) metrics and its wall time."""
    from .metrics import mfu

    cfg = job.cfg
    tps = cfg.train.global_batch * cfg.train.seq_len / seconds
    peak = job.topology.peak_flops(cfg.model.dtype, job.mesh.size)
    return {"step": step, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
            "lr": float(metrics["lr"]), "tokens_per_s": tps, "step_time_s": seconds,
            "mfu": mfu(tps, cfg.model, cfg.train.seq_len, peak)}


def restore_or_init(job: Job, ckpt, log=print):
    """(state, first step): the newest complete checkpoint if there is one, else a fresh init.

    Raises `CheckpointError` (exit 2) for a checkpoint of another model, or a damaged newest
    one unless `checkpoint.fallback` allows stepping back past it."""
    from .checkpoint import abstract_like, restore_newest
    from .step import TrainState, init_state

    target = abstract_like(job.abstract, job.shardings)._asdict()
    found = restore_newest(ckpt, flat(target), config_lib.to_dict(job.cfg)["model"],
                           fallback=job.cfg.checkpoint.fallback, log=log)
    if found is None:
        return init_state(job.cfg, job.mesh, job.shardings), 0
    restored, meta = found
    state = TrainState(**unflat(target, restored))
    return job.reorder(state, to_canonical=False), int(meta["step"])


class Preemption:
    """SIGTERM (what SLURM and Kubernetes send before a kill) asks the loop to stop after the
    step in flight, save it and exit 0.

    One process: a signal handler sets a flag. Several: jax's preemption service (started by
    `jax.distributed`) catches the signal on any process and agrees on one step at which all
    of them stop, so every process saves the same step."""

    def __init__(self):
        import signal
        import threading

        import jax

        self.requested = False
        self._multi = jax.process_count() > 1
        self._previous = None
        if not self._multi and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame):
        self.requested = True

    def stop_at(self, step: int) -> bool:
        """Whether to stop once `step` is done (call on every process at every step)."""
        if self._multi:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def close(self):
        import signal

        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def train(cfg: Config, explain: bool = False, devices=None) -> list[dict]:
    """Train per `cfg`; returns the logged metrics records."""
    import jax

    from .checkpoint import Checkpointer
    from .sharding import describe, format_table, zero_rules
    from .step import schedule_of

    job = setup(cfg, devices)
    cfg = job.cfg
    lead = jax.process_index() == 0
    run_dir = Path(cfg.run.dir)
    n_dev = job.mesh.size
    if lead:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config_lib.to_dict(cfg), sort_keys=False))
        print(f"mesh {dict(job.mesh.shape)} on {n_dev} {jax.devices()[0].platform} devices, "
              f"ZeRO-{cfg.parallel.zero_stage}, SP {cfg.parallel.sequence_parallel}, "
              f"remat {cfg.parallel.remat}", flush=True)
        if cfg.mesh.stage > 1:
            print(schedule_of(cfg).describe(cfg.model.num_layers), flush=True)
        if explain or cfg.run.explain:
            rules = zero_rules(cfg.parallel.zero_stage, cfg.parallel.sequence_parallel)
            print(format_table(describe(job.abstract.params, rules, job.mesh)), flush=True)

    ckpt = Checkpointer(run_dir / "checkpoints", every=cfg.checkpoint.every,
                        keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_,
                        cleanup_tmp=True)
    preemption = Preemption()
    try:
        return _loop(job, ckpt, preemption, run_dir, lead)
    finally:
        preemption.close()
        ckpt.close()


def _loop(job: Job, ckpt, preemption: Preemption, run_dir: Path, lead: bool) -> list[dict]:
    import jax

    from .metrics import MetricsLog, format_line

    cfg = job.cfg
    state, start = restore_or_init(job, ckpt, log=print if lead else (lambda *a: None))
    compiled, compile_s = job.compile()
    if lead:
        print(f"{'resumed at' if start else 'starting at'} step {start}; compiled in {compile_s:.1f} s",
              flush=True)

    log = MetricsLog(run_dir / "metrics.jsonl" if lead else None)
    records, t_last, steps_since = [], time.perf_counter(), 0

    def save(step, force=False):
        return ckpt.save(step, flat(job.reorder(state, True)._asdict()), checkpoint_meta(job, step),
                         force=force)

    for step in range(start, cfg.train.steps):
        state, metrics = compiled(state, job.global_batch(step))
        steps_since += 1
        done = step + 1
        if done % cfg.run.log_every == 0 or done == cfg.train.steps:
            m = jax.device_get(metrics)  # blocks until this step has finished
            now = time.perf_counter()
            rec = step_record(job, done, m, (now - t_last) / steps_since)
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        path, overrides, flags = config_lib.parse_args(argv)
        for f in flags:
            if f not in FLAGS:
                raise ConfigError("argv", f"unknown flag {f} (known: {', '.join(FLAGS)})")
        cfg = config_lib.load(path, overrides)
        simulate_devices(cfg.mesh.simulated_devices)
        dist.initialize(cfg)
        train(cfg, explain="--explain" in flags)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
