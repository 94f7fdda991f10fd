"""What every layer module is built from: parameters with logical axis names (`param`), their
use as matmul inputs (`use`), projections by name (`project`: FP8 and the zero-bubble taps
hook in there), and RMSNorm. `model.py` (attention, MLP, MoE, the stack) and `mla.py` (latent
attention) build their layers from these.

A module that projects declares `PROJECTIONS = {name: (weight attribute, einsum)}`; the
planner, FP8 and the zero-bubble schedule's weight-gradient pass find its projections there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from . import fp8
from .ops import Ops
from .sharding import Param, use_param


def use(p: Param, dtype):
    """The value of parameter `p` as a matmul input (see `sharding.use_param`)."""
    return use_param(p[...], p.get_metadata("axes"), dtype)


def project(module, name: str, x, ops: Ops | None = None):
    """Projection `name` of `module` (its `PROJECTIONS`: weight and einsum) applied to x,
    through FP8 when the module has scaling state (`fp8.einsum`)."""
    weight, spec = module.PROJECTIONS[name]
    w = use(getattr(module, weight), module.dtype)
    with jax.named_scope(name):  # the planner finds a projection's output by this name
        meta = getattr(module, "fp8", None)
        y = jnp.einsum(spec, x, w) if meta is None else \
            fp8.einsum(spec, x, w, meta, list(module.PROJECTIONS).index(name))
    return y if ops is None else ops.project(name, x, y)


def param(rngs: nnx.Rngs, shape, axes, std: float, dtype) -> Param:
    value = std * jax.random.normal(rngs.params(), shape, dtype)
    return Param(value, axes=axes)


def rms_norm(x, scale_d, eps: float):
    """x / rms(x) * scale over the last dim; statistics in fp32 whatever the compute dtype."""
    y = x.astype(jnp.float32)
    y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + eps)
    return (y * scale_d).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm over the last dim: of the residual stream (`width` d_model, axis `norm`, which
    ZeRO never shards: it would save nothing and cost a collective per layer), or of another
    width (MLA's latents: axis `latent`). `scope` names where the planner finds its output."""

    def __init__(self, width: int, eps: float, dtype, axis: str = "norm", scope: str = "norm"):
        self.eps, self.scope = eps, scope
        self.scale = Param(jnp.ones((width,), dtype), axes=(axis,))

    def __call__(self, x):
        with jax.named_scope(self.scope):
            return rms_norm(x, use(self.scale, jnp.float32), self.eps)
