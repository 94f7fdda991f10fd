"""Typed, validated configuration: frozen dataclasses, YAML files, dotted `key=value` overrides.

The dataclass defaults *are* the embedded demo config (`configs/demo.yaml` mirrors them), so
`python -m spmd3d.train` with no arguments trains the demo. Every mistake a user can make in a
config raises `ConfigError(field, message)`; the entry points turn it into one line and exit 2.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import yaml

DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "save_dots")


class ConfigError(ValueError):
    """A configuration mistake; `field` is the dotted name to blame, str(self) is one line."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int = 4
    d_model: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    d_ff: int = 768
    vocab_size: int = 256
    head_dim: int = 0  # 0: d_model // num_heads
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"  # master weights and optimizer state

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.d_model // self.num_heads


@dataclass(frozen=True)
class MeshConfig:
    data: int = -1  # -1: all devices left over
    stage: int = 1
    tensor: int = 2
    seq: int = 1
    # N > 0: N simulated CPU devices; -1: 8 simulated CPU devices unless an accelerator is
    # present; 0: whatever devices JAX finds.
    simulated_devices: int = -1
    topology: str = "auto"  # a file in meshes/ (without .yaml); auto: by platform
    # With several hosts, tensor and seq must fit inside one host (their collectives run every
    # layer); true lets a layout put them across hosts anyway (slow, but it runs).
    allow_cross_host: bool = False

    def sizes(self) -> dict[str, int]:
        return {"data": self.data, "stage": self.stage, "tensor": self.tensor, "seq": self.seq}


@dataclass(frozen=True)
class ParallelConfig:
    zero_stage: int = 1
    pipeline_repeats: int = 1
    sequence_parallel: bool = False
    remat: str = "none"
    # false unrolls the layer loop when tracing (each pipeline stage's chunk, with a pipeline):
    # no per-layer copies into stacked residual buffers and scheduling across layers, for
    # compile time that grows with depth -- a win for small, shallow models (see bench_small)
    scan_layers: bool = True


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 150
    global_batch: int = 32
    seq_len: int = 128
    microbatches: int = 1
    seed: int = 0


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3
    warmup_steps: int = 10
    decay_steps: int = 0  # 0: train.steps
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8


@dataclass(frozen=True)
class DataConfig:
    path: str = ""  # empty: the embedded default corpus (Python's standard library sources)
    tokenizer: str = "bytes"


@dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/demo"
    log_every: int = 1
    explain: bool = False  # print where every parameter lives


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 50
    keep: int = 3
    async_: bool = True  # spelled `async` in YAML and on the command line
    fallback: bool = False  # a damaged newest checkpoint: resume from the previous good one


@dataclass(frozen=True)
class DistConfig:
    """One training job over several processes (hosts); see `dist.py`. Left at these defaults,
    the values come from the environment (SLURM, Kubernetes, JAX_*), or it is one process."""

    coordinator: str = ""  # HOST:PORT where process 0 serves the coordination service
    num_processes: int = 1
    process_id: int = 0
    # A process silent this long is declared lost and every other process stops (exit 1).
    heartbeat_timeout_s: int = 20
    init_timeout_s: int = 300  # how long the processes wait for each other at start-up


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)


# ---------------------------------------------------------------------------------------------
# dict <-> dataclass, strictly typed

def _yaml_name(f: dataclasses.Field) -> str:
    return f.name.rstrip("_")


_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _coerce(path: str, value, typ):
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 (PyYAML) reads exponent notation without a dot (`1e-3`) as a string.
        if isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
            return float(value)
    elif typ is str:
        if isinstance(value, str):
            return value
        if value is None:
            return ""
    else:  # pragma: no cover - only the types above are used
        raise TypeError(typ)
    raise ConfigError(path, f"expected {typ.__name__}, got {value!r}")


def _build(cls, data, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(prefix.rstrip(".") or "config", f"expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {_yaml_name(f): f for f in fields(cls)}
    for key in data:
        if key not in known:
            raise ConfigError(f"{prefix}{key}", "unknown field")
    kwargs = {}
    for name, f in known.items():
        if name not in data:
            continue
        path = f"{prefix}{name}"
        typ = hints[f.name]
        if dataclasses.is_dataclass(typ):
            kwargs[f.name] = _build(typ, data[name], path + ".")
        else:
            kwargs[f.name] = _coerce(path, data[name], typ)
    return cls(**kwargs)


def to_dict(cfg) -> dict:
    """The config as plain YAML-able data, with YAML spellings (`async`, not `async_`)."""
    out = {}
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        out[_yaml_name(f)] = to_dict(v) if dataclasses.is_dataclass(v) else v
    return out


def _set_dotted(tree: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(dotted, "is not a section")
    node[parts[-1]] = value


def parse_args(argv: list[str]) -> tuple[str | None, list[str], list[str]]:
    """Split `[CONFIG.yaml] [key=value ...] [--flags]` into (config path, overrides, flags)."""
    path, overrides, flags = None, [], []
    for a in argv:
        if a.startswith("--"):
            flags.append(a)
        elif "=" in a:
            overrides.append(a)
        elif path is None:
            path = a
        else:
            raise ConfigError("argv", f"unexpected argument {a!r} (expected key=value)")
    return path, overrides, flags


def load(path: str | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Defaults <- YAML file <- `key=value` overrides, then validated. Raises ConfigError."""
    tree: dict = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError("config", f"no such file {path!r}")
        try:
            tree = yaml.safe_load(p.read_text())
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError("config", f"cannot read {path!r} ({e})")
        except yaml.YAMLError as e:
            raise ConfigError("config", f"{path} is not valid YAML ({str(e).splitlines()[0]})")
        if tree is None:
            tree = {}
        if not isinstance(tree, dict):
            raise ConfigError("config", f"{path} must hold a mapping of sections, "
                                        f"got a {type(tree).__name__}")
    for ov in overrides:
        key, _, raw = ov.partition("=")
        if not key:
            raise ConfigError("argv", f"bad override {ov!r} (expected key=value)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key, value)
    cfg = _build(Config, tree, "")
    validate(cfg)
    return cfg


def override(cfg: Config, **sections) -> Config:
    """`override(cfg, model=dict(num_layers=2), mesh=dict(tensor=4))`, validated."""
    tree = to_dict(cfg)
    for sec, vals in sections.items():
        for k, v in vals.items():
            _set_dotted(tree, f"{sec}.{k}", v)
    cfg = _build(Config, tree, "")
    validate(cfg)
    return cfg


# ---------------------------------------------------------------------------------------------
# validation

def _need(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise ConfigError(field, message)


def _divides(field: str, value: int, by: int, what: str) -> None:
    _need(value % by == 0, field, f"{value} is not divisible by {what} = {by}")


def validate(cfg: Config) -> None:
    """Static checks; `mesh.data = -1` is checked again once the device count is known."""
    m, mesh, par, tr, op = cfg.model, cfg.mesh, cfg.parallel, cfg.train, cfg.optim
    for name in ("num_layers", "d_model", "num_heads", "num_kv_heads", "d_ff", "vocab_size"):
        _need(getattr(m, name) > 0, f"model.{name}", "must be positive")
    for name in ("dtype", "param_dtype"):
        _need(getattr(m, name) in DTYPES, f"model.{name}", f"must be one of {', '.join(DTYPES)}")
    _need(m.head_dim >= 0, "model.head_dim", "must be >= 0")
    _divides("model.num_heads", m.num_heads, m.num_kv_heads, "model.num_kv_heads")
    if not m.head_dim:
        _divides("model.d_model", m.d_model, m.num_heads, "model.num_heads")
    _need(m.dim_per_head % 2 == 0, "model.head_dim", "rotary embeddings need an even head dim")

    _need(mesh.data == -1 or mesh.data > 0, "mesh.data", "must be positive or -1")
    for name in ("stage", "tensor", "seq"):
        _need(getattr(mesh, name) > 0, f"mesh.{name}", "must be positive")
    _need(mesh.simulated_devices >= -1, "mesh.simulated_devices", "must be >= -1")
    _divides("model.num_kv_heads", m.num_kv_heads, mesh.tensor, "mesh.tensor")
    _divides("model.d_ff", m.d_ff, mesh.tensor, "mesh.tensor")
    _divides("model.vocab_size", m.vocab_size, mesh.tensor, "mesh.tensor")

    _need(par.zero_stage in (0, 1, 2, 3), "parallel.zero_stage", "must be 0, 1, 2 or 3")
    _need(par.pipeline_repeats >= 1, "parallel.pipeline_repeats", "must be >= 1")
    _need(par.remat in REMAT_POLICIES, "parallel.remat",
          f"must be one of {', '.join(REMAT_POLICIES)}")
    _divides("model.num_layers", m.num_layers, mesh.stage * par.pipeline_repeats,
             "mesh.stage * parallel.pipeline_repeats")
    _need(par.pipeline_repeats == 1 or mesh.stage > 1, "parallel.pipeline_repeats",
          "circular repeats need a pipeline (mesh.stage > 1)")
    _need(par.pipeline_repeats == 1 or cfg.train.microbatches >= mesh.stage, "train.microbatches",
          f"{cfg.train.microbatches} is fewer than mesh.stage = {mesh.stage}: a circular pipeline "
          "(parallel.pipeline_repeats > 1) needs at least one microbatch per stage")

    for name in ("steps", "global_batch", "seq_len", "microbatches"):
        _need(getattr(tr, name) > 0, f"train.{name}", "must be positive")
    _divides("train.global_batch", tr.global_batch, tr.microbatches, "train.microbatches")
    if mesh.data > 0:
        _divides("train.global_batch", tr.global_batch // tr.microbatches, mesh.data,
                 "mesh.data (per microbatch)")
        if par.zero_stage > 0:
            _divides("model.d_model", m.d_model, mesh.data, "mesh.data (ZeRO shards d_model)")
    if mesh.seq > 1:  # the zig-zag layout cuts the sequence into 2 chunks per ring device
        _divides("train.seq_len", tr.seq_len, 2 * mesh.seq, "2 * mesh.seq (zig-zag chunks)")
    if par.sequence_parallel:
        _divides("train.seq_len", tr.seq_len // mesh.seq, mesh.tensor,
                 "mesh.tensor (sequence parallelism)")

    _need(op.lr > 0, "optim.lr", "must be positive")
    _need(op.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
    _need(op.decay_steps >= 0, "optim.decay_steps", "must be >= 0")
    _need(0 <= op.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
    _need(op.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
    _need(op.clip_norm >= 0, "optim.clip_norm", "must be >= 0 (0 disables clipping)")
    _need(cfg.data.tokenizer == "bytes", "data.tokenizer", "only 'bytes' is available")
    if cfg.data.tokenizer == "bytes" and not cfg.data.path:
        _need(m.vocab_size >= 256, "model.vocab_size", "byte tokens need vocab_size >= 256")
    _need(cfg.run.log_every > 0, "run.log_every", "must be positive")
    _need(bool(cfg.run.dir), "run.dir", "must not be empty")
    _need(cfg.checkpoint.every >= 0, "checkpoint.every", "must be >= 0 (0: only at the end)")
    _need(cfg.checkpoint.keep > 0, "checkpoint.keep", "must be positive")
    _need(cfg.dist.num_processes > 0, "dist.num_processes", "must be positive")
    _need(0 <= cfg.dist.process_id < cfg.dist.num_processes, "dist.process_id",
          "must be in [0, dist.num_processes)")
    if cfg.dist.coordinator:
        host, _, port = cfg.dist.coordinator.rpartition(":")
        _need(bool(host) and port.isdigit() and 0 < int(port) < 65536, "dist.coordinator",
              f"{cfg.dist.coordinator!r} is not HOST:PORT")
    _need(cfg.dist.heartbeat_timeout_s >= 2, "dist.heartbeat_timeout_s", "must be >= 2")
    _need(cfg.dist.init_timeout_s > 0, "dist.init_timeout_s", "must be positive")


def resolve_mesh(cfg: Config, num_devices: int) -> Config:
    """Fill in `mesh.data = -1` from the device count and check that the product matches."""
    sizes = cfg.mesh.sizes()
    fixed = sizes["stage"] * sizes["tensor"] * sizes["seq"]
    if cfg.mesh.data == -1:
        _need(num_devices % fixed == 0, "mesh",
              f"stage*tensor*seq = {fixed} does not divide the {num_devices} devices")
        cfg = replace(cfg, mesh=replace(cfg.mesh, data=num_devices // fixed))
    total = cfg.mesh.data * fixed
    _need(total == num_devices, "mesh",
          f"data*stage*tensor*seq = {total} but there are {num_devices} devices")
    validate(cfg)
    return cfg
