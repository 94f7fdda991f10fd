"""What a training loop, a benchmark or a notebook needs around the step: the job (plan, state
shardings, compiled step, data), a fresh or restored state, and one record per logged step.

`setup(cfg, devices)` resolves the plan once and builds the rest from it; `train.py` (the
command's loop), `bench.py` and `api.py` all start here, so they run the same computation.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import jax
import numpy as np

from . import config as config_lib
from . import dist, store
from .config import Config
from .checkpoint import CheckpointError, Damaged, quiet
from .plan import Plan
from .store import SCHEMA

# config fields that decide the arrays' shapes: a checkpoint written with other values cannot load
MODEL_SHAPE_FIELDS = ('num_layers', 'd_model', 'num_heads', 'num_kv_heads', 'head_dim', 'd_ff',
                      'vocab_size', 'param_dtype')


@dataclass(eq=False)
class Job:
    """Everything a training loop (or a benchmark) needs, built from a plan."""

    plan: Plan
    graphdef: object
    abstract: object  # TrainState of ShapeDtypeStructs
    shardings: object  # TrainState of NamedShardings
    step_fn: object  # jitted train step
    batches: object  # data.TokenBatches
    canonical: tuple  # (abstract, shardings) of the canonical state that checkpoints hold
    need: dict | None = None  # per-device bytes of the compiled step (`memory.check`)
    held: object = None  # the held-out tokens (run.eval_every > 0), or None

    @cached_property
    def evals(self):
        """The held-out windows (`data.eval_batches`), built and checked on first use: the
        train loop asks right after the memory check, before the first step."""
        from .data import eval_batches

        if self.held is None:
            raise ValueError("no held-out data: run.eval_every = 0")
        evals = eval_batches(self.held, self.cfg)
        evals.batch(0, self.cfg.train.global_batch)  # bad token ids fail now, not at step 50
        return evals

    @cached_property
    def eval_step(self):
        """The jitted held-out loss, `(params, tokens) -> mean loss` (`step.make_eval_step`)."""
        from .step import make_eval_step

        return make_eval_step(self.plan, self.graphdef, self.shardings)

    def evaluate(self, params) -> float:
        """The mean loss over the fixed held-out batches (`run.eval_batches`)."""
        b = self.cfg.train.global_batch
        losses = [self.eval_step(params, dist.make_global_batch(self.evals, k,
                                                                 self.batch_sharding, b))
                  for k in range(self.cfg.run.eval_batches)]
        return float(np.mean(jax.device_get(losses)))

    @property
    def cfg(self) -> Config:
        return self.plan.cfg

    @property
    def mesh(self):
        return self.plan.mesh

    @property
    def topology(self):
        return self.plan.topology

    @property
    def batch_sharding(self):
        return self.plan.batch_sharding

    @cached_property
    def peak_flops(self) -> float:
        """Peak FLOP/s of all the job's devices at the compute dtype (the MFU denominator):
        by the devices' kind where it is known (H100, H200, A100), else the topology's."""
        return self.topology.peak_flops(self.cfg.model.dtype, self.plan.num_devices,
                                        jax.devices()[0].device_kind)

    def global_batch(self, step: int):
        """This process's rows of step `step`, assembled into the global [B, T+1] array."""
        return dist.make_global_batch(self.batches, step, self.batch_sharding,
                                      self.cfg.train.global_batch)

    @cached_property
    def _reorders(self):
        """Jitted once: storage -> canonical order, and back, in the state's shardings."""
        from .step import reorder

        return tuple(jax.jit(lambda s, c=c: reorder(s, self.plan, to_canonical=c),
                             out_shardings=self.canonical[1] if c else self.shardings)
                     for c in (False, True))

    def reorder(self, state, to_canonical: bool):
        """Between the stored layer order (a circular pipeline keeps each stage's chunks
        together; uneven stages pad) and the canonical [L, ...] order that checkpoints hold, in
        the stored shardings or the canonical ones (`step.canonical_state`)."""
        if self.plan.canonical_layers:
            return state
        return self._reorders[int(to_canonical)](state)

    @cached_property
    def _init(self):
        from .step import init_fn

        return init_fn(self.plan, self.shardings)

    def init_state(self):
        """The fresh state of `train.seed`, in its shardings (the initializer compiled once)."""
        with jax.set_mesh(self.mesh):
            return self._init()

    def entries(self, state) -> dict:
        """{checkpoint key: array} of a state, layers in canonical order."""
        return store.flat(self.reorder(state, to_canonical=True))

    def compile(self):
        """AOT-compile the step for this job's shapes and shardings; returns (compiled, seconds).
        With `run.memory_check` (the default) a step that needs more memory than a device has
        raises `memory.DoesNotFit` here, before anything is allocated; `need` keeps what it
        needs."""
        from . import memory
        from .step import compile_step

        compiled, seconds = compile_step(self.plan, self.step_fn, self.abstract, self.shardings)
        if self.cfg.run.memory_check:
            self.need = memory.check(self.plan, compiled)
        return compiled, seconds


def setup(cfg: Config | Plan, devices=None) -> Job:
    """Resolve the plan against the devices and build the sharded step and the data."""
    from .data import DataError, TokenBatches, held_out, load_tokens
    from .step import canonical_state, make_train_step, state_shardings

    plan = cfg if isinstance(cfg, Plan) else Plan.resolve(cfg, devices)
    cfg = plan.cfg
    graphdef, abstract, shardings = state_shardings(plan)
    step_fn = make_train_step(plan, graphdef, shardings)
    tokens, held = load_tokens(cfg.data.path, cfg.data.tokenizer), None
    if cfg.data.eval_path:
        try:
            held = load_tokens(cfg.data.eval_path, cfg.data.tokenizer)
        except DataError as e:
            raise DataError("data.eval_path", e.message) from None
    elif cfg.data.eval_fraction:
        tokens, held = held_out(tokens, cfg.data.eval_fraction)
    batches = TokenBatches(tokens, cfg.train.seq_len, cfg.train.seed, cfg.model.vocab_size)
    # read one batch now: bad token ids fail in milliseconds, not after compilation
    batches.batch(0, cfg.train.global_batch)
    return Job(plan, graphdef, abstract, shardings, step_fn, batches, canonical_state(plan),
               held=held if cfg.run.eval_every else None)


def checkpoint_meta(job: Job, step: int) -> dict:
    """What a checkpoint stores beside the arrays. The data position is the step (batches are a
    function of seed and step) and a run has no other random state."""
    return {"step": step, "data_step": step, "seed": job.cfg.train.seed,
            "config": config_lib.to_dict(job.cfg), "mesh": dict(job.mesh.shape),
            "processes": jax.process_count()}


def step_record(job: Job, step: int, metrics: dict, seconds: float) -> dict:
    """One `metrics.jsonl` record from a step's (host) metrics and its wall time."""
    from .metrics import mfu

    cfg, tokens = job.cfg, job.plan.tokens_per_step
    tps = tokens / seconds
    return {"step": step, "tokens": step * tokens,
            "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
            "lr": float(metrics["lr"]), "tokens_per_s": tps, "step_time_s": seconds,
            "mfu": mfu(tps, cfg.model, cfg.train.seq_len, job.peak_flops)}


def restore_or_init(job: Job, ckpt, log=print):
    """(state, first step): the newest complete checkpoint if there is one, else a fresh init.

    Raises `CheckpointError` (exit 2) for a checkpoint of another model or schema, or a
    damaged newest one unless `checkpoint.fallback` allows stepping back past it."""
    target = store.abstract_like(*job.canonical)
    found = restore_newest(ckpt, store.flat(target), config_lib.to_dict(job.cfg)["model"],
                           fallback=job.cfg.checkpoint.fallback, log=log)
    if found is None:
        return job.init_state(), 0
    restored, meta = found
    state = store.unflat(target, restored)
    return job.reorder(state, to_canonical=False), int(meta["step"])


def check_compatible(ckpt, step: int, meta: dict, model: dict, target: dict) -> None:
    """Raises ``CheckpointError`` naming the first field in which the checkpoint and the run's
    model disagree (layer count, width, vocab, ...), then any array whose shape differs."""
    where = f'checkpoint step {step} in {ckpt.directory}'
    schema = meta.get('schema', 1)
    if schema != SCHEMA:
        raise CheckpointError('checkpoint', f'{where} has key schema {schema}; this spmd3d reads '
                              f'schema {SCHEMA} (use another run.dir, or the spmd3d that wrote it)')
    saved_model = meta.get('config', {}).get('model', {})
    for name in MODEL_SHAPE_FIELDS:
        if name in saved_model and name in model and saved_model[name] != model[name]:
            raise CheckpointError(f'model.{name}', f'{where} was written with {saved_model[name]}, '
                                  f'this run has {model[name]} (use another run.dir to start afresh)')
    saved = ckpt.saved_shapes(step)
    want = {k: (tuple(v.shape), np.dtype(v.dtype).name) for k, v in target.items()}
    for k in sorted(set(saved) | set(want)):
        if saved.get(k) != want.get(k):
            raise CheckpointError('checkpoint', f'{where} does not match this model at {k}: '
                                  f'saved {saved.get(k)}, expected {want.get(k)}')


def restore_newest(ckpt, target: dict, model: dict, *, fallback: bool = False,
                   log=print) -> tuple | None:
    """(state, meta) of the newest committed step, or None when there is none.

    A damaged newest step stops the run with a one-line ``CheckpointError`` that names it and
    the step before it; with ``fallback`` the damaged step is moved aside (kept, not deleted)
    and the previous one is tried. A checkpoint of another model is always an error.
    """
    steps = _same_on_all_processes(ckpt.all_steps())
    while steps:
        step = steps.pop()
        try:
            meta = ckpt.read_meta(step)
            check_compatible(ckpt, step, meta, model, target)
            return quiet(lambda: ckpt.restore(step, target))
        except Damaged as e:
            if not fallback:
                before = (f'the newest step before it is {steps[-1]}; rerun with '
                          'checkpoint.fallback=true to resume from it' if steps
                          else 'there is no earlier step')
                raise CheckpointError('checkpoint', f'{ckpt.directory}: {e}; {before}') from None
            moved = ckpt.quarantine(step)
            log(f'warning: checkpoint {e}; moved to {moved}, trying the step before it')
    return None


def _same_on_all_processes(steps: list[int]) -> list[int]:
    """Process 0's list of steps on every process: a caching shared filesystem (NFS) may show
    processes different newest steps, and all must restore the same one."""
    if jax.process_count() == 1:
        return steps
    from jax.experimental import multihost_utils

    padded = np.full(256, -1, np.int64)
    padded[:len(steps[-256:])] = steps[-256:]
    return [int(s) for s in multihost_utils.broadcast_one_to_all(padded) if s >= 0]


class Preemption:
    """SIGTERM (what SLURM and Kubernetes send before a kill) asks the loop to stop after the
    step in flight, save it and exit 0.

    One process: a signal handler sets a flag. Several: jax's preemption service (started by
    `jax.distributed`) catches the signal on any process and agrees on one step at which all
    of them stop, so every process saves the same step."""

    def __init__(self):
        import signal
        import threading

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
