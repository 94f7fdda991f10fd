"""Activation offloading (`parallel.remat=offload | offload_dots`): the chosen residuals kept in
the host's pinned memory instead of the device's.

On the CPU device and host are one memory and XLA:CPU compiles the copies away, so what can be
held here is held: every layout equals one device, the traced step keeps exactly the policy's
residuals in host memory (and no copy of them on the device), and the program a GPU would
compile carries the copies to and from the host.
"""

import jax
import numpy as np
import pytest

from helpers import (assert_losses_match, by_layout, job_for, reference_run, small_config,
                     start_state)

LAYOUTS = {
    "offload_dp2_tp4_sp_zero3": dict(data=2, tensor=4, zero=3, sp=True, remat="offload"),
    "offload_dots_dp4_seq2": dict(data=4, seq=2, remat="offload_dots"),
    "offload_dp2_pp2_tp2_gpipe": dict(data=2, stage=2, tensor=2, micro=4, remat="offload"),
    "offload_dots_pp2_dp4": dict(data=4, stage=2, micro=2, remat="offload_dots"),
}


@pytest.fixture(scope="module")
def reference():
    return reference_run(small_config())


@pytest.mark.parametrize("name", by_layout(LAYOUTS))
def test_offloading_matches_one_device(reference, name):
    assert_losses_match(small_config(**LAYOUTS[name]), reference[0], grads_too=True)


def _stacked_on_host(jaxpr):
    """What the traced step stacks over its layers in host memory: the layer scans' outputs of
    the host memory space (looking inside the jaxprs around them, not inside their bodies)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield from (v.aval for v in eqn.outvars
                        if getattr(v.aval, "memory_space", None) == jax.memory.Space.Host)
        else:
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from _stacked_on_host(sub)


def _grad_fn(remat):
    """(the one-device step's jitted gradient function, its abstract inputs, its config)."""
    from spmd3d.step import make_grad_fn
    cfg = small_config(data=1, remat=remat, extra=("train.global_batch=2",))
    job = job_for(cfg)
    batch = jax.ShapeDtypeStruct((2, cfg.train.seq_len + 1), np.int32)
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          start_state(cfg).params)
    return jax.jit(make_grad_fn(job.plan, job.graphdef)), (params, batch), cfg


@pytest.mark.parametrize("remat", ["offload", "offload_dots", "full"])
def test_the_step_keeps_the_policy_residuals_on_the_host(remat):
    """`offload` stacks each layer's input on the host, [L, B, T, D], and nothing else;
    `offload_dots` the projections' outputs; `full` nothing. The planner's host bytes (the
    layer's own vjp, traced apart) are what the step stacks."""
    from spmd3d.plan import residuals
    fn, args, cfg = _grad_fn(remat)
    m, t = cfg.model, cfg.train.seq_len
    stacked = list(_stacked_on_host(fn.trace(*args).jaxpr.jaxpr))
    nbytes = sum(a.size * a.dtype.itemsize for a in stacked)
    if remat == "offload":
        assert [a.shape for a in stacked] == [(m.num_layers, 2, t, m.d_model)]
    elif remat == "offload_dots":  # fused qkv, the output projection, fused gate/up
        assert len(stacked) == 3 and nbytes > 3 * m.num_layers * 2 * t * m.d_model * 4
    planned = residuals.of(job_for(cfg).plan).on_host(remat) * m.num_layers * 2 * t
    assert nbytes == planned


def test_a_gpu_program_copies_to_the_host_and_back():
    """Exported for a GPU, the step's program moves the layer inputs to pinned host memory in
    the forward and back in the backward: the annotations XLA's host offloading acts on (and
    which XLA:CPU, with one memory, drops: the CPU program has none)."""
    from jax import export
    fn, args, _ = _grad_fn("offload")
    text = export.export(fn, platforms=["cuda"])(*args).mlir_module()
    moves = [line for line in text.splitlines() if "@annotate_device_placement" in line]
    to_host = [line for line in moves if '_xla_buffer_placement = "pinned_host"' in line]
    assert len(to_host) >= 1 and len(moves) > len(to_host), moves
    assert "annotate_device_placement" not in fn.lower(*args).as_text()
