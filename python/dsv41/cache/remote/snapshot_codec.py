"""A TensorSnapshot as bytes (the payload of a remote snapshot record) and back.

    u32 header length, JSON header {num_tokens, meta, tensors: [[name, dtype, shape, nbytes]]},
    zero padding to 64 bytes, then each tensor's bytes, each starting 64-byte aligned.

The metadata must be JSON-able (the model adapter's is); tuples come back as lists.
"""
from __future__ import annotations

import json

import numpy as np
import torch

from ..swa_pool import TensorSnapshot

__all__ = ["encode_snapshot", "decode_snapshot"]

_ALIGN = 64


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def encode_snapshot(snap: TensorSnapshot) -> bytes:
    specs, parts = [], []
    for name, t in snap.tensors.items():
        t = t.detach().contiguous().cpu()
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
        specs.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), int(raw.size)])
        parts.append(raw)
    head = json.dumps({"num_tokens": snap.num_tokens, "meta": snap.meta, "tensors": specs},
                      separators=(",", ":")).encode()
    off = _up(4 + len(head))
    total = off + sum(_up(p.size) for p in parts)
    buf = np.zeros(total, dtype=np.uint8)
    buf[:4] = np.frombuffer(len(head).to_bytes(4, "little"), dtype=np.uint8)
    buf[4: 4 + len(head)] = np.frombuffer(head, dtype=np.uint8)
    for p in parts:
        buf[off: off + p.size] = p
        off += _up(p.size)
    return buf.tobytes()


def decode_snapshot(data) -> TensorSnapshot:
    """Raises ValueError on bytes that are not an encoded snapshot."""
    mv = memoryview(data).cast("B")
    if len(mv) < 4:
        raise ValueError("snapshot payload too short")
    n = int.from_bytes(mv[:4], "little")
    if 4 + n > len(mv):
        raise ValueError("snapshot header overruns the payload")
    head = json.loads(bytes(mv[4: 4 + n]))
    flat = bytearray(mv)  # one writable copy; the tensors are views of it
    off = _up(4 + n)
    tensors = {}
    for name, dtype_name, shape, nbytes in head["tensors"]:
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype) or off + nbytes > len(flat):
            raise ValueError(f"snapshot tensor {name!r}: bad dtype or size")
        if nbytes:
            t = torch.frombuffer(flat, dtype=torch.uint8, count=nbytes, offset=off)
            t = t.view(dtype).view(shape)
        else:
            t = torch.empty(shape, dtype=dtype)
        tensors[name] = t
        off += _up(nbytes)
    return TensorSnapshot(int(head["num_tokens"]), tensors, head["meta"])
