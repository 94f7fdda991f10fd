"""FP8 projections with delayed scaling: e4m3 inputs and weights, e5m2 output gradients.

`model.fp8=delayed` puts each transformer projection (QKV, attention output, the MLP's gate/up
and down) through `einsum`: its input and weight are quantized to e4m3 and its output's
gradient to e5m2, each with a per-tensor scale, and the GEMMs take the FP8 tensors themselves,
the scales multiplying their outputs (the form XLA's GPU compiler rewrites into cuBLASLt FP8
GEMMs on Hopper: e4m3 x e4m3 forward, e5m2 x e4m3 for both gradients). `model.fp8_emulate`
keeps the casts and scales and runs the GEMMs in the compute dtype on any device, on the
dequantized FP8 values (on a Hopper GPU, FP8's rounding without FP8's GEMMs: what separates the
two when a loss curve differs; elsewhere, what runs at all). Attention's own products, the
norms, the router, the experts, the head and the loss stay in the compute dtype.

**Delayed scaling.** A tensor's scale at step t comes from the largest absolute value (amax)
it had over the previous `model.fp8_history` steps: scale = amax * 2^margin / fp8 max (1 with
no history yet). The histories are training state (`Fp8State`): checkpointed, resumed
exactly, laid out like the layers.

**How a step learns its amaxes.** Each projection's tensors are observed where they are
quantized, forward (input, weight) and backward (output gradient), and the observation leaves
as the gradient of a zero `probe`, as the MoE router's statistics do (`router.balanced`). The
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
from .untrained import Untrained

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


def quantize(x, fp8_dtype, scale):
    """x / scale, saturated at the format's largest value, rounded to `fp8_dtype`."""
    fmax = float(jnp.finfo(fp8_dtype).max)
    return jnp.clip(x / scale.astype(x.dtype), -fmax, fmax).astype(fp8_dtype)


def _amax(x):
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _scaled_einsum(spec, qa, qb, sa, sb, dtype, emulate, precision=None):
    """`einsum(spec)` of two FP8 tensors, times their scales, as `dtype`.

    Direct: the FP8 tensors are the dot's operands and the product of the scales multiplies
    its output, which XLA's GPU compiler turns into one cuBLASLt FP8 GEMM with the scales
    folded in. (A dequantize -> dot pattern does not survive it: its SimplifyFPConversions
    folds the `bf16 -> fp8 -> bf16` convert pair before the GEMM rewrite sees it; docs/fp8.md.)
    Emulated: each operand dequantized behind two barriers, one between the FP8 value and its
    dequantize (which keeps that pair) and one after (which keeps the dequantize out of an FP8
    GEMM); the GEMM then runs in `dtype`."""
    if emulate:
        qa, qb = (_dequantize(q, s, dtype) for q, s in ((qa, sa), (qb, sb)))
        return jnp.einsum(spec, qa, qb, precision=precision)
    y = jnp.einsum(spec, qa, qb, preferred_element_type=dtype, precision=precision)
    return y * (sa * sb).astype(dtype)


def _dequantize(q, scale, dtype):
    """q * scale as `dtype`, the FP8 value and the result each behind a barrier."""
    bar = jax.lax.optimization_barrier
    return bar(bar(q).astype(dtype) * scale.astype(dtype))


def _specs(spec: str) -> tuple[str, str]:
    """The input's and the weight's gradient specs of `spec` ("A,B->C"): "C,B->A", "A,C->B"."""
    (a, b), c = spec.split("->")[0].split(","), spec.split("->")[1]
    assert set(a) <= set(b) | set(c) and set(b) <= set(a) | set(c), spec
    return f"{c},{b}->{a}", f"{a},{c}->{b}"


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _projection(spec, emulate, x, w, s, probes):
    """`einsum(spec, x, w)` through FP8: x and w in e4m3 with scales s[0], s[1]; the output's
    gradient in e5m2 with s[2], each gradient's GEMM again FP8 (e5m2 x e4m3). The gradient of
    `probes` [3, BINS] is the histograms of the three tensors' amaxes."""
    return _projection_fwd(spec, emulate, x, w, s, probes)[0]


def _projection_fwd(spec, emulate, x, w, s, probes):
    qx, qw = quantize(x, E4M3, s[0]), quantize(w, E4M3, s[1])
    y = _scaled_einsum(spec, qx, qw, s[0], s[1], x.dtype, emulate)
    # FP8 residuals, the backward's GEMM operands at half bf16's bytes, kept as bytes
    # (XLA:CPU gives NaN out of finite values when FP8 arrays cross a layer scan)
    return y, (_bytes(qx), _bytes(qw), s, _amax(x), _amax(w))


def _bytes(q):
    return jax.lax.bitcast_convert_type(q, jnp.uint8)


def _projection_bwd(spec, emulate, res, g):
    bx, bw, s, amax_x, amax_w = res
    qx, qw = (jax.lax.bitcast_convert_type(b, E4M3) for b in (bx, bw))
    dx_spec, dw_spec = _specs(spec)
    qg = quantize(g, E5M2, s[2])
    exact = jax.lax.Precision.HIGHEST  # no fast accumulation for the gradients (as flax)
    dx = _scaled_einsum(dx_spec, qg, qw, s[2], s[1], g.dtype, emulate, exact)
    dw = _scaled_einsum(dw_spec, qx, qg, s[0], s[2], g.dtype, emulate, exact)
    seen = jnp.stack([histogram(amax_x), histogram(amax_w), histogram(_amax(g))])
    return dx, dw, jnp.zeros_like(s), seen


_projection.defvjp(_projection_fwd, _projection_bwd)


def einsum(spec: str, x, w, state: Fp8Meta, i: int):
    """`jnp.einsum(spec, x, w)` through FP8 with projection `i`'s scaling in `state`: x and w
    in e4m3, the output's gradient in e5m2 (`_projection`; with `state.emulate` the GEMMs run
    in x's dtype on the same FP8 values). x and w share a dtype (the compute dtype)."""
    assert x.dtype == w.dtype, (x.dtype, w.dtype)
    s = jax.lax.stop_gradient(scales(state.history[i], state.margin))
    # inside a shard_map, x, w and the probes are made to vary over the same axes first: the
    # casts' transposes then sum each gradient over the devices its value was broadcast to
    # (the weight's over the tokens' shards, a histogram over every device that saw it)
    axes = tuple(sorted(varying(jax.typeof(x)) | varying(jax.typeof(w))))
    return _projection(spec, state.emulate, vary(x, axes), vary(w, axes), s,
                       vary(state.probe[i], axes))
