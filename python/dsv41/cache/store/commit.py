"""Committer: the commit pipeline of a writable store.

A commit takes the put queue, splits it into segments of at most segment_bytes (parents
before children) and starts each one's chunk writes (SegmentWriter.start); the sealer
thread then makes the commit's segments durable and visible as one group
(SegmentWriter.seal), in commit order, while the caller goes on: the next commit's
encoding overlaps this one's last writes, fsync and rename. Disk full or another I/O error
degrades the tier: the records are dropped with a warning and commits are skipped for a
while; nothing is raised.
"""
from __future__ import annotations

import errno
import logging
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from . import format as sf
from .pending import PendingRecord, PutQueue
from .sealer import Job, SerialWorker
from .state import StoreState
from .writer import ParentLost, SegmentWriter, Unsealed

__all__ = ["Committer", "CommitResult", "CommitTicket"]

log = logging.getLogger("dsv41.cache.store")

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@dataclass
class CommitResult:
    persisted: list[int] = field(default_factory=list)  # record ids now durable and visible
    dropped: list[int] = field(default_factory=list)    # record ids that were not persisted
    bytes_written: int = 0
    error: str | None = None


class CommitTicket:
    """A commit in flight (PersistentStore.commit_async): result() waits until its records
    are durable and visible, or dropped, and returns the CommitResult."""

    def __init__(self, res: CommitResult, rids: list[int]):
        self.res = res
        self.rids = rids
        self._jobs: list[Job] = []

    def done(self) -> bool:
        return all(j.done.is_set() for j in self._jobs)

    def result(self) -> CommitResult:
        for job in self._jobs:
            job.result()  # a bug in a sealing step is raised here, not lost in the thread
        return self.res


class Committer:
    def __init__(self, state: StoreState, queue: PutQueue, writer: SegmentWriter):
        self._state = state
        self._queue = queue
        self._writer = writer
        self._sealer = SerialWorker("dsv41-store-seal")  # fsync, rename, publish, in order
        self._unsealed: set[int] = set()  # records of segments written, not yet sealed
        self._degraded_until = 0.0
        self.degraded_reason: str | None = None

    def start(self) -> None:
        """Starts the sealer thread, so the first commit does not wait for it."""
        self._sealer.start()

    def stop(self) -> None:
        self._sealer.stop()

    @property
    def degraded(self) -> bool:
        return self._state.clock() < self._degraded_until

    def degrade(self, e: OSError, retry_after_s: float = 30.0) -> None:
        """A write failed: its records are dropped, and commits are skipped for a while."""
        state = self._state
        cause = "no_space" if e.errno in _NO_SPACE else "io_error"
        state.metrics.persist_failures.inc(cause=cause)
        self.degraded_reason = f"{cause}: {e}"
        self._degraded_until = state.clock() + retry_after_s
        warnings.warn(f"persistent store {state.path}: batch not persisted ({e}); the memory tiers keep "
                      f"their blocks, SSD writes resume in {retry_after_s:.0f} s", RuntimeWarning, stacklevel=4)

    def drain(self) -> None:
        """Waits until every commit started so far is sealed (GC, repair and close change
        what a sealing segment checks against)."""
        self._sealer.submit(lambda: None).result()

    def commit_async(self) -> CommitTicket:
        """Starts writing what is queued (the caller holds the state's write lock):
        segments of at most segment_bytes, parents before children, each one's chunks
        encoded and queued here; the sealer makes them durable and visible as one group
        once the last one's are. An I/O error degrades the tier: the rest is dropped,
        nothing is raised."""
        pending = self._queue.take()
        try:
            return self._start(pending)
        except BaseException:
            self._queue.release(p.rid for p in pending)
            raise

    def _start(self, pending: list[PendingRecord]) -> CommitTicket:
        state = self._state
        res = CommitResult()
        ticket = CommitTicket(res, [p.rid for p in pending])
        t0 = time.perf_counter()
        if pending and self.degraded:
            res.dropped = [p.rid for p in pending]
            res.error = self.degraded_reason
            state.metrics.persist_failures.inc(cause="degraded")
            pending = []
        groups = self._segment_groups(pending)
        started: list[Unsealed] = []
        for gi, g in enumerate(groups):
            # A record whose parent is gone (dropped, or deleted since put) cannot be
            # stored: the store holds whole prefixes only. Parents come before children; a
            # parent in a segment still being sealed counts (seal() checks it made it).
            with state.lock:
                alive = self._with_live_parents(g)
            if len(alive) < len(g):
                kept = {p.rid for p in alive}
                res.dropped += [p.rid for p in g if p.rid not in kept]
            if not alive:
                continue
            try:
                u = self._writer.start(alive, supersedes=[])
            except OSError as e:
                res.dropped += [p.rid for p in alive]
                self.degrade(e)
                res.error = self.degraded_reason
                for rest in groups[gi + 1:]:
                    res.dropped += [p.rid for p in rest]
                break
            with state.lock:
                self._unsealed |= u.rids
            started.append(u)
        if started:
            ticket._jobs.append(self._sealer.submit(self._seal, started, res))
        # Last in the sealer's queue: after every earlier commit's segments too, so a ticket
        # that is done means everything committed before it is done as well.
        ticket._jobs.append(self._sealer.submit(self._finished, ticket, t0))
        return ticket

    def _segment_groups(self, pending: list) -> list[list]:
        """Splits a commit's records, in put order, into segments of at most segment_bytes
        (each record counts its span and 128 bytes of footer, more than its 88-byte entry).
        One Python step per segment: a 64K-token commit is thousands of records, and this
        runs before the first chunk write can start."""
        if not pending:
            return []
        state = self._state
        T, P = state.identity.block_tokens, state.identity.block_bytes
        key_len = np.fromiter(map(len, (p.key for p in pending)), dtype=np.int64, count=len(pending))
        lens = np.unique(key_len)
        cost = np.zeros(len(pending), dtype=np.int64)
        for n in lens.tolist():  # put() fixed T and P: a record's size follows its key length
            cost[key_len == n] = sf.record_geometry(T, n, P)[2] + 128
        groups, first, limit = [], 0, state.segment_bytes - sf.PAGE * 3
        ends = np.cumsum(cost)
        while first < len(pending):
            base = ends[first - 1] if first else 0
            # The last record that still fits; at least one per segment, however large.
            end = max(first + 1, int(np.searchsorted(ends, base + limit, side="right")))
            groups.append(pending[first:end])
            first = end
        return groups

    def _with_live_parents(self, group: list) -> list:
        """The records of `group` whose parent is stored, queued in a segment being sealed,
        or an earlier record of the group that is itself kept (call under state.lock)."""
        recs, unsealed = self._state.index.recs, self._unsealed
        alive, ok = [], set()
        for p in group:
            par = p.parent
            if not par or par in ok or par in recs or par in unsealed:
                alive.append(p)
                ok.add(p.rid)
        return alive

    def _seal(self, us: list[Unsealed], res: CommitResult) -> None:
        """The sealer thread's step for a commit's segments (SegmentWriter.seal: one group)."""
        try:
            published, errors = self._writer.seal(us)
            for u in us:
                rids = [r.rid for r in u.new_recs]
                if u in published:
                    res.bytes_written += u.file_bytes
                    res.persisted += rids
                else:
                    res.dropped += rids
            for e in errors:
                if isinstance(e, ParentLost):
                    log.warning("persistent store %s: a segment was not published: %s", self._state.path, e)
                else:
                    self.degrade(e)
                    res.error = self.degraded_reason
        finally:
            with self._state.lock:
                for u in us:
                    self._unsealed -= u.rids

    def _finished(self, ticket: CommitTicket, t0: float) -> None:
        """The sealer thread's last step of a commit: metrics, the journal, and only now are
        its records stored (or dropped): until here a put() may still name them as parents."""
        state, res = self._state, ticket.res
        with state.lock:
            self._queue.release(ticket.rids)
            state.journal.flush()
        if ticket.rids:
            state.metrics.ssd_commit_seconds.observe(time.perf_counter() - t0)
            state.metrics.bytes_written.inc(res.bytes_written, tier="ssd")
            state.metrics.inserted_blocks.inc(len(res.persisted), tier="ssd")
        state.update_gauges()
