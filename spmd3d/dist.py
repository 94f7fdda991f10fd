"""Multi-process (multi-host) start-up: `jax.distributed` from the config or the environment."""

from __future__ import annotations

from .config import Config


def initialize(cfg: Config) -> None:
    """Join the multi-process job described by `cfg.dist` (no-op for a single process).

    Must run after `mesh.simulate_devices` and before jax's backends start."""
    if cfg.dist.num_processes <= 1 and not cfg.dist.coordinator:
        return
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=cfg.dist.coordinator,
                               num_processes=cfg.dist.num_processes,
                               process_id=cfg.dist.process_id)
