"""The analytic side of the planner: what a plan's step needs per device, by arithmetic alone.

No tracing, no compiling, no devices: shapes come from the config, shardings from the plan's
rules tables, so a layout of 16,384 devices is estimated in about a millisecond and a search
can try tens of thousands. `memory.py` counts the bytes (its docstring itemises them); here
are FLOPs, the step time and MFU, and `traffic.py` counts the collectives per mesh axis
(`footprint.py`: the compiled side; `plan --compile` prints both)."""

from __future__ import annotations

from .. import offload
from ..mesh import DATA
from ..units import gb
from . import quirks
from .memory import _keys_per_query, memory
from .traffic import collectives, recomputes_as, redone


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
        got, live = compiled["compiled"][key], compiled["compiled"].get(f"live_{key}")
        return (f"   compiled {gb(got)} (analytic/compiled {analytic / got:.3f}"
                + (f"; of the {gb(live)} alive at once {analytic / live:.3f}" if live else "")
                + ")")

    lines = [
        "analytic, per device (GB)",
        f"  arguments   {gb(mem['argument_bytes']):>8}   parameters {gb(k['parameters'])}, "
        f"optimizer state {gb(k['optimizer_state'])}" + versus(mem["argument_bytes"], "argument_bytes"),
        f"  temporaries {gb(mem['temp_bytes']):>8}   gradients {gb(k['gradients'])}, saved "
        f"activations {gb(k['saved_activations'])}, one layer's backward "
        f"{gb(k['layer_working'])}, logits/loss {gb(k['logits_loss'])}, pipeline buffers "
        f"{gb(k['pipeline_buffers'])}"
        + (f", a microbatch's experts' gradients {gb(k['expert_gradients'])}"
           if k["expert_gradients"] else "")
        + (f", a microbatch's gradients reduced whole {gb(k['whole_gradients'])}"
           if k["whole_gradients"] else "")
        + (f"; at a microbatch's end its tables' gradients {gb(k['table_gradients'])} beside "
           f"the accumulator" if k["table_gradients"] else "") + versus(mem["temp_bytes"], "temp_bytes"),
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
