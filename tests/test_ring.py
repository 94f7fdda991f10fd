"""Block-causal and ring attention equal dense causal attention: outputs and gradients, GQA,
seq = 2, 4, 8."""

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


def dense(q, k, v):
    """jax's own causal attention (the XLA path: one [T, T] score matrix), an oracle that
    shares no code with the kernels under test; q[B, T, K, G, H] as K*G heads, each group of
    G sharing one kv head, as jax groups them."""
    b, t, kh, g, h = q.shape
    out = jax.nn.dot_product_attention(q.reshape(b, t, kh * g, h), k, v, is_causal=True,
                                       implementation="xla")
    return out.reshape(q.shape)


def rel_err(got, want):
    return float(np.max(np.abs(np.float32(got) - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_block_causal_equals_dense(dtype, tol):
    """Four query blocks each reading only its key prefix give dense attention's output and
    gradients; in bf16, to bf16's precision (the gradients of k and v sum over blocks)."""
    q, k, v, w = inputs()
    blocked = lambda q, k, v: causal_attention(q, k, v, block=T // 4)  # noqa: E731
    loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * w))  # noqa: E731
    low = [x.astype(dtype) for x in (q, k, v)]
    assert rel_err(jax.jit(blocked)(*low), dense(q, k, v)) <= tol
    g_want = jax.grad(loss(dense), (0, 1, 2))(q, k, v)
    g_got = jax.jit(jax.grad(loss(blocked), (0, 1, 2)))(*low)
    for a, b in zip(g_got, g_want):
        assert a.dtype == dtype and rel_err(a, b) <= tol


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
