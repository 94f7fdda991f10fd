"""What the compiler does that the planner's arithmetic cannot derive from the program, each
named once with what it is, the backend and the jax release it was measured on
(`tests/test_estimate.py` compiles the layouts that show each). The planner reads an entry
where it applies (`applies`), on every backend: one seen on XLA:CPU alone is counted for a GPU
plan too, so the estimate errs high, never low. A jax other than the one measured is named in
the plan's report (`stale`), since each may change at the next release: `plan --compile` then
says which still hold."""

from __future__ import annotations

from dataclasses import dataclass

# jax major.minor the whole table was last checked on: `make test` compiles the layouts that
# show each entry (`tests/test_estimate.py`, the property's draws) on the jax `make` installs
MEASURED_ON = "0.12"


@dataclass(frozen=True)
class Quirk:
    backend: str  # where it was seen: "cpu", or "any" backend XLA compiled for; "nowhere": off
    what: str


QUIRKS = {
    "one_trip_loops_inlined": Quirk(
        "any", "a loop of one trip is inlined, and a value it shifts that nobody reads is "
        "dropped: the last K, V shifts of a ring of 2, a pipeline's one-slot phases' last "
        "shifts"),
    "reduce_inside_accumulation": Quirk(
        "any", "gradients are reduced over data inside the microbatch accumulation loop, once "
        "per microbatch, ZeRO-0 too"),
    "lookup_moves_cotangents": Quirk(
        "any", "a lookup in an embedding split over data, without tensor parallelism, moves the "
        "tokens' cotangents and ids, not the table"),
    "fresh_stage_gradient": Quirk(
        "any", "autodiff of GPipe's slot loop hands back a fresh fp32 gradient of the stage's "
        "layers per slot, beside the accumulator; not where a pass runs one layer (its loop "
        "of one trip inlined, `one_trip_loops_inlined`)"),
    "branch_buffers": Quirk(
        "any", "each branch of ZB-H1's per-device switch hands back a gradient of the stage's "
        "layers (W its own, F and B zeros), beside the accumulator, and the stage's layers are "
        "cast to a narrow compute dtype once for the step"),
    "hsdp_reduces_whole": Quirk(
        "any", "under HSDP, accumulated microbatches' gradients are all-reduced whole over a "
        "ZeRO group and then sliced (not reduce-scattered), before their shard is reduced "
        "across groups: a whole fp32 gradient of the layers beside the accumulator"),
    "head_gradient_fp32_copy": Quirk(
        "cpu", "under Ulysses, without SP or accumulated microbatches, the loss's shard_map "
        "sums a narrow head gradient over data and seq in fp32 (`manual.vary`) into a buffer "
        "of its own, whole and held to the step's end"),
    "dot_operand_copies": Quirk(
        "cpu", "a dense MLP's backward reads the gate and up projections' output cotangent "
               "in two layouts, one per matmul, each a copy of its own in fp32 (a narrow "
               "dtype's matmuls read fp32 copies of their operands, the weights' too)"),
    "score_copies": Quirk(
        "cpu", "a score tile's backward (the blocked kernel's, the ring's) holds the tile's "
               "probabilities, their gradient, the scores' gradient and that in a second "
               "layout for the keys' matmul, each in fp32 (16 bytes a score); in GPipe's "
               "backward the last three (12), in 1F1B's tick beside the loss the first two (8); "
               "with packed documents, the probabilities masked by document too (4 more); in "
               "fp32, without the narrow casts, the masked and scaled probabilities apart (4 "
               "more)"),
    "narrow_head_fp32_copy": Quirk(
        "cpu", "in a narrow compute dtype the loss's dots read an fp32 copy of the head's "
               "shard: accumulating microbatches, made at a microbatch's start and held to "
               "its end, beside the tables' gradients; in ZB-H1, while an F runs the head"),
    "recompute_beside_loss": Quirk(
        "cpu", "without a pipeline, the last layer's recompute under a recomputing policy "
               "(it needs only the layer's saved input) is scheduled during the loss's "
               "backward, beside the loss's working set"),
    "one_layer_inlined": Quirk(
        "cpu", "a dense stack of one layer without a pipeline: its loop of one trip is "
               "inlined and its recompute is its forward (remat none, full and save_dots "
               "compile alike); the forward's values are kept as its fp32 matmuls give them, "
               "beside the weights' fp32 copies and the lookup's fp32 output"),
}


def applies(name: str) -> bool:
    """Whether the estimate counts quirk `name`: every entry in the table, whatever backend it
    was seen on (what it adds, it adds to every plan: an estimate that is low is what sends a
    job out of memory); an entry taken out is not counted."""
    return QUIRKS[name].backend != "nowhere"


def stale(version: str) -> str | None:
    """A line for the plan's report when jax `version` is not the release the table was
    measured on, else None."""
    if ".".join(version.split(".")[:2]) == MEASURED_ON:
        return None
    return (f"  (the compiler's quirks the estimate assumes were measured on jax {MEASURED_ON}; "
            f"this is jax {version}: --compile shows which still hold)")
