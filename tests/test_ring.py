"""Ring attention equals dense causal attention: outputs and gradients, GQA, seq = 2, 4, 8."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from spmd3d.model import causal_attention
from spmd3d.ring import ring_attention, zigzag_order

B, T, K, G, H = 2, 64, 2, 3, 8  # 6 query heads sharing 2 kv heads


def inputs():
    kq, kk, kv, kw = jax.random.split(jax.random.PRNGKey(0), 4)
    return (jax.random.normal(kq, (B, T, K, G, H)), jax.random.normal(kk, (B, T, K, H)),
            jax.random.normal(kv, (B, T, K, H)), jax.random.normal(kw, (B, T, K, G, H)))


def ring(n):
    mesh = jax.make_mesh((n,), ("seq",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
    order = zigzag_order(T, n)
    inverse = np.argsort(order)

    def attend(q, k, v):
        return ring_attention(q[:, order], k[:, order], v[:, order], "seq", mesh)[:, inverse]

    return attend


def test_zigzag_order_balances_chunks():
    assert zigzag_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_equals_dense(n):
    q, k, v, w = inputs()
    attend = jax.jit(ring(n))
    want = causal_attention(q, k, v, block=T)
    got = attend(q, k, v)
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))

    loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v) * w))  # noqa: E731
    g_want = jax.grad(loss(lambda q, k, v: causal_attention(q, k, v, block=T)), (0, 1, 2))(q, k, v)
    g_got = jax.jit(jax.grad(loss(attend), (0, 1, 2)))(q, k, v)
    for a, b in zip(g_got, g_want):
        assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b))
