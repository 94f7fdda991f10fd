"""SwiGLU's activation with its own backward: fp32 inside, the inputs' dtype outside."""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def swiglu(gate, up):
    """The dense MLP's silu(gate) * up: computed in fp32 and returned in gate's dtype, and its
    backward keeps gate and up alone.

    Left to autodiff in bf16, XLA rounds after each of silu's elementwise ops (a convert pair
    each, 7 roundings where fp32 has 1), and the backward keeps their intermediates; in fp32
    it would keep fp32 copies. Here the backward recomputes sigmoid(gate) from the two
    inputs, what a fused SwiGLU kernel keeps (Megatron's `bias_swiglu`). The experts keep
    autodiff's bf16: with this, Qwen3-30B-A3B's compiled step grew by 0.4 GB (its fp32
    backward over every routed row) while the planner's figure fell by 1.2 GB."""
    return _swiglu(gate, up)


def _swiglu(gate, up):
    f32 = jnp.float32
    return (jax.nn.silu(gate.astype(f32)) * up.astype(f32)).astype(gate.dtype)


def _swiglu_bwd(inputs, g):  # autodiff of the fp32 formula, from the two inputs again
    return jax.vjp(_swiglu, *inputs)[1](g)


swiglu.defvjp(lambda gate, up: (_swiglu(gate, up), (gate, up)), _swiglu_bwd)
