"""Safetensors files a tensor at a time, so that a host smaller than the model can read and write
them: `Files` reads one tensor with one read of its bytes (no memory map, whose pages would stay
resident and count against the host while it is open); `Writer` streams each tensor to disk as
it comes, a block of rows at a time, and writes each file's header once the file is full.

The format (as the `safetensors` package writes it, which cannot give numpy bfloat16, the dtype
of published LLaMA weights): an 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets}} padded with spaces to 8 bytes, then the tensors' bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from .schema import ConfigError

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_}
TAGS = {np.dtype(v): k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
BLOCK = 1 << 20  # bytes a writer copies at a time


class HFError(ConfigError):
    """A Hugging Face directory this model cannot take (exit status 2, one line)."""


def header(path: Path) -> tuple[dict, int]:
    """(the JSON header, where the tensors' bytes start) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


class Files:
    """The tensors of a directory's safetensors files (those its index lists, else all) by
    name; `files[name]` reads that one tensor."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        index = self.dir / INDEX
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
        if not files:
            raise HFError("HF_DIR", f"{self.dir} has no *.safetensors weights (convert .bin "
                                    "weights with transformers' save_pretrained first)")
        self._where: dict[str, tuple[Path, dict, int]] = {}
        for name in files:
            path = self.dir / name
            if not path.is_file():
                raise HFError("HF_DIR", f"{path} is listed in {INDEX} but missing")
            head, start = header(path)
            for key, info in head.items():
                if key != "__metadata__":
                    self._where[key] = (path, info, start)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple:
        """Tensor `name`'s shape, from its file's header (nothing read)."""
        return tuple(self._where[name][1]["shape"])

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise HFError("HF_DIR", f"{self.dir} has no tensor {name!r}")
        path, info, start = self._where[name]
        if info["dtype"] not in DTYPES:
            raise HFError("HF_DIR", f"{name} has dtype {info['dtype']} (not a float tensor)")
        a, b = info["data_offsets"]
        dtype = np.dtype(DTYPES[info["dtype"]])
        with open(path, "rb") as f:
            f.seek(start + a)
            out = np.empty((b - a) // dtype.itemsize, dtype)
            if f.readinto(out.view(np.uint8)) != b - a:
                raise HFError("HF_DIR", f"{path} ends inside tensor {name!r} (truncated)")
        return out.reshape(info["shape"])


class Writer:
    """Writes tensors into `model-XXXXX-of-YYYYY.safetensors` files of at most `max_bytes`
    each (a lone `model.safetensors` when one is enough) and the index transformers reads.
    A tensor goes to a scratch file as it is added; a file is assembled (its header, then the
    scratch bytes) when the next tensor would not fit: a host holds a block, not a file."""

    def __init__(self, directory: str | Path, max_bytes: int = 5 << 30):
        self.dir, self.max_bytes = Path(directory), max_bytes
        self.dir.mkdir(parents=True, exist_ok=True)
        self._files: list[tuple[Path, list[str]]] = []
        self._tensors: dict[str, dict] = {}
        self._scratch = None
        self._size = 0
        self.total = 0

    def add(self, name: str, array: np.ndarray) -> None:
        if self._tensors and self._size + array.nbytes > self.max_bytes:
            self._flush()
        if self._scratch is None:
            self._scratch = open(self.dir / f"part-{len(self._files):05d}.data.tmp", "w+b")
        flat = array.reshape(1, -1) if array.ndim < 2 else array  # blocks of rows
        rows = max(1, BLOCK // max(1, flat[:1].nbytes))
        for i in range(0, len(flat), rows):
            self._scratch.write(np.ascontiguousarray(flat[i:i + rows]).view(np.uint8).data)
        self._tensors[name] = {"dtype": TAGS[array.dtype], "shape": list(array.shape),
                               "data_offsets": [self._size, self._size + array.nbytes]}
        self._size += array.nbytes
        self.total += array.nbytes

    def _flush(self) -> None:
        head = json.dumps({"__metadata__": {"format": "pt"}, **self._tensors},
                          separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        path = self.dir / f"part-{len(self._files):05d}.safetensors.tmp"
        with open(path, "wb") as out:
            out.write(struct.pack("<Q", len(head)) + head)
            self._scratch.seek(0)
            shutil.copyfileobj(self._scratch, out, BLOCK)
        self._scratch.close()
        os.remove(self._scratch.name)
        self._files.append((path, list(self._tensors)))
        self._scratch, self._tensors, self._size = None, {}, 0

    def close(self) -> list[str]:
        """Names the files for good and writes the index; returns the file names."""
        if self._tensors or not self._files:
            if self._scratch is None:  # no tensor at all: an empty file, as safetensors writes
                self._scratch = open(self.dir / "part-empty.data.tmp", "w+b")
            self._flush()
        n = len(self._files)
        names = (["model.safetensors"] if n == 1 else
                 [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
        for (path, _), name in zip(self._files, names):
            path.rename(self.dir / name)
        if n > 1:
            weight_map = {t: name for (_, tensors), name in zip(self._files, names)
                          for t in tensors}
            (self.dir / INDEX).write_text(json.dumps(
                {"metadata": {"total_size": self.total}, "weight_map": weight_map}, indent=2))
        return names
