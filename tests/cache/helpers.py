"""Shared builders for the cache tests: a tiny model's layout, store identities, and chains
of records whose payloads are a deterministic function of their tokens (so any payload
served can be checked against what was written, even after a crash)."""
from __future__ import annotations

import hashlib

import numpy as np

from dsv41.cache.hashing import BlockHasher, CacheKey, model_fingerprint, sha256
from dsv41.cache.layout import PAYLOAD_FORMAT_VERSION, BlockLayout
from dsv41.cache.store import PersistentStore, StoreIdentity
from dsv41.config import ModelConfig

TINY = ModelConfig.preset("v41-tiny")
B = 16  # small blocks keep records tiny (tiny's ratios are 1 and 2)
LAYOUT = BlockLayout(TINY, B)
WEIGHTS_ID = "tests:tiny"  # the caches of these tests stand for one model's weights
FP = model_fingerprint(TINY.fingerprint(), WEIGHTS_ID)


def weak_hash(data: bytes) -> bytes:
    """A deliberately terrible 1-byte hash: collisions every few blocks."""
    return hashlib.sha256(data).digest()[:1]


def identity(layout: BlockLayout = LAYOUT, fp: str = FP, hasher: BlockHasher | None = None) -> StoreIdentity:
    hasher = hasher or BlockHasher(layout.block_tokens)
    return StoreIdentity(fp, layout.fingerprint(), layout.block_tokens, layout.block_bytes,
                         PAYLOAD_FORMAT_VERSION, hasher.name, hasher.digest_bytes)


def key(namespace: str = "ns", fp: str = FP) -> bytes:
    return CacheKey(namespace, fp, PAYLOAD_FORMAT_VERSION).encode()


def payload_for(tokens: np.ndarray, key_bytes: bytes, block_bytes: int = LAYOUT.block_bytes) -> np.ndarray:
    """The payload a block of these tokens (after this prefix) 'has': seeded by a digest."""
    seed = int.from_bytes(hashlib.sha256(key_bytes + np.ascontiguousarray(tokens, "<u4").tobytes()).digest()[:8],
                          "little")
    return np.random.default_rng(seed).integers(0, 256, block_bytes, dtype=np.uint8)


def chain_payloads(tokens: np.ndarray, key_bytes: bytes, block_tokens: int = B,
                   block_bytes: int = LAYOUT.block_bytes) -> np.ndarray:
    """Payloads of every full block of a token sequence (each depends on the whole prefix)."""
    n = tokens.size // block_tokens
    return np.stack([payload_for(tokens[: (i + 1) * block_tokens], key_bytes, block_bytes) for i in range(n)]) \
        if n else np.zeros((0, block_bytes), np.uint8)


def write_chain(store: PersistentStore, tokens: np.ndarray, key_bytes: bytes, hasher: BlockHasher | None = None,
                commit: bool = True) -> tuple[list[bytes], list[int], np.ndarray]:
    """Puts every full block of `tokens` as one chain (from the root); returns (hashes,
    record ids, payloads)."""
    hasher = hasher or BlockHasher(store.identity.block_tokens)
    T = store.identity.block_tokens
    hashes = hasher.hash_blocks(tokens, key_bytes)
    pays = chain_payloads(tokens, key_bytes, T, store.identity.block_bytes)
    parent, rids = 0, []
    root = hasher.root(key_bytes)
    for i, h in enumerate(hashes):
        parent = store.put(key=key_bytes, parent=parent, block_index=i, block_hash=h,
                           parent_hash=hashes[i - 1] if i else root, tokens=tokens[i * T:(i + 1) * T],
                           payload=pays[i])
        rids.append(parent)
    if commit:
        store.commit()
    return hashes, rids, pays


def token_rows(tokens: np.ndarray, n: int, block_tokens: int = B) -> np.ndarray:
    return np.ascontiguousarray(tokens[: n * block_tokens], "<u4").reshape(n, block_tokens)


def load_all(store: PersistentStore, tokens: np.ndarray, key_bytes: bytes, hasher: BlockHasher | None = None):
    """(record ids, payload rows) of the longest verified stored prefix of `tokens`."""
    hasher = hasher or BlockHasher(store.identity.block_tokens)
    hashes = hasher.hash_blocks(tokens, key_bytes)
    out = np.zeros((len(hashes), store.identity.block_bytes), np.uint8)
    rids = store.load(key_bytes, hashes, token_rows(tokens, len(hashes), store.identity.block_tokens), out)
    return rids, out[: len(rids)]


def rand_tokens(rng: np.random.Generator, n: int, vocab: int = 256) -> np.ndarray:
    return rng.integers(0, vocab, n).astype("<u4")


def open_store(path, **kw) -> PersistentStore:
    kw.setdefault("durability", "none")
    return PersistentStore(path, kw.pop("identity", identity()), **kw)


__all__ = ["TINY", "B", "LAYOUT", "FP", "weak_hash", "identity", "key", "payload_for", "chain_payloads",
           "write_chain", "token_rows", "load_all", "rand_tokens", "open_store", "sha256"]


def kill_during(child, delay_s: float) -> str:
    """Forks; the child runs child(wfd) (it writes its progress to wfd and never returns),
    the parent SIGKILLs it after delay_s and returns everything it wrote."""
    import os
    import signal
    import time

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        os.close(r)
        child(w)
    os.close(w)
    time.sleep(delay_s)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    return data.decode()
