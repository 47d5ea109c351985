"""Prefix matching keys: the chained block hash and the tagged extra keys it covers.

A prompt is cut into blocks of `block_tokens` tokens; block i's hash covers its parent's
hash (block i-1, or the chain root), its token ids and the request's extra keys. Every field
goes through one length-prefixed, tagged encoding (`_field`), so no two fields can run
together: ("ab", "c") and ("a", "bc") encode differently, and a token id can never be read
as part of a namespace.

The hash function is pluggable (`BlockHasher(hash_fn=...)`, sha256 by default) so tests can
inject a deliberately weak one: the cache never trusts a hash alone. Every tier keeps the
token ids and the exact key with each block and compares them on a hit, and a block's
parent is identified by the tier's own block identity (not by the parent hash), so a
collision at any depth costs a miss, never wrong KV.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..config import ModelConfig

__all__ = ["HashFn", "sha256", "CacheKey", "BlockHasher", "model_fingerprint", "as_token_array", "decode_key",
           "MAX_DIGEST_BYTES"]

HashFn = Callable[[bytes], bytes]
MAX_DIGEST_BYTES = 32  # records and pool slots store digests of at most this many bytes

_DOMAIN_ROOT = b"dsv41.cache.root.v1"
_DOMAIN_BLOCK = b"dsv41.cache.block.v1"
_DOMAIN_KEY = b"dsv41.cache.key.v1"
_DOMAIN_MODEL = b"dsv41.model.v1"


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _tag(tag: bytes) -> bytes:
    return len(tag).to_bytes(1, "little") + tag


def _field(tag: bytes, value: bytes) -> bytes:
    """tag length (1 byte), tag, value length (8 bytes little-endian), value."""
    return _tag(tag) + len(value).to_bytes(8, "little") + value


def as_token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a little-endian uint32 array (ids must lie in [0, 2**32))."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.dtype == np.dtype("<u4"):
        return arr
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 32):
        raise ValueError("token ids must lie in [0, 2**32)")
    return arr.astype("<u4")


def model_fingerprint(config: ModelConfig, weights_digest: str | None = None) -> str:
    """The model part of every cache key: the config's fingerprint and a digest of the
    weights (from the loader; None for a model whose weights are not identified, which
    then shares cache entries with every other such model of the same config)."""
    data = _DOMAIN_MODEL + _field(b"config", config.fingerprint().encode()) \
        + _field(b"weights", (weights_digest or "").encode())
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class CacheKey:
    """Everything besides the tokens that decides whether two requests may share KV.

    `namespace` is the tenant/salt (requests in different namespaces never share blocks);
    `model_fingerprint` identifies config and weights; `format_version` the payload format;
    `extra` further tagged keys (a LoRA id, a media hash), in a fixed order.
    """

    namespace: str
    model_fingerprint: str
    format_version: int
    extra: tuple[tuple[str, str], ...] = field(default=())

    def encode(self) -> bytes:
        parts = [_DOMAIN_KEY, _field(b"namespace", self.namespace.encode()),
                 _field(b"model", self.model_fingerprint.encode()),
                 _field(b"format", str(int(self.format_version)).encode())]
        for name, value in self.extra:
            parts.append(_field(b"extra", _field(b"name", name.encode())
                                + _field(b"value", value.encode())))
        return b"".join(parts)


class BlockHasher:
    """The block hash chain over fixed blocks of `block_tokens` tokens."""

    def __init__(self, block_tokens: int, hash_fn: HashFn = sha256, name: str = "sha256"):
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self.block_tokens = block_tokens
        self.hash_fn = hash_fn
        self.name = name
        probe = hash_fn(b"dsv41")
        if not isinstance(probe, bytes) or not 1 <= len(probe) <= MAX_DIGEST_BYTES:
            raise ValueError(f"hash_fn must return 1..{MAX_DIGEST_BYTES} bytes, got {probe!r}")
        self.digest_bytes = len(probe)

    def root(self, key_bytes: bytes) -> bytes:
        """The chain's starting parent: a hash of the extra keys alone."""
        return self.hash_fn(_DOMAIN_ROOT + _field(b"key", key_bytes))

    def hash_blocks(self, tokens: Sequence[int] | np.ndarray, key_bytes: bytes,
                    start: int = 0, parent: bytes | None = None) -> list[bytes]:
        """Hashes of the full blocks of `tokens` from block `start` on; `parent` is the hash
        of block start-1 (required when start > 0; the chain root otherwise). A trailing
        partial block has no hash."""
        arr = as_token_array(tokens)
        n = arr.size // self.block_tokens
        if start > 0 and parent is None:
            raise ValueError("hash_blocks: parent is required when start > 0")
        prev = self.root(key_bytes) if start == 0 else parent
        rows = arr[: n * self.block_tokens].reshape(n, self.block_tokens)
        # block_hash() below, with the constant parts of the encoding built once.
        head = _DOMAIN_BLOCK + _tag(b"parent")
        tok_head = _tag(b"tokens") + (self.block_tokens * 4).to_bytes(8, "little")
        key_part = _field(b"key", key_bytes)
        fn = self.hash_fn
        hashes = []
        for i in range(start, n):
            prev = fn(b"".join((head, len(prev).to_bytes(8, "little"), prev, tok_head,
                                rows[i].tobytes(), key_part)))
            hashes.append(prev)
        return hashes

    def block_hash(self, parent: bytes, block: Sequence[int] | np.ndarray, key_bytes: bytes) -> bytes:
        """The hash of one block: H(domain, parent, tokens, key), each field tagged."""
        arr = as_token_array(block)
        if arr.size != self.block_tokens:
            raise ValueError(f"a block holds {self.block_tokens} tokens, got {arr.size}")
        return self.hash_fn(_DOMAIN_BLOCK + _field(b"parent", parent)
                            + _field(b"tokens", arr.tobytes()) + _field(b"key", key_bytes))


def _read_fields(data: bytes) -> list[tuple[bytes, bytes]]:
    out, pos = [], 0
    while pos < len(data):
        tl = data[pos]
        tag = data[pos + 1: pos + 1 + tl]
        pos += 1 + tl
        vl = int.from_bytes(data[pos: pos + 8], "little")
        pos += 8
        if pos + vl > len(data):
            raise ValueError("truncated field")
        out.append((tag, data[pos: pos + vl]))
        pos += vl
    return out


def decode_key(key_bytes: bytes) -> dict:
    """CacheKey.encode() read back, for tools (`dsv41 cache stats` shows namespaces);
    {"namespace": "?"} for bytes that are not a key encoding."""
    try:
        if not key_bytes.startswith(_DOMAIN_KEY):
            raise ValueError("not a key")
        fields = _read_fields(key_bytes[len(_DOMAIN_KEY):])
        out: dict = {"extra": []}
        for tag, value in fields:
            if tag == b"extra":
                (_, name), (_, val) = _read_fields(value)
                out["extra"].append((name.decode(), val.decode()))
            else:
                out[{b"model": "model_fingerprint", b"format": "format_version"}.get(tag, tag.decode())] = \
                    value.decode()
        return out
    except (ValueError, UnicodeDecodeError, IndexError):
        return {"namespace": "?"}
