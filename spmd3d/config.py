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
REMAT_POLICIES = ("none", "full", "save_dots", "stage")


class ConfigError(ValueError):
    """A configuration mistake; `field` is the dotted name to blame, str(self) is one line."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def doc(default, help: str):
    """A dataclass field with a one-line meaning, read by `field_docs` for `--help`."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int = doc(4, "transformer blocks (the stacked [L, ...] layers)")
    d_model: int = doc(256, "width of the residual stream")
    num_heads: int = doc(4, "query heads per attention layer")
    num_kv_heads: int = doc(2, "key/value heads (grouped-query attention)")
    d_ff: int = doc(768, "hidden width of the MLP")
    vocab_size: int = doc(256, "token ids are in [0, vocab_size)")
    head_dim: int = doc(0, "width of one head; 0: d_model // num_heads")
    rope_theta: float = doc(10000.0, "base of the rotary embedding frequencies")
    norm_eps: float = doc(1e-5, "epsilon of RMSNorm")
    init_std: float = doc(0.02, "standard deviation of the initial weights")
    dtype: str = doc("float32", "compute dtype: float32, bfloat16 or float16")
    param_dtype: str = doc("float32", "dtype of the master weights and optimizer state")

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.d_model // self.num_heads


@dataclass(frozen=True)
class MeshConfig:
    data: int = doc(-1, "data-parallel axis size; -1: all devices left over")
    stage: int = doc(1, "pipeline axis size (stages)")
    tensor: int = doc(2, "tensor-parallel axis size")
    seq: int = doc(1, "sequence axis size (ring attention)")
    simulated_devices: int = doc(-1, "N > 0: N simulated CPUs; -1: 8 if no accelerator; "
                                     "0: the real devices")
    topology: str = doc("auto", "a topology in meshes/ (its name) or a path to a .yaml; "
                                "auto: by platform")
    # With several hosts, tensor and seq must fit inside one host (their collectives run every
    # layer); true lets a layout put them across hosts anyway (slow, but it runs).
    allow_cross_host: bool = doc(False, "let tensor and seq span hosts")

    def sizes(self) -> dict[str, int]:
        return {"data": self.data, "stage": self.stage, "tensor": self.tensor, "seq": self.seq}


@dataclass(frozen=True)
class ParallelConfig:
    zero_stage: int = doc(1, "shard over data: optimizer state (1), + grads (2), + params (3)")
    pipeline_repeats: int = doc(1, "circular pipeline: chunks of layers per stage")
    sequence_parallel: bool = doc(False, "Megatron SP: norms and residual split over T (tensor)")
    remat: str = doc("none", "none, full (keep layer inputs), save_dots (keep matmul outputs), "
                             "stage (keep only each stage's input per microbatch)")
    # false unrolls the layer loop when tracing (each pipeline stage's chunk, with a pipeline):
    # no per-layer copies into stacked residual buffers and scheduling across layers, for
    # compile time that grows with depth -- a win for small, shallow models (see bench_small)
    scan_layers: bool = doc(True, "one compiled layer in a lax.scan; false: layers unrolled")
    zero3_gather: str = doc("step", "ZeRO-3 with a pipeline: gather each stage's layers once "
                                    "per step (step) or per layer at every tick (tick: less "
                                    "memory, stage weights x3 per tick over data)")
    loss_chunk: int = doc(1024, "tokens per device whose logits exist at once in the head "
                                "and loss (pieces in a loop); 0: all at once")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = doc(150, "optimizer steps")
    global_batch: int = doc(32, "sequences per step, over all devices")
    seq_len: int = doc(128, "tokens per sequence")
    microbatches: int = doc(1, "pipeline microbatches (or gradient accumulation steps)")
    seed: int = doc(0, "seed of the initial weights and the data order")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = doc(3e-3, "peak learning rate (AdamW)")
    warmup_steps: int = doc(10, "linear warm-up steps from 0 to lr")
    decay_steps: int = doc(0, "cosine decay ends here; 0: train.steps")
    min_lr_ratio: float = doc(0.1, "the decay ends at lr * min_lr_ratio")
    weight_decay: float = doc(0.1, "AdamW weight decay")
    clip_norm: float = doc(1.0, "clip the global gradient norm to this; 0: no clipping")
    b1: float = doc(0.9, "Adam decay of the first moment")
    b2: float = doc(0.95, "Adam decay of the second moment")
    eps: float = doc(1e-8, "Adam epsilon")


@dataclass(frozen=True)
class DataConfig:
    # The embedded corpus is Python's standard library sources: always there, nothing to download.
    path: str = doc("", "token file, text file or directory; empty: the embedded corpus")
    tokenizer: str = doc("bytes", "how text becomes tokens; only bytes")


@dataclass(frozen=True)
class RunConfig:
    dir: str = doc("runs/demo", "config, metrics, checkpoints; one with checkpoints resumes")
    log_every: int = doc(1, "print a metrics line every N steps")
    explain: bool = doc(False, "print where every parameter lives")
    memory_check: bool = doc(True, "refuse a step that needs more memory than a device has, "
                                   "before the first step")


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = doc(50, "save every N steps; 0: only at the end")
    keep: int = doc(3, "newest checkpoints kept")
    async_: bool = doc(True, "write while training goes on")  # YAML and argv: `async` (a keyword)
    fallback: bool = doc(False, "newest checkpoint damaged: resume from the one before")


@dataclass(frozen=True)
class DistConfig:
    """One training job over several processes (hosts); see `dist.py`. Left at these defaults,
    the values come from the environment (SLURM, Kubernetes, JAX_*), or it is one process."""

    coordinator: str = doc("", "HOST:PORT of the coordination service (process 0)")
    num_processes: int = doc(1, "processes (hosts) in the job")
    process_id: int = doc(0, "this process's index, in [0, num_processes)")
    # A process silent this long is declared lost and every other process stops (exit 1).
    heartbeat_timeout_s: int = doc(20, "seconds of silence before a process counts as lost")
    init_timeout_s: int = doc(300, "seconds the processes wait for each other at start-up")


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


def field_docs() -> list[tuple[str, str, object, str]]:
    """(dotted YAML name, type name, default, meaning) of every field, in declaration order:
    the table `python -m spmd3d.<command> --help` prints, so it cannot drift from the code."""
    rows = []
    for sec in fields(Config):
        cls = typing.get_type_hints(Config)[sec.name]
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            rows.append((f"{sec.name}.{_yaml_name(f)}", hints[f.name].__name__, f.default,
                         f.metadata["help"]))
    return rows


def _set_dotted(tree: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(dotted, "is not a section")
    node[parts[-1]] = value


# the presets ship inside the package (the repository's top-level configs/ links here)
PRESET_DIR = Path(__file__).resolve().parent / "configs"


def find_config(name: str, config_dir: str | None = None) -> Path:
    """A config file: `name` as a path, else the preset `name` (with or without `.yaml`) in
    `config_dir` and then among the presets shipped with the package. Raises ConfigError."""
    p = Path(name).expanduser()
    dirs = ([Path(config_dir).expanduser()] if config_dir else []) + [PRESET_DIR]
    bare = [] if p.parent != Path(".") else [d / f"{p.name.removesuffix('.yaml')}.yaml" for d in dirs]
    found = next((f for f in [p, *bare] if f.is_file()), None)
    if found:
        return found
    known = ", ".join(sorted({f.stem for d in dirs for f in d.glob("*.yaml")}))
    raise ConfigError("config", f"no preset or file {name!r} (presets: {known})")


def load(path: str | None = None, overrides: list[str] | tuple = (),
         config_dir: str | None = None) -> Config:
    """Defaults <- YAML file (a path or a preset's name, see `find_config`) <- `key=value`
    overrides, then validated. Raises ConfigError."""
    tree: dict = {}
    if path:
        p = find_config(path, config_dir)
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
    _need(par.zero3_gather in ("step", "tick"), "parallel.zero3_gather", "must be step or tick")
    _need(par.loss_chunk >= 0, "parallel.loss_chunk", "must be >= 0 (0: no chunks)")
    _need(par.remat in REMAT_POLICIES, "parallel.remat",
          f"must be one of {', '.join(REMAT_POLICIES)}")
    _need(m.num_layers >= mesh.stage * par.pipeline_repeats, "model.num_layers",
          f"{m.num_layers} is fewer than mesh.stage * parallel.pipeline_repeats = "
          f"{mesh.stage * par.pipeline_repeats}: every chunk of the pipeline needs a layer")
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

