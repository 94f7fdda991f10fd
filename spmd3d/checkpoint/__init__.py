"""Sharded, mesh-independent, verifiable checkpoints on top of orbax.

Each checkpoint step holds two orbax items:

* ``state`` -- the array pytree (``StandardSave``/``StandardRestore``). Orbax
  writes every array as a tensorstore with per-shard chunks, and each process
  writes/reads only the shards it owns, so nothing is ever gathered on one
  host. Because parameters are kept in a canonical layout, the saved arrays do
  not depend on the mesh: restoring onto another mesh only needs new target
  shardings.
* ``meta`` -- a small JSON dict (step, data_step, resolved config, mesh shape)
  plus a fingerprint of every array, checked after each restore: a damaged
  file never turns silently into wrong weights.

Commits are atomic through orbax: on local/POSIX filesystems a step is written
to ``<step>.orbax-checkpoint-tmp`` and renamed when complete; on GCS a
``commit_success.txt`` marker is written last. Unfinished steps are never
listed.

Keys follow ``store.py``'s schema, whose version every step's metadata records; a step of
another schema is refused (``CheckpointError``, exit status 2), never restored into the wrong
arrays. This package imports nothing of spmd3d above the config and the store.

``python -m spmd3d.checkpoint info RUN_DIR [--verify]`` (``__main__.py``) lists a run's
checkpoints; ``load(RUN_DIR)`` returns the arrays as nested dicts for a notebook.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from ..config import ConfigError
from ..store import FINGERPRINT, SCHEMA, fingerprint, flat, key_of, nest

STATE_ITEM = 'state'
META_ITEM = 'meta'
TMP_MARK = '.orbax-checkpoint-tmp'



class CheckpointError(ConfigError):
    """A checkpoint that cannot be used as asked (exit status 2, one line, nothing deleted)."""


class Damaged(Exception):
    """A committed step whose files do not read back as they were written."""

    def __init__(self, step: int, why: str):
        super().__init__(f'step {step} is damaged ({why})')
        self.step, self.why = step, why


def _version(meta: dict) -> int:
    """The fingerprint hash a checkpoint was written with (1: before the version was kept)."""
    return int(meta.get('fingerprint_version', 1))


def _all_processes(ok: bool) -> bool:
    """True when `ok` holds on every process (a read error may hit only the process that
    owns the damaged chunk; all must agree before any collective runs)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.array(ok))))


class Checkpointer:
    """Orbax ``CheckpointManager`` storing array state plus JSON metadata per step.

    The save schedule is a plain ``step % every == 0`` decided here (orbax's default policy
    would also save on the first call at any step and refuse steps at or below the latest).
    Retention (``keep``) is orbax's ``LatestN``: old steps go in the same (possibly
    asynchronous) commit. Construct and call it on every process (orbax syncs internally).
    """

    def __init__(self, directory: str | os.PathLike, *, every: int, keep: int,
                 async_save: bool = True, cleanup_tmp: bool = False):
        self.directory = os.path.abspath(os.fspath(directory))
        self.every, self.keep, self.async_save = int(every), int(keep), bool(async_save)
        # Step whose asynchronous commit may still be running. Orbax lists a
        # step as soon as its save *starts*; we hide it until committed.
        self._pending: int | None = None
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(n=self.keep if self.keep > 0
                                                                else None),
            enable_async_checkpointing=self.async_save,
            create=True,
            # Unfinished temp dirs are never listed as steps. A training run owns
            # its directory and removes those a killed run left (`cleanup_tmp`);
            # readers leave them alone, as a writer may still be running.
            cleanup_tmp_directories=cleanup_tmp,
        )
        self._mngr = ocp.CheckpointManager(self.directory, options=options)
        # orbax removes those in a thread of its own, awaited only by its first save: a run
        # refused before that (bad input: one line, exit 2) exited while the thread still
        # listed the directory, and the interpreter's shutdown printed its traceback. Its
        # private wait, where this orbax has it (0.12.8 does).
        getattr(self._mngr, "_maybe_await_cleanup_tmp_directory", lambda: None)()

    # ------------------------------------------------------------------ steps
    def _in_flight(self) -> int | None:
        if self._pending is not None and not self._mngr.is_saving_in_progress():
            self._pending = None
        return self._pending

    def all_steps(self) -> list[int]:
        """Committed steps, ascending (excludes a save still being written)."""
        pending = self._in_flight()
        return sorted(s for s in self._mngr.all_steps() if s != pending)

    def latest_step(self) -> int | None:
        """Newest committed step, or None if there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        """Periodic schedule: ``step % every == 0``; ``every <= 0`` disables it."""
        return self.every > 0 and step % self.every == 0

    # ------------------------------------------------------------- save/load
    def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
        """Saves ``state`` and ``meta`` at ``step``; returns whether it saved. Off-schedule
        steps are skipped unless ``force`` (the final step, a preemption); an existing step is
        skipped, never overwritten. With ``async_save`` this returns once device buffers are
        copied to host; the write goes on in the background (``save``/``wait`` block on it).
        """
        step = int(step)
        if not (force or self.should_save(step)):
            return False
        if step in self._mngr.all_steps():
            return False
        meta = {'schema': SCHEMA, **meta, 'fingerprint': fingerprint(state),
                'fingerprint_version': FINGERPRINT}
        args = ocp.args.Composite(**{
            STATE_ITEM: ocp.args.StandardSave(state, save_args=_layer_chunks(state)),
            META_ITEM: ocp.args.JsonSave(meta)})
        saved = self._mngr.save(step, args=args, force=True)
        if saved and self.async_save:
            self._pending = step
        return saved

    def restore(self, step: int | None, target: Any) -> tuple[Any, dict]:
        """Restores ``(state, meta)`` from ``step`` (None: latest committed) into ``target``,
        a pytree like the saved state of ``jax.ShapeDtypeStruct`` with (possibly new-mesh)
        shardings. Each process reads only the chunks of its own shards. The arrays are
        checked against their fingerprints; a read error or a mismatch raises ``Damaged``
        (on every process alike).
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f'no committed checkpoint in {self.directory}')
        missing = [p for p, x in jax.tree_util.tree_leaves_with_path(target)
                   if getattr(x, 'sharding', None) is None]
        if missing:
            raise ValueError(
                'restore target leaves need a sharding (else orbax returns host numpy): '
                + ', '.join(jax.tree_util.keystr(p) for p in missing[:5])
            )
        step = int(step)
        meta = self.read_meta(step)
        state, why = None, ''
        try:
            state = self._mngr.restore(step, args=ocp.args.Composite(
                **{STATE_ITEM: ocp.args.StandardRestore(target)}))[STATE_ITEM]
        except Exception as e:  # noqa: BLE001 -- any read failure means the files are damaged
            why = f'{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ""}'
        if not _all_processes(state is not None):
            raise Damaged(step, why or 'another process could not read its shards')
        expected = meta.get('fingerprint')
        if expected is not None:
            bad = [k for k, v in fingerprint(state, _version(meta)).items()
                   if expected.get(k) != v]
            if bad:
                raise Damaged(step, f'{bad[0]} does not match its fingerprint'
                                    + (f' (+{len(bad) - 1} more arrays)' if len(bad) > 1 else ''))
        return state, meta

    def read_meta(self, step: int) -> dict:
        """The JSON metadata of a committed step (raises ``Damaged`` if unreadable)."""
        try:
            out = self._mngr.restore(int(step), args=ocp.args.Composite(
                **{META_ITEM: ocp.args.JsonRestore()}))
            meta = dict(out[META_ITEM])
        except Exception as e:  # noqa: BLE001
            raise Damaged(step, f'metadata unreadable: {type(e).__name__}') from None
        if 'step' not in meta:
            raise Damaged(step, 'metadata has no step')
        return meta

    def saved_shapes(self, step: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """{leaf path: (shape, dtype name)} as written, from orbax's metadata (no array reads)."""
        md = quiet(lambda: ocp.PyTreeCheckpointHandler().metadata(
            self.step_dir(step) / STATE_ITEM))
        tree = getattr(md, 'tree', md)
        return {k: (tuple(v.shape), np.dtype(v.dtype).name) for k, v in flat(tree).items()}

    def step_dir(self, step: int) -> Path:
        return Path(self.directory) / str(int(step))

    def quarantine(self, step: int) -> Path:
        """Moves a damaged step out of the way (never deletes it): ``<dir>.damaged/<step>-<t>``.
        Process 0 moves it; every process then re-reads the step list."""
        dest = Path(self.directory + '.damaged') / f'{int(step)}-{int(time.time())}'
        if jax.process_index() == 0:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(self.step_dir(step)), dest)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f'spmd3d quarantine {step}')
        self._mngr.reload()
        return dest

    def wait(self) -> None:
        """Blocks until any pending asynchronous save is committed (re-raises its error)."""
        self._mngr.wait_until_finished()
        self._pending = None

    def close(self) -> None:
        """Waits for pending saves and releases orbax's background threads."""
        self._mngr.close()
        self._pending = None

    def __enter__(self) -> 'Checkpointer':
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _SmallChunks(logging.Filter):
    def filter(self, record):
        return 'target_byte_size too small' not in record.getMessage()


_SMALL_CHUNKS = _SmallChunks()
logging.getLogger('absl').addFilter(_SMALL_CHUNKS)


def layer_piece(layer_bytes: int) -> int:
    """Bytes of the pieces a stacked array's layer of `layer_bytes` crosses host memory in (the
    checkpoint's chunks, the import's transfers): an eighth of it, at least 1 MiB, so that what
    a library holds on to a little after a read or a transfer completes is a piece, not a
    layer; a layer up to 1 MiB goes whole."""
    return max(layer_bytes // 8, 1 << 20)


def _layer_chunks(state):
    """Save arguments that store a stacked array ([L, ...]: the keys under `blocks/`) in chunks of
    an eighth of one layer of a device's shard (`layer_piece`: at least 1 MiB), so that one layer reads back alone and a chunk at a time (`slices.StepArrays`: a host holds
    the layer and a chunk, not a layer's compressed and decoded copies at once); a stack of
    layers under 64 KiB (a norm's) stays in one chunk. orbax warns of chunks under 1 MiB, once
    per array and save: that line is dropped (`_SMALL_CHUNKS`)."""
    def args(path, x):
        shard = x.sharding.shard_shape(x.shape) if hasattr(x, 'sharding') else np.shape(x)
        layer = int(np.prod(shard[1:])) * np.dtype(x.dtype).itemsize
        if 'blocks/' not in key_of(path) or len(shard) < 2 or layer < 1 << 16:
            return ocp.SaveArgs()  # (a stack of small layers, a norm's: read whole)
        return ocp.SaveArgs(chunk_byte_size=layer_piece(layer), shard_axes=(0,))

    return jax.tree_util.tree_map_with_path(args, state)


def quiet(fn):
    """Runs fn with orbax's informational logging silenced (e.g. its complaint that the devices
    differ from the writer's, which is the point of restoring onto another mesh)."""
    root, level = logging.getLogger(), logging.getLogger().level
    root.setLevel(logging.CRITICAL)
    try:
        return fn()
    finally:
        root.setLevel(level)


# ------------------------------------------------------------------------- inspection / loading
def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob('*') if f.is_file())


def info(run_dir: str | os.PathLike, verify: bool = False) -> list[dict]:
    """One dict per step directory (committed or not) of ``RUN_DIR/checkpoints``, ascending:
    step, complete, mesh, zero stage, bytes, written (unix time) and, with ``verify``, whether
    every array reads back with its fingerprint (restored onto this process's first device)."""
    root = Path(run_dir) / 'checkpoints'
    if not root.is_dir():
        root = Path(run_dir)  # RUN_DIR/checkpoints itself was given
    rows = []
    for d in sorted(root.iterdir(), key=lambda p: (int(p.name.split('.')[0])
                                                   if p.name.split('.')[0].isdigit() else -1)):
        base = d.name.split(TMP_MARK)[0]
        if not (d.is_dir() and base.isdigit()):
            continue
        row = {'step': int(base), 'complete': TMP_MARK not in d.name, 'path': str(d),
               'bytes': directory_bytes(d), 'written': d.stat().st_mtime, 'mesh': None, 'zero': None,
               'schema': None}
        try:
            meta = json.loads((d / META_ITEM / 'metadata').read_text())
            row['mesh'] = meta.get('mesh')
            row['zero'] = meta.get('config', {}).get('parallel', {}).get('zero_stage')
            row['schema'] = meta.get('schema', 1)
        except (OSError, ValueError):
            if row['complete']:  # committed, yet its metadata cannot be read
                row['problem'] = 'metadata unreadable'
        rows.append(row)
    if verify:
        with Checkpointer(root, every=0, keep=1 << 30, async_save=False) as ckpt:
            for row in rows:
                if row['complete']:
                    row['verified'] = _verify(ckpt, row['step'])
    return rows


def _single_device_target(ckpt: Checkpointer, step: int, keep=lambda key: True) -> dict:
    dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=dev)
            for k, (shape, dtype) in ckpt.saved_shapes(step).items() if keep(k)}


def _verify(ckpt: Checkpointer, step: int) -> str:
    try:
        quiet(lambda: ckpt.restore(step, _single_device_target(ckpt, step)))
        return 'ok'
    except Damaged as e:
        return e.why


def _open(run_dir, step: int | None) -> tuple[Checkpointer, int]:
    """A reader of RUN_DIR's (or RUN_DIR/checkpoints') steps, and `step` (None: the newest)."""
    root = Path(run_dir) / 'checkpoints'
    ckpt = Checkpointer(root if root.is_dir() else run_dir, every=0, keep=1 << 30,
                        async_save=False)
    step = ckpt.latest_step() if step is None else int(step)
    if step is None:
        ckpt.close()
        raise CheckpointError('RUN_DIR', f'no committed checkpoint in {ckpt.directory}')
    return ckpt, step


def read_meta(run_dir: str | os.PathLike, step: int | None = None) -> dict:
    """The metadata of a run's newest committed checkpoint (or of `step`)."""
    ckpt, step = _open(run_dir, step)
    with ckpt:
        return ckpt.read_meta(step)


def read(run_dir: str | os.PathLike, keys, step: int | None = None,
         target=None) -> tuple[dict, dict]:
    """({key: array}, meta) of the arrays of one checkpoint whose keys `keys` names (a list,
    or a predicate), each checked against its fingerprint; nothing else is read.

    ``target(meta) -> {key: jax.ShapeDtypeStruct with a sharding}`` places them; by default
    every array goes to this process's first device."""
    keep = keys if callable(keys) else set(keys).__contains__
    ckpt, step = _open(run_dir, step)
    with ckpt:
        meta = ckpt.read_meta(step)
        if target is None:
            wanted = _single_device_target(ckpt, step, keep)
        else:
            wanted = {k: v for k, v in target(meta).items() if keep(k)}
        restore_args = ocp.checkpoint_utils.construct_restore_args(wanted)
        arrays = quiet(lambda: ocp.PyTreeCheckpointer().restore(
            ckpt.step_dir(step) / STATE_ITEM,
            args=ocp.args.PyTreeRestore(item=wanted, restore_args=restore_args,
                                        partial_restore=True)))
    expected = meta.get('fingerprint', {})
    bad = [k for k, v in fingerprint(arrays, _version(meta)).items()
           if k in expected and expected[k] != v]
    if bad:
        raise Damaged(step, f'{bad[0]} does not match its fingerprint')
    return arrays, meta


def load(run_dir: str | os.PathLike, step: int | None = None, *, what: str = 'params',
         target=None) -> tuple[dict, dict]:
    """(nested dict of arrays, meta) of one checkpoint's ``what`` subtree ('params', 'opt' or
    '' for everything), for a notebook. Only the arrays asked for are read (`read`).

    ``target(meta) -> {key: jax.ShapeDtypeStruct with a sharding}`` places them (``api.load``
    gives the shardings a mesh's plan has); by default every array goes to this process's first
    device.
    """
    prefix = f'{what}/' if what else ''
    arrays, meta = read(run_dir, lambda k: k.startswith(prefix), step, target)
    return nest({k[len(prefix):]: x for k, x in arrays.items()}), meta
