"""Pipeline parallelism over `stage`: same numbers as one device, and the bubble the theory says.

A 4-layer model (so that 4 stages, or 2 stages x 2 circular repeats, each get one layer).
"""

import functools
from collections import Counter

import jax
import numpy as np
import pytest

from helpers import (assert_grads_match, assert_losses_match, by_layout, devices_for,
                     reference_run, small_config)
from spmd3d import hlo, manual, runtime
from spmd3d.pipeline import Schedule, layer_order

L4 = ["model.num_layers=4"]

LAYOUTS = {
    "dp4_pp2": dict(data=4, stage=2, micro=2),
    "dp2_pp4_m4": dict(data=2, stage=4, micro=4),
    # two microbatches per stage before and after the pipeline, the loss in 4 pieces
    "dp2_pp4_m8_chunked_loss": dict(data=2, stage=4, micro=8, extra=["parallel.loss_chunk=8"]),
    "pp4_tp2_m2": dict(stage=4, tensor=2, micro=2),  # fewer microbatches than stages (v = 1)
    "dp2_pp2_tp2": dict(data=2, stage=2, tensor=2, micro=2),
    "dp2_pp2_tp2_v2": dict(data=2, stage=2, tensor=2, micro=2, extra=["parallel.pipeline_repeats=2"]),
    "dp2_pp2_tp2_zero3": dict(data=2, stage=2, tensor=2, micro=4, zero=3),
    "dp2_pp2_tp2_zero3_tick": dict(data=2, stage=2, tensor=2, micro=4, zero=3,
                                   extra=["parallel.zero3_gather=tick"]),
    # the embedding and head split over the stages too, their uses inside the tick loop
    "dp2_pp2_tp2_zero3_tick_tables": dict(data=2, stage=2, tensor=2, micro=4, zero=3, extra=[
        "parallel.zero3_gather=tick", "parallel.tables_over_stage=true"]),
    "dp2_pp2_tp2_v2_sp_zero1_remat": dict(data=2, stage=2, tensor=2, micro=4, zero=1, sp=True,
                                          remat="full", extra=["parallel.pipeline_repeats=2"]),
    "dp2_pp2_tp2_sp_stage_remat": dict(data=2, stage=2, tensor=2, micro=4, sp=True, remat="stage",
                                       extra=["parallel.loss_chunk=16"]),
}


# 1F1B (`parallel.pipeline_schedule=1f1b`): its own backward, the loss head on the last stage
F1B = ["parallel.pipeline_schedule=1f1b"]
V2 = ["parallel.pipeline_repeats=2"]
ONE_F_ONE_B = {
    "1f1b_dp4_pp2_m2": dict(data=4, stage=2, micro=2, extra=F1B),  # m = p
    "1f1b_pp4_tp2_m16": dict(stage=4, tensor=2, micro=16, extra=F1B),  # m = 4p
    "1f1b_dp2_pp4_m2": dict(data=2, stage=4, micro=2, extra=F1B),  # fewer microbatches than p
    "1f1b_dp2_pp2_tp2_sp_zero3": dict(data=2, stage=2, tensor=2, micro=4, zero=3, sp=True,
                                      extra=F1B),
    "1f1b_pp2_tp2_seq2_sp": dict(stage=2, tensor=2, seq=2, micro=4, sp=True, extra=F1B),
    "1f1b_dp2_pp4_m8_full_remat_chunked_loss": dict(data=2, stage=4, micro=8, remat="full",
                                                    extra=F1B + ["parallel.loss_chunk=8"]),
    "1f1b_dp2_pp2_tp2_stage_remat": dict(data=2, stage=2, tensor=2, micro=4, remat="stage",
                                         extra=F1B),
    "1f1b_dp2_pp2_tp2_save_dots_zero2": dict(data=2, stage=2, tensor=2, micro=4, zero=2,
                                             remat="save_dots", extra=F1B),
    # interleaved 1F1B: two chunks of one layer per stage
    "1f1b_dp4_pp2_v2_m2": dict(data=4, stage=2, micro=2, extra=F1B + V2),  # m = p
    "1f1b_dp2_pp2_tp2_v2_m8_sp_zero3": dict(data=2, stage=2, tensor=2, micro=8, zero=3, sp=True,
                                            extra=F1B + V2),  # m = 4p
    "1f1b_pp2_tp2_seq2_v2_full_remat": dict(stage=2, tensor=2, seq=2, micro=4, remat="full",
                                            extra=F1B + V2),
}
LAYOUTS.update(ONE_F_ONE_B)

# ZB-H1 (`parallel.pipeline_schedule=zb_h1`): B and W apart, each stage its own op per slot
ZB = ["parallel.pipeline_schedule=zb_h1"]
ZERO_BUBBLE = {
    "zb_dp4_pp2_m2": dict(data=4, stage=2, micro=2, extra=ZB),  # m = p
    "zb_pp4_tp2_m16": dict(stage=4, tensor=2, micro=16, extra=ZB),  # m = 4p
    "zb_dp2_pp4_m2": dict(data=2, stage=4, micro=2, extra=ZB),  # fewer microbatches than p
    "zb_dp2_pp2_tp2_sp_zero3": dict(data=2, stage=2, tensor=2, micro=4, zero=3, sp=True,
                                    extra=ZB),
    "zb_dp2_pp4_m8_full_remat_chunked_loss": dict(data=2, stage=4, micro=8, remat="full",
                                                  extra=ZB + ["parallel.loss_chunk=8"]),
    "zb_dp2_pp2_tp2_stage_remat_zero2": dict(data=2, stage=2, tensor=2, micro=4, zero=2,
                                             remat="stage", extra=ZB),
    "zb_dp2_pp2_tp2_save_dots": dict(data=2, stage=2, tensor=2, micro=4, remat="save_dots",
                                     extra=ZB),
    # the sequence over seq: K/V gathered (attention kind `gather`), no ring in the branches
    "zb_pp2_tp2_seq2_sp": dict(stage=2, tensor=2, seq=2, micro=4, sp=True, extra=ZB),
    "zb_dp2_pp2_seq2_full_remat": dict(data=2, stage=2, seq=2, micro=2, remat="full", extra=ZB),
    # interleaved: two chunks of one layer per stage, stage 0's second chunk fed by stage 1
    "zb_dp4_pp2_v2_m2": dict(data=4, stage=2, micro=2, extra=ZB + V2),  # m = p
    "zb_dp2_pp2_tp2_v2_m8_sp_zero3": dict(data=2, stage=2, tensor=2, micro=8, zero=3, sp=True,
                                          extra=ZB + V2),  # m = 4p
}
LAYOUTS.update(ZERO_BUBBLE)


def cfg(extra=(), **kw):
    return small_config(**kw, extra=L4 + list(extra))


@pytest.fixture(scope="module")
def reference():
    return reference_run(cfg())


@pytest.mark.parametrize("name", by_layout(LAYOUTS))
def test_pipeline_losses_match_one_device(reference, name):
    assert_losses_match(cfg(**LAYOUTS[name]), reference[0], grads_too=name in GRADS)


GRADS = ["dp2_pp4_m8_chunked_loss", "dp2_pp2_tp2_v2", "pp4_tp2_m2", "dp2_pp2_tp2_sp_stage_remat",
         "1f1b_dp4_pp2_m2", "1f1b_pp4_tp2_m16", "1f1b_dp2_pp4_m2", "1f1b_dp2_pp2_tp2_sp_zero3",
         "1f1b_pp2_tp2_seq2_sp", "1f1b_dp2_pp4_m8_full_remat_chunked_loss",
         "1f1b_dp2_pp2_tp2_stage_remat", "1f1b_dp4_pp2_v2_m2", "1f1b_dp2_pp2_tp2_v2_m8_sp_zero3",
         *ZERO_BUBBLE]


@pytest.mark.parametrize("name", by_layout(GRADS))
def test_pipeline_grads_match_one_device(reference, name):
    assert_grads_match(cfg(**LAYOUTS[name]), reference[1])


@pytest.mark.parametrize("p,m", [(2, 2), (4, 2), (2, 6), (4, 8), (3, 5)])
def test_microbatches_laid_out_over_the_stages_as_the_belt_needs(p, m):
    """The step's reshape places microbatch i where the schedule's tables say: the input on
    stage i mod p (stage 0 finds it on the belt at tick i), the output where the belt from
    the last stage stops, each microbatch once."""
    from spmd3d.forward import by_slot

    schedule = Schedule(p, m)
    micro = np.arange(m, dtype=np.int32)
    for collect, table in ((False, schedule.feed()), (True, schedule.collect())):
        np.testing.assert_array_equal(by_slot(micro, schedule, -1, collect), table)
        assert sorted(table[table >= 0]) == list(range(m))
    # the belt (the GPipe table's rule): at tick t stage s holds what the last stage finished
    # p - 1 - s ticks ago and keeps it where `collect` says: each microbatch exactly once,
    # within the schedule's ticks
    kept = []
    for t in range(schedule.ticks):
        for s in range(p):
            i = t - (p - 1) - (p - 1 - s)
            slot = min(max((m - 1 - i) // p, 0), len(schedule.collect()) - 1)
            if 0 <= i < m and schedule.collect()[slot, s] == i:
                kept.append(i)
    assert sorted(kept) == list(range(m))


def test_layer_order_puts_chunk_k_on_stage_k_mod_p():
    # 8 layers, 2 stages, 2 repeats: chunks of 2 layers; stage 0 holds chunks 0 and 2
    assert layer_order(8, 2, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert layer_order(8, 4, 1).tolist() == list(range(8))
    assert Schedule(4, 8, 2).ticks == 19 and abs(Schedule(4, 8, 1).bubble - 3 / 11) < 1e-12


@pytest.fixture(scope="module")
def reference_8_layers():
    return reference_run(small_config(extra=["model.num_layers=8", "train.steps=1"]))[1]


@pytest.mark.parametrize("schedule,extra", [("1f1b", []), ("zb_h1", ["mesh.seq=2"])])
def test_interleaved_on_four_stages_matches_one_device(reference_8_layers, schedule, extra):
    """Interleaved 1F1B and ZB-H1 at p = 4 (two one-layer chunks per stage of an 8-layer
    model, m = p, with data; ZB-H1 with the sequence split too): virtual stage j = c p + s, so
    the forward ring wraps stage 3's chunk 0 into stage 0's chunk 1."""
    c = small_config(data=2 if schedule == "1f1b" else 1, stage=4, micro=4, extra=[
        "model.num_layers=8", "train.steps=1", f"parallel.pipeline_schedule={schedule}", *V2,
        *extra])
    assert_grads_match(c, reference_8_layers)


SHAPES = [(2, 2, 1), (2, 8, 1), (3, 5, 1), (4, 4, 1), (4, 2, 1), (4, 16, 1), (8, 32, 1),
          (2, 2, 2), (4, 4, 2), (4, 16, 2), (8, 32, 2), (2, 2, 3), (4, 16, 4)]
TABLES = [(kind, p, m, v) for kind in ("gpipe", "1f1b", "zb_h1") for p, m, v in SHAPES
          if v == 1 or (m >= p and (kind == "gpipe" or m % p == 0))]


@pytest.mark.parametrize("kind,p,m,v", TABLES)
def test_every_table_runs_each_operation_once_after_what_it_needs(kind, p, m, v):
    """For every schedule (GPipe, 1F1B, interleaved 1F1B with v > 1, ZB-H1), its table runs
    every forward and backward (whole, or B and W) once per stage, chunk and microbatch, each
    after what it needs (the virtual stage before, c p + s - 1, wraps to stage p - 1's chunk
    c - 1); a stage keeps at most the schedule's in-flight passes; and replaying every buffer
    and belt slot by slot, each read finds the value stored for that very pass, never
    overwritten while live, and every input gradient (GPipe: every output) reaches the stage
    that keeps it, once."""
    from spmd3d.pipeline.table import BACKWARD, FORWARD, FULL, IDLE, WEIGHT, after, before, build

    table, schedule = build(kind, p, m, v), Schedule(p, m, v, kind)
    kind_ = table.op("kind")
    n, lanes = kind_.shape[0], table.lanes
    field = lambda name, t, s, k=None: int(  # noqa: E731
        table.op(name)[t, s, k] if k is not None else table.end(name)[t, s])
    when = {}
    for t, s, k in np.ndindex(kind_.shape):
        if kind_[t, s, k] != IDLE:
            key = (int(kind_[t, s, k]), s, field("chunk", t, s, k), field("mb", t, s, k))
            assert key not in when, key
            when[key] = (t, k)
    backward = {"gpipe": (), "1f1b": (FULL,), "zb_h1": (BACKWARD, WEIGHT)}[kind]
    assert len(when) == (1 + len(backward)) * p * m * v
    b = backward[0] if backward else None
    for s, c, i in np.ndindex(p, v, m):
        f = when[(FORWARD, s, c, i)]
        prev, nxt = before(p, s, c), after(p, v, s, c)
        assert prev is None or when[(FORWARD, *prev, i)][0] < f[0]
        if b is None:
            continue
        assert f < when[(b, s, c, i)]  # (slot, lane): the loss's gradient may come in-slot
        assert nxt is None or when[(b, *nxt, i)][0] < when[(b, s, c, i)][0]
        if WEIGHT in backward:
            assert when[(BACKWARD, s, c, i)] < when[(WEIGHT, s, c, i)]
    bound = {"gpipe": v * m, "1f1b": min(2 * p - 1, m) if v == 1 else 2 * v * p - 1,
             "zb_h1": min(p, m) * v}[kind]
    assert table.stash_slots == schedule.in_flight <= bound
    if kind == "zb_h1" and m >= p:  # W fills the bubble: 3vm + p - 1 slots, 1F1B's 3(vm + p - 1)
        assert table.ticks == 3 * v * m + p - 1 and abs(schedule.bubble - (p - 1) / (
            3 * v * m + p - 1)) < 1e-12
    elif kind != "zb_h1":
        assert abs(schedule.bubble - (p - 1) / (v * m + p - 1)) < 1e-12

    # replay: at each (slot, lane) reads come before stores; a slot's end stores what arrived
    held, belts = {}, {"feed": [None] * p, "give": [None] * p, "ret": [None] * p}
    kept = Counter()
    on_f = {t: lanes_on for b_, e, lanes_on, _ in table.phases() for t in range(b_, e)}

    def read(buffer, s, slot, key):
        assert slot >= 0 and held.get((buffer, s, slot)) == key, (buffer, s, slot, key)

    for t in range(n):
        for s in range(p):
            if field("put", t, s) >= 0:
                belts["feed"][s] = field("put", t, s) * p + s
        sent = {}
        for k in range(lanes):
            for s in range(p):
                op, c, i = (int(kind_[t, s, k]), field("chunk", t, s, k),
                            field("mb", t, s, k))
                if op == FORWARD:
                    if field("x_at", t, s, k) < 0:
                        assert (s, c) == (0, 0) and belts["feed"][0] == i, (t, s, c, i)
                    else:
                        read("x", s, field("x_at", t, s, k), (c, i))
                    if table.mode != "autodiff":
                        held[("stash", s, field("stash", t, s, k))] = (c, i)
                    if after(p, v, s, c) is None:
                        if table.mode == "autodiff":
                            belts["ret"][p - 1] = i
                        else:
                            held[("ct", s, field("dy_to", t, s, k))] = (c, i)
                    sent[("ahead", s)] = (c + (s == p - 1), i)
                elif op in (BACKWARD, FULL, WEIGHT):
                    read("stash", s, field("stash", t, s, k), (c, i))
                if op in (BACKWARD, FULL):
                    read("ct", s, field("ct_at", t, s, k), (c, i))
                    sent[("back", s)] = (c - (s == 0), i)
                    if (s, c) == (0, 0):
                        belts["give"][0] = i
        for s in range(p):  # the slot's end: arrivals, then what each stage keeps
            for name, frm, box in (("x_to", ("ahead", (s - 1) % p), "x"),
                                   ("ct_to", ("back", (s + 1) % p), "ct")):
                key, slot = sent.get(frm), field(name, t, s)
                assert (slot >= 0) == (key is not None and 0 <= key[0] < v), (t, s, name)
                if slot >= 0:
                    held[(box, s, slot)] = key
            if field("keep", t, s) >= 0:
                belt = belts["ret" if table.mode == "autodiff" else "give"][s]
                want = (schedule.collect() if table.mode == "autodiff" else schedule.feed())[
                    field("keep", t, s), s]
                assert belt == want, (t, s, belt, want)
                kept[belt] += 1
        if any(on and FORWARD in table.lane_kinds(k) for k, on in enumerate(on_f[t])):
            belts["feed"] = belts["feed"][1:] + belts["feed"][:1]
        belts["give"] = belts["give"][-1:] + belts["give"][:-1]
        belts["ret"] = belts["ret"][1:] + belts["ret"][:1]
    assert kept == Counter(range(m)), kept


VOCAB = 384  # no other dimension of the bubble's steps has this size (`stack_flops` checks)


def stack_flops(extra=(), unrolled=False, **kw):
    """Per-device FLOPs of a 4-layer stack. Read on the scanned program as it runs: the step's
    dots less the head's and the loss's (`hlo.matmul_flops(without=VOCAB)`; the embedding and
    the optimizer have none). With every loop unrolled: XLA's cost analysis (which counts a
    loop body once) of the step with 8 layers less the step with 4, so that what does not
    depend on the depth cancels."""
    def compiled(layers):
        c = cfg(**kw, extra=[f"model.num_layers={layers}", f"model.vocab_size={VOCAB}", *extra])
        return runtime.setup(c, devices_for(c)).compile()[0]

    if not unrolled:
        text = compiled(4).as_text()
        stack = hlo.matmul_flops(text, without=VOCAB)
        if "stage" not in kw:  # what is left out is the head's dots alone: its forward and
            # both gradients, on every token (so no dot of the layers has a dim of VOCAB)
            c = cfg(**kw)
            head = 6 * c.train.global_batch * c.train.seq_len * c.model.d_model * VOCAB
            left_out = hlo.matmul_flops(text) - stack
            assert left_out == head, (left_out, head)
        return stack
    with manual.unrolled_loops():
        return hlo.flops(compiled(8)) - hlo.flops(compiled(4))


@functools.cache
def unpipelined_stack_flops(remat, unrolled):
    return stack_flops(remat=remat, unrolled=unrolled)


@pytest.mark.xdist_group("bubble")  # one worker: the unpipelined stacks computed once
@pytest.mark.parametrize("p,m,v,kind", [(2, 2, 1, "gpipe"), (2, 4, 1, "gpipe"),
                                         (4, 4, 1, "gpipe"), (2, 2, 2, "gpipe"),
                                         (4, 4, 1, "1f1b"), (2, 8, 1, "1f1b"),
                                         (2, 4, 2, "1f1b")])
def test_bubble_flops_match_the_schedule(p, m, v, kind):
    """Every stage computes at every tick, so the layer stack's FLOPs per device times p over
    the unpipelined ones is the schedule's (v*m + p - 1) / (v*m): the bubble, no more. 1F1B's
    warm-up and cool-down ticks run forwards alone and backwards alone, so it computes as
    much as GPipe; interleaved, (v*m + p - 1) chunk forwards and backwards per stage. Counted
    on the scanned program as it runs (`hlo.matmul_flops`), except a circular GPipe: it
    recomputes each stage in the backward, so both sides use stage remat, and a chunk of one
    layer then skips the stage recompute the 4-layer step's chunks need (its only input is
    stashed): read with every loop unrolled, where XLA merges the two recomputes, the stack
    differences compare. (Interleaved 1F1B keeps residuals as 1F1B does.)"""
    circular = v > 1 and kind == "gpipe"
    remat = "stage" if circular else "none"
    one = unpipelined_stack_flops(remat, circular)
    piped = stack_flops(stage=p, micro=m, remat=remat, unrolled=circular, extra=[
        f"parallel.pipeline_repeats={v}", f"parallel.pipeline_schedule={kind}"])
    measured = piped * p / one
    theory = Schedule(p, m, v, kind).flops_ratio
    assert abs(measured / theory - 1) < 0.02, (measured, theory)


def test_parameter_bytes_drop_by_stage_count():
    def job_for(stage):
        c = cfg(data=2, stage=stage, micro=4)
        return runtime.setup(c, devices_for(c))

    one, four = job_for(1), job_for(4)
    blocks = lambda j: [(a, s) for a, s in zip(jax.tree.leaves(j.abstract.params["blocks"]),
                                                 jax.tree.leaves(j.shardings.params["blocks"]))]
    local = lambda pairs: sum(int(np.prod(s.shard_shape(a.shape))) * 4 for a, s in pairs)
    block_bytes = local(blocks(one))
    assert local(blocks(four)) * 4 == block_bytes
    # the compiled steps agree: parameters and both Adam moments of the blocks, 3/4 fewer
    saved = hlo.memory(one.compile()[0])["argument_bytes"] - hlo.memory(four.compile()[0])["argument_bytes"]
    assert saved == 3 * (block_bytes - block_bytes // 4)


@pytest.mark.parametrize("name", by_layout(["dp4_pp2", "dp2_pp2_tp2_zero3", "1f1b_dp4_pp2_m2",
                                             "1f1b_dp2_pp2_tp2_sp_zero3"]))
def test_gradients_reduced_over_data_once_per_step_not_per_tick(name):
    """Nothing crosses the data axis inside the tick loop: gradients are reduced once, and
    under ZeRO-3 each stage's layers are gathered once (`parallel.zero3_gather=step`)."""
    layout = LAYOUTS[name]
    c = cfg(**layout)
    job = runtime.setup(c, devices_for(c))
    colls = hlo.collectives(job.compile()[0].as_text(), job.mesh.shape)
    over_data = [x for x in colls if "data" in x.axes]
    assert over_data and all(x.trips == 1 for x in over_data), over_data
    # between neighbouring stages only, per tick: the activations one way and the belt of
    # microbatches coming and going the other, and both again in the backward; nothing else
    shifts = [x for x in colls if x.kind == "collective-permute"]
    assert {x.axes for x in shifts} == {("stage",)}
    p, m = layout["stage"], layout["micro"]
    if name.startswith("1f1b"):
        # per tick at most four, each one microbatch's activations: the activation ahead and
        # the input belt back (forward ticks), the cotangent back (backward ticks), the input
        # gradients' belt ahead (every tick, and p - 1 more); XLA drops those whose value is
        # never used (the last tick's)
        row = c.train.global_batch // m // layout.get("data", 1) * c.train.seq_len * 128 * 4
        assert {x.bytes for x in shifts} == {row // (layout["tensor"] if layout.get("sp") else 1)}
        ticks = Schedule(p, m, kind="1f1b").ticks
        assert 2 * (m + p - 1) <= sum(x.trips for x in shifts) <= 4 * ticks + p - 1
    else:
        assert sum(x.trips for x in shifts) == 4 * Schedule(p, m).ticks
    assert not [x for x in colls if x.kind == "all-to-all"]


def test_model_called_on_stored_layers_runs_them_in_canonical_order():
    """A circular pipeline stores layers permuted. A model merged from those stored parameters
    outside the step knows their order (it is in the graphdef) and still gives the logits of
    the canonical model; ignoring the order would give others."""
    from flax import nnx

    from spmd3d.model import Transformer

    c = cfg(data=2, stage=2, tensor=2, micro=2, extra=["parallel.pipeline_repeats=2"])
    job = runtime.setup(c, devices_for(c))
    assert job.plan.layer_order == (0, 2, 1, 3)
    stored = jax.device_get(job.init_state().params)
    tokens = np.asarray(job.global_batch(0))[:2, :-1]
    logits = np.asarray(nnx.merge(job.graphdef, stored)(tokens))
    canonical = nnx.state(Transformer(job.cfg.model, nnx.Rngs(params=job.cfg.train.seed)))
    want = np.asarray(nnx.merge(nnx.graphdef(Transformer(job.cfg.model, nnx.Rngs(params=0))),
                                canonical)(tokens))
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
    unaware = nnx.merge(nnx.graphdef(Transformer(job.cfg.model, nnx.Rngs(params=0))), stored)
    assert np.max(np.abs(np.asarray(unaware(tokens)) - want)) > 1e-3


# wide enough that a stage's weights (64 MiB per device) dwarf a microbatch's activations
WIDE = ["model.num_layers=4", "model.d_model=1024", "model.num_heads=8", "model.num_kv_heads=8",
        "model.d_ff=4096", "train.seq_len=64"]


def temp_bytes(m, remat, repeats=1):
    """Per-device temporaries of the step with m microbatches of one row per data shard."""
    c = cfg(data=2, stage=2, tensor=2, micro=m, zero=1, remat=remat,
            extra=WIDE + [f"train.global_batch={2 * m}", f"parallel.pipeline_repeats={repeats}"])
    return hlo.memory(runtime.setup(c, devices_for(c)).compile()[0])["temp_bytes"]


@pytest.mark.parametrize("remat,repeats", [("stage", 1), ("none", 2)])
def test_temporaries_grow_by_activations_per_microbatch_never_by_weights(remat, repeats):
    """From 4 to 8 microbatches, what the step keeps per extra microbatch: with stage remat,
    the stage's input (one [1, T, D] fp32 row); with a circular pipeline (whose chunk is
    picked by a traced index), its v visits' inputs and a wrap-around slot, with room for
    scalars. Plus the microbatch's share of the pipeline's buffers (each stage holds m/p
    microbatches of the input, the output and their gradients, three at most alive at once:
    3/p rows). A copy of the weights per tick (64 MiB per stage and device) would show."""
    row, p = 64 * 1024 * 4, 2  # [mb=1, T, D] fp32; stages
    weights = 2 * 16_777_216 // 2 * 4  # 2 layers per stage of 16.8M parameters, tensor 2, fp32
    per_microbatch = (temp_bytes(8, remat, repeats) - temp_bytes(4, remat, repeats)) / 4
    bound = row * ((1 if repeats == 1 else 2 * repeats + 1) + 3 / p)
    assert row <= per_microbatch <= 1.05 * bound, (per_microbatch, bound)
    assert per_microbatch < weights / 50


@pytest.mark.parametrize("repeats", [1, 2])
def test_1f1b_and_zb_h1_temporaries_do_not_grow_with_microbatches(repeats):
    """GPipe keeps what the backward needs of every microbatch until the backward starts, so
    its temporaries grow with m; 1F1B keeps at most 2p - 1 microbatches' residuals (stage 0
    holds min(2p - 1, m); interleaved, the table's peak of chunk passes) and ZB-H1 p
    (interleaved: vp chunk passes), whatever m is: from m = 2p (every stash full) to m = 8p
    their temporaries stay within 2 %, while GPipe's grow by the 6p extra microbatches' saved
    activations (circular GPipe, which keeps only the v stage inputs of each microbatch and
    recomputes the rest, by less). Measured in docs/pipeline.md."""
    p = 2

    def temps(m, kind):
        c = cfg(data=2, stage=p, tensor=2, micro=m, zero=1, extra=WIDE + [
            f"train.global_batch={2 * m}", f"parallel.pipeline_schedule={kind}",
            f"parallel.pipeline_repeats={repeats}"])
        return hlo.memory(runtime.setup(c, devices_for(c)).compile()[0])["temp_bytes"]

    for kind in ("1f1b", "zb_h1"):
        assert Schedule(p, 2 * p, repeats, kind).in_flight == Schedule(p, 8 * p, repeats,
                                                                          kind).in_flight
        grown = temps(8 * p, kind) / temps(2 * p, kind)
        assert grown < 1.02, (kind, grown)
    gpipe = temps(8 * p, "gpipe") / temps(2 * p, "gpipe")
    assert gpipe > (1.2 if repeats == 1 else 1.025), gpipe


def test_zb_h1_never_copies_a_stash_or_the_gradient_stack():
    """ZB-H1 passes only slot-sized values through its per-device conditional: XLA:CPU copies
    every buffer a conditional inside a loop updates in place, which put a copy of every stash
    buffer in each branch and in the slot loop (14 in each), run every slot. Stash-shaped
    [stash slots, layers per stage, ...] copies may appear only in the entry computation
    (the buffers' setup), never in a loop body or a branch."""
    import re
    from collections import Counter

    p, m = 4, 8
    c = cfg(data=2, stage=p, micro=m, extra=WIDE + [
        "model.num_layers=8", f"train.global_batch={2 * m}", "parallel.pipeline_schedule=zb_h1"])
    text = runtime.setup(c, devices_for(c)).compile()[0].as_text()
    slots, computation, copies = Schedule(p, m, kind="zb_h1").in_flight, None, Counter()
    for line in text.splitlines():
        header = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            computation = "entry" if header.group(1) else header.group(2)
        if re.search(rf"f32\[{slots},2,[\d,]+\]\{{[^}}]*\}} copy\(", line):
            copies[computation] += 1
    assert copies["entry"] > 0  # the pattern finds the stash buffers
    assert set(copies) == {"entry"}, copies
