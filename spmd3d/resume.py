"""Resuming: what a checkpoint stores beside the arrays, and the newest compatible complete
checkpoint restored into a job's shardings, or a fresh state.

A checkpoint of another model or key schema is an error naming the field; a damaged newest one
is an error naming it and the step before it, or with `checkpoint.fallback` is moved aside (kept)
and the step before it tried. Every process restores the same step.
"""

from __future__ import annotations

import jax
import numpy as np

from . import config as config_lib
from . import store
from .checkpoint import CheckpointError, Damaged, quiet
from .store import SCHEMA

# config fields that decide the arrays' shapes: a checkpoint written with other values cannot load
MODEL_SHAPE_FIELDS = ('num_layers', 'd_model', 'num_heads', 'num_kv_heads', 'head_dim', 'd_ff',
                      'vocab_size', 'param_dtype')



def checkpoint_meta(job, step: int, hosts: list[str] | None = None) -> dict:
    """What a checkpoint stores beside the arrays. The data position is the step (batches are a
    function of seed and step) and a run has no other random state. `hosts`: the processes'
    hosts (`dist.host_names`), for the record of a later resize."""
    return {"step": step, "data_step": step, "seed": job.cfg.train.seed,
            "config": config_lib.to_dict(job.cfg), "mesh": dict(job.mesh.shape),
            "processes": jax.process_count(), "hosts": hosts or []}


def restore_or_init(job, ckpt, log=print):
    """(state, first step, the checkpoint's meta or None): the newest complete checkpoint if
    there is one, else a fresh init.

    Raises `CheckpointError` (exit 2) for a checkpoint of another model or schema, or a
    damaged newest one unless `checkpoint.fallback` allows stepping back past it."""
    target = store.abstract_like(*job.canonical)
    found = restore_newest(ckpt, store.flat(target), config_lib.to_dict(job.cfg)["model"],
                           fallback=job.cfg.checkpoint.fallback, log=log)
    if found is None:
        return job.init_state(), 0, None
    restored, meta = found
    state = store.unflat(target, restored)
    return job.reorder(state, to_canonical=False), int(meta["step"]), meta


def check_newest(job, ckpt) -> None:
    """`check_compatible` on the newest step's metadata alone, before the step is compiled: a
    checkpoint of another model or key schema then costs no compile (at full size, minutes).
    A newest step whose metadata cannot be read is left to `restore_or_init`."""
    steps = _same_on_all_processes(ckpt.all_steps())
    if not steps:
        return
    try:
        meta = ckpt.read_meta(steps[-1])
    except Damaged:
        return
    check_compatible(ckpt, steps[-1], meta, config_lib.to_dict(job.cfg)["model"],
                     store.flat(store.abstract_like(*job.canonical)))


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
