"""HSDP (`mesh.replicate`): ZeRO over a group of the data-parallel devices, whole copies of
the sharded state across groups.

Every ZeRO stage over `replicate` x `data` equals one device (losses and gradients); the state
is sharded over a group and replicated across groups as placed; the compiled step's
collectives run per group (ZeRO-3's gathers inside a group, the gradients' shards reduced
across groups) and the planner counts them per axis; a checkpoint restores onto any other
grouping."""

import pytest

from helpers import assert_losses_match, by_layout, job_for, reference_run, small_config

LAYOUTS = {
    "hsdp_2x4_zero1": dict(data=8, zero=1, extra=("mesh.replicate=2",)),
    "hsdp_2x2_tp2_zero2": dict(data=4, tensor=2, zero=2, extra=("mesh.replicate=2",)),
    "hsdp_4x2_zero3_accum": dict(data=8, zero=3, micro=2, extra=("mesh.replicate=4",)),
    "hsdp_2x2_pp2_zero3": dict(data=4, stage=2, zero=3, micro=2, extra=("mesh.replicate=2",)),
}


@pytest.fixture(scope="module")
def reference():
    return reference_run(small_config())


@pytest.mark.parametrize("name", by_layout(LAYOUTS))
def test_hsdp_matches_one_device(reference, name):
    assert_losses_match(small_config(**LAYOUTS[name]), reference[0], grads_too=True)


def test_the_state_is_sharded_in_a_group_and_copied_across_groups():
    """ZeRO-3 over 2 groups of 4: a weight's `embed` dim is split over `data` alone, so the
    devices at the same place of each group hold the same shard."""
    import numpy as np

    from helpers import start_state
    cfg = small_config(**LAYOUTS["hsdp_4x2_zero3_accum"])
    job = job_for(cfg)
    assert dict(job.plan.mesh.shape) == {"replicate": 4, "data": 2, "stage": 1, "tensor": 1,
                                         "seq": 1}
    w = start_state(cfg).params["blocks"]["mlp"]["w_down"][...]
    assert "data" in w.sharding.spec and "replicate" not in str(w.sharding.spec)
    shards = {d.id: np.asarray(s.data) for s in w.addressable_shards for d in [s.device]}
    grid = job.plan.mesh.devices  # [replicate, data, stage, tensor, seq]
    for g in range(1, 4):
        for i in range(2):
            np.testing.assert_array_equal(shards[grid[g, i].flat[0].id],
                                          shards[grid[0, i].flat[0].id])
    assert not np.array_equal(shards[grid[0, 0].flat[0].id], shards[grid[0, 1].flat[0].id])


def test_collectives_run_per_group():
    """The compiled ZeRO-3 step gathers weights inside a group (over `data` only), reduces the
    gradients' shards across groups (over `replicate` only), and nothing moves whole weights
    across groups; the planner's bytes per axis are the compiled ones."""
    from spmd3d import hlo
    from spmd3d.plan import estimate
    cfg = small_config(data=8, zero=3, extra=("mesh.replicate=2",))
    job = job_for(cfg)
    from helpers import start_state
    text = job.step_fn.lower(start_state(cfg), job.global_batch(0)).compile().as_text()
    colls = hlo.collectives(text, dict(job.plan.mesh.shape))
    kinds = {(c.kind, c.axes) for c in colls}
    assert ("all-gather", ("data",)) in kinds and ("all-reduce", ("replicate",)) in kinds
    assert not {k for k in kinds if k[0] == "all-gather" and "replicate" in k[1]}, kinds
    got = hlo.bytes_per_axis(colls, dict(job.plan.mesh.shape))
    analytic = estimate.collectives(job.plan)["result"]
    for axis in ("replicate", "data"):
        assert analytic[axis] == pytest.approx(got[axis], rel=0.02), (axis, analytic, got)


def test_a_checkpoint_restores_onto_another_grouping(tmp_path):
    """Four steps under HSDP 2 x 4 with ZeRO-3, resumed under HSDP 4 x 2 with ZeRO-1 for two
    more: the losses of one uninterrupted run over 8 plain data-parallel devices."""
    import numpy as np

    from test_train import cfg_in, train
    ref = train(cfg_in(tmp_path / "ref", "train.steps=6", "mesh.data=8"))
    run = tmp_path / "run"
    train(cfg_in(run, "train.steps=4", "mesh.data=8", "mesh.replicate=2",
                 "parallel.zero_stage=3"))
    more = train(cfg_in(run, "train.steps=6", "mesh.data=8", "mesh.replicate=4",
                        "parallel.zero_stage=1"))
    assert [r["step"] for r in more] == [5, 6]
    got, want = (np.array([r["loss"] for r in rs]) for rs in (more, ref[4:]))
    assert np.max(np.abs(got - want) / want) < 1e-4, (got, want)
