"""Attention of a block of queries against a block of keys in score tiles, flash style: an
online softmax over the key tiles forward, the probabilities recomputed per tile from the saved
log-sum-exp backward (`attend`, `attend_bwd`), so the block holds a few [rows, heads, TILE,
TILE] score tiles at a time, never its whole score matrix. Which keys a query sees
(`Visible`) is causal by global positions and within documents by their ids, made per tile;
a tile no query sees (above the diagonal, of other documents) is skipped. The ring's steps
(`ring.py`) are such blocks, merged by their statistics (`merge`).

Results are unnormalized: (o[B, T, K, G, H] in fp32, the rows' maximum m and sum l[B, K, G,
T]); o / l is the attention, m + log l the log-sum-exp the backward takes.
Shapes: q[B, T, K, G, H], k/v[B, S, K, H].
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .manual import unroll, vary, varying

F32 = jnp.float32


def _scores(q, k, scale):
    return jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=F32) * scale


TILE = 1024  # queries and keys a score tile spans at most (`tile_size`)


class Visible(NamedTuple):
    """Which keys each query of a block sees: causal by global positions `pos_q`[T] >=
    `pos_k`[S] (None: all), and of one document by ids `seg_q`[B, T] == `seg_k`[B, S] (None:
    no documents). Tiles of it go with the queries' and keys' tiles (`_tile_views`).
    `by_documents`: a tile that no query sees for the documents is skipped too, which asks
    all of the batch: per device only (in a shard_map), else a collective per tile."""

    pos_q: jax.Array | None = None
    pos_k: jax.Array | None = None
    seg_q: jax.Array | None = None
    seg_k: jax.Array | None = None
    by_documents: bool = True

    def tile(self, pos_q, pos_k, seg_q, seg_k) -> "Visible":
        return Visible(pos_q, pos_k, seg_q, seg_k, self.by_documents)

    def seen(self):
        """Whether any query sees any key (a tile is skipped where not)."""
        if self.by_documents:
            return jnp.any(self.mask())
        return jnp.any(self.pos_q[:, None] >= self.pos_k[None, :])

    def mask(self):
        """[B or 1, 1, 1, T, S] booleans, or None when every key is seen."""
        m = None
        if self.pos_q is not None:
            m = (self.pos_q[:, None] >= self.pos_k[None, :])[None, None, None]
        if self.seg_q is not None:
            same = (self.seg_q[:, :, None] == self.seg_k[:, None, :])[:, None, None]
            m = same if m is None else m & same
        return m


def tile_size(n: int, tile: int) -> int:
    """The tile length along a dim of n: its largest divisor not above `tile`."""
    return next(d for d in range(min(n, tile), 0, -1) if n % d == 0)


def _tiles(x, axis: int, size: int):
    """x with `axis` cut into tiles of `size`, the tiles stacked first (None stays None)."""
    if x is None:
        return None
    x = x.reshape(x.shape[:axis] + (x.shape[axis] // size, size) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _untile(x, axis: int):
    """The inverse of `_tiles`: the stacked tiles joined back along `axis`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def _tile_views(vis: Visible, size_q: int, size_k: int):
    """(the query-side fields, the key-side fields) of `vis`, tiled as the queries and keys."""
    return ((_tiles(vis.pos_q, 0, size_q), _tiles(vis.seg_q, 1, size_q)),
            (_tiles(vis.pos_k, 0, size_k), _tiles(vis.seg_k, 1, size_k)))


def _like(shape, axes, fill=0.0):
    """An fp32 constant varying over the manual `axes` (a loop's first carry)."""
    return vary(jnp.full(shape, fill, F32), axes)


def _axes(*xs):
    return frozenset().union(*(varying(jax.typeof(x)) for x in xs if x is not None))


def tile_fwd(q, k, v, scale, mask=None):
    """Unnormalized output of one tile and its row statistics: (o[B,T,K,G,H], m, l[B,K,G,T]);
    a row with nothing visible has m = -inf, l = 0 and o = 0."""
    s = _scores(q, k, scale)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m)[..., None])
    o = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), v, preferred_element_type=F32)
    return o, m, jnp.sum(p, axis=-1)


def rows(x_bkgt):  # [B, K, G, T] -> [B, T, K, G, 1] to scale outputs row-wise
    return jnp.moveaxis(x_bkgt, 3, 1)[..., None]


def merge(acc, new):
    (o1, m1, l1), (o2, m2, l2) = acc, new
    m = jnp.maximum(m1, m2)
    finite = jnp.where(m == -jnp.inf, 0.0, m)  # rows nothing visible to yet: weights 0
    a1, a2 = jnp.exp(m1 - finite), jnp.exp(m2 - finite)
    return o1 * rows(a1) + o2 * rows(a2), m, l1 * a1 + l2 * a2


def _tied(vis: Visible, q):
    """(vis, q) through one optimization barrier: the positions and ids then depend on the
    queries. Under `jax.checkpoint` in a scanned layer, values that depend on nothing being
    differentiated are computed once in the forward and saved for the backward: every tile's
    mask (and, behind a `cond` on it, every tile's scores) stacked whole, the very T x T this
    module avoids. Tied to q, they are recomputed per tile like everything else."""
    arrays, q = jax.lax.optimization_barrier((tuple(vis[:4]), q))
    return Visible(*arrays, vis.by_documents), q


def _skippable(vis: Visible, tiled: bool) -> bool:
    """Whether a tile may see no key at all: with documents, or causal and tiled."""
    return (vis.seg_q is not None and vis.by_documents) or (tiled and vis.pos_q is not None)


def attend(q, k, v, scale, vis: Visible, tile: int = TILE):
    """(o, m, l) of queries q against keys k, v (see `tile_fwd`), in tiles of at most `tile`
    queries by `tile` keys: an online softmax over the key tiles, one query tile at a time."""
    sq, sk = tile_size(q.shape[1], tile), tile_size(k.shape[1], tile)
    tiled = (sq, sk) != (q.shape[1], k.shape[1])
    axes = _axes(q, k, v, vis.seg_q, vis.seg_k)
    vis, q = _tied(vis, q)

    def one(acc, q_i, k_j, v_j, vis_ij):
        mask = vis_ij.mask()
        if not _skippable(vis_ij, tiled):
            return merge(acc, tile_fwd(q_i, k_j, v_j, scale, mask))
        return jax.lax.cond(vis_ij.seen(), lambda a: merge(a, tile_fwd(q_i, k_j, v_j, scale,
                                                                          mask)),
                            lambda a: a, acc)

    b, t, kh, g = q.shape[:4]
    h = v.shape[-1]  # the output's head: the values' (MLA's are narrower than the keys')
    if not tiled:
        first = (_like((b, t, kh, g, h), axes), _like((b, kh, g, t), axes, -jnp.inf),
                 _like((b, kh, g, t), axes))
        return one(first, q, k, v, vis) if _skippable(vis, False) else tile_fwd(
            q, k, v, scale, vis.mask())
    (pq, segq), (pk, segk) = _tile_views(vis, sq, sk)

    def per_query(args):
        q_i, pq_i, sq_i = args
        first = (_like((b, sq, kh, g, h), axes), _like((b, kh, g, sq), axes, -jnp.inf),
                 _like((b, kh, g, sq), axes))

        def over_keys(acc, kargs):
            k_j, v_j, pk_j, sk_j = kargs
            return one(acc, q_i, k_j, v_j, vis.tile(pq_i, pk_j, sq_i, sk_j)), None

        return jax.lax.scan(over_keys, first, (_tiles(k, 1, sk), _tiles(v, 1, sk), pk, segk),
                            unroll=unroll())[0]

    o, m, l = jax.lax.map(per_query, (_tiles(q, 1, sq), pq, segq))
    return _untile(o, 1), _untile(m, 3), _untile(l, 3)


def _tile_bwd(q, k, v, do, lse, delta, scale, mask=None):
    """(dq, dk, dv) of one tile, recomputing probabilities from the saved log-sum-exp."""
    s = _scores(q, k, scale)
    p = jnp.exp(s - lse[..., None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    dv = jnp.einsum("bkgts,btkgh->bskh", p.astype(do.dtype), do, preferred_element_type=F32)
    dp = jnp.einsum("btkgh,bskh->bkgts", do, v, preferred_element_type=F32)
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("bkgts,bskh->btkgh", ds.astype(k.dtype), k, preferred_element_type=F32)
    dk = jnp.einsum("bkgts,btkgh->bskh", ds.astype(q.dtype), q, preferred_element_type=F32)
    return dq, dk, dv


def attend_bwd(q, k, v, do, lse, delta, scale, vis: Visible, tile: int = TILE):
    """(dq, dk, dv) in fp32 of `attend`'s block, in its tiles: the key tiles outside, each
    summing its dK, dV over the query tiles, dQ summed over the key tiles."""
    sq, sk = tile_size(q.shape[1], tile), tile_size(k.shape[1], tile)
    tiled = (sq, sk) != (q.shape[1], k.shape[1])
    axes = _axes(q, k, v, do, vis.seg_q, vis.seg_k)
    vis, q = _tied(vis, q)

    def one(q_i, k_j, v_j, do_i, lse_i, delta_i, vis_ij):
        mask = vis_ij.mask()
        grads = lambda _: _tile_bwd(q_i, k_j, v_j, do_i, lse_i, delta_i, scale, mask)  # noqa: E731
        if not _skippable(vis_ij, tiled):
            return grads(None)
        none = lambda _: tuple(_like(x.shape, axes) for x in (q_i, k_j, v_j))  # noqa: E731
        return jax.lax.cond(vis_ij.seen(), grads, none, None)

    if not tiled:
        return one(q, k, v, do, lse, delta, vis)
    (pq, segq), (pk, segk) = _tile_views(vis, sq, sk)
    queries = (_tiles(q, 1, sq), _tiles(do, 1, sq), _tiles(lse, 3, sq), _tiles(delta, 3, sq),
               pq, segq)

    def over_keys(dq, kargs):
        k_j, v_j, pk_j, sk_j = kargs

        def over_queries(dkv, qargs):
            q_i, do_i, lse_i, delta_i, pq_i, sq_i = qargs
            dq_i, dk_j, dv_j = one(q_i, k_j, v_j, do_i, lse_i, delta_i,
                                   vis.tile(pq_i, pk_j, sq_i, sk_j))
            return (dkv[0] + dk_j, dkv[1] + dv_j), dq_i

        first = (_like(k_j.shape, axes), _like(v_j.shape, axes))
        dkv, dqs = jax.lax.scan(over_queries, first, queries, unroll=unroll())
        return dq + _untile(dqs, 1), dkv

    dq, (dk, dv) = jax.lax.scan(over_keys, _like(q.shape, axes),
                                (_tiles(k, 1, sk), _tiles(v, 1, sk), pk, segk), unroll=unroll())
    return dq, _untile(dk, 1), _untile(dv, 1)
