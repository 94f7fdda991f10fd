"""Context parallelism over `seq`: ring attention in the model gives the 1-device numbers."""

import numpy as np
import pytest

from helpers import first_grads, max_rel_diff, small_config, train_losses

L4 = ["model.num_layers=4"]

LAYOUTS = {  # (data, stage, tensor, seq)
    "dp4_seq2": dict(data=4, seq=2),
    "dp2_seq4": dict(data=2, seq=4),
    "seq8": dict(seq=8),
    "dp2_tp2_seq2": dict(data=2, tensor=2, seq=2),
    "pp2_tp2_seq2": dict(stage=2, tensor=2, seq=2, micro=2),
    "dp2_pp2_seq2_zero1": dict(data=2, stage=2, seq=2, zero=1, micro=2),
    "tp2_seq4_sp_zero3": dict(tensor=2, seq=4, sp=True, zero=3),
}


def cfg(**kw):
    return small_config(**kw, extra=L4)


@pytest.fixture(scope="module")
def reference():
    c = cfg()
    return train_losses(c)[0], first_grads(c)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_losses_match_one_device(reference, name):
    losses, job, _ = train_losses(cfg(**LAYOUTS[name]))
    assert job.mesh.size == 8
    assert max_rel_diff(losses, reference[0]) < 1e-4, (losses, reference[0])


@pytest.mark.parametrize("name", ["dp2_seq4", "pp2_tp2_seq2"])
def test_context_parallel_grads_match_one_device(reference, name):
    ref_loss, ref_grads = reference[1]
    loss, grads = first_grads(cfg(**LAYOUTS[name]))
    assert abs(loss - ref_loss) / ref_loss < 1e-5
    for k, g in grads.items():
        scale = np.max(np.abs(ref_grads[k]))
        assert np.max(np.abs(g - ref_grads[k])) <= 1e-5 * scale, k
