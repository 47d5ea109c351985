"""PrefixCache's edges (issue 10 section 4): a store directory that cannot be written
degrades to the memory tiers with one warning; a bad namespace is a clear error.

These tests run as root in CI, where permission bits do not stop writes, so "cannot be
written" is produced in ways root cannot bypass: a store path under a regular file (every
open fails with ENOTDIR), a store path that is itself a regular file, and a sysfs directory
(the kernel refuses new files there even for root; skipped where it does not). A read-only
mount is not covered: creating one needs privileges the test cannot assume."""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from dsv41.cache import CacheConfig, PrefixCache
from dsv41.cache.manager import StoreDisabledWarning

from .helpers import LAYOUT, TINY, WEIGHTS_ID, B


def _cache(store_dir: str) -> tuple[PrefixCache, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = PrefixCache(TINY, CacheConfig(block_tokens=B, device="cpu", gpu_capacity_bytes=16 * LAYOUT.block_bytes,
                                              swa_capacity_bytes=0, store_dir=store_dir, store_durability="none"),
                            weights_id=WEIGHTS_ID)
    return cache, [str(w.message) for w in caught if issubclass(w.category, StoreDisabledWarning)]


def _serves_from_memory(cache: PrefixCache) -> None:
    prompt = np.arange(3 * B, dtype="<u4")
    cache.release(cache.insert(prompt, torch.ones(3, LAYOUT.block_bytes, dtype=torch.uint8)))
    m = cache.match(prompt)
    assert m.gpu_blocks == 3 and m.ssd_blocks == 0
    cache.release(m)


def _unwritable_dirs(tmp_path) -> list[str]:
    f = tmp_path / "a-file"
    f.write_text("not a directory")
    return [str(f / "store"), str(f)]


@pytest.mark.parametrize("which", [0, 1], ids=["parent-is-a-file", "path-is-a-file"])
def test_store_dir_that_cannot_be_opened_degrades_to_memory_with_one_warning(tmp_path, which):
    path = _unwritable_dirs(tmp_path)[which]
    cache, msgs = _cache(path)
    assert cache.store is None and len(msgs) == 1, msgs
    assert path in msgs[0] and "Memory tiers only" in msgs[0] and "writable directory" in msgs[0]
    assert cache.stats()["store_disabled"] == msgs[0]
    _serves_from_memory(cache)
    cache.close()


def test_kernel_refused_directory_degrades_to_memory():
    d = "/sys/kernel"
    probe = os.path.join(d, "dsv41-write-probe")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_WRONLY, 0o600))
    except OSError:
        pass
    else:
        os.unlink(probe)
        pytest.skip(f"{d} accepts new files here")
    if not os.path.isdir(d):
        pytest.skip(f"no {d}")
    cache, msgs = _cache(d)
    assert cache.store is None and len(msgs) == 1 and d in msgs[0]
    _serves_from_memory(cache)


def test_store_locked_by_another_writer_still_raises(tmp_path):
    """Degrading is for directories that cannot work; a live writer elsewhere is an error."""
    from dsv41.cache import StoreLockedError
    first, msgs = _cache(str(tmp_path / "s"))
    assert first.store is not None and not msgs
    with pytest.raises(StoreLockedError):
        _cache(str(tmp_path / "s"))
    first.close()


@pytest.mark.parametrize("bad, err", [(7, TypeError), (None, TypeError), (b"tenant-a", TypeError),
                                      ("tenant-\udc80", ValueError)])
def test_namespace_must_be_a_utf8_str(bad, err):
    cache = PrefixCache(TINY, CacheConfig(block_tokens=B, device="cpu", gpu_capacity_bytes=4 * LAYOUT.block_bytes,
                                          swa_capacity_bytes=0))
    prompt = np.arange(2 * B, dtype="<u4")
    with pytest.raises(err, match="namespace"):
        cache.match(prompt, namespace=bad)
    with pytest.raises(err, match="namespace"):
        cache.insert(prompt, torch.zeros(2, LAYOUT.block_bytes, dtype=torch.uint8), namespace=bad)
    with pytest.raises(err, match="extra key"):
        cache.match(prompt, extra=[("lora", bad)])


def test_remote_tier_needs_a_weights_identity_like_the_store():
    """A remote tier is shared by every server process: without the weights' identity its
    keys cannot tell two models of one config apart, so it stays off (no connection is even
    attempted: the endpoints here point at a closed port) and says so once."""
    cc = CacheConfig(block_tokens=B, device="cpu", gpu_capacity_bytes=1 << 22, swa_capacity_bytes=1 << 22,
                     remote_blocks="mooncake://127.0.0.1:9", remote_snapshots="redis://127.0.0.1:9/0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = PrefixCache(TINY, cc)
    assert cache.remote is None
    msgs = [str(w.message) for w in caught if issubclass(w.category, StoreDisabledWarning)]
    assert len(msgs) == 1 and "remote tier is off" in msgs[0] and "weights identity" in msgs[0]
    cache.close()
