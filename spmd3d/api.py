"""The library as a Python API, for notebooks and scripts: the pieces `python -m spmd3d.train`
wires together, one call each, with no command line and no global state but the devices.

    import spmd3d
    spmd3d.simulate(8)                       # before anything imports jax
    cfg = spmd3d.configure("demo", ["train.steps=5"], mesh=dict(data=2, tensor=4))
    exp = spmd3d.Experiment(cfg)             # plan, shardings, data: `runtime.setup`
    records = exp.run(5)                     # [{'step': 1, 'loss': ...}, ...]
    exp.eval_loss(); exp.params_table(); exp.memory(); exp.collectives()
    exp.save("runs/nb")                      # an Orbax checkpoint, canonical layer order
    other = spmd3d.restore(cfg_on_another_mesh, "runs/nb")

Nothing here imports jax at import time: `simulate` must be able to run first. Everything is
built from `runtime.setup` / `resume.restore_or_init`, so an experiment is the same
computation as the command line's run of the same config.
"""

from __future__ import annotations

import time
from pathlib import Path

from . import config as config_lib
from .config import Config
from .mesh import AXES, simulate  # noqa: F401 (spmd3d.simulate)
from .units import columns

_KIND_ABBREV = {"all-reduce": "ar", "all-gather": "ag", "reduce-scatter": "rs",
                "all-to-all": "a2a", "collective-permute": "cp"}


def configure(preset: str | None = None, overrides: list[str] | tuple = (), **kw) -> Config:
    """A validated Config: defaults <- preset <- `key=value` strings <- keyword overrides.

    `preset` is a preset's name (`"demo"`, `"gpt3_175b"`: `configs/`) or a YAML path; None is the
    built-in demo. Keywords are sections (`mesh=dict(tensor=4)`) or dotted names
    (`**{"mesh.tensor": 4}`). `mesh.simulated_devices` is ignored here: call `simulate`.
    """
    cfg = config_lib.load(preset, list(overrides))
    sections: dict = {}
    for key, value in kw.items():
        if "." not in key and isinstance(value, dict):
            sections.setdefault(key, {}).update(value)
        else:
            sec, _, rest = key.partition(".")
            if not rest:
                raise config_lib.ConfigError(key, "expected a section dict or a dotted name")
            sections.setdefault(sec, {})[rest] = value
    return config_lib.override(cfg, **sections) if sections else cfg


class Table(list):
    """Rows (dicts) that print as an aligned text table (`units.columns`), in a terminal and
    in a notebook."""

    def __init__(self, rows, columns=None):
        super().__init__(rows)
        self.columns = list(columns or (rows[0].keys() if rows else []))

    def __repr__(self) -> str:
        return "\n".join(columns([[r.get(c, "") for c in self.columns] for r in self],
                                 self.columns))

    __str__ = __repr__

    def _repr_pretty_(self, p, cycle) -> None:  # IPython's display hook
        p.text(repr(self))


class Experiment:
    """One config on one mesh: the sharded state, the compiled step, and readouts of both.

    Built by `runtime.setup` (plan, shardings, jitted step, data), so it is exactly the run
    `python -m spmd3d.train` would do. The state is created on first use (`init_state`) or
    restored by `restore`; `run` continues from the current step, so the data order and the
    learning-rate schedule follow the global step as in a resumed command-line run.
    """

    def __init__(self, cfg: Config, devices=None):
        import jax

        from .runtime import setup

        if devices is None:  # a fixed mesh smaller than the machine takes its first devices
            # (mesh.data counts the expert-parallel devices too; -1 takes them all)
            n = cfg.mesh.num_devices if cfg.mesh.data > 0 else 0
            devices = jax.devices()[:n] if n else jax.devices()
        self.job = setup(cfg, devices)
        self.plan = self.job.plan
        self.cfg = self.plan.cfg  # mesh.data resolved
        self.mesh = self.job.mesh
        self.step = 0  # optimizer steps taken
        self.history: list[dict] = []  # every record `run` returned
        self.compile_seconds: float | None = None
        self._state = None
        self._compiled = None
        self._samples: dict = {}

    def __repr__(self) -> str:
        p = self.cfg.parallel
        return (f"Experiment(mesh={dict(self.mesh.shape)}, zero={p.zero_stage}, "
                f"sp={p.sequence_parallel}, repeats={p.pipeline_repeats}, "
                f"microbatches={self.cfg.train.microbatches}, step={self.step})")

    @property
    def rules(self):
        return self.plan.rules

    @property
    def state(self):
        """The TrainState, created in its shardings on first use (seeded by `train.seed`)."""
        if self._state is None:
            self._state = self.job.init_state()
        return self._state

    @state.setter
    def state(self, value) -> None:
        self._state = value

    def compile(self):
        """The step, compiled ahead of time once for this mesh (later calls reuse it)."""
        if self._compiled is None:
            self._compiled, self.compile_seconds = self.job.compile()
        return self._compiled

    def run(self, steps: int) -> list[dict]:
        """Run `steps` train steps from the current one; one record per step with the keys of
        `metrics.jsonl` (step, loss, grad_norm, lr, tokens_per_s, step_time_s, mfu)."""
        import jax

        from .runtime import step_record

        compiled, state = self.compile(), self.state
        records = []
        for _ in range(steps):
            start = time.perf_counter()
            state, metrics = compiled(state, self.job.global_batch(self.step))
            self._state = state  # the old state was donated
            m = jax.device_get(metrics)
            self.step += 1
            records.append(step_record(self.job, self.step, m, time.perf_counter() - start))
        self.history += records
        return records

    def eval_loss(self) -> float:
        """The held-out loss of the current state: the mean over `run.eval_batches` fixed
        batches of the held-out split (`data.eval_fraction` or `data.eval_path`)."""
        return self.job.evaluate(self.state.params)

    def sample(self, prompt: str | None = None, tokens: int | None = None) -> str:
        """`prompt` (default `run.sample_prompt`) and its continuation of `tokens` new
        tokens by the current parameters, as the run's samples are made
        (`generate.samples.Samples`)."""
        from .generate.samples import Samples

        from dataclasses import replace

        run = {"sample_prompt": prompt or self.cfg.run.sample_prompt,
               "sample_tokens": tokens or self.cfg.run.sample_tokens}
        key = tuple(run.values())
        if key not in self._samples:  # compiled once per prompt length and token count
            self._samples[key] = Samples(replace(self.plan, cfg=config_lib.override(
                self.plan.cfg, run=run)))
        return self._samples[key](self.state.params)

    # -- where things live ----------------------------------------------------------------

    def params_table(self) -> Table:
        """Every parameter: global shape, logical names, mesh axes it is stored on (and its
        optimizer state), per-device shape (`sharding.describe`, as `--explain` prints)."""
        from .sharding import PARAM_COLUMNS, describe

        rows = describe(self.job.abstract.params, self.rules, self.mesh)
        return Table(rows, PARAM_COLUMNS)

    def param(self, path: str):
        """The live (sharded) array of one parameter by its `params_table` name, e.g.
        `exp.param("embed")`; stacked block weights are in storage order (a circular pipeline
        keeps each stage's layers together)."""
        from .store import flat

        params = flat(self.state.params)
        if path not in params:
            raise KeyError(f"{path!r}; parameters: {', '.join(params)}")
        return params[path]

    def canonical_params(self) -> dict:
        """{name: numpy array} of the parameters in the canonical [L, ...] layer order: what a
        checkpoint holds, equal across meshes for the same training."""
        import numpy as np

        from .store import flat

        state = self.job.reorder(self.state, to_canonical=True)
        return {k: np.asarray(v) for k, v in flat(state.params).items()}

    # -- the compiled step ----------------------------------------------------------------

    def memory(self) -> dict:
        """Per-device bytes of the compiled step: arguments, outputs, temporaries, total."""
        from .hlo import memory

        return memory(self.compile())

    def collectives(self) -> Table:
        """The compiled step's collectives per (kind, mesh axes): ops per step (loop bodies
        weighted by their trip counts) and result bytes per device per step. Axes `?`: device
        groups that `hlo.collectives` could not name."""
        from . import hlo

        colls = hlo.collectives(self.compile().as_text(), self.mesh.shape)
        counts, nbytes = hlo.summary(colls), hlo.bytes_by_axes(colls)
        rows = [{"kind": k, "axes": ",".join(a) or "?", "count": n, "bytes": nbytes[(k, a)]}
                for (k, a), n in sorted(counts.items())]
        return Table(rows, ["kind", "axes", "count", "bytes"])

    # -- checkpoints ----------------------------------------------------------------------

    def save(self, run_dir: str | Path | None = None) -> Path:
        """Write `config.yaml` and an Orbax checkpoint of the current step (canonical layer
        order, as `train` writes it) under `run_dir` (default `run.dir`); returns the dir."""
        import yaml

        from .checkpoint import Checkpointer
        from .resume import checkpoint_meta

        run_dir = Path(run_dir or self.cfg.run.dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(
            yaml.safe_dump(config_lib.to_dict(self.cfg), sort_keys=False))
        meta = checkpoint_meta(self.job, self.step)
        ckpt = Checkpointer(run_dir / "checkpoints", every=0, keep=self.cfg.checkpoint.keep,
                            async_save=False)
        try:
            ckpt.save(self.step, self.job.entries(self.state), meta, force=True)
            ckpt.wait()
        finally:
            ckpt.close()
        return run_dir


def restore(target: Config | Experiment, run_dir: str | Path) -> Experiment:
    """The newest checkpoint under `run_dir` onto the mesh of `target` (a config, or an
    experiment whose compiled step is reused). Any mesh works: checkpoints hold the canonical
    layout and `resume.restore_or_init` restores it straight into the target shardings."""
    from .checkpoint import Checkpointer
    from .resume import restore_or_init

    exp = target if isinstance(target, Experiment) else Experiment(target)
    directory = Path(run_dir) / "checkpoints"
    ckpt = Checkpointer(directory, every=0, keep=exp.cfg.checkpoint.keep, async_save=False)
    try:
        if ckpt.latest_step() is None:
            raise FileNotFoundError(f"no checkpoint in {directory}")
        exp.state, exp.step, _ = restore_or_init(exp.job, ckpt)
    finally:
        ckpt.close()
    return exp


def compare(experiments: dict) -> Table:
    """Layouts side by side: per-device memory of the compiled step (MiB) and, per mesh axis,
    its collectives per step (ar all-reduce, ag all-gather, rs reduce-scatter, a2a all-to-all,
    cp collective-permute; loop bodies counted once per trip). Experiments compile on first use."""
    rows, groups = [], []
    for name, exp in experiments.items():
        mem = exp.memory()
        row = {"layout": name,
               "mesh": "×".join(f"{a}{n}" for a, n in exp.mesh.shape.items() if n > 1) or "1",
               "args MiB": mem["argument_bytes"] / 2**20, "temp MiB": mem["temp_bytes"] / 2**20,
               "total MiB": mem["total_bytes"] / 2**20}
        per: dict = {}
        for c in exp.collectives():
            key = c["axes"].replace(",", "+")
            per.setdefault(key, []).append(f"{_KIND_ABBREV.get(c['kind'], c['kind'])} {c['count']}")
            if key not in groups:
                groups.append(key)
        row.update({k: " ".join(v) for k, v in per.items()})
        rows.append(row)
    order = {a: i for i, a in enumerate(AXES)}
    groups.sort(key=lambda g: (g.count("+"), [order.get(a, 9) for a in g.split("+")]))
    return Table(rows, ["layout", "mesh", "args MiB", "temp MiB", "total MiB"] + groups)


def load(run_dir: str | Path, mesh=None, step: int | None = None, what: str = "params"):
    """(nested dict of arrays, meta) of a checkpoint's `what` subtree ('params', 'opt' or ''
    for all), for a notebook: on this process's first device, or with `mesh` (a
    `jax.sharding.Mesh` of any shape) in the shardings the checkpoint's own config gives on it."""
    from . import checkpoint, store

    target = None
    if mesh is not None:
        def target(meta):
            from .plan import Plan
            from .step import canonical_state

            sections = {**meta["config"], "mesh": {**meta["config"]["mesh"], **dict(mesh.shape)}}
            cfg = config_lib.override(Config(), **sections)
            plan = Plan.resolve(cfg, mesh.devices.flat)
            return store.flat(store.abstract_like(*canonical_state(plan)))

    return checkpoint.load(run_dir, step, what=what, target=target)
