"""The blocked kernel and ring attention equal dense causal attention: outputs and gradients,
GQA, seq = 1 (the blocked kernel, the ring's code on a ring of one), 2, 4, 8; in score tiles,
with packed documents, and what a step holds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from spmd3d.model import causal_attention
from jax.sharding import PartitionSpec as P

from spmd3d.ring import gathered_attention_local, ring_attention, ring_attention_local, zigzag_order

B, T, K, G, H = 2, 64, 2, 3, 8  # 6 query heads sharing 2 kv heads


def inputs():
    kq, kk, kv, kw = jax.random.split(jax.random.PRNGKey(0), 4)
    return (jax.random.normal(kq, (B, T, K, G, H)), jax.random.normal(kk, (B, T, K, H)),
            jax.random.normal(kv, (B, T, K, H)), jax.random.normal(kw, (B, T, K, G, H)))


def dense(q, k, v, segments=None):
    """jax's own causal attention (the XLA path: one [T, T] score matrix), an oracle that
    shares no code with the kernels under test; q[B, T, K, G, H] as K*G heads, each group of
    G sharing one kv head, as jax groups them; `segments`[B, T]: document ids, a query sees
    its own document's keys only."""
    b, t, kh, g, h = q.shape
    mask = None if segments is None else (segments[:, :, None] == segments[:, None, :])[:, None]
    out = jax.nn.dot_product_attention(q.reshape(b, t, kh * g, h), k, v, mask=mask,
                                       is_causal=True, implementation="xla")
    return out.reshape(q.shape)


def rel_err(got, want):
    return float(np.max(np.abs(np.float32(got) - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("dtype,tol,tile,with_documents", [
    (jnp.float32, 1e-5, T // 4, False), (jnp.bfloat16, 2e-2, T // 4, False),
    (jnp.float32, 1e-5, T // 4, True), (jnp.float32, 1e-5, T, False)])
def test_blocked_kernel_equals_dense(dtype, tol, tile, with_documents):
    """The blocked kernel in score tiles of `tile` (4 x 4, those above the diagonal and of
    other documents skipped; or one tile, masked) gives dense attention's output and
    gradients, with packed documents too; in bf16, to bf16's precision (the gradients of k and
    v sum over tiles)."""
    q, k, v, w = inputs()
    seg = documents(T) if with_documents else None
    blocked = lambda q, k, v: causal_attention(q, k, v, seg, tile)  # noqa: E731
    want = lambda q, k, v: dense(q, k, v, seg)  # noqa: E731
    loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * w))  # noqa: E731
    low = [x.astype(dtype) for x in (q, k, v)]
    assert rel_err(jax.jit(blocked)(*low), want(q, k, v)) <= tol
    g_want = jax.grad(loss(want), (0, 1, 2))(q, k, v)
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
    want = dense(q, k, v)
    got = attend(q, k, v)
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))

    loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v) * w))  # noqa: E731
    g_want = jax.grad(loss(dense), (0, 1, 2))(q, k, v)
    g_got = jax.jit(jax.grad(loss(attend), (0, 1, 2)))(q, k, v)
    for a, b in zip(g_got, g_want):
        assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b))


def documents(t, seed=1):
    """[B, T] document ids: B rows of packed documents of random lengths."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.stack([np.cumsum(rng.random(t) < 0.08) for _ in range(B)]), jnp.int32)


@pytest.mark.parametrize("n,tile,gather,with_documents", [
    (4, 2, False, True), (2, 8, False, False), (2, 4, True, True)])
def test_tiled_ring_steps_equal_dense(n, tile, gather, with_documents):
    """A ring (or gather) step attended in score tiles of `tile` queries by `tile` keys (the
    local chunks are 32/n long: 2-8 tiles a side, tiles above the diagonal and of other
    documents skipped) gives dense attention's output and gradients, with packed documents
    too."""
    q, k, v, w = inputs()
    seg = documents(T) if with_documents else None
    order = zigzag_order(T, n)
    inverse = np.argsort(order)
    mesh = jax.make_mesh((n,), ("seq",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
    local = gathered_attention_local if gather else ring_attention_local
    spec = P(None, "seq")
    mapped = jax.shard_map(lambda q, k, v, s: local(q, k, v, "seq", n, s, tile), mesh=mesh,
                           in_specs=(spec,) * 4, out_specs=spec)
    ids = jnp.zeros((B, T), jnp.int32) if seg is None else seg

    def tiled(q, k, v):
        ids_z = ids[:, order] if seg is not None else None
        if seg is None:  # the map's fourth input: None passes as no array
            f = jax.shard_map(lambda q, k, v: local(q, k, v, "seq", n, None, tile), mesh=mesh,
                              in_specs=(spec,) * 3, out_specs=spec)
            return f(q[:, order], k[:, order], v[:, order])[:, inverse]
        return mapped(q[:, order], k[:, order], v[:, order], ids_z)[:, inverse]

    def want_f(q, k, v):
        return dense(q, k, v, seg)

    loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v) * w))  # noqa: E731
    got, want = jax.jit(tiled)(q, k, v), want_f(q, k, v)
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))
    g_got = jax.jit(jax.grad(loss(tiled), (0, 1, 2)))(q, k, v)
    g_want = jax.grad(loss(want_f), (0, 1, 2))(q, k, v)
    for a, b in zip(g_got, g_want):
        assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b))


def test_a_ring_step_holds_score_tiles_not_the_half_block():
    """Compiled, two scanned layers of the ring under `jax.checkpoint` (as the step runs
    them with remat), forward and backward, hold [B, K, G, tile, tile] score tiles: no score
    array spans more than `tile` queries or keys, and no array is larger than the layers'
    saved inputs (checkpointing once stacked every tile's mask and scores: computed from
    positions alone, jax saved them rather than recompute them)."""
    import math
    import re

    n, tile, t = 2, 16, 256
    x = jax.random.normal(jax.random.key(0), (1, t, K, G, H))
    mesh = jax.make_mesh((n,), ("seq",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])

    def layer(x, _):
        return ring_attention(x, x[..., 0, :], x[..., 1, :], "seq", mesh, None, tile), None

    body = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)
    step = jax.jit(jax.grad(lambda x: jnp.sum(jax.lax.scan(body, x, None, length=2)[0])))
    text = step.lower(x).compile().as_text()
    shapes = {tuple(map(int, s.split(","))) for s in re.findall(r"(?:f32|pred)\[([\d,]+)\]", text)}
    scores = {s[-2:] for s in shapes if len(s) >= 5 and s[-3:-2] == (G,)}
    assert scores and max(max(s) for s in scores) == tile, scores
    assert max(math.prod(s) for s in shapes) <= 2 * x.size, sorted(shapes, key=math.prod)[-3:]
