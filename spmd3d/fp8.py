"""FP8 projections with delayed scaling: e4m3 inputs and weights, e5m2 output gradients.

`model.fp8=delayed` puts each transformer projection (QKV, attention output, the MLP's gate/up
and down) through `einsum`: its input and weight are quantized to e4m3 and its output's
gradient to e5m2, each with a per-tensor scale, and dequantized to the compute dtype around
the matmul (quantize -> dequantize -> dot: the pattern XLA's GPU compiler rewrites into a
cuBLASLt FP8 GEMM on Hopper). `model.fp8_emulate` keeps the casts and scales and runs the GEMMs
in the compute dtype on any device: the dequantized operands pass an optimization barrier,
which the rewrite cannot see through (on a Hopper GPU, FP8's rounding without FP8's GEMMs:
what separates the two when a loss curve differs; elsewhere, what runs at all). Attention's
own products, the norms, the router, the experts, the head and the loss stay in the compute
dtype.

**Delayed scaling.** A tensor's scale at step t comes from the largest absolute value (amax)
it had over the previous `model.fp8_history` steps: scale = amax * 2^margin / fp8 max (1 with
no history yet). The histories are training state (`Fp8State`): checkpointed, resumed
exactly, laid out like the layers.

**How a step learns its amaxes.** Each projection's tensors are observed where they are
quantized, forward (input, weight) and backward (output gradient), and the observation leaves
as the gradient of a zero `probe`, as the MoE router's statistics do (`moe.balanced`). The
observation is a histogram: a one-hot over quarter-binade bins of the tensor's amax on this
device. Whatever runs the layer -- the layer scan, a pipeline's ticks, accumulated
microbatches, the data-parallel reduction, ZB-H1's separate weight pass -- adds the
gradients of every use, and adding histograms keeps every bin any use occupied: the step's
amax is the top occupied bin's upper edge, the max over every microbatch, tick and device,
with no max-combining rule to thread through each of them (flax's `fp32_max_grad` dtype does
this with a custom addition, which psum and this stack's explicit accumulations would not
honour). The price is resolution: an amax is known to within 2^(1/4) (19 %), above it, so a
scaled tensor's largest value lands in [0.84, 1] of the fp8 maximum, not on it.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from .manual import vary, varying
from .schema import FP8_BINS
from .sharding import Untrained

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
ROLES = ("input", "weight", "grad")  # the three tensors of a projection with a scale each
_FMAX = (float(jnp.finfo(E4M3).max), float(jnp.finfo(E4M3).max), float(jnp.finfo(E5M2).max))
PER_BINADE = 4  # histogram bins per power of two
BINS = FP8_BINS  # edges 2^-128 .. 2^128 in quarter binades: float32's range
_ZERO = BINS // 2  # the bin of [1, 2^(1/4))


class Fp8State(Untrained):
    """A projection's scaling state: its tensors' amax histories ([.., 3, fp8_history], the
    newest first), or the zero probe whose gradient is the step's amax histograms."""

    @classmethod
    def advance(cls, old, observed, scale, plan):
        """The histories one step on: the step's amax (its histogram's top bin, a max over
        every use) first; the probe stays zero."""
        rolled = jnp.roll(old["history"], 1, axis=-1)
        return ({"history": rolled.at[..., 0].set(amax_of(observed["probe"])),
                 "probe": old["probe"]}, {})


class Fp8Meta(nnx.Module):
    """The scaling state of a module's projections, in `PROJECTIONS` order: `history`
    [P, 3, H] and `probe` [P, 3, BINS] (3: `ROLES`); `margin`, `model.fp8_margin`; `emulate`,
    `model.fp8_emulate`."""

    def __init__(self, projections: int, history: int, margin: int = 0, emulate: bool = False):
        self.margin, self.emulate = margin, emulate
        self.history = Fp8State(jnp.zeros((projections, len(ROLES), history), jnp.float32),
                                axes=("fp8", "fp8", "fp8"))
        self.probe = Fp8State(jnp.zeros((projections, len(ROLES), BINS), jnp.float32),
                              axes=("fp8", "fp8", "fp8"))


def meta(projections: int, cfg) -> Fp8Meta | None:
    """The scaling state of a module with `projections` projections under `cfg` (a
    ModelConfig), or None without `model.fp8`."""
    if cfg.fp8 == "off" or not projections:
        return None
    return Fp8Meta(projections, cfg.fp8_history, cfg.fp8_margin, cfg.fp8_emulate)


def scales(history_rh, margin: int = 0):
    """[.., 3] scales of a projection's tensors from their amax histories [.., 3, H]: amax x
    2^margin / the fp8 maximum, 1 where nothing was seen yet."""
    amax = jnp.max(history_rh, axis=-1)
    return jnp.where(amax > 0, amax * 2.0 ** margin / jnp.asarray(_FMAX), 1.0)


def histogram(amax):
    """[BINS] one-hot of the bin of amax (zeros for amax 0): bin b holds the amaxes up to
    its upper edge 2^((b - BINS/2) / 4). An amax within 0.02 % above an edge counts as the
    edge: a tensor clipped by the fp8 range has its amax on an edge (the scale's), up to
    rounding that differs between layouts, and must not change bins with it."""
    b = jnp.ceil(jnp.log2(amax) * PER_BINADE - 1e-3).astype(jnp.int32) + _ZERO
    return jax.nn.one_hot(jnp.clip(b, 0, BINS - 1), BINS) * (amax > 0)


def amax_of(histogram_b):
    """The amax a summed histogram [.., BINS] stands for: the top occupied bin's upper edge
    (0 where no bin is)."""
    occupied = histogram_b > 0
    top = BINS - 1 - jnp.argmax(occupied[..., ::-1], axis=-1)
    return jnp.where(jnp.any(occupied, axis=-1),
                     2.0 ** ((top - _ZERO) / PER_BINADE), 0.0).astype(jnp.float32)


def qdq(x, fp8_dtype, scale):
    """x quantized to `fp8_dtype` with `scale` (saturating) and back to x's dtype."""
    fmax = float(jnp.finfo(fp8_dtype).max)
    s = scale.astype(x.dtype)
    q = jnp.clip(x / s, -fmax, fmax).astype(fp8_dtype)
    return q.astype(x.dtype) * s


def _amax(x):
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _gemm_input(x, emulate: bool):
    """A dequantized GEMM operand; emulated, behind a barrier that keeps XLA's GPU compiler
    from fusing the dequantize into an FP8 GEMM (the GEMM then runs in x's dtype)."""
    return jax.lax.optimization_barrier(x) if emulate else x


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _forward_qdq(x, scale, probe, emulate):
    """e4m3 qdq of x; the gradient passes straight through, the probe's is x's histogram."""
    return _gemm_input(qdq(x, E4M3, scale), emulate)


def _forward_fwd(x, scale, probe, emulate):
    return _forward_qdq(x, scale, probe, emulate), (_amax(x), scale)


def _forward_bwd(emulate, res, g):
    amax, scale = res
    return g, jnp.zeros_like(scale), histogram(amax)


_forward_qdq.defvjp(_forward_fwd, _forward_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _backward_qdq(y, scale, probe, emulate):
    """y as it is; its gradient is e5m2 qdq'd, the probe's gradient is the gradient's
    histogram."""
    return y


def _backward_fwd(y, scale, probe, emulate):
    return y, scale


def _backward_bwd(emulate, scale, g):
    return (_gemm_input(qdq(g, E5M2, scale), emulate), jnp.zeros_like(scale),
            histogram(_amax(g)))


_backward_qdq.defvjp(_backward_fwd, _backward_bwd)


def einsum(spec: str, x, w, state: Fp8Meta, i: int):
    """`jnp.einsum(spec, x, w)` through FP8 with projection `i`'s scaling in `state`: x and w
    in e4m3, the output's gradient in e5m2 (dequantized, in x's dtype; with `state.emulate`
    behind a barrier, so that the GEMMs stay in that dtype on a Hopper GPU too)."""
    s = jax.lax.stop_gradient(scales(state.history[i], state.margin))
    probe_rb = state.probe[i]
    # inside a shard_map each probe varies as its tensor does: its gradient, this device's
    # histogram, is then summed over the devices that split the tensor
    def probe(i, a):
        return vary(probe_rb[i], varying(jax.typeof(a)))

    emulate = state.emulate
    y = jnp.einsum(spec, _forward_qdq(x, s[0], probe(0, x), emulate),
                   _forward_qdq(w, s[1], probe(1, w), emulate))
    return _backward_qdq(y, s[2], probe(2, y), emulate)
