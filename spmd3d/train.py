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
        import jax

        local = self.batches.batch(step, self.cfg.train.global_batch, jax.process_index(),
                                   jax.process_count())
        return jax.make_array_from_process_local_data(self.batch_sharding, local)

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

        t = self.cfg.train
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             self.abstract, self.shardings)
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
    mesh = make_mesh(cfg.mesh.sizes(), devices)
    rules = zero_rules(cfg.parallel.zero_stage, cfg.parallel.sequence_parallel)
    graphdef, abstract, shardings = state_shardings(cfg, mesh, rules)
    step_fn = make_train_step(cfg, mesh, graphdef, shardings, rules)
    batch_sharding = NamedSharding(mesh, rules.compute.spec(("batch", None)))
    batches = TokenBatches(load_tokens(cfg.data.path, cfg.data.tokenizer), cfg.train.seq_len,
                           cfg.train.seed, cfg.model.vocab_size)
    # read one batch now: bad token ids fail in milliseconds, not after compilation
    batches.batch(0, cfg.train.global_batch, jax.process_index(), jax.process_count())
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


def restore_or_init(job: Job, ckpt):
    """(state, first step): the newest complete checkpoint if there is one, else a fresh init."""
    import jax

    from .step import TrainState, init_state

    step = ckpt.latest_step()
    if step is None:
        return init_state(job.cfg, job.mesh, job.shardings), 0
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          job.abstract, job.shardings)
    restored, meta = ckpt.restore(step, flat(target._asdict()))
    state = TrainState(**unflat(target._asdict(), restored))
    return job.reorder(state, to_canonical=False), int(meta["step"])


def train(cfg: Config, explain: bool = False, devices=None) -> list[dict]:
    """Train per `cfg`; returns the logged metrics records."""
    import jax

    from .checkpoint import Checkpointer
    from .metrics import MetricsLog, format_line, mfu
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
                        keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_)
    state, start = restore_or_init(job, ckpt)
    compiled, compile_s = job.compile()
    if lead:
        print(f"{'resumed at' if start else 'starting at'} step {start}; compiled in {compile_s:.1f} s",
              flush=True)

    log = MetricsLog(run_dir / "metrics.jsonl" if lead else None)
    tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
    peak = job.topology.peak_flops(cfg.model.dtype, n_dev)
    records, t_last, steps_since = [], time.perf_counter(), 0

    def meta(step):
        return {"step": step, "data_step": step, "config": config_lib.to_dict(cfg),
                "mesh": dict(job.mesh.shape)}

    for step in range(start, cfg.train.steps):
        state, metrics = compiled(state, job.global_batch(step))
        steps_since += 1
        done = step + 1
        if done % cfg.run.log_every == 0 or done == cfg.train.steps:
            m = jax.device_get(metrics)  # blocks until this step has finished
            now = time.perf_counter()
            dt = (now - t_last) / steps_since
            t_last, steps_since = now, 0
            tps = tokens_per_step / dt
            rec = {"step": done, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                   "lr": float(m["lr"]), "tokens_per_s": tps, "step_time_s": dt,
                   "mfu": mfu(tps, cfg.model, cfg.train.seq_len, peak)}
            records.append(rec)
            log.write(rec)
            if lead:
                print(format_line(rec, cfg.train.steps), flush=True)
        if ckpt.should_save(done) and done < cfg.train.steps:
            ckpt.save(done, flat(job.reorder(state, True)._asdict()), meta(done))
    if cfg.train.steps > start or ckpt.latest_step() is None:
        ckpt.save(cfg.train.steps, flat(job.reorder(state, True)._asdict()), meta(cfg.train.steps),
                  force=True)
    ckpt.wait()
    ckpt.close()
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
