"""Errors of the cache package: each names what was wrong and what to do about it."""
from __future__ import annotations

__all__ = ["CacheError", "LayoutError", "PayloadError", "StoreError", "StoreMismatchError",
           "StoreLockedError", "StoreReadOnlyError", "MissingParentError", "PoolFullError"]


class CacheError(Exception):
    """Base class of every cache error."""


class LayoutError(CacheError, ValueError):
    """A block size or model config the block layout cannot serve."""


class PayloadError(CacheError, ValueError):
    """A block payload or snapshot of the wrong size, dtype, shape or device."""


class StoreError(CacheError, OSError):
    """A persistent store directory that cannot be used."""


class StoreMismatchError(StoreError):
    """The store was written for another model fingerprint, layout or format version."""


class StoreLockedError(StoreError):
    """Another process holds the store's writer lock."""


class StoreReadOnlyError(StoreError):
    """A write to a store opened read-only (or opened as empty after a mismatch)."""


class MissingParentError(CacheError, KeyError):
    """PersistentStore.put() of a record whose parent record is neither stored nor queued
    (the store dropped it: LRU, TTL, corruption). A KeyError, as before it had a name."""


class PoolFullError(CacheError, RuntimeError):
    """Every block of a pool is referenced: nothing can be evicted to make room."""
