"""What a plan's step needs in memory per device, by arithmetic alone (`estimate.py` adds
FLOPs, communication and time).

Shapes come from the config, shardings from the plan's rules tables: no tracing, no devices.

Memory per device, by kind:
* parameters, optimizer state (Adam's two moments), gradients (fp32): each parameter's shard
  under its ZeRO table (`param_shapes` mirrors `model.Transformer`; a test holds them equal);
* saved activations: what the backward keeps per layer under the remat policy (`layer_saved`,
  itemised below) times the layer passes alive at the peak (`activation_bytes`: one
  microbatch without a pipeline, the schedule's ticks or stash with one), plus the working set of the
  one layer whose backward runs (`layer_working`);
* pipeline buffers, logits/loss and the layers ZeRO-3 gathers for a pipelined step
  (`working_terms`, which the compiled report's breakdown uses too).

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
from .quirks import applies

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


def gathered_layers(plan) -> int:
    """ZeRO-3 with a pipeline (`parallel.zero3_gather=step`): the stage's layers gathered over
    data for the step (its compute shard: split over stage and tensor only) and their fp32
    gradient accumulator."""
    if not (plan.schedule and plan.rules.params_over_batch
            and plan.cfg.parallel.zero3_gather == "step"):
        return 0
    return stage_layers(plan) * (itemsize(plan.cfg.model.param_dtype) + F32)


def stage_layers(plan) -> int:
    """Elements of the layers a device computes with (its compute shard)."""
    mesh = dict(plan.mesh.shape)
    shapes = param_shapes(plan.cfg.model, len(plan.layer_order))
    return sum(shard_size(s, names, plan.rules.compute, mesh)
               for k, (s, names) in shapes.items() if k.startswith("blocks/"))


def working_terms(plan) -> dict:
    """Per-device bytes of the pipeline's buffers (the microbatches a stage feeds in and
    collects, its belts and its inboxes) and of one
    piece of the loss (its logits, softmax and one-hot, fp32)."""
    from ..vocab import loss_chunks

    cfg, mesh = plan.cfg, plan.mesh.shape
    t, m = cfg.train, cfg.model
    micro = plan.microbatches
    rows = t.global_batch // micro // mesh["data"]
    row = rows * t.seq_len // mesh["seq"]  # tokens of one microbatch on a device
    buffers, tokens = 0, row
    if plan.schedule:  # the stage's input and output slots, two belts and the inboxes
        slots = -(-micro // plan.schedule.stages)
        table = plan.schedule.table()
        buffers = (2 * slots + 2 + table.x_slots + table.ct_slots) * row * m.d_model
        tokens = slots * row
    piece = tokens // loss_chunks(tokens, cfg.parallel.loss_chunk)
    return {"pipeline_buffers": buffers * itemsize(m.dtype),
            "logits_loss": 3 * piece * m.vocab_size // mesh["tensor"] * 4,
            "gathered_layers": gathered_layers(plan)}


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
    if plan.attention in ("ring", "gather"):  # a step scores a query against one device's keys
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
    1F1B and ZB-H1 stash by hand (quirk `vjp_hands_over_more`)."""
    more = policy == "none" and applies("vjp_hands_over_more")
    extra = 5 * w.scores + 2 * F32 * w.d_full if more else 0
    return layer_saved(w, policy, c) + extra


def layer_working(w: Widths, policy: str, c: int) -> float:
    """Bytes per token alive while one layer's backward runs, beyond what it keeps: what it
    recomputes (all of `none`'s residuals, less what the policy kept) and its cotangents."""
    recomputed = layer_saved(w, "none", c) - layer_saved(w, policy, c)
    return recomputed + c * (2 * w.d_full + w.q + 2 * w.kv + 2 * w.f)


def tokens_per_pass(plan) -> int:
    """Tokens of one microbatch on one device."""
    cfg, mesh = plan.cfg, plan.mesh.shape
    micro = plan.microbatches
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
    whole = policy == "stage" or (s is not None and s.recomputes_stage)
    if s is None:  # gradient accumulation: one microbatch's layers at a time
        passes, per_pass = 1, c * w.d if whole else layers * layer_saved(w, policy, c)
    else:  # autodiff keeps every slot's pass (bubbles included), the others their stash
        passes = s.saved_passes
        kept = layer_saved if s.mode == "autodiff" else layer_stashed
        per_pass = c * w.d if whole else chunk * kept(w, policy, c)
    inner = "full" if policy == "stage" else policy  # the policy inside a stage checkpoint
    working = layer_working(w, inner, c)
    if whole:  # the pass being recomputed keeps what its layers' policy saves
        working += (layers if s is None else chunk) * layer_saved(w, inner, c)
    if plan.attention == "gather":  # the sequence's K/V gathered, their fp32 gradients
        working += 2 * plan.mesh.shape["seq"] * w.kv * (c + F32)
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
    kinds = {**state_bytes(plan), **working_terms(plan), **activation_bytes(plan)}
    s, m, mesh = plan.schedule, plan.cfg.model, dict(plan.mesh.shape)
    head = shard_size((m.d_model, m.vocab_size), ("embed", "vocab"), plan.rules.compute,
                      mesh) * F32
    # the head's gradient accumulated whole per device: by the loss's pieces when ZeRO-2/3
    # shard the gradients over the batch, by the schedule's microbatches under 1F1B or ZB-H1
    sharded = plan.rules.grads_over_batch and mesh["data"] > 1
    kinds["head_gradients"] = (head if sharded else 0) + (2 * head if s and s.head_inside
                                                          else 0)
    loss, layer = kinds["logits_loss"], kinds["layer_working"]
    c, sp = itemsize(m.dtype), plan.cfg.parallel.sequence_parallel and mesh["tensor"] > 1
    if (s is None and plan.accum_steps == 1 and not sp and mesh["seq"] == 1 and mesh["data"] > 1
            and c < F32 and applies("head_gradient_fp32_copy")):
        loss += head // F32 * (F32 - c)
    kinds["w_stash"] = 0
    if s is not None and s.mode == "switch":  # the W stash waits beside the branches
        kinds["w_stash"] = int(s.in_flight * kinds["w_stash_per_pass"])
        peak = (1 + applies("branch_buffers")) * loss + layer + kinds["w_stash"]
    elif s is not None and s.mode == "lockstep":  # a slot runs a forward (and head) and a backward
        peak = loss + layer
    elif s is not None:  # GPipe's backward, autodiff of its slot loop
        peak = max(loss, layer + applies("fresh_stage_gradient") * stage_layers(plan) * F32)
    else:
        peak = max(loss, layer)
    del kinds["w_stash_per_pass"]  # a factor, not a kind
    temp = (kinds["gradients"] + kinds["saved_activations"] + kinds["pipeline_buffers"]
            + kinds["gathered_layers"] + kinds["head_gradients"] + peak)
    args = kinds["parameters"] + kinds["optimizer_state"]
    return {"by_kind": kinds, "argument_bytes": args, "temp_bytes": temp,
            "needed_bytes": args + temp}
