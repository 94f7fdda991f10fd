"""A committed step's arrays read a piece at a time, for a host smaller than the model.

orbax restores whole arrays: exporting LLaMA-3 405B that way needs a host of 880 GB. Here each
array is opened where orbax wrote it (tensorstore: zarr chunks over OCDBT) and a stacked
weight is read one layer at a time, so a host holds one layer of one weight. Each array is
still checked against its fingerprint: the layers' shares add up to it (`store.
fingerprint_part`), and a mismatch raises `Damaged` once the last layer has been read.

A layer is read a chunk at a time into an array of its own. Steps saved since the chunks of an
eighth of a layer (`Checkpointer.save`) hold the layer and about a chunk: tensorstore's read
buffers are a chunk's, compressed and decoded, and are handed back on its own threads a little
after the read completes, which a chunk's size keeps small. A step saved with layer-sized chunks
reads each layer in one piece (its compressed and decoded copies at once). An older step's
chunks span every layer of a device's shard: its layers still come one at a time, but each read
decodes those chunks whole.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from ..store import FINGERPRINT, fingerprint_part
from . import STATE_ITEM, Damaged, _open, _version


class StepArrays:
    """The arrays of RUN_DIR's newest committed step (or `step`), by storage key."""

    def __init__(self, run_dir: str | os.PathLike, step: int | None = None):
        ckpt, step = _open(run_dir, step)
        with ckpt:
            self.step, self.meta = step, ckpt.read_meta(step)
            self.shapes = ckpt.saved_shapes(step)
            self.dir = Path(ckpt.step_dir(step)) / STATE_ITEM
        written = json.loads((self.dir / "_METADATA").read_text())
        self._zarr = "zarr3" if written.get("use_zarr3") else "zarr"
        self._ocdbt = written.get("use_ocdbt", True)

    def _open(self, key: str):
        import tensorstore as ts

        base = {"driver": "file", "path": str(self.dir)}
        kvstore = ({"driver": "ocdbt", "base": base, "path": key} if self._ocdbt else
                   {**base, "path": str(self.dir / key)})
        # no cache: what was read is dropped once handed over
        context = ts.Context({"cache_pool": {"total_bytes_limit": 0},
                              "data_copy_concurrency": {"limit": 1},
                              "file_io_concurrency": {"limit": 1}})
        return ts.open({"driver": self._zarr, "kvstore": kvstore}, read=True,
                       context=context).result()

    def layers(self, key: str, stacked: bool = True) -> Iterator[np.ndarray]:
        """Array `key` one layer (its first index) at a time, or whole (`stacked=False`);
        `Damaged` after the last piece when their fingerprint is not the array's."""
        shape, _ = self.shapes[key]
        try:
            array = self._open(key)
        except Exception as e:  # noqa: BLE001 -- unreadable metadata is damage too
            raise Damaged(self.step, f"{key} cannot be opened: {str(e).splitlines()[0][:160]}")
        pieces = range(shape[0]) if stacked and shape else [None]
        per_piece = math.prod(shape[1:]) if stacked and shape else 0
        version, total = _version(self.meta) if self.meta else FINGERPRINT, 0
        for i in pieces:
            try:
                part = _read(array) if i is None else _read_layer(array, i)
            except Exception as e:  # noqa: BLE001 -- a chunk that does not decode
                raise Damaged(self.step, f"{key} is unreadable: {str(e).splitlines()[0][:160]}")
            total += fingerprint_part(part, (i or 0) * per_piece, version)
            yield part
            del part
        expected = self.meta.get("fingerprint", {}).get(key)
        if expected is not None and expected != total & 0xFFFFFFFF:
            raise Damaged(self.step, f"{key} does not match its fingerprint")


def _read(array) -> np.ndarray:
    return np.asarray(array.read().result())


def _read_layer(array, i: int) -> np.ndarray:
    """Layer `i` of `array`, a chunk at a time into an array of its own. tensorstore hands a
    read's buffers back a little after the read completes (on its own threads), so reading a
    chunk at a time bounds what it holds by a chunk or two, not a layer or two."""
    layer = array[i]
    chunk = array.chunk_layout.read_chunk.shape[1:]
    if all(c >= n for c, n in zip(chunk, layer.shape)):
        return _read(layer)  # one chunk (a step saved with layer-sized chunks, or a small layer)
    out = np.empty(layer.shape, layer.dtype.numpy_dtype)
    for start in itertools.product(*(range(0, n, c) for n, c in zip(layer.shape, chunk))):
        block = tuple(slice(s, s + c) for s, c in zip(start, chunk))
        out[block] = _read(layer[block])
    return out
