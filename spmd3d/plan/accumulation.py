"""What a step without a pipeline holds beside its gradients' accumulator, per device: at the
loss (the tables' gradients as they are then, the loss's working set), and accumulating
microbatches, a microbatch's fp32 gradients of the layers and the tables, the experts' sum over
their copies, and XLA:CPU's fp32 copy of a narrow head (`memory.py` adds them to the step's
phases)."""

from __future__ import annotations

from .inventory import F32, itemsize, layer_shard, param_shapes, stage_layers, table_shard
from .quirks import applies

EXPERTS = ("blocks/mlp/w_gate_up", "blocks/mlp/w_down")  # an MoE layer's experts' weights


def head_copy(plan) -> int:
    """Elements of XLA:CPU's fp32 copy of a narrow head the loss's dots read
    (`narrow_head_fp32_copy`): held for an accumulated microbatch, and for ZB-H1's F that runs
    the head."""
    narrow = itemsize(plan.cfg.model.dtype) < F32 and applies("narrow_head_fp32_copy")
    return narrow * table_shard(plan, "head")


def loss_phase(plan) -> int:
    """Without a pipeline, what the loss (its forward's pieces or its backward's, the larger)
    holds beyond the step's other temporaries (`memory`'s, whose gradients count the tables'
    and, split by ZeRO-2/3 without accumulation, the head's whole from the loss on): the
    tables' gradients as they are then and the loss's working set (`vocab.loss_working`, with
    `head_copy`). Then, accumulating,
    the tables' accumulators and the microbatch's zeroed embedding (`zeroed_embedding`); else
    the embedding's alone: the zeroed table the lookup's cotangents scatter into (its compute
    shard where `tensor` splits the vocabulary, its gradient's shard where the lookup moves
    cotangents); the head's is made from the loss's pieces after them."""
    from ..vocab import loss_working

    m, deg, accumulating = plan.cfg.model, plan.degrees, plan.accum_steps > 1
    head, embed = (table_shard(plan, t, plan.rules.grads) * F32 for t in ("head", "embed"))
    whole_head = not accumulating and plan.rules.grads_over_batch and deg.zero > 1
    counted = head + embed + whole_head * table_shard(plan, "head") * F32
    held = accumulating * (head + embed) + (zeroed_embedding(plan, always=True) or
                                            (not accumulating) * embed)
    working = loss_working(plan.tokens_per_microbatch, plan.cfg.parallel.loss_chunk,
                           m.d_model, m.vocab_size // deg.tensor, table_shard(plan, "head"),
                           itemsize(m.dtype), head_copy(plan))
    return held - counted + working


def inlined_layer(plan, saved: int) -> tuple[int, int]:
    """A dense stack of one layer without a pipeline (quirk `one_layer_inlined`): (what the
    loss's phase holds of the layer beyond `saved`, what every phase after the forward holds
    beside), (0, 0) otherwise. The layer's loop of one trip is inlined and its recompute is its
    forward whatever the policy: XLA:CPU keeps every value `none` keeps as its fp32 matmuls
    give it; and the layer's weights' fp32 copies and the lookup's fp32 output, twice."""
    from . import residuals

    m, deg = plan.cfg.model, plan.degrees
    if plan.layers_per_stage > 1 or m.is_moe or not applies("one_layer_inlined"):
        return 0, 0
    c, n = itemsize(m.dtype), plan.tokens_per_microbatch
    split = deg.tensor if plan.cfg.parallel.sequence_parallel else 1
    kept = residuals.of(plan).kept("none", split) * n * F32 // c
    return int(kept - saved), layer_shard(plan) * F32 * (c < F32) + 2 * n * m.d_model * F32


def table_gradients(plan) -> int:
    """Accumulating without a pipeline, at a microbatch's end: its fp32 gradients of the
    tables (their compute shard, whole over the token axes), their sum over those axes
    (`reduce_inside_accumulation`), and the head's fp32 copy (`head_copy`)."""
    deg, accumulating = plan.degrees, plan.schedule is None and plan.accum_steps > 1
    reduced = deg.batch * deg.seq > 1 and applies("reduce_inside_accumulation")
    tables = table_shard(plan, "head") + table_shard(plan, "embed")
    return accumulating * ((1 + reduced) * tables + head_copy(plan)) * F32


def microbatch_gradients(plan, whole: bool = False) -> int:
    """Accumulating without a pipeline, while a microbatch's layers run backward: its fp32
    gradients beside the accumulator, the layers' stacked as the accumulator holds them (an
    MoE layer's experts' too, beside `expert_gradients`; HSDP's `whole` ones counted apart),
    the embedding's when `tensor` splits the vocabulary (the lookup's cotangents scattered
    into a zeroed table from the forward on), the head's fp32 copy (`head_copy`) and, unless
    ZeRO-2/3 reduce-scatter it after the loss, the head's from the loss on."""
    if plan.schedule is not None or plan.accum_steps == 1:
        return 0
    layers = stage_layers(plan, plan.rules.grads)
    kept = not (plan.rules.grads_over_batch and plan.degrees.zero > 1)
    if plan.cfg.model.is_moe and not experts_copied(plan):
        # no sum of the experts' gradient over copies: one of theirs for the microbatch
        # (`expert_gradients`)
        layers -= stage_layers(plan, plan.rules.grads, keys=EXPERTS)
    return ((not whole) * layers + head_copy(plan) + kept * table_shard(plan, "head")) * F32 \
        + zeroed_embedding(plan)


def zeroed_embedding(plan, always: bool = False) -> int:
    """Accumulating without a pipeline (`always`: or not): the embedding's zeroed fp32
    gradient, its compute shard, the lookup's cotangents are scattered into, from a
    microbatch's forward to its end (its loss's backward too); none where, without `tensor`,
    the lookup moves them into a gradient split over data (`lookup_moves_cotangents`)."""
    moved = plan.degrees.tensor == 1 and table_shard(plan, "embed", plan.rules.grads) < \
        table_shard(plan, "embed")
    if plan.schedule is not None or moved or plan.accum_steps == 1 and not always:
        return 0
    return table_shard(plan, "embed") * F32


def experts_copied(plan) -> bool:
    """Whether a token axis holds copies of each expert (data's replicas, HSDP's groups, seq),
    over which the experts' gradient is summed (`manual.vary`)."""
    deg = plan.degrees
    return deg.replicas * deg.replicate * deg.seq > 1


def expert_gradients(plan) -> int:
    """MoE without a pipeline: a microbatch's gradient of the experts, whole over their
    replicas and in fp32 (their shard_map sums it over the token axes, `manual.vary`), beside
    the accumulator when microbatches accumulate or the gradients are split over data."""
    if not plan.cfg.model.is_moe or plan.schedule is not None:
        return 0
    split = plan.rules.grads["expert_embed"] is not None and plan.degrees.replicas > 1
    if plan.accum_steps == 1 and not split:
        return 0
    return stage_layers(plan, keys=EXPERTS) * F32


def expert_reduce(plan) -> int:
    """MoE without a pipeline, the experts' gradient neither accumulated nor split over data
    (`expert_gradients` counts none): at the end of each MoE layer's backward its shard_map
    sums the layer's fp32 gradient of the experts over the token axes the experts are copied
    on (`manual.vary`), the sum's input and its result alive together beside the gradients,
    once the layer's other working set is gone (seeds 6 and 10 of the planner's property)."""
    m = plan.cfg.model
    if not m.is_moe or plan.schedule is not None or expert_gradients(plan) or \
            not experts_copied(plan):
        return 0
    stacked = param_shapes(m, len(plan.layer_order))[EXPERTS[0]][0][0]  # the MoE layers
    return 2 * stage_layers(plan, keys=EXPERTS) // stacked * F32
