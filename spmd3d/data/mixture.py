"""Several sources mixed by weight (`data.mixture`), the batch of a step still a pure function
of the step.

The global samples 0, 1, 2, ... are cut into blocks of `BLOCK`. In every block source i gets
exactly its quota of places (its weight's share of BLOCK, the remainders given to the largest
fractions, so the quotas sum to BLOCK), laid out in a permutation drawn from (seed, block).
Sample k is then the j-th window of its source, j counting that source's places in the blocks
before and in its own; each source walks its windows in its own per-epoch permutations
(`TokenBatches` with a stream of its own). So any sample is found in O(BLOCK) without replaying
the ones before it, a resumed run reads exactly what it would have read, the mesh and the
process count change nothing, and over any n samples each source's share is within
1 / (weight x BLOCK) + BLOCK / n of its weight.

Why not Grain's mixing: its `MapDataset.mix` is random access too, but its ranges of samples
and its checkpointed iterator state would be a second record of where a run is; here the step
number is the whole state, as it is for one source (`TokenBatches`).
"""

from __future__ import annotations

import functools

import numpy as np

from . import samples

from ..schema import DataError

BLOCK = 1000


def quotas(weights, block: int = BLOCK) -> np.ndarray:
    """Each weight's whole share of `block` places (largest remainders), summing to block."""
    w = np.asarray(weights, np.float64) / np.sum(weights) * block
    q = np.floor(w).astype(np.int64)
    q[np.argsort(q - w, kind="stable")[:block - q.sum()]] += 1
    return q


class Mixture:
    """Windows from `sources` (each a `TokenBatches`) in proportion to `weights`: the same
    `batch(step, global_batch, process_index, process_count)` as one source."""

    def __init__(self, sources: list, weights, seed: int):
        lengths = {s.seq_len for s in sources}
        if len(lengths) != 1:
            raise DataError("data.mixture", f"the sources' windows differ ({sorted(lengths)})")
        self.sources, self.seed, self.seq_len = sources, int(seed), lengths.pop()
        self.quota = quotas(weights)

    @functools.lru_cache(maxsize=4)
    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each place of block b, its index among that source's places there)."""
        order = np.random.default_rng([self.seed, b, 0x6D6978]).permutation(
            np.repeat(np.arange(len(self.quota)), self.quota))
        rank = np.empty(BLOCK, np.int64)
        for i in range(len(self.quota)):
            at = order == i
            rank[at] = np.arange(at.sum())
        return order, rank

    def sources_of(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index among the source's samples) of each global sample index in k."""
        block, place = np.divmod(k, BLOCK)
        source, index = np.empty_like(k), np.empty_like(k)
        for b in np.unique(block):
            at = block == b
            order, rank = self._block(int(b))
            source[at] = order[place[at]]
            index[at] = b * self.quota[source[at]] + rank[place[at]]
        return source, index

    def batch(self, step: int, global_batch: int, process_index: int = 0,
              process_count: int = 1) -> np.ndarray:
        source, index = self.sources_of(samples(step, global_batch, process_index,
                                                process_count))
        rows = np.empty((source.size, self.seq_len + 1), np.int32)
        for i, src in enumerate(self.sources):
            at = source == i
            if at.any():
                rows[at] = src.rows(src.windows_at(index[at]), step)
        return rows
