"""Where PersistentStore used to live: it is now the facade of the cache.store package.
Kept so that `from dsv41.cache.persistent import PersistentStore, StoreIdentity` works."""
from __future__ import annotations

from .store import DEFAULT_SEGMENT_BYTES, DEFAULT_TTL_S, DURABILITY, CommitResult, PersistentStore, StoreIdentity

__all__ = ["PersistentStore", "StoreIdentity", "CommitResult", "DURABILITY", "DEFAULT_TTL_S",
           "DEFAULT_SEGMENT_BYTES"]
