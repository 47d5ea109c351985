"""One safetensors file's header, read and checked without the safetensors library, so a
damaged shard is reported by name with what is wrong with it (the library only says
`incomplete metadata, file not fully covered` or `invalid header length`).

The format (https://github.com/huggingface/safetensors, "Format"): an 8-byte little-endian
header length N, N bytes of JSON (tensor name -> {dtype, shape, data_offsets [begin, end)}
relative to the data section, plus an optional "__metadata__" of strings), then the data
section, which the tensors cover exactly: each tensor's byte length is its element count
times its element size, and the last one ends where the file ends.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MAX_HEADER_BYTES", "SafetensorsHeader", "ShardError", "read_header"]

MAX_HEADER_BYTES = 100 << 20      # safetensors' own bound on the JSON header

# Bits per element of every dtype safetensors 0.8 writes (sub-byte types pack densely).
_DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
               "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
               "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6,
               "F6_E3M2": 6}


class ShardError(ValueError):
    """A safetensors file whose bytes do not hold what its header says."""


@dataclass(frozen=True)
class SafetensorsHeader:
    raw: bytes                     # the JSON header as stored (hashed by weights_id.py)
    tensors: dict[str, dict]       # name -> {"dtype", "shape", "data_offsets"}
    data_start: int                # file offset of the data section
    file_size: int

    def span(self, name: str) -> tuple[int, int]:
        """[begin, end) of a tensor's bytes, as file offsets."""
        begin, end = self.tensors[name]["data_offsets"]
        return self.data_start + begin, self.data_start + end


def read_header(path: str | Path) -> SafetensorsHeader:
    """The header of a safetensors file, checked against the file: ShardError naming the
    file and the first thing wrong (truncated, trailing bytes, a malformed entry, a tensor
    whose byte length is not its shape's)."""
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) != 8:
            raise ShardError(f"{path}: not a safetensors file: {size} bytes, shorter than "
                             f"the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise ShardError(f"{path}: not a safetensors file: header length {n} is over "
                             f"the format's {MAX_HEADER_BYTES}-byte bound")
        if n > size - 8:
            raise ShardError(f"{path}: truncated: the header alone should take {n} bytes "
                             f"after its length, the file has {size - 8}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise ShardError(f"{path}: the safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ShardError(f"{path}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    data_start, data_size = 8 + n, size - 8 - n
    end_of_data = 0
    for name, info in header.items():
        where = f"{path}: tensor {name!r}"
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            dtype, shape = str(info["dtype"]), [int(s) for s in info["shape"]]
        except (KeyError, TypeError, ValueError):
            raise ShardError(f"{where}: malformed header entry {info!r}") from None
        if begin < 0 or end < begin or any(s < 0 for s in shape):
            raise ShardError(f"{where}: malformed header entry (offsets [{begin}, {end}), "
                             f"shape {shape})")
        bits = _DTYPE_BITS.get(dtype)
        if bits is not None:
            want = math.prod(shape) * bits / 8
            if end - begin != want:
                raise ShardError(f"{where}: {dtype} {shape} needs {want:g} bytes, the header "
                                 f"gives it {end - begin}")
        if end > data_size:
            raise ShardError(f"{path}: truncated: tensor {name!r} ends at byte {end} of the "
                             f"data section, the file holds {data_size} "
                             f"({end - data_size} bytes missing)")
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
        begin, end = info["data_offsets"]
        if begin != end_of_data:
            raise ShardError(f"{path}: tensor {name!r} starts at byte {begin} of the data "
                             f"section, the tensors before it end at {end_of_data} "
                             f"({'overlap' if begin < end_of_data else 'gap'})")
        end_of_data = end
    if end_of_data != data_size:
        raise ShardError(f"{path}: {data_size - end_of_data} bytes after the last tensor "
                         f"(the data section holds {data_size} bytes, the tensors "
                         f"{end_of_data}): appended to or overwritten")
    return SafetensorsHeader(raw, header, data_start, size)
