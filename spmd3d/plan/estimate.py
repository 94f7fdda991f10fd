"""The analytic side of the planner: what a plan's step needs per device, by arithmetic alone.

No tracing, no compiling, no devices: shapes come from the config, shardings from the plan's
rules tables, so a layout of 16,384 devices is estimated in about a millisecond and a search
can try tens of thousands. `memory.py` counts the bytes (its docstring itemises them); here
are FLOPs, the collectives per mesh axis, the step time and MFU. `footprint.py` is the
compiled side; `plan --compile` prints both.
"""

from __future__ import annotations

from .memory import Widths, _keys_per_query, itemsize, memory, state_bytes, tokens_per_pass


# --------------------------------------------------------------------------------------------
# FLOPs, communication and step time

# extra forward passes of the layers' matmuls the backward redoes, per remat policy
RECOMPUTE = {"none": 0, "save_dots": 0, "full": 1, "stage": 2}


def redone(plan) -> int:
    """Forwards of the layers the backward redoes: the remat policy's, and a circular GPipe's
    stage checkpoint (`gpipe.run`) one more, unless stage remat already counts it."""
    s, remat = plan.schedule, plan.cfg.parallel.remat
    circular = s is not None and s.kind == "gpipe" and s.repeats > 1 and remat != "stage"
    return RECOMPUTE[remat] + circular


def flops(plan) -> dict:
    """FLOPs per step per device: `model` (MFU's count: 6 N per token plus causal attention
    counted half, `metrics.flops_per_token`) and what runs, split in `matmul` and `attention`:
    with what remat recomputes (also apart, `recompute_*`), the score blocks the kernel
    computes, and the bubble ticks a lockstep pipeline computes on padding (`bubble_*`)."""
    from ..metrics import flops_per_token, matmul_params

    cfg, s, n = plan.cfg, plan.schedule, plan.num_devices
    m, t, remat = cfg.model, cfg.train.seq_len, cfg.parallel.remat
    tokens = cfg.train.global_batch * t / n
    keys = 0.5 * t if plan.attention in ("cudnn", "ring") else _keys_per_query(plan)
    matmul_fwd = 2 * m.num_layers * m.layer_params  # per token, one forward of the layers
    attention_fwd = 4 * m.num_layers * m.num_heads * m.dim_per_head * keys
    redo = redone(plan)  # save_dots keeps the matmuls' results, not the scores
    redo_attention = redo + (1 if remat == "save_dots" else 0)
    # lockstep schedules: every stage computes at every tick; ZB-H1's idle slots compute nothing
    stretch = s.flops_ratio if s is not None and s.kind != "zb_h1" else 1.0
    layers_m, layers_a = matmul_fwd * (3 + redo) * stretch, attention_fwd * (3 + redo_attention) * stretch
    head = 6 * (matmul_params(m) - m.num_layers * m.layer_params)
    return {"model": flops_per_token(m, t) * tokens, "matmul": (layers_m + head) * tokens,
            "attention": layers_a * tokens,
            "recompute_matmul": matmul_fwd * redo * stretch * tokens,
            "recompute_attention": attention_fwd * redo_attention * stretch * tokens,
            "bubble_matmul": layers_m * (1 - 1 / stretch) * tokens,
            "bubble_attention": layers_a * (1 - 1 / stretch) * tokens}


def _crosses_nodes(plan) -> dict:
    """{mesh axis: whether its groups span nodes} on the plan's topology."""
    from ..mesh import AXES, split_over_hosts

    topo, sizes = plan.topology, dict(plan.mesh.shape)
    total = plan.num_devices
    if total <= topo.devices_per_node or total % topo.devices_per_node:
        return {a: False for a in AXES}
    _, outer = split_over_hosts(sizes, topo.devices_per_node, total // topo.devices_per_node,
                                True)
    return {a: o > 1 for a, o in zip(AXES, outer)}


def collectives(plan) -> dict:
    """{mesh axis: bytes per device per step} of the collectives' results, as the compiled
    HLO counts them (an all-reduce or all-gather of S bytes: S; a reduce-scatter: S / n)
    and {mesh axis: bytes each device sends}, which is what takes time (ring algorithms:
    an all-reduce sends 2 S (n-1)/n, a gather or scatter S (n-1)/n, a permute S)."""
    cfg, s, mesh = plan.cfg, plan.schedule, dict(plan.mesh.shape)
    m, par = cfg.model, cfg.parallel
    c, w, n = itemsize(m.dtype), Widths.of(plan), tokens_per_pass(plan)
    micro = s.microbatches if s else plan.accum_steps
    layers = len(plan.layer_order) // (s.stages if s else 1)
    forwards = 1 + redone(plan) + (1 if par.remat == "stage" and s is None else 0)
    ticks = (s.ticks if s.kind == "gpipe" else s.microbatches * s.repeats) if s else micro
    passes = ticks * (s.repeats if s and s.kind == "gpipe" else 1) if s else micro
    result, sent = {a: 0.0 for a in mesh}, {a: 0.0 for a in mesh}

    def add(axis, kind, nbytes, times=1):
        k = mesh[axis]
        if k == 1:
            return
        result[axis] += times * (nbytes / k if kind == "reduce-scatter" else nbytes)
        sent[axis] += times * nbytes * (2 if kind == "all-reduce" else 1) * (
            1 if kind == "permute" else (k - 1) / k)

    chunk_passes = passes * layers // (s.repeats if s else 1) if s else micro * layers
    # tensor: two row-parallel outputs reduced per layer forward, two input gradients per
    # backward (under SP a gather and a scatter each: the same traffic)
    act = c * m.d_model * n
    add("tensor", "all-reduce", act, 2 * (forwards + 1) * chunk_passes)
    add("tensor", "all-reduce", act, 2 * micro)  # the embedding's lookup, and its gradient
    # seq: the ring passes keys and values around in the forward, and with their gradients
    # (fp32) back in the backward
    kv = c * 2 * w.kv * n
    add("seq", "permute", kv * (mesh["seq"] - 1), (forwards + 3) * chunk_passes)
    # stage: each tick hands an activation ahead and a cotangent back
    if s is not None:
        add("stage", "permute", 2 * act / (mesh["tensor"] if par.sequence_parallel else 1),
            s.ticks)
    # data: the gradients reduced once per step (ZeRO-0/1; ZeRO-2/3 once per accumulated
    # microbatch), the updated parameters gathered back (ZeRO-1/2), the weights gathered per
    # use (ZeRO-3: each pass of each microbatch; with a pipeline once per step, or three
    # times per tick under `zero3_gather=tick`)
    state = state_bytes(plan)
    sharded = plan.rules.grads["embed"] is not None
    if sharded:
        add("data", "reduce-scatter", state["gradients"] * mesh["data"], plan.accum_steps)
    else:
        add("data", "all-reduce", state["gradients"])
    if plan.rules.opt["embed"] is not None and plan.rules.params["embed"] is None:
        add("data", "all-gather", state["parameters"])
    if plan.rules.params["embed"] is not None:
        weights = state["parameters"] * mesh["data"] * c // itemsize(m.param_dtype)
        gathers = ((forwards + 1) * plan.accum_steps if s is None else
                   1 if par.zero3_gather == "step" else 3 * s.ticks)
        add("data", "all-gather", weights, gathers)
    return {"result": result, "sent": sent}


def step_time(plan, flop: dict | None = None, comm: dict | None = None) -> dict:
    """Predicted seconds per step: compute at the topology's achieved share of peak, plus
    each axis's communication over its links (intra- or inter-node), hidden behind compute on
    the topology's `overlapped` axes; ZB-H1's idle slots added. MFU against that time. What
    the step loses, apart: `bubble_s` (a pipeline's idle or padded ticks), `recompute_s`
    (remat's repeated forwards) and `exposed_comm_s`."""
    topo = plan.topology
    flop, comm = flop or flops(plan), comm or collectives(plan)
    peak = topo.peak_flops(plan.cfg.model.dtype)

    def seconds(kind):
        return (flop[f"{kind}matmul"] / (peak * topo.matmul_efficiency)
                + flop[f"{kind}attention"] / (peak * topo.attention_efficiency))

    compute, bubble = seconds(""), seconds("bubble_")
    s = plan.schedule
    if s is not None and s.kind == "zb_h1":  # its idle slots, in time
        bubble = compute * s.bubble / (1 - s.bubble)
        compute += bubble
    crosses = _crosses_nodes(plan)
    links = {a: (topo.inter_node_gbps if crosses[a] else topo.intra_node_gbps) * 1e9
             * topo.link_efficiency for a in comm["sent"]}
    times = {a: comm["sent"][a] / links[a] for a in comm["sent"]}
    exposed = sum(t for a, t in times.items() if a not in topo.overlapped)
    hidden = sum(t for a, t in times.items() if a in topo.overlapped)
    total = compute + exposed + max(0.0, hidden - compute)
    return {"compute_s": compute, "bubble_s": bubble, "recompute_s": seconds("recompute_"),
            "comm_s": times, "exposed_comm_s": total - compute, "step_s": total,
            "mfu": flop["model"] / (total * peak)}


def estimate(plan) -> dict:
    """Everything above for one plan, as the report's record."""
    f, comm = flops(plan), collectives(plan)
    return {"memory": memory(plan), "flops": f, "collectives": comm,
            "time": step_time(plan, f, comm),
            "bubble": plan.schedule.bubble if plan.schedule else 0.0}


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def format_estimate(e: dict, plan, compiled: dict | None = None) -> list[str]:
    """The estimate as the report's lines; given `footprint.measure`'s record, the compiled
    figures beside the analytic ones with their ratio."""
    mem, k, t = e["memory"], e["memory"]["by_kind"], e["time"]
    topo = plan.topology

    def versus(analytic, key):
        if compiled is None:
            return ""
        got = compiled["compiled"][key]
        return f"   compiled {_gb(got)} (analytic/compiled {analytic / got:.3f})"

    lines = [
        "analytic, per device (GB)",
        f"  arguments   {_gb(mem['argument_bytes']):>8}   parameters {_gb(k['parameters'])}, "
        f"optimizer state {_gb(k['optimizer_state'])}" + versus(mem["argument_bytes"], "argument_bytes"),
        f"  temporaries {_gb(mem['temp_bytes']):>8}   gradients {_gb(k['gradients'])}, saved "
        f"activations {_gb(k['saved_activations'])}, one layer's backward "
        f"{_gb(k['layer_working'])}, logits/loss {_gb(k['logits_loss'])}, pipeline buffers "
        f"{_gb(k['pipeline_buffers'])}" + versus(mem["temp_bytes"], "temp_bytes"),
        f"  needed      {_gb(mem['needed_bytes']):>8}   of {topo.device_memory_gb:g} on "
        f"{topo.name}" + ("" if compiled is None else
                          f"   compiled {_gb(compiled['needed_bytes'])} (analytic/compiled "
                          f"{mem['needed_bytes'] / compiled['needed_bytes']:.3f})"),
        *(["  (layers unrolled: XLA's schedule of unrolled layers keeps more than remat's "
           "arithmetic; LLaMA-3.2-3B, remat full, one H100: 72.2 GB)"]
          if not plan.cfg.parallel.scan_layers and plan.cfg.parallel.remat != "none" else []),
        "analytic, per step per device",
        f"  FLOPs       {e['flops']['model'] / 1e12:,.1f} T model, "
        f"{(e['flops']['matmul'] + e['flops']['attention']) / 1e12:,.1f} T executed "
        f"(recompute, bubble ticks); bubble {e['bubble']:.1%}",
        "  collectives " + ", ".join(
            f"{a} {e['collectives']['result'][a] / 1e9:.2f} GB ({t['comm_s'][a]:.3f} s"
            f"{', hidden' if a in topo.overlapped else ''})"
            for a in e["collectives"]["result"] if e["collectives"]["result"][a]),
        f"  step time   {t['step_s']:.3f} s: compute {t['compute_s']:.3f} s, exposed "
        f"communication {t['exposed_comm_s']:.3f} s; MFU {t['mfu']:.1%} (assumes "
        f"{topo.matmul_efficiency:.0%} of peak in matmuls, {topo.attention_efficiency:.0%} in "
        f"attention, {topo.link_efficiency:.0%} of link bandwidth)",
    ]
    return lines
