"""ZeRO does what it claims, read from the compiled step and the arrays themselves.

On `data = 8`: ZeRO-1 divides the per-device optimizer state by 8, ZeRO-2 the gradients,
ZeRO-3 the parameters; each stage is compared with the one before it, so exactly one kind of
state changes at a time. Byte counts come from `compiled.memory_analysis()`.
"""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import devices_for, small_config
from spmd3d import hlo, runtime
from spmd3d.sharding import shardings_for
from spmd3d.step import make_grad_fn
from spmd3d.store import abstract_like, flat

DATA = 8


abstract = abstract_like  # ShapeDtypeStructs with the given shardings


def local_bytes(tree, shardings):
    """Per-device bytes of a tree of arrays laid out by `shardings`."""
    return sum(int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
               for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


# one worker builds the compiled steps of the four ZeRO stages, not both
pytestmark = pytest.mark.xdist_group("zero")


@pytest.fixture(scope="module")
def compiled():
    """Per ZeRO stage: (job, train-step memory, gradient-function memory: ZeRO-1's and -2's,
    which ZeRO-2's test compares; None for the others)."""
    out = {}
    for z in range(4):
        cfg = small_config(data=DATA, zero=z)
        job = runtime.setup(cfg, devices_for(cfg))
        step, _ = job.compile()
        if z not in (1, 2):
            out[z] = (job, hlo.memory(step), None)
            continue
        grad_sh = shardings_for(job.abstract.params, job.plan.rules.grads, job.mesh)
        grad_fn = jax.jit(make_grad_fn(job.plan, job.graphdef),
                          out_shardings=(NamedSharding(job.mesh, P()), grad_sh))
        batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.train.seq_len + 1), np.int32,
                                     sharding=job.batch_sharding)
        grads = grad_fn.lower(abstract(job.abstract.params, job.shardings.params), batch).compile()
        out[z] = (job, hlo.memory(step), hlo.memory(grads))
    return out


def param_bytes(job):
    """(bytes ZeRO shards: every matrix, bytes it keeps whole: the d_model-sized norm scales)."""
    flat = jax.tree_util.tree_flatten(job.abstract.params, is_leaf=lambda x: hasattr(x, "get_metadata"))[0]
    sharded = sum(v.size * 4 for v in flat if "embed" in v.get_metadata("axes"))
    whole = sum(v.size * 4 for v in flat if "embed" not in v.get_metadata("axes"))
    assert whole < 0.01 * sharded
    return sharded, whole


def test_optimizer_state_sharded_by_zero1(compiled):
    job0, mem0, _ = compiled[0]
    job1, mem1, _ = compiled[1]
    full = local_bytes(job0.abstract.opt, job0.shardings.opt)
    s, w = param_bytes(job0)
    moments = 2 * s  # Adam's two moments of the sharded parameters
    assert full >= 2 * (s + w)
    assert local_bytes(job1.abstract.opt, job1.shardings.opt) == full - moments + moments // DATA
    # the compiled step's arguments shrink by exactly the moments' 7/8
    assert mem0["argument_bytes"] - mem1["argument_bytes"] == moments - moments // DATA


def test_gradients_sharded_by_zero2(compiled):
    job1, mem1, grads1 = compiled[1]
    _, mem2, grads2 = compiled[2]
    s, w = param_bytes(job1)
    scalar_and_padding = grads1["output_bytes"] - s - w
    assert 0 <= scalar_and_padding < 1024
    assert grads2["output_bytes"] == s // DATA + w + scalar_and_padding
    # inside the train step the gradient buffers are temporaries: they shrink too
    assert mem1["temp_bytes"] - mem2["temp_bytes"] >= 0.8 * (s - s // DATA)
    # and the parameters and optimizer state are unchanged from ZeRO-1
    assert mem1["argument_bytes"] == mem2["argument_bytes"]


def test_parameters_sharded_by_zero3(compiled):
    job2, mem2, _ = compiled[2]
    job3, mem3, _ = compiled[3]
    s, w = param_bytes(job2)
    assert local_bytes(job2.abstract.params, job2.shardings.params) == s + w
    assert local_bytes(job3.abstract.params, job3.shardings.params) == s // DATA + w
    assert mem2["argument_bytes"] - mem3["argument_bytes"] == s - s // DATA


def test_zero3_gathers_weights_layer_by_layer(compiled):
    """FSDP: each layer's four weight matrices are all-gathered over data inside the layer
    loop, in the forward loop and again in the backward loop: gathered weights are never kept
    for the backward, so at most one layer's full weights are alive at a time."""
    job, _, _ = compiled[3]
    step, _ = job.compile()
    colls = hlo.collectives(step.as_text(), job.mesh.shape)
    matrix_gathers = [c for c in colls if c.kind == "all-gather" and c.axes == ("data",)
                      and c.trips == job.cfg.model.num_layers and c.bytes >= 64 * 1024]
    per_loop = {}
    for c in matrix_gathers:
        per_loop[c.computation] = per_loop.get(c.computation, 0) + 1
    assert sorted(per_loop.values()) == [4, 4], per_loop


def test_zero3_gathers_weights_in_the_compute_dtype(compiled):
    """ZeRO-3 casts each layer's weights to the compute dtype where they are stored and then
    gathers them: half the bytes of gathering the fp32 weights (left to sharding propagation,
    the cast followed the gather). Shown with float16 compute: XLA:CPU widens bf16 collectives
    to fp32 after partitioning (a GPU's NCCL takes bf16), but keeps float16 ones."""
    def layer_gather_bytes(job):
        colls = hlo.collectives(job.compile()[0].as_text(), job.mesh.shape)
        return sum(c.bytes * c.trips for c in colls
                   if c.kind == "all-gather" and c.trips == job.cfg.model.num_layers)

    fp32 = compiled[3][0]
    cfg = small_config(data=DATA, zero=3, extra=["model.dtype=float16"])
    fp16 = runtime.setup(cfg, devices_for(cfg))
    assert layer_gather_bytes(fp32) > 0
    assert 2 * layer_gather_bytes(fp16) == layer_gather_bytes(fp32)


@pytest.mark.parametrize("zero", [0, 3])
def test_initialized_state_lives_where_the_rules_say(zero):
    """Walk the initialized state: every leaf's sharding is the one its logical names give."""
    cfg = small_config(data=2, tensor=4, zero=zero)
    job = runtime.setup(cfg, devices_for(cfg))
    state = job.init_state()
    expected = shardings_for(job.abstract.params, job.plan.rules.params, job.mesh)
    for (path, arr), want in zip(jax.tree_util.tree_flatten_with_path(state.params)[0],
                                 jax.tree.leaves(expected)):
        assert arr.sharding.is_equivalent_to(want, arr.ndim), (path, arr.sharding, want)
    # spot checks in mesh-axis terms
    w_qkv = state.params["blocks"]["attn"]["w_qkv"][...]
    assert w_qkv.sharding.spec[2] == "tensor"  # kv heads over tensor
    assert (w_qkv.sharding.spec[1] == "data") == (zero == 3)  # embed over data only in ZeRO-3
    mu = flat(state)["opt/mu/blocks/mlp/w_down"]
    assert mu.sharding.spec == P("stage", "tensor", "data" if zero >= 1 else None)


@pytest.mark.parametrize("layout", [
    dict(data=2, tensor=4, zero=3, sp=True),
    dict(tensor=2, seq=4, zero=1),
    dict(data=2, stage=2, tensor=2, micro=2, extra=["model.num_layers=4",
                                                   "parallel.pipeline_repeats=2"]),
    dict(data=2, stage=4, micro=4, extra=["model.num_layers=6"]),  # uneven: padding slots
])
def test_every_layout_initializes_the_same_state(layout):
    """A layout's own jitted initializer (values from `train.seed` and the canonical layout
    alone) gives, leaf for leaf and bit for bit, the one-device state placed in its layout:
    what the equivalence tests start from (`helpers.start_state`)."""
    from helpers import job_for, start_state

    cfg = small_config(**layout)
    own, placed = job_for(cfg).init_state(), start_state(cfg)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(own)[0], jax.tree.leaves(placed)):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), path
        assert np.array_equal(np.asarray(a), np.asarray(b)), path


def test_zero1_accumulating_keeps_its_gradients_sharded_and_gathers_once():
    """ZeRO-1 over 4 accumulated microbatches: the accumulator is sharded over data (as
    ZeRO-2's), each microbatch's gradients are reduced in the loop and the updated parameters
    gathered once, after it (with a replicated accumulator XLA gathered it every microbatch)."""
    from spmd3d import hlo, runtime
    from spmd3d.plan import Plan

    c = small_config(data=8, zero=1, micro=4, extra=("train.global_batch=32",))
    plan = Plan.resolve(c, devices_for(c))
    assert plan.rules.grads_over_batch and not plan.rules.params_over_batch
    assert "gradients accumulated sharded" in plan.describe()
    job = runtime.setup(c, devices_for(c))
    colls = hlo.collectives(job.compile()[0].as_text(), job.mesh.shape)
    gathers = [x for x in colls if x.kind == "all-gather" and x.axes == ("data",)]
    # (the plain lookup's token ids, 4 KB, are gathered per microbatch: no weights)
    assert gathers and all(x.trips == 1 for x in gathers if x.bytes > 4096), gathers
