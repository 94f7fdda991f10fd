"""What a plan's step needs in memory per device, by arithmetic alone (`estimate.py` adds
FLOPs, communication and time).

Shapes come from the config, shardings from the plan's rules tables, a layer's residuals from
tracing it on abstract shapes: no devices, nothing compiled.

Memory per device, by kind:
* parameters, optimizer state (Adam's two moments), gradients (fp32): each parameter's shard
  under its ZeRO table (`inventory.py`: the model's own abstract state);
* saved activations: what the backward keeps of a layer, asked of the layer itself
  (`residuals.py`: its vjp traced at one device's share, per remat policy and kernel) times
  the layer passes alive at the peak (`activation_bytes`: one microbatch without a pipeline,
  the schedule's slots or stash with one), plus the working set of the one layer whose backward
  runs: what it recomputes, its projections' output cotangents, the score tiles a pure-JAX
  kernel (blocked, the ring) computes again, and under ZeRO-2/3 the layer's weights and their
  gradient whole over data (`layer_weights`);
* pipeline buffers, logits/loss and the layers ZeRO-3 gathers for a pipelined step
  (`working_terms`, which the compiled report's breakdown uses too).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..mesh import STAGE
from . import residuals
from .accumulation import (expert_gradients, expert_reduce, head_copy, inlined_layer,
                           loss_phase, microbatch_gradients, table_gradients)
from .inventory import (F32, itemsize, layer_shard, param_shapes, shard_size, stage_layers,
                        state_bytes, table_shard)
from .quirks import applies


def gathered_layers(plan) -> int:
    """A pipeline whose gradients ZeRO-2/3 split over data: the stage's fp32 gradient
    accumulated whole over data (the pipeline hands back its compute shard, reduced over data
    after it) and, under ZeRO-3 with `parallel.zero3_gather=step`, the stage's layers gathered
    over data for the step (their compute shard: split over stage and tensor only). Nothing
    when the batch is not split (data 1: the compiled step holds what ZeRO-1 holds)."""
    rules = plan.rules
    if not (plan.schedule and rules.grads_over_batch and plan.degrees.zero > 1):
        return 0
    gathered = rules.params_over_batch and plan.cfg.parallel.zero3_gather == "step"
    return stage_layers(plan) * (gathered * itemsize(plan.cfg.model.param_dtype) + F32)


def layer_weights(plan, phase: str = "attention") -> int:
    """Per-device bytes of one layer's weights in a `phase` of its backward, when ZeRO splits
    them over data and no pipeline gathers its stage for the step. The MLP's, which runs before
    any of the layer's weight gradients is made, holds the layer ZeRO-3 gathered as its dots
    read it (fp32 copies of narrow weights, quirk `dot_operand_copies`: LLaMA-3 8B's and 70B's
    dumps); the attention's, the gathered layer in the compute dtype and, under ZeRO-2 and 3,
    its weights' gradient whole over data, in the compute dtype as the matmuls give it and in
    fp32, before its reduce-scatter. Each weight only where its table splits it finer than it
    computes (not an expert ZeRO leaves whole for want of copies)."""
    rules = plan.rules
    if plan.schedule is not None or plan.degrees.zero == 1 or not rules.grads_over_batch:
        return 0
    c = itemsize(plan.cfg.model.dtype)
    if phase == "mlp":
        read = F32 if c < F32 and applies("dot_operand_copies") else c
        return _split_finer(plan, rules.params) * read // plan.layers_per_stage
    return (_split_finer(plan, rules.params) * c + _split_finer(plan, rules.grads) * (c + F32)) \
        // plan.layers_per_stage


def _split_finer(plan, table) -> int:
    """Elements of the stage's layers, in their compute shard, of the weights `table` splits
    finer than they compute."""
    mesh, compute = dict(plan.mesh.shape), plan.rules.compute
    return sum(shard_size(s, n, compute, mesh) for k, (s, n) in
               param_shapes(plan.cfg.model, len(plan.layer_order)).items()
               if k.startswith("blocks/") and shard_size(s, n, table, mesh) < shard_size(
                   s, n, compute, mesh))


def branch_gradients(plan) -> int:
    """ZB-H1's switch: each branch hands back a gradient of the stage's layers (W its own,
    the others zeros), fp32, beside the accumulator (`branch_buffers`), and the stage's layers
    cast to a narrow compute dtype once for the step."""
    m = plan.cfg.model
    narrow = itemsize(m.dtype) < F32
    return applies("branch_buffers") * stage_layers(plan) * (F32 + narrow * itemsize(m.dtype))


def switch_peak(plan, kinds: dict, loss: int, layer: int, head: int) -> int:
    """ZB-H1's slot (`pipeline.executor`): the stash (`saved_activations`, W's inputs in
    `w_stash`), the slot of each stash kind its operation reads (one pass, held to the slot's
    end: each branch hands back what it does not write) and the branches' gradients, beside
    the largest of an F with the head (a loss piece, the head's fp32 copy its dots read when
    narrow; split over data, the microbatch's head gradient, which its accumulator takes, made
    from two of the piece's three values), a B
    (a layer's backward, and what it stashes for W: the taps, and under stage remat W's
    inputs) and a W (the pass it read handed back, its widest matmul's operands and, over more
    than one layer, one layer's fresh gradient beside the stack it fills); B and W hand back
    a zero gradient of the head too (fp32, `branch_buffers`)."""
    s, sharded = plan.schedule, plan.rules.grads_over_batch and plan.degrees.zero > 1
    one = kinds["saved_activations"] // s.in_flight + kinds["w_stash_per_pass"]
    kinds["w_stash"] = int(s.in_flight * kinds["w_stash_per_pass"] + one)
    kinds["branch_gradients"] = branch_gradients(plan)
    f = head_copy(plan) * F32 + (loss * 2 // 3 + head if sharded else loss)
    w = one + mlp_operands(plan) + layer_shard(plan) * F32 * (plan.layers_per_chunk > 1)
    zeros = applies("branch_buffers") * table_shard(plan, "head") * F32
    return max(f, zeros + max(layer + kinds["w_built_per_pass"], w)) + kinds["mtp_working"] + \
        kinds["w_stash"] + kinds["branch_gradients"]


def working_terms(plan) -> dict:
    """Per-device bytes of the pipeline's buffers (the microbatches a stage feeds in and
    collects, its belts and its inboxes) and of one
    piece of the loss (its logits, softmax and one-hot, fp32)."""
    from ..vocab import loss_chunks

    cfg, m = plan.cfg, plan.cfg.model
    row = plan.tokens_per_microbatch
    buffers, tokens = 0, row
    if plan.schedule:  # the stage's input and output slots, two belts and the inboxes
        slots = -(-plan.microbatches // plan.schedule.stages)
        table = plan.schedule.table()
        buffers = (2 * slots + 2 + table.x_slots + table.ct_slots) * row * m.d_model
        tokens = slots * row
    piece = tokens // loss_chunks(tokens, cfg.parallel.loss_chunk)
    return {"pipeline_buffers": buffers * itemsize(m.dtype),
            "logits_loss": 3 * piece * m.vocab_size // plan.degrees.tensor * 4,
            "gathered_layers": gathered_layers(plan),
            "gathered_tables": gathered_tables(plan),
            "dense_activations": dense_activations(plan)}


# the weights a pipeline runs outside its schedule (the embedding, head and dense layers
# before the stack), split over `stage` too: what they hold (`tables.py`: their traffic)

def over_stage(plan) -> bool:
    """Whether the weights outside the pipeline are stored split over `stage`."""
    return STAGE in plan.rules.params.spare


def gathered_tables(plan) -> int:
    """Tables held whole for the step: a pipeline's head and final norm, in the parameter
    dtype, when split over the stages (the embedding is looked up in its slices, the dense
    layers gathered one at a time); accumulating under ZeRO-3 without a pipeline, the
    embedding as stored and the head in the compute dtype (XLA hoists the gathers)."""
    m = plan.cfg.model
    if over_stage(plan):
        return (table_shard(plan, "head") + m.d_model) * itemsize(m.param_dtype)
    hoisted = plan.schedule is None and plan.accum_steps > 1 and plan.degrees.zero > 1
    return hoisted * plan.rules.params_over_batch * (
        table_shard(plan, "embed") * itemsize(m.param_dtype)
        + table_shard(plan, "head") * itemsize(m.dtype))


def _slots(plan) -> int:
    """The dense layers' runs per layer a step: a pipeline's slots, else the microbatches."""
    s = plan.schedule
    return -(-plan.microbatches // s.stages) if s is not None else plan.microbatches


def dense_activations(plan) -> int:
    """What the dense layers keep for their backward while the stack runs: with a pipeline
    under a remat policy each layer's input for every slot (`forward._dense_by_slot`), else
    what the layer's policy keeps, for every slot (one microbatch without a pipeline)."""
    cfg, m, s = plan.cfg, plan.cfg.model, plan.schedule
    if not m.dense_layers:
        return 0
    policy = "full" if cfg.parallel.remat == "stage" or s is not None and \
        cfg.parallel.remat != "none" else cfg.parallel.remat
    split = plan.degrees.tensor if cfg.parallel.sequence_parallel else 1
    kept = residuals.of(plan, dense=True).kept(policy, split)
    return int(m.dense_layers * (_slots(plan) if s is not None else 1)
               * plan.tokens_per_microbatch * kept)


@dataclass(frozen=True)
class Widths:
    """One device's share of the attention's widths, in elements per token: what the
    collectives of the ring move."""

    kv: float  # kv heads x head dim (the mean of K's and V's: MLA's values are narrower)

    @classmethod
    def of(cls, plan) -> "Widths":
        m, t = plan.cfg.model, plan.degrees.tensor
        return cls(kv=m.num_kv_heads / t * (m.dim_per_head + m.value_dim) / 2)


def _keys_per_query(plan) -> float:
    """Keys a query's scores span under the plan's attention kernel, for its FLOPs."""
    from ..attention import computed_fraction

    t, seq = plan.cfg.train.seq_len, plan.degrees.seq
    if plan.attention_local in ("cudnn", "pallas"):
        return 0.0
    if plan.attention in ("ring", "gather"):  # a step scores a query against one device's keys
        return t / seq
    return t * computed_fraction(t, plan.cfg.model.attention_tile)


def activation_bytes(plan) -> dict:
    """{saved_activations, layer_working, w_stash_per_pass}: per-device bytes the backward
    keeps at its peak, those one layer's backward needs on top, and what ZB-H1's W waits for
    per pass. Per-layer bytes are the layer's own (`residuals.of`)."""
    cfg, s, deg = plan.cfg, plan.schedule, plan.degrees
    policy = cfg.parallel.remat
    n = plan.tokens_per_microbatch
    layer = residuals.of(plan)
    split = deg.tensor if cfg.parallel.sequence_parallel else 1  # the stream under SP

    def kept(p):  # what autodiff keeps of a layer under policy p
        return layer.kept(p, split)

    layers, chunk = plan.layers_per_stage, plan.layers_per_chunk  # stored; one pass's
    # a pass that keeps its input alone: stage remat, and circular GPipe's recomputed stages
    whole = policy == "stage" or (s is not None and s.recomputes_stage)
    inner = "full" if policy == "stage" else policy  # the policy inside a stage checkpoint
    if s is None:  # one microbatch's layers at a time (and MTP's), and the experts' as used
        passes, per_pass = 1, (kept("full") if whole else layers * (
            kept(policy) + layer.fixed_kept[policy] / n)) + cfg.model.mtp_layers * kept(inner)
    else:  # autodiff keeps every slot's pass (bubbles included), the others their stash
        passes = s.saved_passes
        per_pass = kept("full") if whole else chunk * kept(inner)
        # a stash also holds, per layer and pass, what the layer makes that does not grow
        # with the tokens (the experts' weights as used, a custom_vjp's residuals)
        if s.mode != "autodiff" and not whole:
            per_pass += chunk * layer.fixed[inner] / n
    # an offloading policy's residuals, in host memory: as many passes as the device's would be
    host = passes * (layers if s is None else chunk) * layer.on_host(inner, split) * n
    # one layer's backward, in two phases (the MLP's runs first): the MLP's holds all the layer
    # recomputes (all it would keep under `none`, less what the policy kept) and the MLP's
    # matmul operands; the attention's its own recompute, its kernel's working set
    # (`_kernel_working`) and the MLP weights' gradient (an MoE layer in 1F1B's slot: less
    # what its MLP kept, fitted, no mechanism found: `test_estimate`'s MoE 1F1B layout at
    # 1.015 with it, 1.050 without); each the weights ZeRO gathers for it, and the
    # attention's the layer's whole gradient (`layer_weights`); both the projections' output
    # cotangents and an offloading policy's residuals, back on the device
    redo = kept("none") - kept(inner)
    lockstep_moe = cfg.model.is_moe and s is not None and s.mode == "lockstep"
    attention = (layer.kept("none", split, True) - layer.kept(inner, split, True)
                 + _kernel_working(plan) + mlp_gradient(plan, "attention") / n
                 - lockstep_moe * layer.kept(inner, split, False))
    m = cfg.model
    ep = deg.expert
    rows = m.is_moe * ep * min(m.experts_per_token, m.num_experts // ep)  # per token
    # without a pipeline, an MoE layer's MLP phase holds its dispatched rows' cotangent twice:
    # the zeroed table the gather's gradient scatters into and the matmul's result
    rows_ct = (s is None) * 2 * rows * m.d_model * itemsize(m.dtype)
    working = (layer.projection_outputs + layer.on_host(inner, split)
               + max(redo + rows_ct + (mlp_operands(plan) + mlp_gradient(plan, "mlp")
                                       + layer_weights(plan, "mlp")) / n,
                     attention + layer_weights(plan) / n))
    if m.is_moe and s is not None and deg.tensor > 1:
        # inside a pipeline the compiler sums the experts' partial outputs over `tensor` itself
        # (`traffic.transfers`): the backward's three sums of [R, D] (R = expert x tokens x
        # min(k, local experts)) run as one all-reduce, their results beside their inputs
        working += 3 * rows * m.d_model * itemsize(m.dtype)
    if whole:  # the pass being recomputed keeps what its layers' policy saves
        working += (layers if s is None else chunk) * kept(inner)
    # ZB-H1's W waits for its projections' inputs and output gradients, which B makes (and
    # under stage remat the inputs too)
    w_stash = chunk * layer.waits(split) * n
    built = chunk * (layer.waits(split) if whole else layer.projection_outputs) * n
    return {"saved_activations": int(passes * per_pass * n), "layer_working": int(working * n),
            "layer_redo": int(redo * n), "layer_kept": int(kept(inner) * n),
            "w_stash_per_pass": int(w_stash), "w_built_per_pass": int(built),
            "host_activations": int(host)}


def mlp_gradient(plan, phase: str) -> int:
    """Bytes of a dense layer's MLP weights' gradient, which its backward holds from the
    MLP's `phase` through the attention's: in the compute dtype, and in the MLP's phase as
    XLA:CPU's matmuls give it, fp32 (quirk `dot_operand_copies`); with the whole layer's under
    ZeRO-2/3 (`layer_weights`) counted there."""
    m = plan.cfg.model
    if m.is_moe or layer_weights(plan):
        return 0
    keys = tuple(k for k in param_shapes(m, len(plan.layer_order)) if k.startswith("blocks/mlp/"))
    size = F32 if phase == "mlp" and applies("dot_operand_copies") else itemsize(m.dtype)
    return stage_layers(plan, keys=keys) // plan.layers_per_stage * size


def mlp_operands(plan) -> int:
    """Per-device bytes of XLA:CPU's operands of a dense MLP's widest backward matmuls (quirk
    `dot_operand_copies`), beyond the projection's output cotangent: that cotangent in a
    second layout, fp32 (in a narrow dtype, fp32 in both layouts, and the gate and up
    weights' fp32 copy)."""
    m = plan.cfg.model
    if m.is_moe or not applies("dot_operand_copies"):
        return 0
    narrow = itemsize(m.dtype) < F32
    width = 2 * m.d_ff // plan.degrees.tensor  # gate and up, this device's share
    return ((1 + narrow) * plan.tokens_per_microbatch + narrow * m.d_model) * width * F32


def _kernel_working(plan) -> float:
    """Bytes per token the attention kernel's backward holds beyond what its layer recomputes
    (the kernel's own count, `attention.working`, with XLA:CPU's score tiles as compiled)."""
    from ..attention import working

    m, deg = plan.cfg.model, plan.degrees
    kind = plan.attention_local  # Ulysses': its kernel over the whole sequence
    s = plan.schedule
    mode = "alone" if s is None or s.mode == "switch" else s.mode  # ZB-H1's B runs alone
    score = ({"alone": 16, "autodiff": 12, "lockstep": 8}[mode] + 4 * (plan.eot is not None)
             + 4 * (itemsize(m.dtype) == F32))
    return working(kind, heads=m.num_heads / deg.tensor, kv_heads=m.num_kv_heads / deg.tensor,
                   head_dim=m.dim_per_head, seq_len=plan.cfg.train.seq_len,
                   seq=1 if plan.attention == "ulysses" else deg.seq,
                   itemsize=itemsize(m.dtype), tile=m.attention_tile,
                   score_bytes=score if applies("score_copies") else None)


def mtp_working(plan, kinds: dict) -> int:
    """Multi-token prediction in a pipeline (`forward._pipelined_loss`): the depths run with
    the head, per microbatch on the last stage (1F1B, ZB-H1) or per slot after GPipe's
    pipeline, their backward at once: the main loss's logits piece kept meanwhile (one piece
    per device), one depth's layer backward, and the depths' weights' gradient of the
    microbatch beside their accumulator, in fp32; after GPipe's, the slot's gradient of the
    head too, beside the head's (their shard_map sums the slots' at its boundary)."""
    m, mesh = plan.cfg.model, dict(plan.mesh.shape)
    if not m.mtp_layers:
        return 0
    shapes = param_shapes(m, len(plan.layer_order))
    depths = sum(shard_size(s, names, plan.rules.compute, mesh)
                 for k, (s, names) in shapes.items() if k.startswith("mtp/"))
    head = table_shard(plan, "head")
    gpipe = not plan.schedule.head_inside
    return int(kinds["logits_loss"] // 3 + kinds["layer_working"] + 2 * depths * F32
               + gpipe * head * F32)


def memory(plan) -> dict:
    """Per-device bytes by kind (`footprint.by_kind`'s kinds, and `layer_working`), the
    temporaries and the total. The temporaries' peak: gradients, saved activations and the
    pipeline's buffers, plus the larger of the loss's working set (the head's backward runs
    before any layer's) and one layer's backward; 1F1B, which runs the head per microbatch
    inside its slots, also accumulates the head's gradient; ZB-H1's switch holds the larger of
    its head's, a B's and a W's working set beside its branches' gradients and its W stash; an
    accumulating step's microbatch end may be larger (`table_gradients`)."""
    kinds = {**state_bytes(plan), **working_terms(plan), **activation_bytes(plan)}
    s, m = plan.schedule, plan.cfg.model
    head = table_shard(plan, "head") * F32
    # the head's gradient accumulated whole per device: by the loss's pieces when ZeRO-2/3
    # shard the gradients over the batch (ZB-H1's too), by 1F1B's microbatches; each MTP
    # depth's use of the head and the embedding holds one more of each, whole
    sharded = plan.rules.grads_over_batch and plan.degrees.zero > 1
    embed = table_shard(plan, "embed")
    lockstep = bool(s and s.mode == "lockstep")
    # accumulating without a pipeline, a microbatch's whole one is reduce-scattered after its
    # loss: in the loss's phase alone
    loss_head = sharded * head if s is None and plan.accum_steps > 1 else 0
    kinds["head_gradients"] = (sharded + 2 * lockstep) * head - loss_head + \
        m.mtp_layers * (head + embed * F32)
    kinds["expert_gradients"] = expert_gradients(plan)
    # HSDP accumulating: a microbatch's layer gradients reduced whole over the group
    kinds["whole_gradients"] = stage_layers(plan) * F32 if (
        s is None and plan.accum_steps > 1 and sharded and plan.degrees.replicate > 1
        and applies("hsdp_reduces_whole")) else 0
    kinds["microbatch_gradients"] = microbatch_gradients(plan, kinds["whole_gradients"] > 0)
    loss, layer = kinds["logits_loss"], kinds["layer_working"] + kinds["microbatch_gradients"]
    deg = plan.degrees
    c, sp = itemsize(m.dtype), plan.cfg.parallel.sequence_parallel and deg.tensor > 1
    if (plan.attention == "ulysses" and s is None and plan.accum_steps == 1 and not sp
            and deg.batch > 1 and c < F32 and applies("head_gradient_fp32_copy")):
        kinds["head_gradients"] += head  # summed over data and seq, held to the step's end
    kinds["w_stash"], kinds["mtp_working"] = 0, mtp_working(plan, kinds) if s is not None else 0
    if s is not None and s.mode == "switch":
        peak = switch_peak(plan, kinds, loss, layer, head)
    elif s is not None and s.mode == "lockstep":  # a slot runs a forward (and head) and a backward
        peak = loss + kinds["mtp_working"] + layer
    elif s is not None:  # GPipe's backward, autodiff of its slot loop: a slot's pass read out
        # (none where a pass runs one layer: seeds 13 and 24)
        fresh = applies("fresh_stage_gradient") and plan.layers_per_chunk > 1
        peak = max(loss + kinds["mtp_working"],
                   layer + fresh * stage_layers(plan) * F32
                   + kinds["saved_activations"] // s.saved_passes)
    else:  # the loss (and beside its backward the last layer's recompute), one layer's
        # backward, or the end of an MoE layer's
        redo = applies("recompute_beside_loss") * kinds["layer_redo"]
        inlined, held = inlined_layer(plan, kinds["saved_activations"])  # a stack of one
        # (an MoE layer's end: its residuals, read out of the stacks, still held)
        reduce = expert_reduce(plan) and expert_reduce(plan) + kinds["layer_kept"]
        peak = max(loss_phase(plan) + (inlined or redo), layer, reduce) + held
    for factor in ("w_stash_per_pass", "w_built_per_pass", "layer_redo", "layer_kept"):
        del kinds[factor]
    temp = (kinds["gradients"] + kinds["saved_activations"] + kinds["pipeline_buffers"]
            + kinds["gathered_layers"] + kinds["gathered_tables"] + kinds["dense_activations"]
            + kinds["head_gradients"] + kinds["expert_gradients"] + kinds["whole_gradients"]
            + peak)
    # accumulating without a pipeline, a microbatch's end: its tables' gradients beside the
    # accumulator; the activations and the experts' microbatch gradient are gone by then
    kinds["table_gradients"] = table_gradients(plan)
    temp = max(temp, kinds["gradients"] + kinds["table_gradients"] + kinds["gathered_tables"]
               + kinds["whole_gradients"])
    args = kinds["parameters"] + kinds["optimizer_state"]
    return {"by_kind": kinds, "argument_bytes": args, "temp_bytes": temp,
            "needed_bytes": args + temp, "host_bytes": kinds.pop("host_activations")}
