"""What the weights every stage uses cost a pipelined step: the embedding, the head and final
norm, and the dense layers before the stack (`model.dense_layers`). A pipeline runs them
outside its schedule, on the whole mesh, and stores them split over `stage` too
(`sharding.zero_rules(over_stage=True)`, where the width divides): each is gathered where it
is used and its gradient reduced to the stages' slices. Per device, for the planner: the memory
that adds (`gathered`, `dense_activations`) and the traffic (`traffic`)."""

from __future__ import annotations

from ..mesh import DATA, EXPERT, SEQ, STAGE
from ..sharding import flat_axes
from .memory import F32, itemsize, param_shapes, shard_size

__all__ = ["over_stage", "gathered", "dense_activations", "traffic"]


def over_stage(plan) -> bool:
    """Whether the weights outside the pipeline are stored split over `stage`."""
    return STAGE in plan.rules.params.spare


def gathered(plan) -> int:
    """The head and final norm whole over the stages, in the parameter dtype, while the
    pipeline runs (the loss needs them; the embedding is looked up in its slices, the dense
    layers are gathered one at a time)."""
    if not over_stage(plan):
        return 0
    m, mesh = plan.cfg.model, dict(plan.mesh.shape)
    head = shard_size((m.d_model, m.vocab_size), ("embed", "vocab"), plan.rules.compute, mesh)
    return (head + m.d_model) * itemsize(m.param_dtype)


def _slots(plan) -> int:
    """The dense layers' runs per layer a step: a pipeline's slots, else the microbatches."""
    s = plan.schedule
    return -(-plan.microbatches // s.stages) if s is not None else plan.microbatches


def dense_activations(plan) -> int:
    """What the dense layers keep for their backward while the stack runs: with a pipeline
    under a remat policy each layer's input for every slot (`forward._dense_by_slot`), else
    what the layer's policy keeps, for every slot (one microbatch without a pipeline)."""
    from . import residuals
    from .quirks import applies

    cfg, m, s = plan.cfg, plan.cfg.model, plan.schedule
    if not m.dense_layers:
        return 0
    policy = "full" if cfg.parallel.remat == "stage" or s is not None and \
        cfg.parallel.remat != "none" else cfg.parallel.remat
    split = plan.degrees.tensor if cfg.parallel.sequence_parallel else 1
    kept = residuals.of(plan, dense=True).kept(policy, split,
                                                xla_drops=applies("vjp_hands_over_more"))
    return int(m.dense_layers * (_slots(plan) if s is not None else 1)
               * plan.tokens_per_microbatch * kept)


def traffic(plan, act: float, f: int, again: int) -> list[tuple[str, str, tuple, float]]:
    """(what, kind, mesh axes, bytes per device per step) of the dense layers -- their
    activations' sums over `tensor` (`act` bytes a pass, `f` a forward's sums, `again` those a
    recompute adds: `estimate.transfers`' figures for a layer), and in a pipeline their
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
