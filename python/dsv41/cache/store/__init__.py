"""The persistent prefix store (the SSD tier), in parts; PersistentStore is the facade.

Lower modules first: each imports only modules above it in this list.

    format          the bytes on disk: records, segments, journal entries, manifest checksum
    files           opening files in a store directory: regular files only, never a link
    manifest        StoreIdentity (MANIFEST.json) and the one writer's lock
    index           the in-memory index: segment files, records, chains
    journal         journal.log: access times, deletions, id watermarks
    segments        SegmentLoader: a segment's index (footer, or a scan of record headers)
    state           StoreState: what the parts share (index, segments, journal, ids, locks)
    fds             SegmentFds: segment files open for reading (fds, cuFile handles)
    staging         StagingPool: the aligned host buffers reads and writes go through
    pending         PutQueue: records put and not yet committed
    segment_layout  SegmentLayout: where a segment's records go, its footer, its chunks
    sealer          SerialWorker: the thread that seals commits in order
    writer          SegmentWriter: one segment written, made durable, published by rename
    commit          Committer: commits split into segments, sealed in commit order
    plan            plan_reads: records grouped into reads, each one's expectation
    device          DevicePath: reads into device memory (GPUDirect Storage)
    reads           RecordReader: verified reads; a failed read never removes a record
    gc              Compactor: TTL, LRU to the byte capacity, compaction
    recovery        opening the files, and a reader's refresh
    verify          every record read and checked (`dsv41 cache verify`)
    store           PersistentStore: opens the directory, builds the parts, the public API
"""
from __future__ import annotations

from .manifest import StoreIdentity
from .store import DEFAULT_SEGMENT_BYTES, DEFAULT_TTL_S, DURABILITY, CommitResult, PersistentStore

__all__ = ["PersistentStore", "StoreIdentity", "CommitResult", "DURABILITY", "DEFAULT_TTL_S",
           "DEFAULT_SEGMENT_BYTES"]
