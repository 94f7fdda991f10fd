"""Hugging Face directories in and out of run directories (`python -m spmd3d.convert
import|export` is the command, `__main__.py`): LLaMA, Mistral and Qwen3, and the MoE families
Mixtral and Qwen3-MoE.

Import reads a transformers directory (`hf.py` maps its config and weights) into a run
directory that `python -m spmd3d.train RUN_DIR/config.yaml` fine-tunes on any mesh: a step-0
checkpoint in the canonical [L, ...] layout (fresh optimizer state), `config.yaml` (the model's
fields from `config.json`, the rest from `--config` and the overrides) and `hf/` (the original
`config.json`, tokenizer and generation files, which an export hands back).

Each weight goes straight into its sharding on this process's devices: a stacked weight is
converted one layer at a time and each layer's slice written into the device shards that hold
it, so the host holds one layer of one weight (each safetensors tensor is read on its own,
`hf_files.Files`), never the model.

Export reads a checkpoint one layer of one weight at a time (`checkpoint.slices`: a host holds
about one layer, 0.9 GB for LLaMA-3 8B's MLP in fp32, where a whole stacked weight was 15 GB),
each array checked against its fingerprint, and streams `config.json` and safetensors files
(`--max-shard-gb` each, with the index transformers reads when there are several) that
transformers' `from_pretrained` loads as they are (`LlamaForCausalLM`, `Qwen3ForCausalLM`,
`MixtralForCausalLM` or `Qwen3MoeForCausalLM`, by `hf.family`).
"""

from __future__ import annotations

import json
import logging
import shutil
from functools import lru_cache
from pathlib import Path

from .. import config as config_lib
from ..config import Config, ConfigError

LOG = logging.getLogger("spmd3d")
# files of a HF model directory that travel with the weights (tokenizer, sampling defaults)
COMPANIONS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "tokenizer.model", "generation_config.json")
EXPORT_DTYPES = ("float32", "bfloat16", "float16")

# ------------------------------------------------------------------------------------ import
def import_config(hf_dir: str | Path, preset: str | None = None, overrides=()) -> Config:
    """The run's config: defaults <- `preset` <- `overrides` <- the model's fields from
    `HF_DIR/config.json` (validated once, all together: the mesh must suit that model)."""
    from ..hf import Reader
    from ..hf_config import model_fields

    reader = Reader(hf_dir)
    fields = model_fields(reader.config, f"{hf_dir}/config.json")
    # multi-token prediction: where the checkpoint holds the depths' weights (a config may
    # count depths whose weights were left out), unless `model.mtp_layers` says otherwise
    if any(o.startswith("model.mtp_layers=") for o in overrides) or \
            f"model.layers.{fields['num_layers']}.eh_proj.weight" not in reader:
        fields.pop("mtp_layers", None)
    tokenizer = [f"data.tokenizer={hf_dir}"] if (Path(hf_dir) / "tokenizer.json").is_file() else []
    return config_lib.load(preset, [*tokenizer, *overrides,
                                    *(f"model.{k}={v}" for k, v in fields.items())])


def load_params(hf_dir: str | Path, cfg, target):
    """The parameters of `HF_DIR` as `target` (the abstract params, canonical layer order, every
    leaf a ShapeDtypeStruct with its sharding) says: a pytree of jax Arrays."""
    from .. import store
    from ..hf import Reader, weights

    reader, conversions = Reader(hf_dir), weights(cfg.model)
    entries = store.flat(target)
    missing = set(entries) - {w.key for w in conversions}
    assert not missing, f"no conversion for {sorted(missing)}"
    arrays = {w.key: _place(reader, w, cfg.model, entries[w.key]) for w in conversions}
    return store.unflat(target, arrays)


def _place(reader, w, model, aval):
    """One weight as a jax Array in `aval.sharding`, each layer converted once."""
    import jax
    import numpy as np

    from ..hf import HFError

    shape, devices = aval.shape, aval.sharding.addressable_devices_indices_map(aval.shape)
    bounds = {d: tuple(s.indices(n)[:2] for s, n in zip(idx, shape)) for d, idx in devices.items()}

    def convert(layer=None):
        try:
            out = reader.layer(w, model, layer, aval.dtype)
        except ValueError as e:  # a reshape that cannot be: shapes disagree with config.json
            out = e
        want = shape[1:] if w.stacked else shape
        if isinstance(out, Exception) or out.shape != tuple(want):
            names = w.hf_names(layer)
            got = [reader.shape(n) for n in names if n in reader]
            raise HFError("HF_DIR", f"{', '.join(names)} of shape {got} does not fit "
                                    f"config.json's model ({w.key} should be {tuple(want)})")
        return out

    def cut(full, b):
        return full[tuple(slice(lo, hi) for lo, hi in b)]

    if not w.stacked:
        full = convert()
        arrays = [jax.device_put(np.ascontiguousarray(cut(full, bounds[d])), d) for d in devices]
        return jax.make_array_from_single_device_arrays(shape, aval.sharding, arrays)
    # a stacked weight: each device's shard starts as zeros on the device and takes one layer
    # at a time (updated in place: the buffer is donated), so the host holds one layer. A layer
    # goes over in slabs of rows (`layer_piece`: an eighth of it, at least 1 MiB), each a copy
    # of its own: a transfer lets go of its host memory a little after it completes (on jax's
    # threads), and what it holds on to is then a slab, not the layer beside the next one
    import jax.numpy as jnp

    from ..checkpoint import layer_piece

    bufs = {d: jnp.zeros([hi - lo for lo, hi in bounds[d]], aval.dtype, device=d)
            for d in devices}
    for layer in range(shape[0]):
        users = [d for d in devices if bounds[d][0][0] <= layer < bounds[d][0][1]]
        if users:
            full = convert(layer)
            for d in users:
                part, at = cut(full, bounds[d][1:]), layer - bounds[d][0][0]
                rows = max(1, layer_piece(part.nbytes) // max(1, part[:1].nbytes))
                for row in range(0, len(part), rows):
                    piece = jax.device_put(np.array(part[row:row + rows]), d)
                    bufs[d] = _rows_setter()(bufs[d], piece, at, row)
                    del piece
                del part
            jax.block_until_ready([bufs[d] for d in users])  # no layer left in flight
            del full
    return jax.make_array_from_single_device_arrays(shape, aval.sharding,
                                                    [bufs[d] for d in devices])


@lru_cache(maxsize=1)
def _rows_setter():
    """`(buf, rows, index, row) -> buf` with `buf[index, row:row + len(rows)] = rows`, in place
    (`buf` donated)."""
    import jax

    return jax.jit(lambda b, p, i, r: jax.lax.dynamic_update_slice(
        b, p[None], (i, r) + (0,) * (p.ndim - 1)), donate_argnums=0)


def import_hf(hf_dir: str | Path, run_dir: str | Path, cfg: Config, devices=None) -> Path:
    """Writes RUN_DIR: config.yaml, hf/ and a step-0 checkpoint of HF_DIR's weights."""
    import jax
    import jax.numpy as jnp
    import yaml

    from .. import store
    from ..checkpoint import Checkpointer
    from ..optim import make_optimizer
    from ..plan import Plan
    from ..resume import checkpoint_meta
    from ..step import TrainState, canonical_state

    run_dir, hf_dir = Path(run_dir), Path(hf_dir)
    if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
        raise ConfigError("RUN_DIR", f"{run_dir} already holds checkpoints (import into a new "
                                     "directory; nothing was changed)")
    kept = {"dir": str(run_dir)}, ({"tokenizer": str(run_dir / "hf")}
                                   if cfg.data.tokenizer == str(hf_dir) else {})
    cfg = config_lib.override(cfg, run=kept[0], data=kept[1])  # the run keeps its tokenizer
    plan = Plan.resolve(cfg, devices)
    abstract, shardings = canonical_state(plan)
    target = store.abstract_like(abstract, shardings)
    params = load_params(hf_dir, cfg, target.params)
    with jax.set_mesh(plan.mesh):
        opt = jax.jit(make_optimizer(cfg.optim, params).init, out_shardings=shardings.opt)(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
    state = TrainState(step, params, opt)
    if jax.process_index() == 0:
        (run_dir / "hf").mkdir(parents=True, exist_ok=True)
        for name in ("config.json",) + COMPANIONS:
            if (hf_dir / name).is_file():
                shutil.copy2(hf_dir / name, run_dir / "hf" / name)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config_lib.to_dict(cfg),
                                                            sort_keys=False))
    meta = {**checkpoint_meta(plan, 0), "source": str(hf_dir.resolve())}
    with Checkpointer(run_dir / "checkpoints", every=0, keep=cfg.checkpoint.keep,
                      async_save=False) as ckpt:
        ckpt.save(0, store.flat(state), meta, force=True)
    return run_dir


# ------------------------------------------------------------------------------------ export
def export_hf(run_dir: str | Path, hf_dir: str | Path, step: int | None = None,
              dtype: str = "float32", max_bytes: int = 5 << 30) -> list[str]:
    """Writes HF_DIR from RUN_DIR's checkpoint (newest, or `step`); returns its weight files.
    A stacked weight is read and written one layer at a time; everything is written next to
    HF_DIR first and renamed into place at the end, so a damaged array or a refusal leaves no
    HF_DIR at all."""
    import ml_dtypes
    import numpy as np
    from tqdm import tqdm

    from ..checkpoint import CheckpointError, Damaged
    from ..checkpoint.slices import StepArrays
    from ..hf import HFError, weights
    from ..hf_config import exportable, hf_config
    from ..hf_files import Writer

    run_dir, hf_dir = Path(run_dir), Path(hf_dir)
    if hf_dir.exists() and any(hf_dir.iterdir()):
        raise ConfigError("HF_DIR", f"{hf_dir} is not empty (export into a new directory)")
    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    arrays = StepArrays(run_dir, step)
    cfg = config_lib.override(Config(), **arrays.meta["config"])
    exportable(cfg.model)
    conversions = weights(cfg.model)
    total = sum(int(np.prod(arrays.shapes[f"params/{w.key}"][0])) for w in conversions)
    tmp = hf_dir.with_name(f".{hf_dir.name}.export-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        writer = Writer(tmp, max_bytes)
        with tqdm(total=total, desc="export", unit=" weights", unit_scale=True,
                  disable=None) as bar:
            for w in conversions:
                layer = -1  # not enumerate(): its reused result tuple would keep the last
                # layer alive while the next one is read
                for part in arrays.layers(f"params/{w.key}", w.stacked):
                    layer += 1
                    if w.key == "blocks/mlp/bias" and not w.names and np.any(part):
                        raise HFError("model.router_bias_rate", "trained a selection bias for "
                                      "the experts, which no transformers family holds: the "
                                      "export would route otherwise")
                    names = w.hf_names(layer if w.stacked else None)
                    for name, t in zip(names, w.to_hf(part, cfg.model)):
                        writer.add(name, t.astype(np_dtype, copy=False))
                        del t  # (a view of `part`)
                    bar.update(part.size)
                    del part  # before the next layer is read: one layer held at a time
        files = writer.close()
        kept = run_dir / "hf"
        original = kept / "config.json"
        base = json.loads(original.read_text()) if original.is_file() else {}
        config = hf_config(cfg.model, base, dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in COMPANIONS:
            if (kept / name).is_file():
                shutil.copy2(kept / name, tmp / name)
        if hf_dir.exists():
            hf_dir.rmdir()  # empty (checked above)
        tmp.rename(hf_dir)
    except Damaged as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError("checkpoint", f"{run_dir}: {e}; nothing was exported") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return files
