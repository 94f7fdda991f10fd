"""What crosses each mesh axis in a plan's step, by arithmetic: every collective as (what,
kind, mesh axes, bytes per device per step), counted as `hlo.bytes_per_axis` counts the
compiled ones (a reduction by the bytes it reduces, a gather by those it gathers, a permute or
all-to-all by those it moves): the HLO of `tests/test_estimate.py`'s layouts, with its dtypes,
reuses and quirks.

Each feature states its own share beside its code: the vocabulary's lookup and head
(`vocab.traffic`), the weights outside a pipeline (`tables.traffic`), an MoE layer's dispatch
and sums (`moe.traffic`), the ring (`ring.traffic`), Ulysses (`ulysses.traffic`) and a
schedule's shifts (`Schedule.shifts`). Here: the layers' activations over `tensor`, the
gradients' reductions and ZeRO's gathers, and their sum per axis (`collectives`)."""

from __future__ import annotations

import math

from .. import moe, offload, ring, ulysses, vocab
from ..mesh import DATA, EXPERT, REPLICATE, SEQ, STAGE, TENSOR
from ..sharding import mesh_axes
from . import tables
from .inventory import F32, itemsize, param_shapes, shard_size, state_bytes, untrained
from .memory import Widths
from .quirks import applies

# extra forward passes of the layers' matmuls the backward redoes, per remat policy
RECOMPUTE = {"none": 0, "save_dots": 0, "full": 1, "stage": 2}
# the batch's axes (`expert`: under expert parallelism; `replicate`: HSDP's copies), and the
# ZeRO group's, which ZeRO shards over
BATCH, GROUP = (REPLICATE, DATA, EXPERT), (DATA, EXPERT)
# a ring algorithm's bytes sent per device, per byte counted (k: the devices of the group)
_SENT = {"reduce": lambda k: 2 * (k - 1) / k, "reduce-scatter": lambda k: (k - 1) / k,
         "gather": lambda k: (k - 1) / k, "all-to-all": lambda k: (k - 1) / k,
         "permute": lambda k: 1.0}


def recomputes_as(policy: str) -> str:
    """The policy whose forwards `policy` redoes: an offloading one's device twin."""
    return offload.RECOMPUTES_AS.get(policy, policy)


def redone(plan) -> int:
    """Forwards of the layers the backward redoes: the remat policy's, and a circular GPipe's
    stage checkpoint (`Schedule.recomputes_stage`) one more, unless stage remat counts it."""
    s, remat = plan.schedule, recomputes_as(plan.cfg.parallel.remat)
    return RECOMPUTE[remat] + (s is not None and s.recomputes_stage and remat != "stage")


def _tokens(plan) -> int:
    """Tokens a device embeds and scores in a step (a pipeline's stages take a share each)."""
    train, deg = plan.cfg.train, plan.degrees
    return train.global_batch * train.seq_len // (
        deg.batch * deg.seq * (deg.stage if plan.schedule else 1))


def _head_passes(plan) -> int:
    """Microbatches a device runs the head on in a step: 1F1B and ZB-H1 run it in each steady
    tick, under a conditional (`Schedule.head_runs`); else its tokens (`_tokens`) at once, or
    after GPipe's pipeline multi-token prediction's depths one slot at a time."""
    s = plan.schedule
    if s is not None and s.head_inside:
        return s.head_runs
    return _tokens(plan) // plan.tokens_per_microbatch


def _activations(plan, add) -> None:
    """The activations' collectives: over `tensor` per layer pass, the vocabulary's ends and
    the weights outside a pipeline, an MoE layer's, the sequence's, the pipeline's shifts."""
    cfg, s, deg = plan.cfg, plan.schedule, plan.degrees
    m, par, t, q = cfg.model, cfg.parallel, deg.tensor, deg.seq
    c, w, n = itemsize(m.dtype), Widths.of(plan), plan.tokens_per_microbatch
    pb, sp = itemsize(m.param_dtype), par.sequence_parallel and t > 1
    remat = "full" if par.remat == "stage" else recomputes_as(par.remat)  # per layer
    # layer passes a device runs: forward and backward (lockstep, bubbles included; MTP's too)
    if s is None:
        fwd = bwd = plan.microbatches * (plan.layers_per_stage + m.mtp_layers)
    else:  # MTP's depths with the head: on the last stage per microbatch, or per slot
        fwd = bwd = s.forwards * plan.layers_per_chunk + m.mtp_layers * _head_passes(plan)
    # whole-stage recomputes: stage remat, and circular GPipe's stage checkpoint
    restage = bwd * (redone(plan) - (1 if remat == "full" else 0))

    # tensor: per layer two row-parallel outputs reduced and two input gradients (under SP each
    # a gather and a reduce-scatter: four and four); full remat's recompute skips the layer's
    # last reduction (its output is not needed), save_dots under SP gathers the norms' again
    act = n * m.d_model * c
    f = 4 if sp else 2
    again = {"none": 0, "save_dots": f - 2, "full": f - 1}[remat]
    # (as sent: an all-reduce is a reduce-scatter and a gather, so SP's four cost its two)
    # (an MoE layer in a pipeline reduces its experts' sums instead of the MLP's: below)
    # (an entry of the stack is `moe_every` layers: k - 1 dense ones, then an MoE one)
    experts_auto, k = m.is_moe and s is not None and t > 1, m.moe_every
    add("layers' activations", "reduce-scatter" if sp else "reduce", (TENSOR,), act,
        k * ((fwd + restage) * f + bwd * (f + again)) - (fwd + bwd) * experts_auto)
    # the vocabulary's lookup and head (`vocab.traffic`); 1F1B and ZB-H1 run the head in
    # each steady tick, under a conditional
    head_tokens = n * _head_passes(plan)
    for what, kind, nbytes in vocab.traffic(m.d_model, _tokens(plan), head_tokens, pb, c, sp):
        add(what, kind, (TENSOR,), nbytes)
    for what, kind, nbytes in vocab.traffic(m.d_model, head_tokens, head_tokens, pb, c, sp):
        add(what, kind, (TENSOR,), nbytes, m.mtp_layers)  # each MTP depth's, where the head is
    for what, kind, axes, nbytes in tables.traffic(plan, act, f, again):  # outside a pipeline
        add(what, kind, axes, nbytes)

    # an MoE layer's sums over `tensor` and its dispatch over `expert` (`moe.traffic`)
    if m.is_moe:
        how = "auto" if experts_auto else "manual" if s is None and t > 1 else ""
        for what, kind, axis, nbytes in moe.traffic(m, deg.expert, how, n, c, fwd, restage,
                                                    bwd, remat != "none"):
            add(what, kind, (axis,), nbytes)

    # seq: what the ring (or ZB-H1's gather) moves (`ring.traffic`), or Ulysses
    # (`ulysses.traffic`)
    inlined = applies("one_trip_loops_inlined")
    if plan.attention == "ulysses":  # recomputed as attention is: save_dots keeps matmuls only
        heads = m.num_heads / t * (m.dim_per_head + m.value_dim) / 2  # q and the output
        again = k * fwd * (redone(plan) + (remat == "save_dots"))
        for what, kind, nbytes in ulysses.traffic(q, n * heads * c, n * w.kv * c,
                                                  k * (fwd + restage), again, k * bwd,
                                                  n * 4 if plan.eot is not None else 0):
            add(what, kind, (SEQ,), nbytes)
    elif plan.attention in ("ring", "gather"):
        for what, kind, nbytes in ring.traffic(q, plan.attention == "gather", n * w.kv * c,
                                               n * w.kv * F32, k * fwd, k * restage,
                                               k * fwd * redone(plan), k * bwd, inlined):
            add(what, kind, (SEQ,), nbytes)

    # stage: what the schedule's table moves between neighbours (`Schedule.shifts`)
    if s is not None:
        res = act / (t if sp else 1)
        moves = s.shifts()
        if s.mode != "autodiff" and inlined:  # one-slot phases' unused last shifts dropped
            moves -= (s.mode == "lockstep" and s.repeats * s.stages == 2) + (s.stages == 2)
        add("pipeline shifts", "permute", (STAGE,), res, moves)


def _weights(plan):
    """(size(keys, table): elements of a device's shard of those parameters, the stack's keys
    (MTP's counted as a layer's), the experts' among them, the untrained ones)."""
    m, mesh = plan.cfg.model, dict(plan.mesh.shape)
    shapes = param_shapes(m, len(plan.layer_order))

    def size(keys, table):
        return sum(shard_size(*shapes[k], table, mesh) for k in keys)

    blocks = [k for k in shapes if k.startswith(("blocks/", "mtp/"))]
    experts = [k for k in blocks if "experts" in shapes[k][1]]  # split over `expert` already
    return size, blocks, experts, untrained(m, len(plan.layer_order))


def _gradients(plan, add) -> None:
    """The gradients: reduced over what splits the tokens (data, seq; the embedding and head
    also over stage, their rows split over it), once per accumulated microbatch (a pipeline's
    step is one). Layers in the compute dtype (the cast before each matmul), or fp32 in a
    pipeline (the shard_map sums its fp32 weights' cotangent); the embedding in fp32; the head
    in fp32 (summed inside the loss's or the schedule's shard_map: `manual.vary`)."""
    cfg, s, deg, mesh, rules = plan.cfg, plan.schedule, plan.degrees, dict(plan.mesh.shape), \
        plan.rules
    m, c, pb, n = cfg.model, itemsize(cfg.model.dtype), itemsize(cfg.model.param_dtype), \
        plan.tokens_per_microbatch
    size, blocks, experts, skip = _weights(plan)
    rows_split = BATCH + ((STAGE,) if s else ())  # what splits the embedding's rows
    sharded = rules.grads_over_batch and deg.zero > 1
    times = plan.accum_steps if applies("reduce_inside_accumulation") else 1
    fp32 = [k for k in blocks if "norm" in k or k.endswith("router") or k in skip]
    # (the experts' weights in fp32 everywhere: their shard_map sums them over the token axes,
    # `manual.vary`)
    # (HSDP: sharded gradients reduce-scattered inside a ZeRO group, then their shard reduced
    # across the groups; unsharded ones reduced over every batch axis at once)
    for keys, axes in (([k for k in blocks if k not in experts], GROUP),
                       (experts, (DATA,))):
        layer_bytes = (size([k for k in keys if k not in fp32], rules.compute)
                       * (F32 if s or keys is experts else c)
                       + size([k for k in keys if k in fp32], rules.compute) * F32)
        shard = math.prod(mesh.get(a, 1) for a in axes) if sharded else 1
        apart = sharded and s is None  # (a pipeline's shard_map sums over every axis at once)
        add("layer gradients", "reduce-scatter" if sharded else "reduce",
            axes if apart else axes + (REPLICATE,), layer_bytes, times)
        if apart:
            add("layer gradients' shards", "reduce", (REPLICATE,), layer_bytes / shard, times)
        # over seq after data when the gradients are sharded: the data shard only (a
        # pipeline's shard_map sums the stage's whole gradient over data and seq at once)
        add("layer gradients", "reduce", (SEQ,),
            layer_bytes / (shard if s is None else 1), times)
    # (each MTP depth's use apart, but in 1F1B's and ZB-H1's head, which sums them together)
    add("head gradient", "reduce", rows_split + (SEQ,),
        size(["head"], rules.compute) * F32 + m.d_model * F32,
        times * (1 + m.mtp_layers * (s is None or not s.head_inside)))
    if s is not None:  # MTP's depths beside the head: their fp32 gradient summed over stage too
        add("depths' gradients", "reduce", (STAGE,),
            size([k for k in blocks if k.startswith("mtp/")], rules.compute) * F32)
    embed = size(["embed"], rules.compute) * F32
    # the lookup in slices of D (`vocab.embed_lookup`): HSDP's, and a pipeline's over `stage`
    split = tuple(a for a in mesh_axes(rules.grads["embed"]) if a in rows_split and mesh[a] > 1)
    k, tokens = math.prod(mesh[a] for a in split), _tokens(plan)
    if deg.tensor == 1 and split and (sharded and deg.replicate > 1 or STAGE in split):
        add("embedding ids", "gather", split, tokens * k * 4)
        add("embedding rows", "all-to-all", split, tokens * m.d_model * pb, 2)
        add("embedding gradient", "reduce",
            tuple(a for a in rows_split if a not in split) + (SEQ,), embed / k, times)
    elif sharded and deg.tensor == 1 and applies("lookup_moves_cotangents"):
        add("embedding cotangents", "all-to-all", BATCH, n * m.d_model * F32,
            plan.accum_steps)
        add("embedding ids", "gather", BATCH, n * deg.batch * 4, plan.accum_steps)
        add("embedding gradient", "reduce",
            tuple(a for a in rows_split if a not in BATCH) + (SEQ,), embed, times)
    else:
        add("embedding gradient", "reduce", rows_split + (SEQ,), embed, times * (1 + m.mtp_layers))


def _gathers(plan, add) -> None:
    """Parameters gathered over data: ZeRO-1/2 once, after the update, as stored; ZeRO-3 the
    layers before each use (forward, backward; a recompute reuses the backward's), the experts
    too (their grouped matmul keeps them as given, `grouped.matmul`), cast to
    the compute dtype first (`sharding.use_param`), the embedding (as stored) and head once;
    with a pipeline the stage's layers as stored, once per step (or per tick)."""
    s, rules, par, m = plan.schedule, plan.rules, plan.cfg.parallel, plan.cfg.model
    c, pb = itemsize(m.dtype), itemsize(m.param_dtype)
    size, blocks, experts, skip = _weights(plan)
    if rules.opt["embed"] is not None and not rules.params_over_batch:
        held = size(experts, rules.params) * pb  # the experts': over their replicas only
        add("updated parameters", "gather", GROUP, state_bytes(plan)["parameters"] - held)
        add("updated experts", "gather", (DATA,), held)
    if rules.params_over_batch:
        uses = (1 if s is not None and par.zero3_gather == "step" else
                3 * s.ticks if s is not None else 2 * plan.accum_steps)
        g = pb if s is not None else c
        dense = [k for k in blocks if k not in experts and k not in skip]
        add("layers gathered (ZeRO-3)", "gather", GROUP, size(dense, rules.compute) * g, uses)
        add("experts gathered (ZeRO-3)", "gather", (DATA,), size(experts, rules.compute) * g,
            uses)
        add("embedding and head gathered (ZeRO-3)", "gather", GROUP,  # per MTP depth again
            size(["embed", "final_norm/scale"], rules.compute) * pb
            + size(["head"], rules.compute) * g, 1 + m.mtp_layers)


def transfers(plan) -> list[tuple[str, str, tuple, float]]:
    """Every collective of the plan's step as (what, kind, mesh axes, bytes per device per
    step): the activations', the gradients' and ZeRO's gathers; an axis of size 1 moves
    nothing."""
    mesh, items = dict(plan.mesh.shape), []

    def add(what, kind, axes, nbytes, times=1):
        axes = tuple(a for a in axes if mesh.get(a, 1) > 1)
        if axes and nbytes and times:
            items.append((what, kind, axes, float(nbytes) * times))

    for part in (_activations, _gradients, _gathers):
        part(plan, add)
    return items


def collectives(plan) -> dict:
    """{"result": {mesh axis: bytes per device per step}, counted as `transfers` counts them
    (an operation over several axes counts on each), "sent": {mesh axis: bytes each device
    sends} (ring algorithms: a reduction 2 S (n-1)/n, a reduce-scatter, gather or all-to-all
    S (n-1)/n, a permute S), which is what takes time, and "items": `transfers`}."""
    mesh = dict(plan.mesh.shape)
    items = transfers(plan)
    result, sent = {a: 0.0 for a in mesh}, {a: 0.0 for a in mesh}
    for _, kind, axes, nbytes in items:
        for a in axes:
            result[a] += nbytes
            sent[a] += nbytes * _SENT[kind](mesh[a])
    return {"result": result, "sent": sent, "items": items}
