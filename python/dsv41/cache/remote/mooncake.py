"""Mooncake Store backend: `mooncake://MASTER_HOST:RPC_PORT[?option=value&...]`.

The client joins the cluster as a pure client (global segment 0 by default): values live
in the storage processes (`mooncake_client`, or other clients that mount a segment).
Options: metadata (default P2PHANDSHAKE, i.e. no etcd / HTTP metadata server),
protocol (tcp), local_hostname (this host's address the storage processes can reach;
default 127.0.0.1 for a loopback master, else the address that routes to the master),
buffer_bytes (the client's transfer buffer, 64 MiB), segment_bytes (memory this process
contributes, 0), staging_bytes (the most memory the block puts' registered staging buffer
grows to, 64 MiB; a larger batch goes out in several transfers). Unless
MC_TCP_BIND_ADDRESS is set, connect() sets it to local_hostname so this process's data port
does not listen on every interface.

Semantics the tier relies on (seen with mooncake-transfer-engine 0.3.13): a put of an
existing key keeps the first value; a missing key reads as b''; there is no TTL; a full
store evicts roughly LRU and answers -200 when it cannot; a dead master makes calls hang
for longer than any deadline, then fail with -900 (Guarded bounds them; docs/remote.md
has the times). Its RPC and data ports have no
authentication: see docs/remote.md.

Needs `pip install mooncake-transfer-engine-non-cuda` (CPU hosts) or
`mooncake-transfer-engine` (GPU hosts), and libibverbs1 even over tcp.
"""
from __future__ import annotations

import os
import socket
import threading
from typing import Sequence
from urllib.parse import parse_qs, urlsplit

import numpy as np

from .base import RemoteBackend, RemoteError, RemoteFull

__all__ = ["MooncakeBackend"]

_NO_SPACE = -200
_TOO_SMALL = -600   # batch_get_into: the value is longer than its buffer


def _route_to(host: str, port: int) -> str:
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((host, port))   # no packet is sent: this only picks the outgoing interface
        return s.getsockname()[0]
    finally:
        s.close()


class MooncakeBackend(RemoteBackend):
    scheme = "mooncake"
    native_ttl = False
    keeps_first = True
    reads_into = True

    def __init__(self, url: str):
        super().__init__(url)
        u = urlsplit(url)
        if u.scheme != "mooncake" or not u.hostname or not u.port:
            raise ValueError(f"expected mooncake://HOST:PORT (the master's RPC address), got {url!r}")
        q = {k: v[-1] for k, v in parse_qs(u.query).items()}
        unknown = set(q) - {"metadata", "protocol", "local_hostname", "buffer_bytes", "segment_bytes",
                            "staging_bytes"}
        if unknown:
            raise ValueError(f"{url!r}: unknown options {sorted(unknown)}")
        self.master = f"{u.hostname}:{u.port}"
        self.metadata = q.get("metadata", "P2PHANDSHAKE")
        self.protocol = q.get("protocol", "tcp")
        self.local_hostname = q.get("local_hostname") or _route_to(u.hostname, u.port)
        self.buffer_bytes = int(q.get("buffer_bytes", 64 << 20))
        self.segment_bytes = int(q.get("segment_bytes", 0))
        self.staging_bytes = int(q.get("staging_bytes", 64 << 20))
        self._store = None
        # put_records' staging buffer: registered with the client once, reused by every put,
        # grown (re-registered) when a batch needs more. One put uses it at a time: a put
        # whose caller stopped waiting may still be sending from it in another worker.
        self._staging: np.ndarray | None = None
        self._staging_lock = threading.Lock()

    def connect(self) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise RemoteError("mooncake.store is not importable: pip install mooncake-transfer-engine-non-cuda "
                              f"(CPU) or mooncake-transfer-engine (GPU), apt-get install libibverbs1 ({e})") from e
        # The transfer engine listens for data on every interface unless told otherwise, and
        # nothing on that port is authenticated: bind it to the address we announce.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", self.local_hostname)
        store = MooncakeDistributedStore()
        rc = store.setup(self.local_hostname, self.metadata, self.segment_bytes, self.buffer_bytes,
                         self.protocol, "", self.master)
        if rc != 0:
            raise RemoteError(f"mooncake setup with master {self.master} failed: {rc}")
        self._store = store

    @property
    def client(self):
        """The raw MooncakeDistributedStore (benchmarks and fault tests use it directly)."""
        return self._store

    def exists(self, keys: Sequence[str]) -> list[bool]:
        codes = self._store.batch_is_exist(list(keys))
        if any(c < 0 for c in codes):
            raise RemoteError(f"batch_is_exist: {min(codes)}")
        return [c == 1 for c in codes]

    def get(self, keys: Sequence[str], ttl_s: float | None = None) -> list[bytes | None]:
        return [v if v else None for v in self._store.get_batch(list(keys))]

    def get_into(self, keys: Sequence[str], rows) -> list[int]:
        """batch_get_into the rows, registered with the client for the call (its fastest read:
        the transfer lands in place, with no bytes object per value). A missing key reads as
        0 (get_batch's b''), as does any other error code."""
        st, addr, row = self._store, rows.ctypes.data, rows.shape[1]
        rc = st.register_buffer(addr, rows.nbytes)
        if rc != 0:
            raise RemoteError(f"register_buffer: {rc}")
        try:
            got = st.batch_get_into(list(keys), [addr + i * row for i in range(len(keys))], [row] * len(keys))
        finally:
            st.unregister_buffer(addr)
        return [n if n > 0 else -1 if n == _TOO_SMALL else 0 for n in got]

    def put(self, items: Sequence[tuple[str, bytes]], ttl_s: float | None = None, overwrite: bool = False) -> None:
        if not items:
            return
        keys, values = [k for k, _ in items], [v for _, v in items]
        rc = (self._store.upsert_batch if overwrite else self._store.put_batch)(keys, values)
        if rc == _NO_SPACE:
            raise RemoteFull(f"put_batch: {rc} (no space that is not leased)")
        if rc != 0:
            raise RemoteError(f"put_batch: {rc}")

    def put_records(self, keys: Sequence[str], batch, overwrite: bool = False) -> None:
        """The records of a RecordBatch, encoded straight into the staging buffer registered
        with the client and sent from there with batch_put_from (batch_upsert_from when
        overwriting): the client's zero-copy put, with no buffer allocated, touched for the
        first time or registered per call (a fresh buffer's allocation and page faults cost
        a sizeable share of the transfer itself:
        docs/performance.md#where-the-tiers-time-goes-no-json). Each key's return
        code is checked; -200 (no space) is RemoteFull. A batch over staging_bytes goes out
        in staging-sized transfers. While another put holds the staging buffer (one that
        outlived its deadline), and for a value larger than staging_bytes, the records go
        through put() instead."""
        n, rb = len(keys), batch.record_bytes
        if n != len(batch):
            raise ValueError(f"put_records: {n} keys for {len(batch)} values")
        if not n:
            return
        per = self.staging_bytes // rb
        if per == 0 or not self._staging_lock.acquire(blocking=False):
            super().put_records(keys, batch, overwrite=overwrite)   # put() of freshly encoded values
            return
        try:
            st = self._store
            send = st.batch_upsert_from if overwrite else st.batch_put_from
            rows = min(n, per)
            stage = self._stage(rows * rb)
            codes: list[int] = []
            for s in range(0, n, rows):
                e = min(n, s + rows)
                out = stage[: (e - s) * rb].reshape(e - s, rb)
                batch.encode_into(out, s, e)
                addr = out.ctypes.data
                got = send(list(keys[s:e]), [addr + i * rb for i in range(e - s)], [rb] * (e - s))
                codes += got
                if any(c != 0 for c in got):
                    break   # full or failing: the rest would meet the same
        finally:
            self._staging_lock.release()
        bad = [c for c in codes if c != 0]
        if bad and all(c == _NO_SPACE for c in bad):
            raise RemoteFull(f"batch_put_from: {len(bad)} of {n} values: {_NO_SPACE} (no space that is not leased)")
        if bad:
            raise RemoteError(f"batch_put_from: {len(bad)} of {n} values failed ({min(bad)})")

    def _stage(self, nbytes: int) -> np.ndarray:
        """The staging buffer (uint8, at least nbytes), registered; caller holds _staging_lock.
        It grows to the next power of two from 1 MiB (at most staging_bytes), so a writer
        whose batches vary in size registers a few times, not every time."""
        cur = self._staging
        if cur is not None and cur.nbytes >= nbytes:
            return cur
        size = min(max(1 << 20, 1 << max(0, nbytes - 1).bit_length()), max(nbytes, self.staging_bytes))
        st = self._store
        if cur is not None:
            self._staging = None
            st.unregister_buffer(cur.ctypes.data)
        buf = np.empty(size, dtype=np.uint8)
        rc = st.register_buffer(buf.ctypes.data, buf.nbytes)
        if rc != 0:
            raise RemoteError(f"register_buffer (staging, {size} bytes): {rc}")
        self._staging = buf
        return buf

    def remove(self, keys: Sequence[str]) -> None:
        self._store.batch_remove(list(keys), force=True)

    def close(self) -> None:
        if self._store is not None:
            # Guarded closes only when no call is running: nothing sends from the staging buffer
            if self._staging is not None:
                self._store.unregister_buffer(self._staging.ctypes.data)
                self._staging = None
            self._store.close()
            self._store = None
