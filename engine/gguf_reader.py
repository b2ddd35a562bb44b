"""Read a llama.cpp GGUF file: its metadata, tensor table and dequantized tensors.

A small reader of our own: gguf.GGUFReader spends ~2.5 s building numpy views of the 98k vocabulary
strings, while struct does it in a fraction of that; gguf still supplies the quantization kernels.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from core.errors import ModelLoadError

_GGUF_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# GGUFValueType -> struct format; 8 (string) and 9 (array) are read by hand.
_SCALAR_TYPES = (0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12)
_SCALARS: dict[int, str] = {t: "<" + c for t, c in zip(_SCALAR_TYPES, "BbHhIif?Qqd", strict=True)}


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """One entry of a GGUF tensor table; `shape` is numpy order (GGUF's `ne` order reversed)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset of the tensor data in the file


class _Cursor:
    """Sequential little-endian reads over the bytes of a GGUF header."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("string runs past the end of the file")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if count > len(self.buf) - self.pos:
                raise ValueError(f"array of {count} items runs past the end of the file")
            if item_type in _SCALARS:
                dtype = np.dtype(_SCALARS[item_type])
                items = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
                self.pos += count * dtype.itemsize
                return items
            return [self.value(item_type) for _ in range(count)]
        if value_type not in _SCALARS:
            raise ValueError(f"unknown metadata value type {value_type}")
        return self.scalar(_SCALARS[value_type])


class GGUFFile:
    """A GGUF file's metadata and tensor table; tensor bytes stay in a read-only memory map."""

    __slots__ = ("path", "metadata", "tensors", "_map", "_data")

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"GGUF file not found: {self.path}")
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._data = np.frombuffer(self._map, dtype=np.uint8)
            self.metadata, self.tensors = self._parse()
        except (ValueError, struct.error, UnicodeDecodeError, OverflowError) as e:
            raise ModelLoadError(f"malformed GGUF file {self.path}: {e}") from e

    def _parse(self) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
        cur = _Cursor(memoryview(self._map))
        if bytes(self._data[:4]) != _GGUF_MAGIC:
            raise ValueError("bad magic (not a GGUF file)")
        cur.pos = 4
        version, num_tensors, num_kv = cur.scalar("<I"), cur.scalar("<Q"), cur.scalar("<Q")
        if version not in (2, 3):
            raise ValueError(
                f"unsupported GGUF version {version} (big-endian or pre-v2 files are not supported)"
            )
        metadata = {}
        for _ in range(num_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("<I"))
        raw_infos = []
        for _ in range(num_tensors):
            name, n_dims = cur.string(), cur.scalar("<I")
            ne = [cur.scalar("<Q") for _ in range(n_dims)]
            raw_infos.append((name, tuple(reversed(ne)), cur.scalar("<I"), cur.scalar("<Q")))
        alignment = metadata.get("general.alignment", 32)
        data_start = -(-cur.pos // alignment) * alignment
        tensors = {
            name: GGUFTensorInfo(name, shape, GGMLQuantizationType(qtype), data_start + offset)
            for name, shape, qtype, offset in raw_infos
        }
        return metadata, tensors

    def read_tensor(self, name: str) -> np.ndarray:
        """Tensor `name` dequantized to an owned float32 array of numpy shape."""
        info = self.tensors[name]
        block_size, type_size = GGML_QUANT_SIZES[info.ggml_type]
        row = info.shape[-1]
        if row % block_size:
            raise ModelLoadError(
                f"{self.path}: tensor {name} rows ({row}) are not whole {info.ggml_type.name} blocks"
            )
        num_rows, row_bytes = math.prod(info.shape[:-1]), row // block_size * type_size
        raw = self._data[info.offset : info.offset + num_rows * row_bytes]
        if raw.size != num_rows * row_bytes:
            raise ModelLoadError(f"{self.path}: tensor {name} runs past the end of the file (truncated?)")
        try:
            values = dequantize(raw.reshape(num_rows, row_bytes), info.ggml_type)
        except NotImplementedError as e:
            raise ModelLoadError(f"{self.path}: tensor {name}: {e}") from e
        return np.array(values, dtype=np.float32).reshape(info.shape)


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """A GGUF file's key/value metadata (vocabulary included) without touching tensor data."""
    return GGUFFile(path).metadata
