"""Typed, validated configuration: the dataclasses of `schema.py`, YAML files, dotted
`key=value` overrides.

The dataclass defaults *are* the embedded demo config (`configs/demo.yaml` mirrors them), so
`python -m spmd3d.train` with no arguments trains the demo. Every mistake a user can make in a
config raises `ConfigError(field, message)`; the entry points turn it into one line and exit 2.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import typing
from dataclasses import fields, replace
from pathlib import Path

import yaml

from .checks import divides as _divides, need as _need, validate_model
from .schema import (ATTENTION_KERNELS, DTYPES, EXPERT_KERNELS, EXPERT_WEIGHT_GRADS,  # noqa: F401
                     FP8_RECIPES, PIPELINE_SCHEDULES, REMAT_POLICIES, ROPE_SCALINGS,
                     CheckpointConfig, Config, ConfigError, DataConfig, DataError, DistConfig,
                     MeshConfig, ModelConfig, OptimConfig, ParallelConfig, RunConfig, TrainConfig,
                     compute_dtype, doc)
from .parsing import parse_mixture, parse_xla_flags  # noqa: F401


# ---------------------------------------------------------------------------------------------
# dict <-> dataclass, strictly typed

def _yaml_name(f: dataclasses.Field) -> str:
    return f.name.rstrip("_")


_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_BOOL = "tag:yaml.org,2002:bool"
_WORDS = {"yes": True, "on": True, "no": False, "off": False}  # YAML 1.1's other booleans


class _Loader(yaml.SafeLoader):
    """YAML with only true and false as booleans (as YAML 1.2 has it): `off`, `on`, `yes`, `no`
    stay text, so a text field takes them as written (`model.fp8: off`); a boolean field reads
    them as YAML 1.1 did (`_coerce`)."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def _coerce(path: str, value, typ):
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _WORDS:
            return _WORDS[value.lower()]
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


def reference_markdown() -> str:
    """docs/config.md: `field_docs()` as one Markdown table per section (tests/test_docs.py
    holds the file equal to this)."""
    def shown(v):  # as typed after `key=`, the spelling `--help` uses: true, "", "def "
        if isinstance(v, bool):
            return "true" if v else "false"
        return json.dumps(v) if isinstance(v, str) and (v == "" or v != v.strip()) else str(v)

    lines = ["# Configuration reference", "",
             "<!-- generated by spmd3d.config.reference_markdown() from the fields in "
             "spmd3d/schema.py: edit those, not this file -->", "",
             "Every field of a config, by section: `CONFIG.yaml` sets it, `key=value` on the",
             "command line overrides it (`python -m spmd3d.train --help` prints the same list).",
             "The defaults are the built-in demo (`configs/demo.yaml`)."]
    section = None
    for name, typ, default, meaning in field_docs():
        if name.split(".")[0] != section:
            section = name.split(".")[0]
            lines += ["", f"## {section}", "", "| field | type | default | meaning |",
                      "|---|---|---|---|"]
        cell = meaning.replace("|", r"\|")
        lines.append(f"| `{name}` | {typ} | `{shown(default)}` | {cell} |")
    return "\n".join(lines) + "\n"


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
    stem = p.name.removesuffix(".yaml")
    bare = [d / f"{stem}.yaml" for d in dirs] if p.parent == Path(".") else []
    found = next((f for f in [p, *bare] if f.is_file()), None)
    if found:
        return found
    known = ", ".join(sorted({f.stem for d in dirs for f in d.glob("*.yaml")}))
    raise ConfigError("config", f"no preset or file {name!r} (presets: {known})")


def load(path: str | None = None, overrides: list[str] | tuple = (),
         config_dir: str | None = None, base: dict | None = None) -> Config:
    """Defaults <- YAML file (a path or a preset's name, see `find_config`) or `base` (a
    config as `to_dict` gives it) <- `key=value` overrides, then validated. Raises ConfigError."""
    tree: dict = copy.deepcopy(base) if base else {}
    if path:
        p = find_config(path, config_dir)
        try:
            tree = yaml.load(p.read_text(), _Loader)
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
            value = yaml.load(raw, _Loader) if raw.strip() else ""
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

def validate(cfg: Config) -> None:
    """Static checks; `mesh.data = -1` is checked again once the device count is known."""
    m, mesh, par, tr, op = cfg.model, cfg.mesh, cfg.parallel, cfg.train, cfg.optim
    validate_model(m, mesh)
    _need(op.moment_dtype in ("auto", "float32", "bfloat16"), "optim.moment_dtype",
          "must be auto, float32 or bfloat16")

    _need(mesh.data == -1 or mesh.data > 0, "mesh.data", "must be positive or -1")
    _need(mesh.replicate >= 1, "mesh.replicate", "must be >= 1")
    if mesh.data > 0:
        _divides("mesh.data", mesh.data, mesh.replicate * mesh.expert,
                 "mesh.replicate x mesh.expert (both carved out of mesh.data)")
    for name in ("stage", "tensor", "seq"):
        _need(getattr(mesh, name) > 0, f"mesh.{name}", "must be positive")
    _need(mesh.simulated_devices >= -1, "mesh.simulated_devices", "must be >= -1")
    _divides("model.num_kv_heads", m.num_kv_heads, mesh.tensor, "mesh.tensor")
    _divides("model.d_ff", m.d_ff, mesh.tensor, "mesh.tensor")
    _divides("model.vocab_size", m.vocab_size, mesh.tensor, "mesh.tensor")

    _need(par.zero_stage in (0, 1, 2, 3), "parallel.zero_stage", "must be 0, 1, 2 or 3")
    _need(par.pipeline_repeats >= 1, "parallel.pipeline_repeats", "must be >= 1")
    _need(par.pipeline_schedule in PIPELINE_SCHEDULES, "parallel.pipeline_schedule",
          f"must be one of {', '.join(PIPELINE_SCHEDULES)}")
    _need(par.pipeline_schedule == "gpipe" or par.pipeline_repeats == 1
          or cfg.train.microbatches % mesh.stage == 0, "train.microbatches",
          f"{cfg.train.microbatches} is not a multiple of mesh.stage = {mesh.stage}: "
          f"interleaved {par.pipeline_schedule} (parallel.pipeline_repeats > 1) takes p "
          "microbatches at a time")
    _need(par.zero3_gather in ("step", "tick"), "parallel.zero3_gather", "must be step or tick")
    _need(par.context in ("auto", "ring", "ulysses"), "parallel.context",
          "must be auto, ring or ulysses")
    _need(cfg.mesh.inside in ("seq", "tensor"), "mesh.inside", "must be seq or tensor")
    _need(par.pipeline_schedule == "gpipe" or par.zero3_gather == "step" or par.zero_stage < 3,
          "parallel.zero3_gather", "tick needs parallel.pipeline_schedule=gpipe (1f1b and zb_h1 "
          "gather each stage's layers once per step)")
    _need(par.loss_chunk >= 0, "parallel.loss_chunk", "must be >= 0 (0: no chunks)")
    _need(par.remat in REMAT_POLICIES, "parallel.remat",
          f"must be one of {', '.join(REMAT_POLICIES)}")
    _need(not par.remat.startswith("offload") or mesh.stage == 1
          or par.pipeline_schedule == "gpipe", "parallel.remat",
          f"{par.remat} needs parallel.pipeline_schedule=gpipe: {par.pipeline_schedule}'s "
          "stash buffers are in device memory")
    _need(m.stacked_layers >= mesh.stage * par.pipeline_repeats, "model.num_layers",
          f"{m.stacked_layers} (without model.dense_layers) is fewer than mesh.stage * "
          f"parallel.pipeline_repeats = "
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
            for name in ("d_model", "kv_lora_rank", "q_lora_rank"):  # MLA's latents too
                if getattr(m, name):
                    _divides(f"model.{name}", getattr(m, name), mesh.data // mesh.replicate,
                             f"mesh.data / mesh.replicate (ZeRO shards {name} over a group)")
    if par.tables_over_stage and mesh.stage > 1:  # split by width over stage (x ZeRO's group)
        group = mesh.data // mesh.replicate if par.zero_stage >= 2 and mesh.data > 0 else 1
        _divides("model.d_model", m.d_model, mesh.stage * group,
                 "mesh.stage x ZeRO's group (parallel.tables_over_stage splits it over both)")
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
    _need(bool(cfg.data.tokenizer), "data.tokenizer", "bytes, a tokenizer.json or a directory "
                                                      "holding one")
    if cfg.data.tokenizer == "bytes" and not cfg.data.path:
        _need(m.vocab_size >= 256, "model.vocab_size", "byte tokens need vocab_size >= 256")
    _need(cfg.run.log_every > 0, "run.log_every", "must be positive")
    _need(0 <= cfg.data.eval_fraction < 1, "data.eval_fraction", "must be in [0, 1)")
    if cfg.data.mixture:
        try:
            parse_mixture(cfg.data.mixture)
        except DataError as e:
            raise ConfigError(e.field, e.message) from None
    _need(cfg.run.eval_every >= 0, "run.eval_every", "must be >= 0 (0: never)")
    _need(cfg.run.eval_batches > 0, "run.eval_batches", "must be positive")
    _need(cfg.run.sample_every >= 0, "run.sample_every", "must be >= 0 (0: never)")
    _need(cfg.run.sample_tokens > 0, "run.sample_tokens", "must be positive")
    parse_xla_flags(cfg.run.xla_flags)  # its syntax; which flags this jaxlib knows: on a GPU
    _need(not cfg.run.eval_every or cfg.data.eval_fraction > 0 or bool(cfg.data.eval_path),
          "run.eval_every", "needs held-out data: data.eval_fraction > 0 or data.eval_path")
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
    _need(cfg.dist.min_processes >= 1, "dist.min_processes", "must be >= 1")
    _need(cfg.dist.max_restarts >= 0, "dist.max_restarts", "must be >= 0")


def resolve_mesh(cfg: Config, num_devices: int) -> Config:
    """Fill in `mesh.data = -1` from the device count and check that the product matches."""
    fixed = cfg.mesh.non_data
    if cfg.mesh.data == -1:
        _need(num_devices % fixed == 0, "mesh",
              f"stage*tensor*seq = {fixed} does not divide the {num_devices} devices")
        cfg = replace(cfg, mesh=replace(cfg.mesh, data=num_devices // fixed))
    total = cfg.mesh.num_devices
    _need(total == num_devices, "mesh",
          f"data*stage*tensor*seq = {total} but there are {num_devices} devices")
    validate(cfg)
    return cfg

