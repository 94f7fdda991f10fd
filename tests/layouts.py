"""Layouts drawn at random over the whole space the planner covers, at real widths: the
property test's generator (`tests/test_planner_property.py`).

A draw is a preset's model (its widths and vocabulary, its layers cut to a few) and a layout
of 8 devices: every mesh axis and degree (data, expert, stage, tensor, seq), ZeRO 0-3, each
remat policy, sequence parallelism, gradient accumulation or pipeline microbatches, each
pipeline schedule with or without circular repeats, FP8 and packed documents, at a sequence
length from 1k to 8k; an MoE model's layers as drawn, DeepSeek's (latent attention, the group
router, a dense layer first, an MTP depth) or a dense layer before each MoE one. Draws the
config's validation or the plan refuses are drawn again: the generator yields only layouts a
user could run.
"""

from __future__ import annotations

import random

from spmd3d import config
from spmd3d.config import ConfigError
from spmd3d.mesh import load_topology
from spmd3d.plan import Plan

DEVICES = 8
TOPOLOGY = load_topology("h100x8")

# the presets' widths (configs/*.yaml): dense LLaMA-3 8B and 1B-class, GPT-style (no GQA, a 32k
# vocabulary), Mixtral (8 wide experts) and Qwen3-MoE (128 narrow experts, top-8, q/k norms)
MODELS = {
    "llama3_8b": dict(d_model=4096, num_heads=32, num_kv_heads=8, d_ff=14336,
                      vocab_size=128256),
    "gpu_1b": dict(d_model=2048, num_heads=32, num_kv_heads=8, d_ff=8192, vocab_size=128256),
    "gpt_1b": dict(d_model=2048, num_heads=16, num_kv_heads=16, d_ff=5632, vocab_size=32768),
    "mixtral_8x7b": dict(d_model=4096, num_heads=32, num_kv_heads=8, d_ff=14336,
                         vocab_size=32000, num_experts=8, experts_per_token=2),
    "qwen3_30b_a3b": dict(d_model=2048, num_heads=32, num_kv_heads=4, head_dim=128, d_ff=6144,
                          vocab_size=151936, qk_norm=True, num_experts=128,
                          experts_per_token=8, d_ff_expert=768),
}
REMAT = ("none", "full", "save_dots", "stage")
SCHEDULES = ("gpipe", "1f1b", "zb_h1")


def _degrees(rng: random.Random, moe: bool) -> dict:
    """Mesh degrees whose product is DEVICES: each axis a power of two."""
    sizes = {"data": 1, "stage": 1, "tensor": 1, "seq": 1}
    for _ in range(DEVICES.bit_length() - 1):  # three doublings, each to an axis drawn
        sizes[rng.choice(tuple(sizes))] *= 2
    expert = 1
    if moe and sizes["data"] > 1:
        expert = rng.choice([e for e in (1, 2, 4, 8) if sizes["data"] % e == 0])
    return {**sizes, "expert": expert}


def overrides(rng: random.Random, tokenizer: str | None = None) -> list[str]:
    """One draw as `key=value` overrides (not yet validated). `tokenizer`: a tokenizer with an
    end-of-text id, for the draws with packed documents (none: no such draws)."""
    name = rng.choice(tuple(MODELS))
    model = MODELS[name]
    moe = "num_experts" in model
    deg = _degrees(rng, moe)
    repeats = rng.choice((1, 1, 2)) if deg["stage"] > 1 else 1
    schedule = rng.choice(SCHEDULES) if deg["stage"] > 1 else "gpipe"
    micro = rng.choice((1, 2, 4)) * (deg["stage"] if deg["stage"] > 1 else 1)
    rows = rng.choice((1, 2))  # sequences of a microbatch on a batch device
    batch = deg["data"] * micro * rows
    # some stacks padded (stage x repeats does not divide the layers); not an MoE model's, so
    # that the seeds draw the MoE layouts they drew (padded MoE pipelines run: test_moe_layouts)
    layers = deg["stage"] * repeats * rng.choice((1, 2)) + (0 if moe else rng.choice((0, 0, 1)))
    seq_len = rng.choice((1024, 2048, 4096, 8192))
    out = [f"model.{k}={v}" for k, v in model.items()] + [
        f"model.num_layers={layers}", f"model.dtype={rng.choice(('bfloat16', 'bfloat16', 'float32'))}",
        "model.param_dtype=float32",
        *(f"mesh.{k}={v}" for k, v in deg.items()),
        "mesh.simulated_devices=0", "mesh.topology=h100x8",
        f"parallel.zero_stage={rng.randrange(4)}", f"parallel.remat={rng.choice(REMAT)}",
        f"parallel.sequence_parallel={str(deg['tensor'] > 1 and rng.random() < 0.5).lower()}",
        f"parallel.pipeline_schedule={schedule}", f"parallel.pipeline_repeats={repeats}",
        f"train.global_batch={batch}", f"train.microbatches={micro}", f"train.seq_len={seq_len}"]
    if moe:  # an MoE model's layers as DeepSeek's or as Llama 4's (drawn after the rest)
        out += _moe_kind(rng, layers)
    if rng.random() < 0.2:
        out += ["model.fp8=delayed", "model.fp8_emulate=true"]
    if tokenizer and rng.random() < 0.25:
        out.append(f"data.tokenizer={tokenizer}")
    return out


def _moe_kind(rng: random.Random, layers: int) -> list[str]:
    """As drawn, or DeepSeek's kind of model on the drawn widths (latent attention with
    DeepSeek-V3's head geometry, the sigmoid router over 4 groups, a shared expert, a dense
    layer first, sometimes an MTP depth), or a dense layer before each MoE one (Llama 4's
    interleaving, `model.moe_every=2`)."""
    kind = rng.choice(("as_drawn", "as_drawn", "deepseek", "every2"))
    if kind == "every2":
        return ["model.moe_every=2", f"model.num_layers={2 * layers}"]
    if kind == "as_drawn":
        return []
    return ["model.kv_lora_rank=512", f"model.q_lora_rank={rng.choice((0, 1536))}",
            "model.qk_nope_head_dim=128", "model.qk_rope_head_dim=64", "model.v_head_dim=128",
            "model.num_kv_heads=32", "model.head_dim=0", "model.qk_norm=false",
            "model.router_score=sigmoid", "model.router_groups=4", "model.router_topk_groups=2",
            "model.router_scale=2.5", "model.shared_experts=1", "model.dense_layers=1",
            f"model.num_layers={layers + 1}", f"model.mtp_layers={rng.choice((0, 1))}"]


def draw(seed: int, tokenizer: str | None = None) -> tuple[list[str], Plan]:
    """(the overrides, their plan on TOPOLOGY) of the first valid draw from `seed`'s stream."""
    rng = random.Random(seed)
    while True:
        args = overrides(rng, tokenizer)
        try:
            cfg = config.load(None, args)
            return args, Plan.resolve(cfg, topology=TOPOLOGY)
        except ConfigError:
            continue


def describe(args: list[str]) -> str:
    """A draw in one line: its non-default choices, without the model's widths."""
    skip = ("model.num_heads", "model.num_kv_heads", "model.d_ff", "model.vocab_size",
            "model.head_dim", "model.qk_norm", "model.d_ff_expert", "mesh.simulated_devices",
            "mesh.topology", "model.param_dtype", "model.fp8_emulate")
    last = {a.split("=")[0]: a for a in args}  # a key given twice: its last value
    keep = [a for a in last.values() if not a.startswith(skip)]
    return " ".join(a.split(".", 1)[1] if not a.startswith("data.tokenizer") else "documents"
                    for a in keep)
