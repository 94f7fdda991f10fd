"""The analytic side of the planner: what a plan's step needs per device, by arithmetic alone.

No tracing, no compiling, no devices: shapes come from the config, shardings from the plan's
rules tables, so a layout of 16,384 devices is estimated in well under a millisecond and a
search can try thousands. `footprint.py` is the compiled side; `plan --compile` prints both.

Memory per device, by kind:
* parameters, optimizer state (Adam's two moments), gradients (fp32): each parameter's shard
  under its ZeRO table (`param_shapes` mirrors `model.Transformer`; a test holds them equal);
* saved activations: what the backward keeps per layer under the remat policy (`layer_saved`,
  itemised below) times the layer passes alive at the peak (`activation_bytes`: one
  microbatch without a pipeline, the schedule's ticks or stash with one), plus the working set of the
  one layer whose backward runs (`layer_working`);
* pipeline buffers, logits/loss and the layers ZeRO-3 gathers for a pipelined step: as
  `footprint.working_terms` counts them for the compiled report (shared code).

Per-layer residuals per token (c: the compute dtype's bytes; D the width, Q = heads x head
dim and Kv = kv heads x head dim the query and key widths, F the MLP width; under tensor
parallelism Q, Kv and F are split over `tensor`, and under sequence parallelism so are the
residual stream's D-sized values):
* full remat: the layer's input, c D;
* save_dots: the input, the fused QKV and output projections' results and the fused gate/up
  result: c (2 D + Q + 2 Kv + 2 F);
* none: everything its backward reads: two D-sized residual values, the two norms' outputs
  and their fp32 normalised copies, QKV, the rotated queries and keys, the fp32 copies of keys
  and values the blocked kernel slices, the attention output, the projection's result, six
  F-sized MLP values, and per attention score kept by the blocked kernel 6 bytes (its fp32
  exponentials and their compute-dtype probabilities), none under cuDNN's flash attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import ModelConfig

F32 = 4


def itemsize(dtype: str) -> int:
    return 2 if dtype in ("bfloat16", "float16") else 4


def param_shapes(m: ModelConfig, layers: int) -> dict:
    """{parameter key: (global shape, logical names)} of the model with `layers` stored
    layers, as `model.Transformer` builds them."""
    d, k, g, h, f, v = (m.d_model, m.num_kv_heads, m.num_heads // m.num_kv_heads,
                        m.dim_per_head, m.d_ff, m.vocab_size)
    stacked = {
        "attn_norm/scale": ((d,), ("norm",)),
        "attn/w_qkv": ((d, k, g + 2, h), ("embed", "kv_heads", "q_per_kv", "head_dim")),
        "attn/w_o": ((k, g, h, d), ("kv_heads", "q_per_kv", "head_dim", "embed")),
        "mlp_norm/scale": ((d,), ("norm",)),
        "mlp/w_gate_up": ((d, 2, f), ("embed", "gate_up", "mlp")),
        "mlp/w_down": ((f, d), ("mlp", "embed")),
    }
    out = {"embed": ((v, d), ("vocab", "embed"))}
    out.update({f"blocks/{key}": ((layers, *shape), ("layers", *names))
                for key, (shape, names) in stacked.items()})
    out.update({"final_norm/scale": ((d,), ("norm",)), "head": ((d, v), ("embed", "vocab"))})
    return out


def _axes(rule) -> tuple:
    return () if rule is None else rule if isinstance(rule, tuple) else (rule,)


def shard_size(shape, names, rules, mesh: dict) -> int:
    """Elements of one device's shard of an array laid out by `rules` (uneven dims padded)."""
    n = 1
    for dim, name in zip(shape, names):
        n *= -(-dim // math.prod(mesh[a] for a in _axes(rules[name])))
    return n


def state_bytes(plan) -> dict:
    """Per-device bytes of parameters, optimizer state and fp32 gradients: exactly what
    `footprint.state_terms` reads from the shardings, without them."""
    mesh, rules = dict(plan.mesh.shape), plan.rules
    shapes = param_shapes(plan.cfg.model, len(plan.layer_order))
    pbytes = itemsize(plan.cfg.model.param_dtype)

    def total(table, size):
        return sum(shard_size(s, n, table, mesh) for s, n in shapes.values()) * size

    return {"parameters": total(rules.params, pbytes),
            "optimizer_state": 2 * total(rules.opt, pbytes) + 4,  # two moments and a count
            "gradients": total(rules.grads, F32)}


@dataclass(frozen=True)
class Widths:
    """One device's share of a layer's widths, in elements per token."""

    d: float  # the model width, as the residual stream holds it (split over tensor under SP)
    d_full: int  # the model width where T is whole on the tensor group (the norms' outputs)
    q: float  # query heads x head dim
    kv: float  # kv heads x head dim
    f: float  # MLP width
    scores: float  # attention scores a query computes, over its heads

    @classmethod
    def of(cls, plan) -> "Widths":
        m, mesh = plan.cfg.model, plan.mesh.shape
        t, sp = mesh["tensor"], plan.cfg.parallel.sequence_parallel
        heads = m.num_heads / t
        return cls(d=m.d_model / (t if sp else 1), d_full=m.d_model,
                   q=heads * m.dim_per_head, kv=m.num_kv_heads / t * m.dim_per_head,
                   f=m.d_ff / t, scores=heads * _keys_per_query(plan))


def _keys_per_query(plan) -> float:
    """Keys a query's scores span under the plan's attention kernel (0: flash attention keeps
    no scores)."""
    from ..attention import computed_fraction

    t, seq = plan.cfg.train.seq_len, plan.mesh.shape["seq"]
    if plan.attention == "cudnn":
        return 0.0
    if plan.attention == "ring":  # each ring step scores a query against one device's keys
        return t / seq
    return t * computed_fraction(t)


def layer_saved(w: Widths, policy: str, c: int) -> float:
    """Bytes per token one layer keeps for its backward under remat `policy` (see above)."""
    if policy in ("full", "stage"):
        return c * w.d
    if policy == "save_dots":
        return c * (2 * w.d + w.q + 2 * w.kv + 2 * w.f)
    return (c * (2 * w.d + 2 * w.d_full + w.q + 2 * w.kv + w.q + w.kv + w.q + w.d + 6 * w.f)
            + 2 * F32 * w.d_full + 2 * F32 * w.kv + 6 * w.scores)


def layer_stashed(w: Widths, policy: str, c: int) -> float:
    """Bytes per token of a layer's residuals as autodiff hands them over (`jax.vjp`), which
    1F1B and ZB-H1 stash by hand: under `none` more than XLA keeps when it schedules the
    backward itself -- the blocked kernel's masks and masked scores (5 bytes a score) and a
    second fp32 copy in each norm."""
    extra = 5 * w.scores + 2 * F32 * w.d_full if policy == "none" else 0
    return layer_saved(w, policy, c) + extra


def layer_working(w: Widths, policy: str, c: int) -> float:
    """Bytes per token alive while one layer's backward runs, beyond what it keeps: what it
    recomputes (all of `none`'s residuals, less what the policy kept) and its cotangents."""
    recomputed = layer_saved(w, "none", c) - layer_saved(w, policy, c)
    return recomputed + c * (2 * w.d_full + w.q + 2 * w.kv + 2 * w.f)


def tokens_per_pass(plan) -> int:
    """Tokens of one microbatch on one device."""
    cfg, mesh = plan.cfg, plan.mesh.shape
    micro = plan.schedule.microbatches if plan.schedule else plan.accum_steps
    return cfg.train.global_batch // micro // mesh["data"] * cfg.train.seq_len // mesh["seq"]


def activation_bytes(plan) -> dict:
    """{saved_activations, layer_working}: per-device bytes the backward keeps at its peak and
    those one layer's backward needs on top (see the module's docstring)."""
    cfg, s = plan.cfg, plan.schedule
    c, policy = itemsize(cfg.model.dtype), cfg.parallel.remat
    w, n = Widths.of(plan), tokens_per_pass(plan)
    layers = len(plan.layer_order) // (s.stages if s else 1)  # stored on this device
    chunk = layers // (s.repeats if s else 1)  # one pass: a chunk (a stage's layers if v = 1)
    # a pass that keeps its input alone: stage remat, and circular GPipe's recomputed stages
    whole = policy == "stage" or (s is not None and s.kind == "gpipe" and s.repeats > 1)
    if s is None:  # gradient accumulation: one microbatch's layers at a time
        passes, per_pass = 1, c * w.d if whole else layers * layer_saved(w, policy, c)
    else:  # GPipe keeps every tick's pass (bubbles included); 1F1B and ZB-H1 their stash
        passes = s.ticks if s.kind == "gpipe" else s.in_flight
        kept = layer_saved if s.kind == "gpipe" else layer_stashed
        per_pass = c * w.d if whole else chunk * kept(w, policy, c)
    working = layer_working(w, "full" if policy == "stage" else policy, c)
    if whole:  # the pass being recomputed keeps each of its layers' input
        working += (layers if s is None else chunk) * c * w.d
    # ZB-H1's W waits for its projections' inputs and output gradients
    w_stash = chunk * c * (4 * w.d_full + 2 * w.q + 2 * w.kv + 3 * w.f) * n
    return {"saved_activations": int(passes * per_pass * n), "layer_working": int(working * n),
            "w_stash_per_pass": int(w_stash)}


def memory(plan) -> dict:
    """Per-device bytes by kind (`footprint.by_kind`'s kinds, and `layer_working`), the
    temporaries and the total. The temporaries' peak: gradients, saved activations and the
    pipeline's buffers, plus the larger of the loss's working set (the head's backward runs
    before any layer's) and one layer's backward; a schedule that runs the head per
    microbatch inside the pipeline (1F1B, ZB-H1) also accumulates the head's gradient."""
    from ..footprint import working_terms

    kinds = {**state_bytes(plan), **working_terms(plan), **activation_bytes(plan)}
    s, m, mesh = plan.schedule, plan.cfg.model, dict(plan.mesh.shape)
    head = shard_size((m.d_model, m.vocab_size), ("embed", "vocab"), plan.rules.compute,
                      mesh) * F32
    # the head's gradient accumulated whole per device: by the loss's pieces when ZeRO-2/3
    # shard the gradients over the batch, by the schedule's microbatches under 1F1B or ZB-H1
    sharded = plan.rules.grads["embed"] is not None and mesh["data"] > 1
    kinds["head_gradients"] = (head if sharded else 0) + (2 * head if s and s.kind != "gpipe"
                                                          else 0)
    loss, layer = kinds["logits_loss"], kinds["layer_working"]
    kinds["w_stash"] = 0
    if s is not None and s.kind == "zb_h1":
        # each device's branch of the per-stage switch has buffers of its own: the head's
        # forward (F) and backward (B) each hold a loss piece, and the W stash waits
        kinds["w_stash"] = int(s.in_flight * kinds["w_stash_per_pass"])
        peak = 2 * loss + layer + kinds["w_stash"]
    elif s is not None and s.kind == "1f1b":  # a tick runs a forward (the head's too) and a backward
        peak = loss + layer
    else:
        peak = max(loss, layer)
    del kinds["w_stash_per_pass"]  # a factor, not a kind
    temp = (kinds["gradients"] + kinds["saved_activations"] + kinds["pipeline_buffers"]
            + kinds["gathered_layers"] + kinds["head_gradients"] + peak)
    args = kinds["parameters"] + kinds["optimizer_state"]
    return {"by_kind": kinds, "argument_bytes": args, "temp_bytes": temp,
            "needed_bytes": args + temp}


# --------------------------------------------------------------------------------------------
# FLOPs, communication and step time

# extra forward passes of the layers' matmuls the backward redoes, per remat policy
RECOMPUTE = {"none": 0, "save_dots": 0, "full": 1, "stage": 2}


def flops(plan) -> dict:
    """FLOPs per step per device: `model` (MFU's count: 6 N per token plus causal attention
    counted half, `metrics.flops_per_token`) and `executed`, split in `matmul` and
    `attention`: with what remat recomputes, the score blocks the kernel computes, and the
    bubble ticks a lockstep pipeline computes on padding."""
    from ..metrics import flops_per_token, matmul_params

    cfg, s, n = plan.cfg, plan.schedule, plan.num_devices
    m, t = cfg.model, cfg.train.seq_len
    tokens = cfg.train.global_batch * t
    layers = m.num_layers * m.layer_params
    forwards = 3 + RECOMPUTE[cfg.parallel.remat]  # forward + backward (2) + recomputed ones
    attention_fwd = 4 * m.num_layers * m.num_heads * m.dim_per_head * t * (
        0.5 if plan.attention == "cudnn" else _keys_per_query(plan) / t if plan.attention
        != "ring" else 0.5)
    attention = attention_fwd * (forwards + (1 if cfg.parallel.remat == "save_dots" else 0))
    matmul = 2 * layers * forwards
    if s is not None and s.kind != "zb_h1":  # every stage computes on every tick
        matmul, attention = matmul * s.flops_ratio, attention * s.flops_ratio
    matmul += 6 * (matmul_params(m) - m.num_layers * m.layer_params)  # the head
    return {"model": flops_per_token(m, t) * tokens / n, "matmul": matmul * tokens / n,
            "attention": attention * tokens / n}


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
    forwards = 1 + RECOMPUTE[par.remat] + (1 if par.remat == "stage" and s is None else 0)
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
    # data: the gradients reduced once per step (ZeRO-0/1) or per microbatch (ZeRO-2/3), the
    # updated parameters gathered back (ZeRO-1/2), the weights gathered per use (ZeRO-3)
    state = state_bytes(plan)
    grads = state["gradients"] * (1 if plan.rules.grads["embed"] is None else mesh["data"])
    if plan.rules.grads["embed"] is None:
        add("data", "all-reduce", grads)
    else:
        add("data", "reduce-scatter", grads, micro)
    if plan.rules.opt["embed"] is not None and plan.rules.params["embed"] is None:
        add("data", "all-gather", state["parameters"])
    if plan.rules.params["embed"] is not None:
        weights = state["parameters"] * mesh["data"] * c // itemsize(m.param_dtype)
        add("data", "all-gather", weights, (forwards + 1) * micro)
    return {"result": result, "sent": sent}


def step_time(plan, flop: dict | None = None, comm: dict | None = None) -> dict:
    """Predicted seconds per step: compute at the topology's achieved share of peak, plus
    each axis's communication over its links (intra- or inter-node), hidden behind compute on
    the topology's `overlapped` axes; ZB-H1's idle slots added. MFU against that time."""
    topo = plan.topology
    flop, comm = flop or flops(plan), comm or collectives(plan)
    peak = topo.peak_flops(plan.cfg.model.dtype)
    compute = (flop["matmul"] / (peak * topo.matmul_efficiency)
               + flop["attention"] / (peak * topo.attention_efficiency))
    s = plan.schedule
    if s is not None and s.kind == "zb_h1":
        compute /= 1 - s.bubble
    crosses = _crosses_nodes(plan)
    links = {a: (topo.inter_node_gbps if crosses[a] else topo.intra_node_gbps) * 1e9
             * topo.link_efficiency for a in comm["sent"]}
    times = {a: comm["sent"][a] / links[a] for a in comm["sent"]}
    exposed = sum(t for a, t in times.items() if a not in topo.overlapped)
    hidden = sum(t for a, t in times.items() if a in topo.overlapped)
    total = compute + exposed + max(0.0, hidden - compute)
    return {"compute_s": compute, "comm_s": times, "exposed_comm_s": total - compute,
            "step_s": total, "mfu": flop["model"] / (total * peak)}


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
