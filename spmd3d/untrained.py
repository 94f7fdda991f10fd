"""State kept with the parameters that the optimizer does not train (`Untrained`): the MoE
router's selection bias and statistics (`router.RouterState`), FP8's amax histories (`fp8.py`).
Each kind advances itself by its type's rule from what the step observed, so the step has no
branch per feature (`advance_untrained`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .sharding import Param


class Untrained(Param):
    """State kept with the parameters (sharded, stacked and checkpointed like them) that the
    step updates by its own rule, not the optimizer: no moments, no weight decay, and its
    gradient, a statistic, counts neither in the gradient norm nor in clipping. The MoE
    router's bias and statistics probe (`router.RouterState`), FP8's amax histories and probes
    (`fp8.Fp8State`).

    It comes in groups, one module's: a zero `probe`, whose gradient is what the step observed
    (the router's statistics, FP8's amax histograms), beside the state it advances. The step
    hands each group to its type's `advance` (`advance_untrained`), so it has no branch per
    feature."""

    @classmethod
    def advance(cls, old: dict, observed: dict, scale, plan) -> tuple[dict, dict]:
        """(the group's values after the step, the step's metrics of it) from its values
        before the step (`old`: {name: value}), their gradients of the summed loss
        (`observed`), `scale` (1 / the step's count: summed to mean) and the plan."""
        raise NotImplementedError(cls.__name__)


def advance_untrained(params, observed, old, scale, plan) -> tuple[object, dict]:
    """(`params` with every group of `Untrained` state advanced by its type, their metrics):
    a group is the `Untrained` leaves of a node that holds a `probe`. Metrics of groups under
    multi-token prediction's depths (`mtp`) are named `mtp_...`."""
    metrics = {}

    def walk(node, seen, before, prefix=""):
        probe = node.get("probe") if hasattr(node, "get") else None
        if isinstance(probe, Untrained):
            names = [k for k, v in node.items() if isinstance(v, Untrained)]
            new, m = type(probe).advance({k: before[k][...] for k in names},
                                         {k: seen[k][...] for k in names}, scale, plan)
            metrics.update({k if k.startswith(prefix) else prefix + k: v for k, v in m.items()})
            for k in names:
                node[k] = before[k].replace(new[k])
            return
        for k, v in (node.items() if hasattr(node, "items") else ()):
            if not isinstance(v, nnx.Variable):
                walk(v, seen[k], before[k], "mtp_" if k == "mtp" else prefix)

    walk(params, observed, old)
    return params, metrics


def trainable(params):
    """A tree of bools: False for the `Untrained` leaves."""
    return jax.tree.map(lambda v: not isinstance(v, Untrained), params,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def untrained_zeroed(grads):
    """`grads` with every `Untrained` leaf's zeroed (what the optimizer and the norm see)."""
    return jax.tree.map(lambda v: jax.tree.map(jnp.zeros_like, v)
                        if isinstance(v, Untrained) else v,
                        grads, is_leaf=lambda x: isinstance(x, nnx.Variable))
