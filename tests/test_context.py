"""Context parallelism over `seq`: ring attention in the model gives the 1-device numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from helpers import (assert_grads_match, assert_losses_match, by_layout, devices_for, reference_run,
                     small_config)
from spmd3d import hlo, manual, runtime
from spmd3d.flash import tile_fwd
from spmd3d.ring import ring_attention

L4 = ["model.num_layers=4"]

LAYOUTS = {  # (data, stage, tensor, seq)
    "dp4_seq2": dict(data=4, seq=2),
    # a ring step (8 local tokens) in score tiles of 2 queries by 2 keys
    "dp2_seq4_tiles2": dict(data=2, seq=4, extra=["model.attention_tile=2"]),
    "seq8": dict(seq=8),
    # loss pieces of 8 positions, each spanning both sequence shards
    "dp2_tp2_seq2_chunked_loss": dict(data=2, tensor=2, seq=2, extra=["parallel.loss_chunk=8"]),
    "pp2_tp2_seq2_chunked_loss": dict(stage=2, tensor=2, seq=2, micro=2,
                                      extra=["parallel.loss_chunk=8"]),
    "dp2_pp2_seq2_zero1": dict(data=2, stage=2, seq=2, zero=1, micro=2),
    "tp2_seq4_sp_zero3": dict(tensor=2, seq=4, sp=True, zero=3),
    # Ulysses: all-to-alls over seq around the blocked kernel (8 kv heads: 4 a tensor shard)
    "ulysses_dp4_seq2": dict(data=4, seq=2, extra=["parallel.context=ulysses"]),
    "ulysses_tp2_seq4_sp_zero3": dict(tensor=2, seq=4, sp=True, zero=3,
                                      extra=["parallel.context=ulysses"]),
    "ulysses_dp2_pp2_seq2_1f1b": dict(data=2, stage=2, seq=2, micro=4,
                                      extra=["parallel.context=ulysses",
                                             "parallel.pipeline_schedule=1f1b"]),
}


def cfg(extra=(), **kw):
    return small_config(**kw, extra=L4 + list(extra))


@pytest.fixture(scope="module")
def reference():
    return reference_run(cfg())


GRADS = ["dp2_seq4_tiles2", "ulysses_tp2_seq4_sp_zero3", "ulysses_dp2_pp2_seq2_1f1b", "pp2_tp2_seq2_chunked_loss"]


@pytest.mark.parametrize("name", by_layout(LAYOUTS))
def test_context_parallel_losses_match_one_device(reference, name):
    assert_losses_match(cfg(**LAYOUTS[name]), reference[0], grads_too=name in GRADS)


@pytest.mark.parametrize("name", by_layout(GRADS))
def test_context_parallel_grads_match_one_device(reference, name):
    assert_grads_match(cfg(**LAYOUTS[name]), reference[1])


LONG = ["model.num_layers=1", "train.seq_len=4096", "train.global_batch=1", "model.d_model=64",
        "model.num_heads=4", "model.num_kv_heads=4", "model.d_ff=128"]


def test_activation_memory_falls_with_the_ring():
    """A device of a ring over n needs what one device needs for its share of the sequence:
    the compiled step's per-device temporaries at 4096 tokens over n are within 10 % of one
    device's at 4096 / n tokens (the ring holds one score tile at a time, as one device's
    kernel does, and recomputes the scores in the backward; the rest is its K/V blocks in
    flight), and so fall with n."""
    def temp(c):
        return hlo.memory(runtime.setup(c, devices_for(c)).compile()[0])["temp_bytes"]

    ring = {n: temp(small_config(seq=n, extra=LONG)) for n in (1, 2, 4, 8)}
    for n in (2, 4, 8):
        alone = temp(small_config(extra=LONG + [f"train.seq_len={4096 // n}"]))
        assert ring[n] <= 1.1 * alone and ring[n] < ring[n // 2], (n, ring, alone)


def test_zigzag_ring_computes_about_half_the_blocks():
    """Per-device attention FLOPs of the zig-zag ring over those of a causal-unaware ring (n
    full local blocks, masked): (n+1)/(2n) — the local step plus n-1 half blocks."""
    t, b, k, g, h = 1024, 1, 2, 2, 16
    q = jax.ShapeDtypeStruct((b, t, k, g, h), jnp.float32)
    kv = jax.ShapeDtypeStruct((b, t, k, h), jnp.float32)

    def flops(f, *args):
        with manual.unrolled_loops():
            return hlo.flops(jax.jit(f).lower(*args).compile())

    for n in (2, 4, 8):
        mesh = jax.make_mesh((n,), ("seq",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
        ring = flops(lambda q, k, v: ring_attention(q, k, v, "seq", mesh), q, kv, kv)
        ql = jax.ShapeDtypeStruct((b, t // n, k, g, h), jnp.float32)
        kvl = jax.ShapeDtypeStruct((b, t // n, k, h), jnp.float32)
        mask = np.tril(np.ones((t // n, t // n), bool))
        block = flops(lambda q, k, v: tile_fwd(q, k, v, 1.0, mask)[0], ql, kvl, kvl)
        # the ring's forward alone: its output's FLOPs exclude any backward
        ratio = ring / (n * block)
        assert abs(ratio - (n + 1) / (2 * n)) < 0.05, (n, ratio)


def test_a_pipeline_with_the_ring_reduces_layer_gradients_over_seq_once():
    """GPipe with ring attention: the layers' gradients cross `seq` once, after the tick loop,
    not once per tick and layer (the weights turn seq-varying before the loop); inside the
    loop `seq` carries the ring's shifts alone."""
    c = cfg(**LAYOUTS["dp2_pp2_seq2_zero1"])
    job = runtime.setup(c, devices_for(c))
    colls = hlo.collectives(job.compile()[0].as_text(), job.mesh.shape)
    over_seq = [x for x in colls if "seq" in x.axes]
    assert all(x.trips == 1 for x in over_seq if x.kind != "collective-permute"), over_seq
    assert any(x.kind == "collective-permute" and x.trips > 1 for x in over_seq)
