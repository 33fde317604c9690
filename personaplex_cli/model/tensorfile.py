"""Safetensors files, read one tensor (or a run of its rows) at a time.

The format: an 8-byte little-endian header length, that much JSON ({name: {dtype, shape,
data_offsets}} plus "__metadata__"), then the tensors' bytes. The header is read without
torch (doctor looks at model files this way); a tensor is read with plain `pread`s into
memory of our own. Unlike the safetensors library, which maps the whole file and hands out
tensors backed by the mapping, this leaves nothing of the file mapped: the pages a tensor
was read from are the kernel's page cache, not this process's memory, so a tensor dropped
after use (quantized at load) is gone, and the 16.7 GB checkpoint never sits in the process.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

MAX_HEADER = 100_000_000  # bytes; a header larger than this is not a safetensors header
# safetensors dtype name -> (torch dtype name, bytes per value)
DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2),
          "BF16": ("bfloat16", 2), "I64": ("int64", 8), "I32": ("int32", 4),
          "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1), "BOOL": ("bool", 1),
          "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1)}


class TensorFileError(ValueError):
    """The file is not a (complete) safetensors file; the message says why, in a phrase."""


@dataclass(frozen=True)
class TensorEntry:
    dtype: str  # the safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int

    @property
    def row_bytes(self) -> int:
        return DTYPES[self.dtype][1] * math.prod(self.shape[1:])


def _format_size(n: int) -> str:
    from .voices_archive import format_size

    return format_size(n)


def _raw_header(path: Path) -> tuple[dict, int, int]:
    """The header's JSON object, its length and the file's size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise TensorFileError("too short to be a safetensors file")
            (length,) = struct.unpack("<Q", head)
            if length > min(size - 8, MAX_HEADER):
                raise TensorFileError("not a safetensors file (bad header length)")
            header = json.loads(fh.read(length))
    except (OSError, ValueError, UnicodeDecodeError) as error:
        if isinstance(error, TensorFileError):
            raise
        raise TensorFileError(f"unreadable safetensors header ({error})") from None
    if not isinstance(header, dict):
        raise TensorFileError("not a safetensors file (header is not a JSON object)")
    return header, length, size


def read_metadata(path: Path) -> dict:
    """The header's `__metadata__` (string keys and values by the format; {} when absent)."""
    metadata = _raw_header(path)[0].get("__metadata__")
    return metadata if isinstance(metadata, dict) else {}


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Every tensor's entry, checked against the file: known dtypes, offsets that match the
    shapes, and a last tensor that ends exactly at the end of the file (so a truncated
    download is caught here, before any loading)."""
    header, length, size = _raw_header(path)
    data_start = 8 + length
    entries: dict[str, TensorEntry] = {}
    try:
        for name, value in header.items():
            if name == "__metadata__":
                continue
            begin, end = (int(v) for v in value["data_offsets"])
            shape = tuple(int(n) for n in value["shape"])
            dtype = value["dtype"]
            if dtype not in DTYPES:
                raise TensorFileError(f"tensor {name} has an unknown dtype {dtype!r}")
            if end - begin != DTYPES[dtype][1] * math.prod(shape) or begin < 0:
                raise TensorFileError(f"not a safetensors file (tensor {name}'s bytes do "
                                      "not match its shape)")
            entries[name] = TensorEntry(dtype, shape, data_start + begin, data_start + end)
    except (TypeError, KeyError, IndexError, ValueError) as error:
        if isinstance(error, TensorFileError):
            raise
        raise TensorFileError("not a safetensors file (bad tensor entry)") from None
    described = max((e.end for e in entries.values()), default=data_start)
    if described != size:
        raise TensorFileError(f"truncated or damaged: its header describes "
                              f"{_format_size(described)}, the file has {_format_size(size)}")
    return entries


def read_tensor(fh: BinaryIO, entry: TensorEntry, rows: tuple[int, int] | None = None):
    """The tensor of `entry` (rows [first, last) only, when given) from the open file `fh`,
    in fresh CPU memory."""
    import torch

    first, last = rows if rows is not None else (0, entry.shape[0] if entry.shape else 1)
    shape = (last - first, *entry.shape[1:]) if entry.shape else ()
    tensor = torch.empty(shape, dtype=getattr(torch, DTYPES[entry.dtype][0]))
    buffer = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    offset = entry.start + first * entry.row_bytes
    done = 0
    while done < len(buffer):
        n = os.preadv(fh.fileno(), [buffer[done:]], offset + done)
        if n <= 0:
            raise TensorFileError("truncated while reading")
        done += n
    return tensor
