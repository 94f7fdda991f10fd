"""Activation offloading: remat policies that keep a layer's chosen residuals in the host's
pinned memory instead of the device's, and what their copies cost.

`offload` keeps what `full` keeps, the layer's input (named `NAME` by the layer), on the
host; `offload_dots` keeps what `save_dots` keeps, the projections' outputs, there. Each
recomputes what its device twin does (`RECOMPUTES_AS`). The scan over the layers stacks the
offloaded values in host memory; the backward brings each layer's back before its recompute.
docs/context.md says when the copies hide behind compute.
"""

from __future__ import annotations

NAME = "layer_input"  # what `offload` keeps (`Transformer.layer` names its input)
RECOMPUTES_AS = {"offload": "full", "offload_dots": "save_dots"}  # a policy's device twin


def policy(name: str):
    """jax's checkpoint policy for offloading policy `name`."""
    import jax

    policies = jax.checkpoint_policies
    if name == "offload":
        return policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=[NAME],
            offload_src="device", offload_dst="pinned_host")
    return policies.offload_dot_with_no_batch_dims("device", "pinned_host")


def copies(nbytes: float, gbps: float, compute_s: float, redone: int) -> dict:
    """A step's copies of `nbytes` each way over a host link of `gbps` GB/s: out during the
    forward, back in during the backward (`copy_s`, each way), against the forward's and the
    backward's share of `compute_s` (`forward_s`: one pass in 3 + the `redone` forwards).
    What a copy does not hide behind the half it overlaps is `exposed_s` (the seeds' rule:
    offload when the link's time is under the compute's)."""
    copy = nbytes / (gbps * 1e9)
    forward = compute_s / (3 + redone)
    exposed = max(0.0, copy - forward) + max(0.0, copy - (compute_s - forward))
    return {"bytes": nbytes, "copy_s": copy, "forward_s": forward, "exposed_s": exposed}
