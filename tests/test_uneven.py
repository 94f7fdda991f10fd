"""Uneven stages: a layer count that stage x repeats does not divide (LLaMA-3 405B: 126 layers
on 16 stages) pads the short chunks with empty slots, gives the 1-device numbers, and keeps
checkpoints in the canonical [L, ...] order."""

import numpy as np
import pytest

from helpers import (assert_grads_match, assert_losses_match, by_layout, reference_run,
                     small_config)
from spmd3d.pipeline import layer_order
from spmd3d.train import train

L6 = ["model.num_layers=6"]

LAYOUTS = {
    "dp2_pp4_m4": dict(data=2, stage=4, micro=4),  # 6 layers on 4 stages: 1, 2, 2, 1
    "dp2_pp2_tp2_v2_m2": dict(data=2, stage=2, tensor=2, micro=2,
                              extra=["parallel.pipeline_repeats=2"]),  # chunks of 1, 2, 2, 1
}


def cfg(extra=(), **kw):
    return small_config(**kw, extra=L6 + list(extra))


@pytest.fixture(scope="module")
def reference():
    return reference_run(cfg())


def test_layer_order_pads_the_first_and_last_chunks():
    order = layer_order(126, 16, 1)
    assert len(order) == 128 and list(np.flatnonzero(order < 0)) == [7, 127]
    assert sorted(order[order >= 0]) == list(range(126))
    stage_sizes = [(order[s * 8:(s + 1) * 8] >= 0).sum() for s in range(16)]
    assert stage_sizes == [7] + [8] * 14 + [7]
    # circular: stage 0 holds chunks 0 and 2, stage 1 chunks 1 and 3; chunks 0 and 3 are short
    assert layer_order(6, 2, 2).tolist() == [0, -1, 3, 4, 1, 2, 5, -1]
    assert layer_order(8, 2, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]  # even: as before


@pytest.mark.parametrize("name", by_layout(LAYOUTS))
def test_uneven_losses_match_one_device(reference, name):
    assert_losses_match(cfg(**LAYOUTS[name]), reference[0], grads_too=name in GRADS)


GRADS = ["dp2_pp2_tp2_v2_m2"]


@pytest.mark.parametrize("name", by_layout(GRADS))
def test_uneven_grads_match_one_device(reference, name):
    assert_grads_match(cfg(**LAYOUTS[name]), reference[1])


def test_uneven_checkpoint_is_canonical(tmp_path, reference):
    """Saved from 6 layers on 4 stages (8 stored slots), resumed on data parallelism alone."""
    run = [f"run.dir={tmp_path}", "checkpoint.every=2",  # the reference's decay horizon
           f"optim.decay_steps={cfg().train.steps}"]
    train(cfg(data=2, stage=4, micro=4, extra=run + ["train.steps=2"]))
    more = train(cfg(data=8, extra=run + ["train.steps=4"]))
    got = np.array([r["loss"] for r in more])
    assert np.max(np.abs(got - reference[0][2:4]) / reference[0][2:4]) < 1e-4, got
