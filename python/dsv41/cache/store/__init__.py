"""The persistent prefix store (the SSD tier), in parts; PersistentStore is the facade.

    format     the bytes on disk: records, segments, journal entries, manifest checksum
    files      opening files in a store directory: regular files only, never a link
    manifest   StoreIdentity (MANIFEST.json) and the one writer's lock
    index      the in-memory index: segment files, records, chains
    journal    journal.log: access times, deletions, id watermarks
    segments   loading a segment's index (footer, or a scan of record headers)
    recovery   opening the files (recovery) and a reader's refresh, through that one loader
    writer     writing one segment and publishing it by rename
    reads      verified reads, host (pread) and device (GPUDirect Storage)
    gc         TTL, LRU to the byte capacity, reclaiming space by compaction
    verify     reading and checking every record (`dsv41 cache verify`)
    store      PersistentStore: the facade that owns the locks and the state
"""
from __future__ import annotations

from .manifest import StoreIdentity
from .store import DEFAULT_SEGMENT_BYTES, DEFAULT_TTL_S, DURABILITY, CommitResult, PersistentStore

__all__ = ["PersistentStore", "StoreIdentity", "CommitResult", "DURABILITY", "DEFAULT_TTL_S",
           "DEFAULT_SEGMENT_BYTES"]
