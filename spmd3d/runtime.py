"""What a training loop, a benchmark or a notebook needs around the step: the job (plan, state
shardings, compiled step, data) and one record per logged step (a restored state: `resume`).

`setup(cfg, devices)` resolves the plan once and builds the rest from it; `train.py` (the
command's loop), `bench.py` and `api.py` all start here, so they run the same computation.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import jax
import numpy as np

from . import dist, hostmem, store
from .config import Config
from .plan import Plan

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
        train loop asks before it compiles the step."""
        from .data.loader import eval_batches

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
        """Peak FLOP/s of all the job's devices at `Plan.peak_dtype` (the MFU denominator):
        by the devices' kind where it is known (H100, H200, A100), else the topology's."""
        return self.topology.peak_flops(self.plan.peak_dtype, self.plan.num_devices,
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
    from .data.loader import training_data
    from .step import canonical_state, make_train_step, state_shardings

    plan = cfg if isinstance(cfg, Plan) else Plan.resolve(cfg, devices)
    cfg = plan.cfg
    if isinstance(plan.mesh, jax.sharding.Mesh) and plan.mesh.devices.flat[0].platform == "cpu":
        hostmem.keep_freed_memory()  # XLA:CPU's per-step temporaries: reused, not re-faulted
    graphdef, abstract, shardings = state_shardings(plan)
    step_fn = make_train_step(plan, graphdef, shardings)
    batches, held = training_data(cfg)
    # read one batch now: bad token ids fail in milliseconds, not after compilation
    batches.batch(0, cfg.train.global_batch)
    return Job(plan, graphdef, abstract, shardings, step_fn, batches, canonical_state(plan),
               held=held if cfg.run.eval_every else None)


def step_record(job: Job, step: int, metrics: dict, seconds: float) -> dict:
    """One `metrics.jsonl` record from a step's (host) metrics and its wall time."""
    from .metrics import mfu

    cfg, tokens = job.cfg, job.plan.tokens_per_step
    tps = tokens / seconds
    return {"step": step, "tokens": step * tokens,
            "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
            "lr": float(metrics["lr"]), "tokens_per_s": tps, "step_time_s": seconds,
            "mfu": mfu(tps, cfg.model, cfg.train.seq_len, job.peak_flops),
            # MoE: the routing metrics (`router.step_metrics`)
            **{k: float(v) for k, v in metrics.items() if k.startswith("moe_")}}
