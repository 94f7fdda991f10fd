"""The central property: every layout gives the 1-device numbers (float32).

4 train steps per layout (the learning rate's warm-up, peak and decay) must match the 1-device
losses at every step (relative < 1e-4), and the gradients at the initial parameters must match
leaf by leaf. Meshes are asymmetric (2x4 and 4x2) so that a swapped axis cannot hide.
"""

import pytest

from helpers import (assert_grads_match, assert_losses_match, by_layout, reference_run,
                     small_config)

LAYOUTS = {
    "dp8": dict(data=8),
    "tp8": dict(tensor=8),
    "dp2_tp4": dict(data=2, tensor=4),
    "dp4_tp2": dict(data=4, tensor=2),
    # the head and loss in pieces of 8 positions (4 of them): the chunked, vocab-parallel loss
    "dp2_tp4_sp_chunked_loss": dict(data=2, tensor=4, sp=True, extra=("parallel.loss_chunk=8",)),
    "zero1_dp4_tp2": dict(data=4, tensor=2, zero=1),
    "zero2_dp4_tp2": dict(data=4, tensor=2, zero=2),
    "zero3_dp8": dict(data=8, zero=3),
    "zero3_dp2_tp4_sp_accum_remat": dict(data=2, tensor=4, zero=3, sp=True, micro=2, remat="full"),
    "zero2_dp8_accum4_save_dots": dict(data=8, zero=2, micro=2, remat="save_dots"),
    "zero3_dp4_tp2_unrolled": dict(data=4, tensor=2, zero=3, extra=("parallel.scan_layers=false",)),
    "dp4_tp2_accum2_stage_remat": dict(data=4, tensor=2, micro=2, remat="stage"),
}


@pytest.fixture(scope="module")
def reference():
    return reference_run(small_config())


@pytest.mark.parametrize("name", by_layout(LAYOUTS))
def test_losses_match_one_device(reference, name):
    ref_losses, _ = reference
    assert ref_losses[-1] < ref_losses[0] - 0.3, "the reference run should be learning"
    assert_losses_match(small_config(**LAYOUTS[name]), ref_losses, grads_too=name in GRADS)


GRADS = ["dp8", "dp2_tp4", "dp4_tp2", "dp2_tp4_sp_chunked_loss", "zero3_dp2_tp4_sp_accum_remat"]


@pytest.mark.parametrize("name", by_layout(GRADS))
def test_grads_match_one_device(reference, name):
    assert_grads_match(small_config(**LAYOUTS[name]), reference[1])
