"""Tensor parallelism emits Megatron's collectives, counted in the compiled step's HLO.

Per transformer layer (the layer loop bodies appear once in the HLO, run L times):
- TP: forward one all-reduce after attention's and one after the MLP's row-parallel matmul;
  backward one each for the input gradients of the column-parallel matmuls. All of them
  activation-sized, over `tensor` only.
- TP + SP: each of those becomes an all-gather entering the block and a reduce-scatter
  leaving it (XLA:CPU lowers a reduce-scatter as an all-reduce whose result each device
  slices, so on CPU it reads as an all-reduce), with the residual stream split over T.
"""

from collections import Counter

import pytest

from helpers import devices_for, small_config
from spmd3d import hlo, runtime


def layer_loop_collectives(cfg):
    job = runtime.setup(cfg, devices_for(cfg))
    compiled, _ = job.compile()
    colls = hlo.collectives(compiled.as_text(), job.mesh.shape)
    activation = (cfg.train.global_batch // cfg.mesh.data) * cfg.train.seq_len * cfg.model.d_model * 4
    loops = {}
    for c in colls:
        if c.trips == cfg.model.num_layers and c.bytes == activation:
            loops.setdefault(c.computation, Counter())[(c.kind, c.axes)] += 1
    return loops, colls, hlo.memory(compiled)


@pytest.mark.parametrize("data,tensor", [(2, 4), (4, 2)])
def test_tensor_parallel_all_reduces(data, tensor):
    loops, colls, _ = layer_loop_collectives(small_config(data=data, tensor=tensor))
    # forward loop and backward loop: two activation all-reduces over tensor each, nothing else
    assert list(loops.values()) == [Counter({("all-reduce", ("tensor",)): 2})] * 2, loops
    # gradients are reduced over data, never over tensor
    assert not [c for c in colls if c.axes == ("data", "tensor")]


def test_sequence_parallel_gathers_and_scatters():
    cfg = small_config(data=2, tensor=4, sp=True)
    loops, colls, mem = layer_loop_collectives(cfg)
    assert list(loops.values()) == [Counter({("all-gather", ("tensor",)): 2,
                                             ("all-reduce", ("tensor",)): 2})] * 2, loops
    # the norm scales see only their T/tensor slice: their gradients are summed over tensor
    # (XLA may combine the two norms' reductions into one op)
    norm_grads = sum(c.bytes for c in colls if c.kind == "all-reduce" and c.axes == ("tensor",)
                     and c.trips == cfg.model.num_layers and c.bytes < 4 * cfg.model.d_model * 4)
    assert norm_grads == 2 * cfg.model.d_model * 4
    # activations kept for the backward are T-split: less temporary memory than plain TP
    _, _, mem_tp = layer_loop_collectives(small_config(data=2, tensor=4))
    assert mem["temp_bytes"] < mem_tp["temp_bytes"]


def test_pure_data_parallel_has_no_tensor_collectives():
    cfg = small_config(data=8)
    loops, colls, _ = layer_loop_collectives(cfg)
    assert loops == {}
    assert {c.axes for c in colls} <= {("data",), ()}
    # one gradient reduction per layer, in the backward loop, over data
    grads = [c for c in colls if c.kind == "all-reduce" and c.trips == cfg.model.num_layers]
    assert len(grads) == 1 and grads[0].axes == ("data",)


def test_shardy_replica_groups_with_device_ids():
    """Shardy prints a mesh that is not in device order with `device_ids=([dims]T(perm))`."""
    from spmd3d.hlo import _groups

    plain = "replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}, to_apply=%add"
    assert _groups(plain) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    permuted = "replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}"
    assert _groups(permuted) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert _groups(permuted.replace("{'axis_0'}", "{'axis_1'}")) == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_unrolled_layers_run_the_same_tensor_collectives_without_a_loop():
    """`parallel.scan_layers=false` traces the L layers one after another: no while loop in
    the compiled step, and per step the same tensor-axis collectives as the scanned step (each
    layer's own, L times over, instead of one loop body run L times): the same bytes, as XLA
    may combine the optimizer's small norm all-reduces with different neighbours in each."""
    def compiled(scan):
        cfg = small_config(data=2, tensor=4, extra=(f"parallel.scan_layers={scan}",))
        job = runtime.setup(cfg, devices_for(cfg))
        text = job.compile()[0].as_text()
        return text, hlo.collectives(text, job.mesh.shape)

    (scanned, loop_colls), (unrolled, flat_colls) = compiled("true"), compiled("false")
    assert " while(" in scanned and " while(" not in unrolled
    assert all(c.trips == 1 for c in flat_colls)
    tensor = lambda colls: {k: n for k, n in hlo.bytes_by_axes(colls).items()  # noqa: E731
                            if k[1] == ("tensor",)}
    assert tensor(flat_colls) == tensor(loop_colls) != {}


def test_collectives_in_a_branch_run_with_the_loop_and_count_per_axis_alike():
    """A collective inside a conditional's branch, in a loop body, runs once per trip of the
    loop (as if its branch were taken); `bytes_per_axis` counts a reduce-scatter by its input,
    an all-reduce by its result and one over two axes on each of them."""
    text = """
HloModule m

%branch (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %ar = f32[8]{0} all-reduce(%p), replica_groups={{0,1},{2,3}}, to_apply=%add
}

%body (c: (s32[], f32[8])) -> (s32[], f32[8]) {
  %x = f32[8]{0} get-tuple-element(%c), index=1
  %k = f32[8]{0} conditional(%pred, %x, %x), branch_computations={%branch, %other}
  %rs = f32[4]{0} reduce-scatter(%x), replica_groups={{0,2},{1,3}}, dimensions={0}
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %both = f32[8]{0} all-reduce(%a), replica_groups={{0,1,2,3}}, to_apply=%add
}
"""
    mesh = {"data": 2, "stage": 1, "tensor": 2, "seq": 1}
    colls = hlo.collectives(text, mesh)
    assert [(c.kind, c.axes, c.trips) for c in colls] == [
        ("all-reduce", ("tensor",), 3), ("reduce-scatter", ("data",), 3),
        ("all-reduce", ("data", "tensor"), 1)]
    assert hlo.bytes_per_axis(colls, mesh) == {"data": 3 * 32 + 32, "stage": 0,
                                               "tensor": 3 * 32 + 32, "seq": 0}


def test_matmul_flops_count_every_trip_of_a_scanned_program():
    """`hlo.matmul_flops` reads a compiled scan as it runs: a loop of 5 matmuls inside a loop
    of 3, whose body computation also runs once outside it, counts 2 m n k for each of the
    3 x 5 + 1 (and the head's after them), as it does in the same program unrolled (XLA's
    cost analysis of the scanned program counts each loop body once)."""
    import jax
    import jax.numpy as jnp

    from spmd3d.manual import unrolled_loops, unroll

    def inner(x, w):
        return jax.lax.scan(lambda x, _: (jnp.tanh(x @ w), None), x, None, length=5,
                            unroll=unroll())[0]

    def f(x, w, head):
        x = jax.lax.scan(lambda x, _: (inner(x, w), None), x, None, length=3, unroll=unroll())[0]
        return (x @ w) @ head

    args = (jnp.ones((16, 32)), jnp.ones((32, 32)), jnp.ones((32, 48)))
    one, last = 2 * 16 * 32 * 32, 2 * 16 * 32 * 48
    compiled = jax.jit(f).lower(*args).compile()
    assert hlo.matmul_flops(compiled.as_text()) == (3 * 5 + 1) * one + last
    # less the dots with a dimension of 48 (the head's, as a vocabulary's): the last alone
    assert hlo.matmul_flops(compiled.as_text(), without=48) == (3 * 5 + 1) * one
    with unrolled_loops():
        unrolled = jax.jit(f).lower(*args).compile()
    assert hlo.matmul_flops(unrolled.as_text()) == (3 * 5 + 1) * one + last
    assert hlo.flops(compiled) < 3 * one + last  # what the cost analysis sees of the loops
