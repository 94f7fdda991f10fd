"""A plan's parameters, read from the model's own abstract state (`model.abstract_model`:
nothing allocated): each parameter's global shape and logical names, what the optimizer does
not train, and one device's shard of each under the plan's rules tables. `memory.py` sums
them into the state a device holds; `traffic.py` into what the collectives move."""

from __future__ import annotations

import math
from functools import lru_cache

from ..config import ModelConfig

F32 = 4


def itemsize(dtype: str) -> int:
    return 2 if dtype in ("bfloat16", "float16") else 4


@lru_cache(maxsize=64)
def _inventory(m: ModelConfig, layers: int) -> tuple[dict, frozenset]:
    """({parameter key: (global shape, logical names)}, the keys of state the optimizer does
    not train) of the model with `layers` stored layer slots, read from the model's own
    abstract state (`model.abstract_model`: nothing allocated): its shapes, its logical
    names, and `untrained.Untrained` by type (the router's state, FP8's)."""
    from flax import nnx

    from ..model import abstract_model
    from ..untrained import Untrained
    from ..store import flat

    order = tuple(range(m.stacked_layers)) + (-1,) * (layers - m.stacked_layers)  # -1: padding
    _, params = abstract_model(m, order)
    variables = flat(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    shapes = {k: (tuple(v.shape), tuple(v.get_metadata("axes"))) for k, v in variables.items()}
    return shapes, frozenset(k for k, v in variables.items() if isinstance(v, Untrained))


def param_shapes(m: ModelConfig, layers: int) -> dict:
    """{parameter key: (global shape, logical names)} with `layers` layer slots (`_inventory`)."""
    return _inventory(m, layers)[0]


def untrained(m: ModelConfig, layers: int) -> frozenset:
    """The keys of `param_shapes` the optimizer does not train (`Untrained`: no moments)."""
    return _inventory(m, layers)[1]


def _axes(rule) -> tuple:
    return () if rule is None else rule if isinstance(rule, tuple) else (rule,)


def shard_size(shape, names, rules, mesh: dict) -> int:
    """Elements of one device's shard of an array laid out by `rules` (uneven dims padded)."""
    n = 1
    for dim, axes in zip(shape, rules.spec(names)):
        n *= -(-dim // math.prod(mesh[a] for a in _axes(axes)))
    return n


def state_bytes(plan) -> dict:
    """Per-device bytes of parameters, optimizer state and fp32 gradients: exactly what
    `footprint.state_terms` reads from the shardings, without them (kept: a search asks again)."""
    return dict(_state_bytes(plan.cfg.model, len(plan.layer_order), plan.rules,
                             tuple(plan.mesh.shape.items()), plan.cfg.optim.moment_dtype))


@lru_cache(maxsize=1024)
def _state_bytes(model, layers: int, rules, mesh_items: tuple, moments: str) -> dict:
    mesh, shapes, skip = dict(mesh_items), param_shapes(model, layers), untrained(model, layers)
    total = lambda table, size, trained=False: size * sum(  # noqa: E731
        shard_size(s, n, table, mesh) for k, (s, n) in shapes.items()
        if not (trained and k in skip))
    pbytes = itemsize(model.param_dtype)
    return {"parameters": total(rules.params, pbytes),  # two moments and a count, trained only
            "optimizer_state": 2 * total(rules.opt, pbytes if moments == "auto" else
                                         itemsize(moments), trained=True) + 4,
            "gradients": total(rules.grads, F32)}


def stage_layers(plan, table=None, keys: tuple = ()) -> int:
    """Elements of the layers a device holds under rules `table` (by default what it computes
    with: its compute shard); `keys`: of those parameters alone (all the layers' by default)."""
    mesh = dict(plan.mesh.shape)
    shapes = param_shapes(plan.cfg.model, len(plan.layer_order))
    table = plan.rules.compute if table is None else table
    return sum(shard_size(s, names, table, mesh)
               for k, (s, names) in shapes.items()
               if k in keys or not keys and k.startswith("blocks/"))


def layer_shard(plan) -> int:
    """Elements of one layer slot of the device's compute shard (the stage's over its slots)."""
    return stage_layers(plan) // plan.layers_per_stage


def table_shard(plan, which: str, table=None) -> int:
    """Elements of the head (`head`) or the embedding (`embed`) a device holds under rules
    `table` (by default as it computes)."""
    m = plan.cfg.model
    shape, names = (((m.d_model, m.vocab_size), ("embed", "vocab")) if which == "head" else
                    ((m.vocab_size, m.d_model), ("vocab", "embed")))
    return shard_size(shape, names, plan.rules.compute if table is None else table,
                      dict(plan.mesh.shape))
