"""PutQueue: records put() and not yet committed.

put_chain gives each record its id at once (so a later put can name it as a parent) and
queues it; a commit takes the queue (take) and releases the ids once its records are
stored or dropped (release). Until then holds() says the id may still be a parent.
"""
from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import numpy as np
import torch

from ..errors import MissingParentError, PayloadError
from .state import StoreState

__all__ = ["PutQueue", "PendingRecord", "as_token_ids"]


class PendingRecord(NamedTuple):
    """A record put() and not yet committed. A tuple: put_chain makes thousands at a time,
    and tuple.__new__ over zipped columns costs a fraction of a Python __init__ each."""
    rid: int
    parent: int
    block_index: int
    block_hash: bytes
    parent_hash: bytes
    tokens: np.ndarray
    key: bytes
    payload: np.ndarray


_new_pending = functools.partial(tuple.__new__, PendingRecord)
_U4 = np.dtype("<u4")


def _as_bytes_view(payload) -> np.ndarray:
    if type(payload) is np.ndarray and payload.dtype == np.uint8 and payload.flags.c_contiguous:
        return payload.reshape(-1)  # the common case, without the general conversions
    if isinstance(payload, torch.Tensor):
        if payload.device.type != "cpu":
            payload = payload.cpu()
        return payload.contiguous().view(torch.uint8).reshape(-1).numpy()
    return np.ascontiguousarray(payload, dtype=np.uint8).reshape(-1)


def _payload_rows(payloads, n: int, block_bytes: int) -> list[np.ndarray]:
    """n byte rows of block_bytes each: from one (n, ...) array or tensor, or a sequence of
    n payloads (each an array or tensor). Raises PayloadError for any other size."""
    if isinstance(payloads, (np.ndarray, torch.Tensor)):
        flat = _as_bytes_view(payloads)
        if flat.size != n * block_bytes:
            raise PayloadError(f"payloads have {flat.size} bytes: {n} blocks of this store need "
                               f"{n * block_bytes}")
        return list(flat.reshape(n, block_bytes))
    rows = [_as_bytes_view(p) for p in payloads]
    if len(rows) != n:
        raise PayloadError(f"{len(rows)} payloads for {n} blocks")
    for row in rows:
        if row.size != block_bytes:
            raise PayloadError(f"payload has {row.size} bytes, a block of this store has {block_bytes}")
    return rows


def as_token_ids(tokens) -> np.ndarray:
    if type(tokens) is np.ndarray and tokens.dtype == _U4 and tokens.flags.c_contiguous:
        return tokens.reshape(-1)
    return np.ascontiguousarray(tokens, dtype="<u4").reshape(-1)


class PutQueue:
    def __init__(self, state: StoreState):
        self._state = state
        self._pending: list[PendingRecord] = []
        self._held: set[int] = set()  # queued, or in a commit that has not finished yet
        self._bytes = 0

    @property
    def pending_bytes(self) -> int:
        """Payload bytes put() and not yet taken by a commit."""
        return self._bytes

    def holds(self, rid: int) -> bool:
        """Whether `rid` is queued or in a commit still running (call under state.lock)."""
        return rid in self._held

    def put_chain(self, *, key: bytes, parent: int, first_index: int, block_hashes, parent_hash: bytes,
                  tokens, payloads) -> list[int]:
        """PersistentStore.put_chain (its docstring says what each argument is)."""
        state = self._state
        n = len(block_hashes)
        T, P = state.identity.block_tokens, state.identity.block_bytes
        tokens = as_token_ids(tokens)
        if tokens.size != n * T:
            raise PayloadError(f"a record holds {T} token ids: {n} records need {n * T}, got {tokens.size}")
        tokens = tokens.reshape(n, T)
        rows = _payload_rows(payloads, n, P)
        if n and max(map(len, block_hashes)) > 32 or len(parent_hash) > 32:
            raise ValueError("hashes are at most 32 bytes")
        if type(key) is not bytes:
            key = bytes(key)
        with state.lock:
            if parent and parent not in state.index.recs and parent not in self._held:
                raise MissingParentError(f"parent record {parent} is neither stored nor queued")
            first = state.next_rid
            state.next_rid = first + n
            rids = range(first, first + n)
            self._pending += map(_new_pending, zip(
                rids, itertools.chain((parent,), rids[:-1]), range(first_index, first_index + n), block_hashes,
                itertools.chain((parent_hash,), block_hashes[:-1]), tokens, itertools.repeat(key, n), rows))
            self._held.update(rids)
            self._bytes += n * P
        return list(rids)

    def take(self) -> list[PendingRecord]:
        """Everything queued, for a commit; the ids stay held until release()."""
        with self._state.lock:
            pending, self._pending = self._pending, []
            self._bytes = 0
        return pending

    def release(self, rids) -> None:
        """A commit finished with these ids (stored, or dropped): no longer held."""
        with self._state.lock:
            self._held.difference_update(rids)
