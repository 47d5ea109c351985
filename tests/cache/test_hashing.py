"""Block hash chain and cache keys: determinism, domain separation, incremental hashing."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from dsv41.cache.hashing import BlockHasher, CacheKey, _field, as_token_array, decode_key, model_fingerprint
from dsv41.config import ModelConfig

from .helpers import B, FP, TINY, key


def test_chain_is_deterministic_and_each_block_depends_on_its_whole_prefix():
    h = BlockHasher(B)
    t = np.arange(5 * B) % 97
    a = h.hash_blocks(t, key())
    assert a == h.hash_blocks(t.tolist(), key()) and len(a) == 5 and len(set(a)) == 5
    t2 = t.copy()
    t2[3] += 1  # changes block 0: every later hash changes too
    b = h.hash_blocks(t2, key())
    assert all(x != y for x, y in zip(a, b))
    t3 = t.copy()
    t3[3 * B] += 1  # block 3: blocks 0-2 keep their hashes
    c = h.hash_blocks(t3, key())
    assert c[:3] == a[:3] and all(x != y for x, y in zip(a[3:], c[3:]))


def test_partial_block_has_no_hash_and_incremental_equals_full():
    h = BlockHasher(B)
    t = np.arange(3 * B + 5)
    full = h.hash_blocks(t, key())
    assert len(full) == 3
    assert h.hash_blocks(t, key(), start=1, parent=full[0]) == full[1:]
    assert h.block_hash(full[1], t[2 * B:3 * B], key()) == full[2]
    assert h.block_hash(h.root(key()), t[:B], key()) == full[0]
    with pytest.raises(ValueError, match="parent"):
        h.hash_blocks(t, key(), start=1)


def test_every_key_field_changes_the_chain():
    h = BlockHasher(B)
    t = np.arange(B)
    variants = [CacheKey("a", FP, 1), CacheKey("b", FP, 1), CacheKey("a", FP[::-1], 1), CacheKey("a", FP, 2),
                CacheKey("a", FP, 1, (("lora", "x"),)), CacheKey("a", FP, 1, (("lora", "y"),))]
    hashes = {h.hash_blocks(t, k.encode())[0] for k in variants}
    assert len(hashes) == len(variants)


def test_fields_cannot_run_together():
    # Without length prefixes these pairs would encode to the same bytes.
    assert CacheKey("ab", "c", 1).encode() != CacheKey("a", "bc", 1).encode()
    assert CacheKey("a", FP, 1, (("x", "yz"),)).encode() != CacheKey("a", FP, 1, (("xy", "z"),)).encode()
    assert _field(b"tokens", b"\x01\x02") + _field(b"key", b"") != _field(b"tokens", b"\x01") + _field(b"key", b"\x02")
    # A namespace that spells out an encoded field is still just a namespace.
    sneaky = CacheKey("x" + _field(b"model", FP.encode()).decode("latin1"), "", 1)
    assert sneaky.encode() != CacheKey("x", FP, 1).encode()


def test_decode_key_reads_back_the_fields():
    k = CacheKey("tenant-7", FP, 1, (("lora", "abc"),))
    d = decode_key(k.encode())
    assert d["namespace"] == "tenant-7" and d["model_fingerprint"] == FP and d["format_version"] == "1"
    assert d["extra"] == [("lora", "abc")]
    assert decode_key(b"garbage")["namespace"] == "?"


def test_pluggable_hash_and_its_checks():
    weak = BlockHasher(B, lambda b: hashlib.md5(b).digest()[:2], "md5-2")
    assert weak.digest_bytes == 2 and len(weak.hash_blocks(np.arange(B), key())[0]) == 2
    with pytest.raises(ValueError, match="1..32"):
        BlockHasher(B, lambda b: hashlib.sha512(b).digest())
    with pytest.raises(ValueError):
        BlockHasher(0)


def test_token_validation():
    assert as_token_array([1, 2, 3]).dtype == np.dtype("<u4")
    for bad in ([-1], [1 << 32]):
        with pytest.raises(ValueError):
            as_token_array(bad)
    with pytest.raises(TypeError):
        as_token_array([0.5])
    with pytest.raises(ValueError):
        as_token_array([[1, 2]])


def test_model_fingerprint_covers_config_and_weights():
    tiny, other = TINY.fingerprint(), ModelConfig.preset("v41-small").fingerprint()
    assert model_fingerprint(tiny, "w") == model_fingerprint(tiny, "w")
    assert model_fingerprint(tiny, "w") != model_fingerprint(other, "w")
    assert len({model_fingerprint(tiny, "w1"), model_fingerprint(tiny, "w2"), model_fingerprint(tiny, None),
                model_fingerprint(tiny, "")}) == 4   # unknown weights (None) is not the id ""


@pytest.mark.parametrize("bad, err", [(7, TypeError), (b"tenant", TypeError), (None, TypeError),
                                      ("tenant-\udc80", ValueError)])
def test_namespace_must_be_a_utf8_encodable_str(bad, err):
    with pytest.raises(err, match="namespace"):
        CacheKey(bad, FP, 1).encode()
    with pytest.raises(err, match="extra key value"):
        CacheKey("ns", FP, 1, (("lora", bad),)).encode()
