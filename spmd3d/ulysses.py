"""Ulysses context parallelism over a mesh axis (DeepSpeed-Ulysses): two all-to-alls turn the
sequence split into a head split around an unmodified local kernel.

Per device (inside a shard_map manual over the axis, n devices, and over whatever splits the
batch and the heads): q[B, T/n, K, G, H], k/v[B, T/n, K, H] -> all-to-all over the axis ->
q[B, T, K/n, G, H], k/v[B, T, K/n, H], the whole sequence for K/n kv heads, each with its G
query heads (GQA's groups stay whole) -> the local kernel (blocked, cuDNN, Pallas with
document ids: `attention.py`) -> all-to-all back to [B, T/n, K, G, H]. The sequence is laid
out in its natural order (contiguous shards, no zig-zag): the local kernel is causal over the
whole of it, and packed documents' ids are gathered over the axis once per layer pass.

It needs the device's kv heads (after tensor parallelism) to divide by n, and it holds the
local kernel's working set for the whole sequence: linear in T with every kernel (cuDNN's and
Pallas' flash kernels; the blocked kernel's score tiles), as without context parallelism.
Each all-to-all moves (n - 1)/n of its operand, over the axis's group only: against the ring
it moves q and the output too, but in two collectives per pass instead of n shifts, which
is why it wins while the heads divide and the group is inside a node (Megatron's guidance).
"""

from __future__ import annotations

import jax


def ulysses_local(q, k, v, axis: str, n: int, local, segments=None):
    """Per-device Ulysses attention (see the module's docstring): `local(q, k, v, segments)`
    is the kernel run on the whole sequence of K/n kv heads; `segments`[B, T/n]: the local
    positions' document ids, or None."""
    if n == 1:
        return local(q, k, v, segments)

    def heads(x):  # [B, T/n, K, ...] -> [B, T, K/n, ...]
        return jax.lax.all_to_all(x, axis, 2, 1, tiled=True)

    ids = None if segments is None else jax.lax.all_gather(segments, axis, axis=1, tiled=True)
    out = local(heads(q), heads(k), heads(v), ids)
    return jax.lax.all_to_all(out, axis, 1, 2, tiled=True)


def traffic(n: int, q: float, kv: float, forwards: float, redone: float, backwards: float,
            ids: float = 0.0) -> list[tuple[str, str, float]]:
    """What this module moves over its axis in a step, per device, for the planner
    (`plan.traffic.transfers`): (what, kind, bytes), an all-to-all counted by the bytes it
    moves, a gather by those it gathers. `q`: one layer pass's queries on a device in the
    compute dtype (the output is as large), `kv`: its K (or V); the layer passes a device
    runs: `forwards`, `redone` (forwards a recompute redoes), `backwards` (each moves the
    output's gradient in and q, k, v's out); `ids`: the document ids one pass gathers."""
    if n == 1:
        return []
    per_pass = 2 * q + 2 * kv
    return [("Ulysses q, k, v, out", "all-to-all", per_pass * (forwards + redone + backwards)),
            ("Ulysses document ids", "gather", ids * (forwards + redone + backwards))]
