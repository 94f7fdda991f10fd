"""bfloat16 on several devices: every axis trains and gives the 1-device bf16 numbers.

bf16 keeps 8 bits of mantissa (unit roundoff u = 2^-8 = 0.0039), and the layouts sum their
matmuls and gradients in other orders than one device does, so they agree to about u, not to
float32's 1e-5. Measured on these layouts: losses within 1e-4 relative over 3 steps, gradient
leaves within 1.5 u of their largest value. The bounds keep a margin above that: 1e-3 for the
losses (the first step moves the loss by 0.7, so a gradient 1 % off moves the next loss by
about that), 4 u for the gradients.

A gradient that a shard_map sums over a manual axis is summed in fp32 (`manual.vary`): in
bf16 XLA:CPU's all-reduce-promotion pass aborted the compile (its reducer's root was the
sharding constraint's copy, "Invalid binary instruction opcode copy").
"""

import re

import jax
import numpy as np
import pytest

from helpers import devices_for, first_grads, max_rel_diff, reference_run, small_config, train_losses
from spmd3d import runtime
from spmd3d.store import abstract_like

BF16 = ["model.dtype=bfloat16", "train.steps=3", "model.num_layers=4"]

LAYOUTS = {  # one per axis and ZeRO stage, and each schedule over stage
    "dp8_zero1": dict(data=8, zero=1),
    "dp8_zero3": dict(data=8, zero=3),
    "dp4_tp2_sp": dict(data=4, tensor=2, sp=True),
    "dp4_seq2": dict(data=4, seq=2),
    "dp4_pp2_gpipe": dict(data=4, stage=2, micro=2),
    "dp2_pp2_tp2_1f1b_zero3": dict(data=2, stage=2, tensor=2, micro=2, zero=3,
                                   extra=["parallel.pipeline_schedule=1f1b"]),
    "dp2_pp2_seq2_zb_h1": dict(data=2, stage=2, seq=2, micro=2,
                               extra=["parallel.pipeline_schedule=zb_h1"]),
}


GRADS = ("dp8_zero3", "dp2_pp2_seq2_zb_h1")  # and every leaf's gradient at step 0


def cfg(extra=(), **kw):
    return small_config(**kw, extra=BF16 + list(extra))


@pytest.fixture(scope="module")
def reference():
    return reference_run(cfg())


def reducer_dtypes(job):
    """The element type of every all-reduce's reducer in the lowered step (before XLA's
    passes: what XLA:CPU's all-reduce promotion sees)."""
    t = job.cfg.train
    batch = jax.ShapeDtypeStruct((t.global_batch, t.seq_len + 1), np.int32,
                                 sharding=job.plan.batch_sharding)
    text = job.step_fn.lower(abstract_like(job.abstract, job.shardings), batch).as_text()
    return re.findall(r'"stablehlo\.all_reduce".*\n\s*\^bb0\(%\w+: tensor<(\w+)>', text)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bf16_matches_one_device(reference, name):
    c = cfg(**LAYOUTS[name])
    # first, before anything compiles: no gradient is summed over devices in bf16
    dtypes = reducer_dtypes(runtime.setup(c, devices_for(c)))
    assert dtypes and "bf16" not in dtypes, dtypes
    ref_losses, (ref_loss, ref_grads) = reference
    losses, job, _ = train_losses(c)
    assert job.mesh.size == 8 and ref_losses[-1] < ref_losses[0] - 0.3
    assert max_rel_diff(losses, ref_losses) < 1e-3, (losses, ref_losses)
    if name in GRADS:
        loss, grads = first_grads(c)
        assert abs(loss - ref_loss) / ref_loss < 1e-3 and grads.keys() == ref_grads.keys()
        for k, g in grads.items():
            scale = np.max(np.abs(ref_grads[k]))
            assert np.max(np.abs(g - ref_grads[k])) <= 2**-6 * scale, k
