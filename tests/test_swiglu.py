"""SwiGLU's activation against autodiff of its formula."""

import jax
import jax.numpy as jnp
import numpy as np

from spmd3d.swiglu import swiglu


def test_swiglu_is_autodiffs_silu_times_up_rounded_once():
    """`swiglu` (the dense MLP's activation, with its own backward): in fp32
    its value and gradients are autodiff's of silu(gate) * up; in bf16 its value is the fp32
    one rounded once, its gradients the fp32 ones rounded once, and its backward keeps only
    the two inputs."""
    k = jax.random.split(jax.random.key(0), 3)
    gate, up, ct = (4 * jax.random.normal(i, (64, 96), jnp.float32) for i in k)

    def plain(g, u):
        return jax.nn.silu(g) * u

    def vjp(f, g, u):
        out, back = jax.vjp(f, g, u)
        return (out, *back(ct.astype(out.dtype)))

    want = vjp(plain, gate, up)
    for a, b in zip(vjp(swiglu, gate, up), want):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6)
    bf = [x.astype(jnp.bfloat16) for x in (gate, up)]
    ct = ct.astype(jnp.bfloat16)
    exact = vjp(plain, *[x.astype(jnp.float32) for x in bf])
    for i, (a, b) in enumerate(zip(vjp(swiglu, *bf), exact)):
        assert a.dtype == jnp.bfloat16
        a, b = np.asarray(a, np.float32), np.asarray(b.astype(jnp.bfloat16), np.float32)
        if i == 0:  # the value: the same fp32 formula, rounded once
            np.testing.assert_array_equal(a, b)
        else:  # the gradients: fp32 formulas a rounding apart, then rounded once
            np.testing.assert_allclose(a, b, rtol=2 ** -8, atol=1e-6)
    _, residuals = jax.vjp(swiglu, *bf)
    assert sum(x.size for x in jax.tree.leaves(residuals)) == 2 * gate.size
