"""State <-> disk: the checkpoint's key schema, and the one flat/unflat that names pytree leaves.

A key is a leaf's pytree path joined with `/`, minus what is an accident of the libraries:
Flax's `value` attribute on a Variable, and optax's positions in its chain of transforms. So a
weight is `params/blocks/mlp/w_down` and its Adam moment `opt/mu/blocks/mlp/w_down`, whatever
the optax chain looks like (turning `optim.clip_norm` on adds a transform with an empty state,
and no key). Two leaves that would share a key are an error, never a silent overwrite.

Every array is stored with a 32-bit fingerprint (`fingerprint`), checked when it is read back.
`SCHEMA` is written into every checkpoint's metadata and checked when one is read: a checkpoint
of another schema is refused with one line, not restored into the wrong arrays. Schema 1 (no
`schema` in the metadata) kept Flax's `value` leaves and optax's chain positions in its keys.

Nothing here imports spmd3d modules: storage sits below everything that computes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.tree_util import GetAttrKey, SequenceKey

SCHEMA = 2


def key_of(path) -> str:
    """The storage name of one pytree path: `params/blocks/attn/w_qkv`."""
    parts = []
    for k in path:
        if isinstance(k, SequenceKey):  # a position in an optax chain (or any tuple)
            continue
        if isinstance(k, GetAttrKey) and k.name == "value":  # Flax's Variable wrapper
            continue
        parts.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
    return "/".join(parts)


def flat(tree, is_leaf=None) -> dict[str, Any]:
    """{key: leaf} of a pytree, in its flattening order (keys are unique or this raises)."""
    out: dict[str, Any] = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
        key = key_of(path)
        if key in out:
            raise ValueError(f"two leaves map to the storage key {key!r}")
        out[key] = x
    return out


def unflat(like, entries: dict):
    """`like`'s structure with every leaf taken from `entries` by its key."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    missing = [key_of(p) for p, _ in paths if key_of(p) not in entries]
    if missing:
        raise KeyError(f"no entry for {missing[0]!r}" + (f" (+{len(missing) - 1} more)"
                                                         if len(missing) > 1 else ""))
    return jax.tree.unflatten(treedef, [entries[key_of(p)] for p, _ in paths])


def nest(entries: dict) -> dict:
    """{'a/b': x} -> {'a': {'b': x}}: flat entries as nested dicts, for a notebook."""
    out: dict = {}
    for key, x in entries.items():
        *parents, leaf = key.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = x
    return out


def abstract_like(tree, shardings=None):
    """A restore or compile target: `jax.ShapeDtypeStruct` leaves carrying `shardings` (a
    matching pytree of shardings; default each leaf's own `.sharding`)."""
    if shardings is None:
        shardings = jax.tree.map(lambda x: x.sharding, tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


FINGERPRINT = 2  # the hash's version, stored beside the fingerprints (1: before odd weights)


def _leaf_hash(x: jax.Array, version: int = FINGERPRINT) -> jax.Array:
    """Position-weighted sum of the bit patterns, mod 2**32. Integer addition is associative, so
    the value is the same whatever the sharding or reduction order; a flipped bit, a zeroed
    chunk or two swapped blocks all change it. Every weight is odd (version 2), so no single
    flipped bit can vanish mod 2**32; version 1's weights (index * C + 1) were even at odd
    indices and missed a flip in an element's top bits there (1 in 32 of them)."""
    bits = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32,
                                            8: jnp.uint32}[x.dtype.itemsize])
    bits = bits.astype(jnp.uint32)
    if bits.ndim > x.ndim:  # 8-byte types bitcast to [..., 2]
        bits = bits[..., 0] ^ (bits[..., 1] * jnp.uint32(0x85EBCA6B))
    index = jnp.zeros(bits.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(bits.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, d) * jnp.uint32(stride)
        stride = (stride * bits.shape[d]) % (1 << 32)
    c = jnp.uint32(0x9E3779B1)
    weight = (index * jnp.uint32(2) + jnp.uint32(1)) * c if version >= 2 else index * c + 1
    return jnp.sum(bits * weight, dtype=jnp.uint32)


_hash_all = jax.jit(lambda tree, version: jax.tree.map(lambda x: _leaf_hash(x, version), tree),
                    static_argnums=1)


def fingerprint_part(x, offset: int, version: int = FINGERPRINT, block: int = 1 << 16) -> int:
    """The share of `_leaf_hash` of the host array `x`: the elements of an array from its flat
    (row-major) index `offset` on, e.g. one layer of a stack. An array's parts add up, mod
    2**32, to its fingerprint, so an array read a layer at a time is checked whole without
    ever being whole in memory (numpy, a block of elements at a time)."""
    import numpy as np

    flat_x = np.ascontiguousarray(x).reshape(-1)
    bits = flat_x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[x.dtype.itemsize])
    if x.dtype.itemsize == 8:  # as `_leaf_hash`: the two words of each element mixed
        bits = bits[0::2] ^ (bits[1::2] * np.uint32(0x85EBCA6B))
    c, total = np.uint32(0x9E3779B1), 0
    for start in range(0, bits.size, block):
        b = bits[start:start + block].astype(np.uint32)
        index = ((np.arange(b.size, dtype=np.uint64) + (offset + start)) & 0xFFFFFFFF).astype(
            np.uint32)
        weight = ((index * np.uint32(2) + np.uint32(1)) * c if version >= 2
                  else index * c + np.uint32(1))
        total += int(np.sum(b * weight, dtype=np.uint32))
    return total & 0xFFFFFFFF


def fingerprint(state: Any, version: int = FINGERPRINT) -> dict[str, int]:
    """{leaf path: 32-bit hash} of an array pytree, computed where the arrays live (nothing is
    gathered; one small jitted reduction per leaf); `version` of the hash (a checkpoint's
    `fingerprint_version`, 1 when it has none)."""
    return {k: int(v) for k, v in flat(jax.device_get(_hash_all(state, version))).items()}
