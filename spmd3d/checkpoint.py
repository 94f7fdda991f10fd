"""Sharded, mesh-independent checkpoints on top of orbax.

Each checkpoint step holds two orbax items:

* ``state`` -- the array pytree (``StandardSave``/``StandardRestore``). Orbax
  writes every array as a tensorstore with per-shard chunks, and each process
  writes/reads only the shards it owns, so nothing is ever gathered on one
  host. Because parameters are kept in a canonical layout, the saved arrays do
  not depend on the mesh: restoring onto another mesh only needs new target
  shardings.
* ``meta`` -- a small JSON dict (step, data_step, resolved config, mesh shape).

Commits are atomic through orbax: on local/POSIX filesystems a step is written
to ``<step>.orbax-checkpoint-tmp-<ts>`` and renamed when complete; on GCS a
``commit_success.txt`` marker is written last. Unfinished steps are never
listed.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

STATE_ITEM = 'state'
META_ITEM = 'meta'


def abstract_like(state: Any, shardings: Any | None = None) -> Any:
    """Builds a restore target (``jax.ShapeDtypeStruct`` leaves with sharding).

    ``shardings`` is a pytree of ``jax.sharding.Sharding`` matching ``state``;
    when omitted, each leaf's own ``.sharding`` is used. Convenient for tests
    and for callers that already hold a freshly initialised (or eval_shape'd)
    state on the new mesh.
    """
    if shardings is None:
        shardings = jax.tree.map(lambda x: x.sharding, state)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )


class Checkpointer:
    """Orbax ``CheckpointManager`` storing array state plus JSON metadata per step.

    The save schedule (``every``) is decided here rather than by orbax's default
    save policy, which would also save on the very first call at any step and
    refuse steps at or below the latest one; a plain ``step % every == 0`` rule
    is easier to reason about when resuming. Retention (``keep``) is delegated
    to orbax's ``LatestN`` preservation policy so old steps are deleted as part
    of the same (possibly asynchronous) commit.

    Must be constructed and called on every process (orbax syncs internally).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        every: int,
        keep: int,
        async_save: bool = True,
    ):
        self.directory = os.path.abspath(os.fspath(directory))
        self.every = int(every)
        self.keep = int(keep)
        self.async_save = bool(async_save)
        # Step whose asynchronous commit may still be running. Orbax lists a
        # step as soon as its save *starts*; we hide it until committed.
        self._pending: int | None = None
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(
                n=self.keep if self.keep > 0 else None
            ),
            enable_async_checkpointing=self.async_save,
            create=True,
            # Leave others' temp dirs alone: deleting them on open would break
            # a writer still running against the same directory. Unfinished
            # temp dirs are never listed as steps anyway.
            cleanup_tmp_directories=False,
        )
        self._mngr = ocp.CheckpointManager(self.directory, options=options)

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
        """Saves ``state`` and ``meta`` at ``step``; returns whether it saved.

        Off-schedule steps are skipped unless ``force`` (e.g. the final step or
        a preemption). A step that already exists is skipped rather than
        overwritten, so a forced final save that coincides with a periodic one
        is harmless. With ``async_save`` this returns once device buffers have
        been copied to host; the write continues in the background (a
        following ``save`` or ``wait`` blocks on it).
        """
        step = int(step)
        if not (force or self.should_save(step)):
            return False
        if step in self._mngr.all_steps():
            return False
        args = ocp.args.Composite(
            **{STATE_ITEM: ocp.args.StandardSave(state), META_ITEM: ocp.args.JsonSave(dict(meta))}
        )
        saved = self._mngr.save(step, args=args, force=True)
        if saved and self.async_save:
            self._pending = step
        return saved

    def restore(self, step: int | None, target: Any) -> tuple[Any, dict]:
        """Restores ``(state, meta)`` from ``step`` (None: latest committed).

        ``target`` is a pytree of ``jax.ShapeDtypeStruct`` with ``.sharding``
        set to the desired (possibly new-mesh) ``NamedSharding``s, with the
        same structure as the saved state. Each process reads only the chunks
        covering its addressable shards.
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
        args = ocp.args.Composite(
            **{STATE_ITEM: ocp.args.StandardRestore(target), META_ITEM: ocp.args.JsonRestore()}
        )
        out = self._mngr.restore(int(step), args=args)
        return out[STATE_ITEM], dict(out[META_ITEM])

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
