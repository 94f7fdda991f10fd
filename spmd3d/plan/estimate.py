"""The analytic side of the planner: what a plan's step needs per device, by arithmetic alone.

No tracing, no compiling, no devices: shapes come from the config, shardings from the plan's
rules tables, so a layout of 16,384 devices is estimated in about a millisecond and a search
can try tens of thousands. `memory.py` counts the bytes (its docstring itemises them); here
are FLOPs, the collectives per mesh axis, the step time and MFU (`footprint.py`: the compiled
side; `plan --compile` prints both)."""

from __future__ import annotations

import math

from .. import moe, offload, ring, ulysses, vocab
from ..mesh import DATA, EXPERT, REPLICATE, SEQ, STAGE, TENSOR
from ..sharding import mesh_axes
from ..units import gb
from . import quirks, tables
from .memory import (F32, Widths, _keys_per_query, itemsize, memory, param_shapes, shard_size,
                     state_bytes, untrained)
from .quirks import applies


# extra forward passes of the layers' matmuls the backward redoes, per remat policy
RECOMPUTE = {"none": 0, "save_dots": 0, "full": 1, "stage": 2}


def recomputes_as(policy: str) -> str:
    """The policy whose forwards `policy` redoes: an offloading one's device twin."""
    return offload.RECOMPUTES_AS.get(policy, policy)


def redone(plan) -> int:
    """Forwards of the layers the backward redoes: the remat policy's, and a circular GPipe's
    stage checkpoint (`Schedule.recomputes_stage`) one more, unless stage remat counts it."""
    s, remat = plan.schedule, recomputes_as(plan.cfg.parallel.remat)
    return RECOMPUTE[remat] + (s is not None and s.recomputes_stage and remat != "stage")


def flops(plan) -> dict:
    """FLOPs per step per device: `model` (MFU's count: 6 N per token plus causal attention
    counted half, `metrics.flops_per_token`) and what runs, split in `matmul` and `attention`:
    with what remat recomputes (also apart, `recompute_*`), the score blocks the kernel
    computes, and the bubble ticks a lockstep pipeline computes on padding (`bubble_*`)."""
    from ..metrics import flops_per_token, matmul_params

    cfg, s, n = plan.cfg, plan.schedule, plan.num_devices
    m, t, remat = cfg.model, cfg.train.seq_len, recomputes_as(cfg.parallel.remat)
    tokens = cfg.train.global_batch * t / n
    keys = (0.5 * t if plan.attention_local in ("cudnn", "pallas", "ring", "gather")
            else _keys_per_query(plan))
    # per token, one forward of the layers (the stack's and MTP's; the dense ones': `head`)
    matmul_fwd, depths = 2 * (m.stacked_layers + m.mtp_layers) * m.active_layer_params, m.mtp_layers
    attention_fwd = 2 * (m.num_layers + depths) * m.num_heads * (m.dim_per_head + m.value_dim) * keys
    redo = redone(plan)  # save_dots keeps the matmuls' results, not the scores
    redo_attention = redo + (1 if remat == "save_dots" else 0)
    stretch = s.flops_ratio if s is not None else 1.0  # lockstep: all compute, ZB-H1's idle not
    layers_m, layers_a = matmul_fwd * (3 + redo) * stretch, attention_fwd * (3 + redo_attention) * stretch
    head = 6 * (matmul_params(m) - m.stacked_layers * m.active_layer_params  # + MTP's heads
                + depths * (m.d_model * m.vocab_size + 2 * m.d_model ** 2))  # and projections
    return {"model": flops_per_token(m, t) * tokens, "matmul": (layers_m + head) * tokens,
            "attention": layers_a * tokens,
            "recompute_matmul": matmul_fwd * redo * stretch * tokens,
            "recompute_attention": attention_fwd * redo_attention * stretch * tokens,
            "bubble_matmul": layers_m * (1 - 1 / stretch) * tokens,
            "bubble_attention": layers_a * (1 - 1 / stretch) * tokens}


def _crosses_nodes(plan) -> dict:
    """{mesh axis: whether its groups span nodes} on the plan's topology."""
    from ..mesh import axis_names, split_over_hosts

    topo, sizes = plan.topology, dict(plan.mesh.shape)
    total, names = plan.num_devices, axis_names(sizes)
    if total <= topo.devices_per_node or total % topo.devices_per_node:
        return {a: False for a in names}
    _, outer = split_over_hosts(sizes, topo.devices_per_node, total // topo.devices_per_node,
                                True, plan.cfg.mesh.inside)
    return {a: o > 1 for a, o in zip(names, outer)}


# a ring algorithm's bytes sent per device, per byte counted (k: the devices of the group)
_SENT = {"reduce": lambda k: 2 * (k - 1) / k, "reduce-scatter": lambda k: (k - 1) / k,
         "gather": lambda k: (k - 1) / k, "all-to-all": lambda k: (k - 1) / k,
         "permute": lambda k: 1.0}


def transfers(plan) -> list[tuple[str, str, tuple, float]]:
    """Every collective of the plan's step as (what, kind, mesh axes, bytes per device per
    step), counted as `hlo.bytes_per_axis` counts the compiled ones (a reduction by the bytes
    it reduces, a gather by those it gathers, a permute or all-to-all by those it moves): the
    HLO of `tests/test_estimate.py`'s layouts, with its dtypes, reuses and quirks."""
    cfg, s, mesh = plan.cfg, plan.schedule, dict(plan.mesh.shape)
    m, par, rules = cfg.model, cfg.parallel, plan.rules
    deg = plan.degrees
    d, p, t, q = deg.batch, deg.stage, deg.tensor, deg.seq
    # the batch's axes (`expert`: under expert parallelism; `replicate`: HSDP's copies), and
    # the ZeRO group's, which ZeRO shards over
    batch, group = (REPLICATE, DATA, EXPERT), (DATA, EXPERT)
    c, w, n = itemsize(m.dtype), Widths.of(plan), plan.tokens_per_microbatch
    pb, sp = itemsize(m.param_dtype), par.sequence_parallel and t > 1
    remat = "full" if par.remat == "stage" else recomputes_as(par.remat)  # per layer
    micro = plan.microbatches
    chunk = plan.layers_per_chunk
    rows_split = batch + ((STAGE,) if s else ())  # what splits the embedding's rows
    tokens = cfg.train.global_batch * cfg.train.seq_len // (d * q * (p if s else 1))
    items = []

    def add(what, kind, axes, nbytes, times=1):
        axes = tuple(a for a in axes if mesh.get(a, 1) > 1)
        if axes and nbytes and times:
            items.append((what, kind, axes, float(nbytes) * times))

    # layer passes a device runs: forward and backward (lockstep, bubbles included; MTP's too)
    if s is None:
        fwd = bwd = micro * (plan.layers_per_stage + m.mtp_layers)
    else:
        fwd = bwd = s.forwards * chunk
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
    experts_auto = m.is_moe and s is not None and t > 1
    add("layers' activations", "reduce-scatter" if sp else "reduce", (TENSOR,), act,
        (fwd + restage) * f + bwd * (f + again) - (fwd + bwd) * experts_auto)
    # the vocabulary's lookup and head (`vocab.traffic`); 1F1B and ZB-H1 run the head in
    # each steady tick, under a conditional
    head_tokens = n * s.head_runs if s is not None and s.head_inside else tokens
    for what, kind, nbytes in vocab.traffic(m.d_model, tokens, head_tokens, pb, c, sp):
        add(what, kind, (TENSOR,), nbytes, 1 + m.mtp_layers)  # each MTP depth's lookup, head
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
        again = fwd * (redone(plan) + (remat == "save_dots"))
        for what, kind, nbytes in ulysses.traffic(q, n * heads * c, n * w.kv * c,
                                                  fwd + restage, again, bwd,
                                                  n * 4 if plan.eot is not None else 0):
            add(what, kind, (SEQ,), nbytes)
    elif plan.attention in ("ring", "gather"):
        for what, kind, nbytes in ring.traffic(q, plan.attention == "gather", n * w.kv * c,
                                               n * w.kv * F32, fwd, restage,
                                               fwd * redone(plan), bwd, inlined):
            add(what, kind, (SEQ,), nbytes)

    # stage: what the schedule's table moves between neighbours (`Schedule.shifts`)
    if s is not None:
        res = act / (t if sp else 1)
        moves = s.shifts()
        if s.mode != "autodiff" and inlined:  # one-slot phases' unused last shifts dropped
            moves -= (s.mode == "lockstep" and s.repeats * s.stages == 2) + (s.stages == 2)
        add("pipeline shifts", "permute", (STAGE,), res, moves)

    # gradients: reduced over what splits the tokens (data, seq; the embedding and head also
    # over stage, their rows split over it), once per accumulated microbatch (a pipeline's
    # step is one). Layers in the compute dtype (the cast before each matmul), or fp32
    # in a pipeline (the shard_map sums its fp32 weights' cotangent); the embedding in fp32;
    # the head in fp32 (summed inside the loss's or the schedule's shard_map: `manual.vary`)
    shapes = param_shapes(m, len(plan.layer_order))
    skip = untrained(m, len(plan.layer_order))
    sharded = rules.grads_over_batch and deg.zero > 1
    times = plan.accum_steps if applies("reduce_inside_accumulation") else 1

    def size(keys, table):
        return sum(shard_size(*shapes[k], table, mesh) for k in keys)

    blocks = [k for k in shapes if k.startswith(("blocks/", "mtp/"))]  # MTP's as a layer's
    experts = [k for k in blocks if "experts" in shapes[k][1]]  # split over `expert` already
    fp32 = [k for k in blocks if "norm" in k or k.endswith("router") or k in skip]
    # (the experts' weights in fp32 everywhere: their shard_map sums them over the token axes,
    # `manual.vary`)
    # (HSDP: sharded gradients reduce-scattered inside a ZeRO group, then their shard reduced
    # across the groups; unsharded ones reduced over every batch axis at once)
    for keys, axes in (([k for k in blocks if k not in experts], group),
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
    add("head gradient", "reduce", rows_split + (SEQ,),  # (each MTP depth's use apart)
        size(["head"], rules.compute) * F32 + m.d_model * F32, times * (1 + m.mtp_layers))
    embed = size(["embed"], rules.compute) * F32
    # the lookup in slices of D (`vocab.embed_lookup`): HSDP's, and a pipeline's over `stage`
    split = tuple(a for a in mesh_axes(rules.grads["embed"]) if a in rows_split and mesh[a] > 1)
    k = math.prod(mesh[a] for a in split)
    if t == 1 and split and (sharded and deg.replicate > 1 or STAGE in split):
        add("embedding ids", "gather", split, tokens * k * 4)
        add("embedding rows", "all-to-all", split, tokens * m.d_model * pb, 2)
        add("embedding gradient", "reduce",
            tuple(a for a in rows_split if a not in split) + (SEQ,), embed / k, times)
    elif sharded and t == 1 and applies("lookup_moves_cotangents"):
        add("embedding cotangents", "all-to-all", batch, n * m.d_model * F32,
            plan.accum_steps)
        add("embedding ids", "gather", batch, n * d * 4, plan.accum_steps)
        add("embedding gradient", "reduce",
            tuple(a for a in rows_split if a not in batch) + (SEQ,), embed, times)
    else:
        add("embedding gradient", "reduce", rows_split + (SEQ,), embed, times * (1 + m.mtp_layers))

    # parameters gathered over data: ZeRO-1/2 once, after the update, as stored; ZeRO-3 the
    # layers before each use (forward, backward; a recompute reuses the backward's; the experts'
    # gather, in their shard_map, autodiff keeps for the backward unless it recomputes), cast
    # to the compute dtype first (`sharding.use_param`), the embedding (as stored) and head once;
    # with a pipeline the stage's layers as stored, once per step (or per tick)
    state = state_bytes(plan)
    if rules.opt["embed"] is not None and not rules.params_over_batch:
        held = size(experts, rules.params) * pb  # the experts': over their replicas only
        add("updated parameters", "gather", group, state["parameters"] - held)
        add("updated experts", "gather", (DATA,), held)
    if rules.params_over_batch:
        uses = (1 if s is not None and par.zero3_gather == "step" else
                3 * s.ticks if s is not None else 2 * plan.accum_steps)
        g = pb if s is not None else c
        dense = [k for k in blocks if k not in experts and k not in skip]
        add("layers gathered (ZeRO-3)", "gather", group, size(dense, rules.compute) * g, uses)
        add("experts gathered (ZeRO-3)", "gather", (DATA,), size(experts, rules.compute) * g,
            uses if s is not None or par.remat != "none" else uses // 2)
        add("embedding and head gathered (ZeRO-3)", "gather", group,  # per MTP depth again
            size(["embed", "final_norm/scale"], rules.compute) * pb
            + size(["head"], rules.compute) * g, 1 + m.mtp_layers)
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


def step_time(plan, flop: dict | None = None, comm: dict | None = None) -> dict:
    """Predicted seconds per step: compute at the topology's achieved share of peak, plus
    each axis's communication over its links (intra- or inter-node), hidden behind compute on
    the topology's `overlapped` axes; ZB-H1's idle slots added. MFU against that time. What
    the step loses, apart: `bubble_s` (a pipeline's idle or padded ticks), `recompute_s`
    (remat's repeated forwards) and `exposed_comm_s`."""
    topo = plan.topology
    flop, comm = flop or flops(plan), comm or collectives(plan)
    # FP8 projections at float8's peak (the head's matmul counted with them); attention's
    # products stay in the compute dtype
    peak, attention_peak = topo.peak_flops(plan.peak_dtype), topo.peak_flops(plan.cfg.model.dtype)

    def seconds(kind):
        return (flop[f"{kind}matmul"] / (peak * topo.matmul_efficiency)
                + flop[f"{kind}attention"] / (attention_peak * topo.attention_efficiency))

    compute, bubble = seconds(""), seconds("bubble_")
    s = plan.schedule
    if s is not None and s.mode == "switch":  # its idle slots, in time
        bubble = compute * s.bubble / (1 - s.bubble)
        compute += bubble
    crosses = _crosses_nodes(plan)
    links = {a: (topo.inter_node_gbps if crosses[a] else topo.intra_node_gbps) * 1e9
             * topo.link_efficiency for a in comm["sent"]}
    times = {a: comm["sent"][a] / links[a] for a in comm["sent"]}
    exposed = sum(t for a, t in times.items() if a not in topo.overlapped)
    hidden = sum(t for a, t in times.items() if a in topo.overlapped)
    host = offload_time(plan, compute)
    total = compute + exposed + max(0.0, hidden - compute) + host["exposed_s"]
    return {"compute_s": compute, "bubble_s": bubble, "recompute_s": seconds("recompute_"),
            "comm_s": times, "exposed_comm_s": total - compute - host["exposed_s"],
            "host": host, "step_s": total, "mfu": flop["model"] / (total * peak)}


def offload_time(plan, compute_s: float) -> dict:
    """An offloading remat policy's copies a step over the device's host link
    (`offload.copies`): every microbatch's layers' host residuals (`residuals.py`)."""
    from . import residuals
    par, deg = plan.cfg.parallel, plan.degrees
    split = deg.tensor if par.sequence_parallel else 1
    kept = par.remat in offload.RECOMPUTES_AS
    per_token = residuals.of(plan).on_host(par.remat, split) if kept else 0.0
    tokens = plan.cfg.train.global_batch * plan.cfg.train.seq_len / deg.batch / deg.seq
    return offload.copies(per_token * plan.layers_per_stage * tokens,
                          plan.topology.host_gbps * plan.topology.link_efficiency, compute_s,
                          redone(plan))


def estimate(plan) -> dict:
    """Everything above for one plan, as the report's record."""
    f, comm = flops(plan), collectives(plan)
    return {"memory": memory(plan), "flops": f, "collectives": comm,
            "time": step_time(plan, f, comm),
            "bubble": plan.schedule.bubble if plan.schedule else 0.0}


def _versus_compiled(e: dict, compiled: dict, axis: str) -> str:
    """The compiled step's bytes over `axis` beside the analytic, where comparable (the
    compiled `data` axis is the real one unless XLA:CPU's device limit cut it)."""
    got = compiled.get("collective_bytes_per_axis", {}).get(axis)
    if not got or (axis == DATA and compiled.get("data_cut", 1) > 1):
        return ""
    return f" [compiled {got / 1e9:.2f} GB, {e['collectives']['result'][axis] / got:.3f}]"


def _host_lines(mem: dict, host: dict, topo, compiled: dict | None) -> list[str]:
    """An offloading policy's host memory and its copies against the compute; beside a
    compiled step from XLA:CPU, where host and device are one memory and the copies are
    compiled away, the device bytes and the host's together against its needed bytes."""
    if not mem["host_bytes"]:
        return []
    hides = host["exposed_s"] == 0
    line = (f"  host        {gb(mem['host_bytes']):>8}   offloaded residuals; copies "
            f"{host['copy_s']:.3f} s each way a step over {topo.host_gbps:g} GB/s against "
            f"{host['forward_s']:.3f} s of forward: "
            + ("hidden behind compute" if hides else f"{host['exposed_s']:.3f} s exposed"))
    if compiled is None or compiled.get("platform", "cpu") != "cpu":
        return [line]
    both = mem["needed_bytes"] + mem["host_bytes"]
    return [line, f"  device+host {gb(both):>8}   compiled {gb(compiled['needed_bytes'])} "
                  f"(analytic/compiled {both / compiled['needed_bytes']:.3f}; XLA:CPU keeps "
                  "offloaded values in its one memory)"]


def format_estimate(e: dict, plan, compiled: dict | None = None) -> list[str]:
    """The estimate as the report's lines; given `footprint.measure`'s record, only the lines
    that have compiled figures (memory, collectives), those beside the analytic ones with their
    ratio."""
    mem, k, t = e["memory"], e["memory"]["by_kind"], e["time"]
    topo = plan.topology

    def versus(analytic, key):
        if compiled is None:
            return ""
        got = compiled["compiled"][key]
        return f"   compiled {gb(got)} (analytic/compiled {analytic / got:.3f})"

    lines = [
        "analytic, per device (GB)",
        f"  arguments   {gb(mem['argument_bytes']):>8}   parameters {gb(k['parameters'])}, "
        f"optimizer state {gb(k['optimizer_state'])}" + versus(mem["argument_bytes"], "argument_bytes"),
        f"  temporaries {gb(mem['temp_bytes']):>8}   gradients {gb(k['gradients'])}, saved "
        f"activations {gb(k['saved_activations'])}, one layer's backward "
        f"{gb(k['layer_working'] + k['layer_weights'])}, logits/loss {gb(k['logits_loss'])}, pipeline buffers "
        f"{gb(k['pipeline_buffers'])}"
        + (f", a microbatch's experts' gradients {gb(k['expert_gradients'])}"
           if k["expert_gradients"] else "")
        + (f", a microbatch's gradients reduced whole {gb(k['whole_gradients'])}"
           if k["whole_gradients"] else "") + versus(mem["temp_bytes"], "temp_bytes"),
        f"  needed      {gb(mem['needed_bytes']):>8}   of {topo.device_memory_gb:g} on "
        f"{topo.name}" + ("" if compiled is None else
                          f"   compiled {gb(compiled['needed_bytes'])} (analytic/compiled "
                          f"{mem['needed_bytes'] / compiled['needed_bytes']:.3f})"),
        *_host_lines(mem, t["host"], topo, compiled),
        *(["  (layers unrolled: XLA's schedule of unrolled layers keeps more than remat's "
           "arithmetic: docs/choices.md)"]
          if not plan.cfg.parallel.scan_layers and plan.cfg.parallel.remat != "none" else []),
        "analytic, per step per device",
        f"  FLOPs       {e['flops']['model'] / 1e12:,.1f} T model, "
        f"{(e['flops']['matmul'] + e['flops']['attention']) / 1e12:,.1f} T executed "
        f"(recompute, bubble ticks); bubble {e['bubble']:.1%}",
        "  collectives " + ", ".join(
            f"{a} {e['collectives']['result'][a] / 1e9:.2f} GB ({t['comm_s'][a]:.3f} s"
            f"{', hidden' if a in topo.overlapped else ''})"
            + ("" if compiled is None else _versus_compiled(e, compiled, a))
            for a in e["collectives"]["result"] if e["collectives"]["result"][a]),
        f"  step time   {t['step_s']:.3f} s: compute {t['compute_s']:.3f} s, exposed "
        f"communication {t['exposed_comm_s']:.3f} s; MFU {t['mfu']:.1%} (assumes "
        f"{topo.matmul_efficiency:.0%} of peak in matmuls, {topo.attention_efficiency:.0%} in "
        f"attention, {topo.link_efficiency:.0%} of link bandwidth)",
    ]
    if compiled is not None:  # FLOPs and time have no compiled counterpart here
        lines = [x for x in lines if not x.startswith(("  FLOPs", "  step time"))]
    import jax

    return lines + ([quirks.stale(jax.__version__)] if quirks.stale(jax.__version__) else [])
