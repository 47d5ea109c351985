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

__all__ = ["HashFn", "sha256", "CacheKey", "BlockHasher", "model_fingerprint", "as_token_array", "decode_key",
           "MAX_DIGEST_BYTES"]

HashFn = Callable[[bytes], bytes]
MAX_DIGEST_BYTES = 32  # records and pool slots store digests of at most this many bytes

_DOMAIN_ROOT = b"dsv41.cache.root.v1"
_DOMAIN_BLOCK = b"dsv41.cache.block.v1"
_DOMAIN_KEY = b"dsv41.cache.key.v1"
_DOMAIN_MODEL = b"dsv41.model.v2"   # v2: KV options and the weights' identity


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


def model_fingerprint(kv_fingerprint: str, weights_id: str | None) -> str:
    """The model part of every cache key, computed here and nowhere else.

    kv_fingerprint: the config and every model option that changes stored bytes
    (`Model.kv_fingerprint()`; a cache built from a config alone uses
    `ModelConfig.fingerprint()`, so it never matches a model's). weights_id: the weights'
    identity (`Model.weights_id`); None when unknown, and then the cache never uses its
    persistent store (PrefixCache), since the fingerprint cannot tell such models apart."""
    data = _DOMAIN_MODEL + _field(b"kv", _text("kv_fingerprint", kv_fingerprint)) \
        + _field(b"weights", b"" if weights_id is None else b"id:" + _text("weights_id", weights_id))
    return hashlib.sha256(data).hexdigest()


def _text(what: str, value) -> bytes:
    """A key field as UTF-8, with a clear error for a non-str or a str UTF-8 cannot encode."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__} {value!r}")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} {value!r} cannot be encoded as UTF-8 ({e.reason} at index "
                         f"{e.start}); use a str without lone surrogates") from None


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
        parts = [_DOMAIN_KEY, _field(b"namespace", _text("namespace", self.namespace)),
                 _field(b"model", _text("model_fingerprint", self.model_fingerprint)),
                 _field(b"format", str(int(self.format_version)).encode())]
        for pair in self.extra:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise TypeError(f"extra keys must be (name, value) pairs of str, got {pair!r}")
            parts.append(_field(b"extra", _field(b"name", _text("extra key name", pair[0]))
                                + _field(b"value", _text("extra key value", pair[1]))))
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
