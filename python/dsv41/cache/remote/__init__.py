"""The remote tier: global KV blocks and SWA snapshots in existing distributed stores
(Mooncake Store, Redis/Valkey) shared by every server process, each value wrapped in and
verified against dsv41's own record (docs/remote.md).

    base        RemoteBackend (exists/get/put/remove) and Guarded (deadlines + breaker)
    breaker     CircuitBreaker
    workers     DaemonWorkers (the threads Guarded runs calls in)
    mooncake    MooncakeBackend  mooncake://MASTER:PORT
    redis       RedisBackend     redis://HOST:PORT/DB
    record      encode/verify of remote values (the SSD record format)
    snapshot_codec  TensorSnapshot <-> bytes
    tier        RemoteTier: keys, lookups with promotion, the write-behind queue
    (the prefix cache reaches it through cache/tiers/remote.py: the tier protocol)
    metrics     RemoteMetrics (dsv41_cache_remote_*)
    servers     start/stop local Mooncake + Redis servers on loopback (tests, demo, bench)
"""
from __future__ import annotations

from .base import Guarded, RemoteBackend, RemoteError, RemoteFull, RemoteUnavailable
from .breaker import CircuitBreaker
from .metrics import RemoteMetrics
from .tier import RemoteConfig, RemoteTier, namespace_tag, open_backend

__all__ = ["Guarded", "RemoteBackend", "RemoteError", "RemoteFull", "RemoteUnavailable", "CircuitBreaker",
           "RemoteMetrics", "RemoteConfig", "RemoteTier", "namespace_tag", "open_backend"]
