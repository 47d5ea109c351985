"""RemoteTier: global KV blocks and SWA snapshots in remote stores shared by every server.

Keys (namespace first, so a Redis ACL user can be limited to its tenant's prefix):

    dsv41:<ns>:<model>:kv:<block hash hex>     one global KV block (its record: record.py)
    dsv41:<ns>:<model>:swa:<anchor hash hex>   the latest SWA snapshot whose last full block
                                               is the anchor (or the chain root)

<ns> is the namespace itself when it is 1-64 characters of [A-Za-z0-9_.-], "@" for the
empty namespace, else "#" and 16 hex digits of its SHA-256; <model> is the first 16 hex
digits of the cache's model fingerprint. Keys only route: every value is verified against
the full key encoding, the token ids and the chain before it is served (record.py).

Reads happen in PrefixCache.match (after the GPU pool, SWA pool and SSD store), each call
under a deadline (lookup_timeout_s plus the transfer time at min_bytes_per_s); a fault, a
timeout or an open breaker is a counted miss. Writes go through a bounded queue to one
background writer; when the queue is full a write is dropped and counted.
"""
from __future__ import annotations

import hashlib
import queue
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from ..swa_pool import TensorSnapshot
from .base import Guarded, RemoteBackend, RemoteFull, RemoteUnavailable
from .metrics import RemoteMetrics
from .record import (RecordBatch, chain_ids, encode_record, record_geometry, value_bytes, verify_record,
                     verify_records)
from .snapshot_codec import decode_snapshot, encode_snapshot

__all__ = ["RemoteTier", "RemoteConfig", "open_backend", "namespace_tag"]

_NS_PLAIN = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_SNAPSHOT_CANDIDATES = 32   # anchors probed per lookup, longest first
_SNAPSHOT_TRIES = 2         # values fetched per lookup before giving up


def namespace_tag(namespace: str) -> str:
    if namespace == "":
        return "@"
    if _NS_PLAIN.match(namespace):
        return namespace
    return "#" + hashlib.sha256(namespace.encode()).hexdigest()[:16]


def open_backend(url: str) -> RemoteBackend:
    scheme = url.split("://", 1)[0]
    if scheme == "mooncake":
        from .mooncake import MooncakeBackend
        return MooncakeBackend(url)
    if scheme in ("redis", "rediss", "unix"):
        from .redis import RedisBackend
        return RedisBackend(url)
    raise ValueError(f"unknown remote tier URL {url!r}: expected mooncake://HOST:PORT or redis://HOST:PORT/DB")


@dataclass
class RemoteConfig:
    blocks: str | None = None               # URL of the global KV block store
    snapshots: str | None = None            # URL of the SWA snapshot store
    lookup_timeout_s: float = 0.05          # per lookup call, plus transfer time
    write_timeout_s: float = 2.0            # per background write call
    min_bytes_per_s: float = 100e6          # transfer time allowance: bytes / this
    snapshot_ttl_s: float | None = 300.0    # since last use (Redis); since the write elsewhere
    queue_items: int = 256                  # pending writes before new ones are dropped
    breaker_failures: int = 3
    breaker_cooldown_s: float = 0.25         # an open breaker probes this often
    max_lookup_blocks: int = 1024           # blocks fetched by one lookup


class _Work:
    __slots__ = ("kind", "args", "on_done")

    def __init__(self, kind, args, on_done=None):
        self.kind, self.args, self.on_done = kind, args, on_done

    def done(self) -> None:
        if self.on_done is not None:
            self.on_done()


class RemoteTier:
    def __init__(self, rc: RemoteConfig, *, fingerprint: str, block_tokens: int, block_bytes: int,
                 metrics: RemoteMetrics):
        if rc.blocks is None and rc.snapshots is None:
            raise ValueError("RemoteTier: no endpoint given")
        self.rc, self.metrics = rc, metrics
        self.model_tag = fingerprint[:16]
        self.block_tokens, self.block_bytes = block_tokens, block_bytes
        opened: dict[str, Guarded] = {}

        def guard(url):
            if url is None:
                return None
            if url not in opened:
                opened[url] = Guarded(open_backend(url), metrics, breaker_failures=rc.breaker_failures,
                                      breaker_cooldown_s=rc.breaker_cooldown_s)
            return opened[url]

        self.blocks, self.snapshots = guard(rc.blocks), guard(rc.snapshots)
        self._guards = list(opened.values())
        self._q: queue.Queue[_Work | None] = queue.Queue(maxsize=max(1, rc.queue_items))
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="dsv41-remote-writer", daemon=True)
        self._writer.start()

    # ---- keys -------------------------------------------------------------------------

    def _prefix(self, namespace: str) -> str:
        return f"dsv41:{namespace_tag(namespace)}:{self.model_tag}"

    def block_key(self, namespace: str, block_hash: bytes) -> str:
        return f"{self._prefix(namespace)}:kv:{block_hash.hex()}"

    def block_keys(self, namespace: str, block_hashes: Sequence[bytes]) -> list[str]:
        """block_key of each hash (the prefix built once)."""
        kv = f"{self._prefix(namespace)}:kv:"
        return [kv + h.hex() for h in block_hashes]

    def snapshot_key(self, namespace: str, anchor_hash: bytes) -> str:
        return f"{self._prefix(namespace)}:swa:{anchor_hash.hex()}"

    def wait_connected(self, timeout_s: float = 10.0) -> bool:
        end = time.monotonic() + timeout_s
        return all(g.wait_connected(max(0.0, end - time.monotonic())) for g in self._guards)

    def _deadline(self, nbytes: int) -> float:
        return self.rc.lookup_timeout_s + nbytes / self.rc.min_bytes_per_s

    # ---- reads ------------------------------------------------------------------------

    def load_blocks(self, key: bytes, namespace: str, hashes: Sequence[bytes], tok: np.ndarray, start: int,
                    root: bytes) -> np.ndarray:
        """Verified payloads of blocks start, start+1, ... (uint8 [n, block_bytes], n may be 0;
        rows of one fresh buffer, not necessarily contiguous): the longest run the remote store
        holds. tok: uint32 [nb, B], every full block."""
        m = self.metrics
        want = min(len(hashes) - start, self.rc.max_lookup_blocks)
        empty = np.empty((0, self.block_bytes), dtype=np.uint8)
        if self.blocks is None or want <= 0:
            return empty
        keys = self.block_keys(namespace, hashes[start: start + want])
        try:
            vals, records = self._get_blocks(keys, len(key), self._deadline(want * self.block_bytes))
        except RemoteUnavailable:
            m.misses.inc(want, role="blocks")
            return empty
        t0 = time.perf_counter()
        chain = chain_ids(tok[: start + want], key)
        rows, status = verify_records(vals, key=key, start=start, hashes=hashes[start: start + want],
                                      parent_hash=hashes[start - 1] if start else root, chain=chain[start:],
                                      parent_chain=chain[start - 1] if start else 0,
                                      tokens=tok[start: start + want], payload_bytes=self.block_bytes,
                                      records=records)
        if status is not None:
            m.verify_failures.inc(role="blocks", kind=status)
        n = len(rows)
        m.verify_seconds.observe(time.perf_counter() - t0)
        m.hits.inc(n, role="blocks")
        m.misses.inc(want - n, role="blocks")
        m.bytes_read.inc(n * self.block_bytes, role="blocks")
        return rows

    def _get_blocks(self, keys: list[str], key_bytes: int, deadline: float) -> tuple[list, np.ndarray | None]:
        """The block values under keys (None: missing) and, from a backend that reads_into,
        the array of records they were read into (else None). There a value longer than a
        record, which cannot be ours, is fetched alone so that it is classified like any
        other; the values after it are not needed (a lookup serves a run)."""
        be = self.blocks.backend
        if not be.reads_into:
            return self.blocks.call("get", deadline, keys), None
        _, rbytes, _ = record_geometry(self.block_tokens, key_bytes, self.block_bytes)
        records = np.empty((len(keys), rbytes), dtype=np.uint8)
        vals = []
        for i, n in enumerate(self.blocks.call("get_into", deadline, keys, records)):
            if n < 0:
                vals += self.blocks.call("get", deadline, keys[i: i + 1])
                break
            vals.append(records[i, :n] if n else None)
        return vals, records

    def get_snapshot(self, key: bytes, namespace: str, arr: np.ndarray, hashes: Sequence[bytes], root: bytes,
                     max_blocks: int, limit: int) -> TensorSnapshot | None:
        """The snapshot of the longest prefix of arr[:limit] whose last full block is at most
        block max_blocks (so its global KV is in the match), verified; or None."""
        m = self.metrics
        if self.snapshots is None:
            return None
        B = self.block_tokens
        top = min(max_blocks, limit // B, len(hashes))
        cands = list(range(top, max(-1, top - _SNAPSHOT_CANDIDATES), -1))
        keys = [self.snapshot_key(namespace, hashes[j - 1] if j else root) for j in cands]
        ttl = self.rc.snapshot_ttl_s
        try:
            present = self.snapshots.call("exists", self._deadline(0), keys)
        except RemoteUnavailable:
            m.misses.inc(role="snapshots")
            return None
        tok = arr[: top * B].reshape(top, B)
        chain = None
        tries = 0
        for j, k, ok in zip(cands, keys, present):
            if not ok:
                continue
            if tries == _SNAPSHOT_TRIES:
                break
            tries += 1
            try:
                (v,) = self.snapshots.call("get", self._deadline(8 << 20), [k],
                                           ttl_s=ttl if self.snapshots.backend.native_ttl else None)
            except RemoteUnavailable:
                break
            if v is None:
                continue
            if chain is None:
                chain = chain_ids(tok, key)
            t0 = time.perf_counter()
            anchor = hashes[j - 1] if j else root
            ver = verify_record(v, key=key, block_index=j, block_hash=anchor, parent_hash=anchor,
                                parent_chain=chain[j - 1] if j else 0)
            m.verify_seconds.observe(time.perf_counter() - t0)
            if ver.status != "ok":
                m.verify_failures.inc(role="snapshots", kind=ver.status)
                continue
            L = j * B + ver.tokens.size
            if L > limit or not np.array_equal(ver.tokens, arr[j * B: L]):
                continue   # another continuation of the same anchor: not this request's prefix
            if ttl is not None and not self.snapshots.backend.native_ttl \
                    and time.time_ns() - ver.created_ns > ttl * 1e9:
                m.expired.inc(role="snapshots")
                continue
            try:
                snap = decode_snapshot(ver.payload)
            except (ValueError, KeyError, TypeError):
                m.verify_failures.inc(role="snapshots", kind="corrupt")
                continue
            if snap.num_tokens != L:
                m.verify_failures.inc(role="snapshots", kind="corrupt")
                continue
            m.hits.inc(role="snapshots")
            m.bytes_read.inc(len(ver.payload), role="snapshots")
            return snap
        m.misses.inc(role="snapshots")
        return None

    # ---- writes (off the request path) ------------------------------------------------

    def _enqueue(self, role: str, work: _Work) -> bool:
        if self._closed:
            return False
        try:
            self._q.put_nowait(work)
        except queue.Full:
            self.metrics.dropped_writes.inc(role=role, cause="queue_full")
            return False
        self.metrics.queue_depth.set(self._q.qsize())
        return True

    def enqueue_blocks(self, key: bytes, namespace: str, hashes: Sequence[bytes], tok: np.ndarray, start: int,
                       payloads: torch.Tensor | Callable[[], torch.Tensor], root: bytes,
                       on_done: Callable[[], None] | None = None) -> bool:
        """Queues blocks start.. (payloads row j is block start + j) for the remote store.
        payloads may be a callable that returns them, called by the writer only when it
        writes (the prefix cache's adopted pages are read then); it covers blocks
        start .. len(hashes) - 1. on_done is called once the work is written or dropped."""
        lazy = callable(payloads)
        n = len(hashes) if lazy else start + len(payloads)
        if self.blocks is None or n <= start:
            ok = False
        else:
            rows = payloads if lazy else payloads.detach().to("cpu")
            ok = self._enqueue("blocks", _Work("blocks", (key, namespace, list(hashes[:n]), tok[:n].copy(), start,
                                                          rows, root), on_done))
        if not ok and on_done is not None:
            on_done()
        return ok

    def enqueue_snapshot(self, key: bytes, namespace: str, arr: np.ndarray, hashes: Sequence[bytes], root: bytes,
                         snapshot: TensorSnapshot) -> bool:
        if self.snapshots is None:
            return False
        return self._enqueue("snapshots", _Work("snapshot", (key, namespace, arr[: snapshot.num_tokens].copy(),
                                                             list(hashes), root, snapshot)))

    def _write_loop(self) -> None:
        while True:
            w = self._q.get()
            try:
                if w is None:
                    return
                if w.kind == "blocks":
                    self._write_blocks(*w.args)
                else:
                    self._write_snapshot(*w.args)
            except Exception:  # a bug here must not kill the writer; count it and go on
                self.metrics.dropped_writes.inc(role=w.kind if w else "?", cause="error")
            finally:
                if w is not None:
                    w.done()
                self._q.task_done()
                self.metrics.queue_depth.set(self._q.qsize())

    def _write_blocks(self, key, namespace, hashes, tok, start, payloads, root) -> None:
        idx = list(range(start, len(hashes)))
        keys = self.block_keys(namespace, [hashes[i] for i in idx])
        try:  # skip what another server wrote already (Mooncake would keep it anyway)
            have = self.blocks.call("exists", self.rc.write_timeout_s, keys)
        except RemoteUnavailable as e:
            self.metrics.dropped_writes.inc(len(idx), role="blocks", cause=e.cause)
            return
        todo = [i for i, ok in zip(idx, have) if not ok]
        if todo:
            if callable(payloads):
                payloads = payloads()
            self._put_blocks(self.blocks, *self.block_batch(key, namespace, hashes, tok, todo, payloads, start, root),
                             timeout_s=self.rc.write_timeout_s)

    def block_batch(self, key: bytes, namespace: str, hashes: Sequence[bytes], tok: np.ndarray,
                    which: Sequence[int], payloads, start: int, root: bytes) -> tuple[list[str], RecordBatch]:
        """(remote keys, RecordBatch) of blocks `which` (payloads row i - start is block i),
        still to be encoded: the backend's put_records encodes them where it sends from."""
        which = list(which)
        chain = chain_ids(tok[: max(which) + 1], key)
        rows = payloads.contiguous().view(torch.uint8).numpy() if isinstance(payloads, torch.Tensor) else payloads
        if which == list(range(which[0], which[-1] + 1)):   # a run (the usual case): views, no gather
            sel = slice(which[0], which[-1] + 1)
            t, p = tok[sel], rows[which[0] - start: which[-1] + 1 - start]
        else:
            t, p = tok[which], rows[np.asarray(which) - start]
        batch = RecordBatch(key=key, tokens=t, payloads=p, block_indices=which,
                            block_hashes=[hashes[i] for i in which],
                            parent_hashes=[hashes[i - 1] if i else root for i in which],
                            chain_ids=[chain[i] for i in which],
                            parent_chains=[chain[i - 1] if i else 0 for i in which])
        return self.block_keys(namespace, [hashes[i] for i in which]), batch

    def block_values(self, key: bytes, namespace: str, hashes: Sequence[bytes], tok: np.ndarray,
                     which: Sequence[int], payloads, start: int, root: bytes, parts: bool = False) -> list[tuple]:
        """(remote key, value) of blocks `which`, encoded (block_batch's records); with parts,
        each value is a (head, payload) pair of views (backends that take_parts)."""
        keys, batch = self.block_batch(key, namespace, hashes, tok, which, payloads, start, root)
        return list(zip(keys, batch.values(parts)))

    def _put_blocks(self, guard: Guarded, keys: list[str], batch: RecordBatch, timeout_s: float) -> None:
        """The writer's put of block records (the benchmark times this): put_records through
        the guard."""
        self._counted("blocks", len(keys), batch.nbytes, guard, "put_records", timeout_s, keys, batch)

    def snapshot_value(self, key: bytes, namespace: str, arr: np.ndarray, hashes: Sequence[bytes], root: bytes,
                       snap: TensorSnapshot) -> tuple[str, bytes]:
        """(remote key, value) of a snapshot of the state after arr[:snap.num_tokens]."""
        B = self.block_tokens
        j = snap.num_tokens // B
        if j > len(hashes):
            raise ValueError(f"snapshot anchor block {j} but only {len(hashes)} block hashes")
        chain = chain_ids(arr[: j * B].reshape(j, B), key)
        parent = chain[j - 1] if j else 0
        anchor = hashes[j - 1] if j else root
        tail = np.ascontiguousarray(arr[j * B: snap.num_tokens], dtype="<u4")
        value = encode_record(key=key, tokens=tail, payload=encode_snapshot(snap), block_index=j, block_hash=anchor,
                              parent_hash=anchor, chain_id=chain_ids(tail.reshape(1, -1), key, parent=parent)[0],
                              parent_chain=parent)
        return self.snapshot_key(namespace, anchor), value

    def _write_snapshot(self, key, namespace, arr, hashes, root, snap) -> None:
        try:
            item = self.snapshot_value(key, namespace, arr, hashes, root, snap)
        except (TypeError, ValueError):  # metadata that is not JSON, or a bad anchor
            self.metrics.dropped_writes.inc(role="snapshots", cause="unencodable")
            return
        self._put("snapshots", self.snapshots, [item], self.rc.snapshot_ttl_s, overwrite=True)

    def _put(self, role, guard, items, ttl_s, overwrite) -> None:
        self._counted(role, len(items), sum(value_bytes(v) for _, v in items), guard, "put",
                      self.rc.write_timeout_s, items, ttl_s=ttl_s, overwrite=overwrite)

    def _counted(self, role: str, n: int, nbytes: int, guard: Guarded, op: str, timeout_s: float, *args,
                 **kwargs) -> None:
        """A write of n values (nbytes in all) through the guard, counted: written, or
        dropped with its cause (full, or the guard's: timeout, error, breaker_open, ...)."""
        m = self.metrics
        try:
            guard.call(op, timeout_s, *args, **kwargs)
        except RemoteFull:
            m.dropped_writes.inc(n, role=role, cause="full")
            return
        except RemoteUnavailable as e:
            m.dropped_writes.inc(n, role=role, cause=e.cause)
            return
        m.writes.inc(n, role=role)
        m.bytes_written.inc(nbytes, role=role)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Waits until every queued write was done (or dropped); False on timeout."""
        end = time.monotonic() + timeout_s
        while self._q.unfinished_tasks:
            if time.monotonic() > end:
                return False
            time.sleep(0.005)
        return True

    def stats(self) -> dict:
        return {"blocks": self.rc.blocks, "snapshots": self.rc.snapshots, "queued_writes": self._q.qsize(),
                "breakers": {g.name: g.breaker.state for g in self._guards}}

    def close(self, flush_timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        self.flush(flush_timeout_s)
        self._closed = True
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass
        self._writer.join(timeout=1.0)
        while True:   # work left behind (the flush timed out) is dropped: let its owner know
            try:
                w = self._q.get_nowait()
            except queue.Empty:
                break
            if w is not None:
                w.done()
            self._q.task_done()
        for g in self._guards:
            g.close()
