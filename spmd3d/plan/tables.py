"""What the weights every stage uses cost a pipelined step: the embedding, the head and final
norm, and the dense layers before the stack (`model.dense_layers`). A pipeline runs them
outside its schedule, on the whole mesh, and stores them split over `stage` too
(`sharding.zero_rules(over_stage=True)`, where the width divides): each is gathered where it
is used and its gradient reduced to the stages' slices. Their traffic per device, for the
planner (`memory.py` counts what they hold: `gathered_tables`, `dense_activations`)."""

from __future__ import annotations

from ..mesh import DATA, EXPERT, SEQ, STAGE
from ..sharding import flat_axes
from .inventory import F32, itemsize, param_shapes, shard_size
from .memory import _slots, over_stage


def traffic(plan, act: float, f: int, again: int) -> list[tuple[str, str, tuple, float]]:
    """(what, kind, mesh axes, bytes per device per step) of the dense layers -- their
    activations' sums over `tensor` (`act` bytes a pass, `f` a forward's sums, `again` those a
    recompute adds: `traffic.transfers`' figures for a layer), and in a pipeline their
    weights' gathers and gradients' sums -- and of the head and embedding gathered over the
    stages. A pipeline's dense layer runs forward twice under a remat policy (its own
    checkpoint's recompute, then each slot's inside), gathers its weights for each, and sums
    its fp32 gradient over the rows' axes and `seq` once."""
    m, s, mesh = plan.cfg.model, plan.schedule, dict(plan.mesh.shape)
    rules, remat = plan.rules, plan.cfg.parallel.remat != "none"
    out = []
    if m.dense_layers:
        runs = m.dense_layers * _slots(plan)
        forwards = runs * (2 if s is not None and remat else 1)
        out.append(("dense layers' activations", "reduce-scatter" if f == 4 else "reduce",
                    ("tensor",), act * (forwards * f + runs * (f + again))))
    if s is None or not over_stage(plan):
        return out
    shapes = param_shapes(m, len(plan.layer_order))
    dense = [k for k in shapes if k.startswith("dense/")]
    pb = itemsize(m.param_dtype)
    layer = sum(shard_size(*shapes[k], rules.compute, mesh) for k in dense) // max(
        m.dense_layers, 1)
    zero = (DATA, EXPERT) if plan.rules.params_over_batch else ()
    out += [("dense layers gathered", "gather", (STAGE,) + zero,
             layer * pb * m.dense_layers * (1 + remat)),
            ("dense layers' gradients", "reduce",
             flat_axes(rules.compute["layers"], rules.compute["batch"], SEQ),
             layer * F32 * m.dense_layers),
            ("embedding and head gathered over stage", "gather", (STAGE,),
             sum(shard_size(*shapes[k], rules.compute, mesh) for k in ("embed", "head")) * pb)]
    return out
