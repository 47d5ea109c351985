"""The tiers of the prefix cache behind one protocol (base.py says it in full).

    base         BlockTier, SnapshotTier; BlockRows (HostRows, PoolRows): payloads for a put
    pool         PoolTier "gpu": GlobalKVPool; pages enter a match here (fill, adopt)
    ssd          SsdTier "ssd": PersistentStore; promotion, admission, write-behind jobs
    remote       RemoteBlockTier "remote", RemoteSnapshotTier "remote_swa": RemoteTier
    snapshots    SwaPoolTier "swa": SwaSnapshotPool; CheckpointTier "ssd_swa": SWA checkpoints
    staging      StagingRows: reused buffers for blocks on their way into the pool
    write_behind BackgroundCommitter: the SSD tier's commit thread
"""
from __future__ import annotations

from .base import BlockRows, BlockTier, HostRows, PoolRows, SnapshotTier
from .pool import PoolTier
from .remote import RemoteBlockTier, RemoteSnapshotTier, open_remote
from .snapshots import CheckpointTier, SwaPoolTier
from .ssd import SsdTier

__all__ = ["BlockTier", "SnapshotTier", "BlockRows", "HostRows", "PoolRows", "PoolTier", "SsdTier",
           "RemoteBlockTier", "RemoteSnapshotTier", "open_remote", "SwaPoolTier", "CheckpointTier"]
