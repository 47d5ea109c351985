"""The weights' identity of a checkpoint: recorded by save_pretrained and `dsv41 digest`,
independent of sharding, re-checked cheaply on load, recomputed when a shard changed; a
copy whose mtimes moved (a clone, `cp -r`) is hashed once, silently, and remembered by a
stamp in the user's cache instead of a rewritten record."""
from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch
from dsv41.cli import main
from dsv41.config import ModelConfig
from dsv41.model import Model
from dsv41.model import weights_id as wid
from dsv41.model.checkpoint import shard_files
from dsv41.model.safetensors_file import read_header

TINY = ModelConfig.preset("v41-tiny")


@pytest.fixture(scope="module")
def model():
    return Model.synthetic(TINY, seed=5)


def test_save_records_a_digest_that_loads_and_ignores_sharding(model, tmp_path):
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "many", max_shard_bytes=64 << 10)
    assert len(shard_files(tmp_path / "many")) > 3
    a, b = Model.from_pretrained(tmp_path / "one"), Model.from_pretrained(tmp_path / "many")
    assert a.weights_id.startswith("sha256:") and a.weights_id == b.weights_id
    record = json.loads((tmp_path / "one" / wid.DIGEST_NAME).read_text())
    assert record["weights_id"] == a.weights_id and set(record["files"]) == set(shard_files(tmp_path / "one"))
    other = Model.synthetic(TINY, seed=6)
    other.save_pretrained(tmp_path / "other")
    assert Model.from_pretrained(tmp_path / "other").weights_id != a.weights_id
    # the operator's identity wins over the record
    assert Model.from_pretrained(tmp_path / "one", weights_id="acme/tiny@1").weights_id == "acme/tiny@1"
    with pytest.raises(TypeError, match="weights_id"):
        Model.from_pretrained(tmp_path / "one", weights_id="")


def test_load_trusts_an_unchanged_record_without_hashing(model, tmp_path, monkeypatch):
    model.save_pretrained(tmp_path / "ck")
    expected = Model.from_pretrained(tmp_path / "ck").weights_id

    def no_hashing(*a, **k):
        raise AssertionError("the weights were hashed again although nothing changed")

    monkeypatch.setattr(wid, "compute_weights_digest", no_hashing)
    assert Model.from_pretrained(tmp_path / "ck").weights_id == expected


def _flip_one_weight(directory) -> None:
    """Changes one float of a shard in place: same size and header, new content."""
    path = directory / shard_files(directory)[0]
    header = read_header(path)
    begin, _ = header.span(next(iter(header.tensors)))
    with open(path, "r+b") as f:
        f.seek(begin)
        b = f.read(4)
        f.seek(begin)
        f.write(bytes([b[0] ^ 1]) + b[1:])


@pytest.fixture
def user_cache(tmp_path, monkeypatch):
    """The stamps' cache of one test (never the real home)."""
    monkeypatch.setenv("DSV41_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def hashes(monkeypatch):
    """Counts the full hashes of the weights (the expensive part of a load; saving hashes too,
    so tests clear it after they save)."""
    calls = []
    real = wid.compute_weights_digest

    def counting(*a, **k):
        calls.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(wid, "compute_weights_digest", counting)
    return calls


def _no_hashing(monkeypatch):
    def no_hashing(*a, **k):
        raise AssertionError("the weights were hashed although the stamp vouches for them")
    monkeypatch.setattr(wid, "compute_weights_digest", no_hashing)


def _load_silently(directory) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # any warning fails the test
        return Model.from_pretrained(directory).weights_id


def _touch_all(directory, by_ns: int = 10**9) -> None:
    """New mtimes, same bytes: what a clone, `cp -r` or rsync without -t does."""
    for name in shard_files(directory):
        st = (directory / name).stat()
        os.utime(directory / name, ns=(st.st_atime_ns, st.st_mtime_ns + by_ns))


def test_a_changed_shard_is_detected_and_rehashed(model, tmp_path, user_cache, hashes):
    ck = tmp_path / "ck"
    model.save_pretrained(ck)
    hashes.clear()                             # saving hashed once; count the loads'
    before = Model.from_pretrained(ck).weights_id
    _flip_one_weight(ck)                       # the mtime moves with the write
    with pytest.warns(UserWarning, match="recomputing"):
        after = Model.from_pretrained(ck).weights_id
    assert after != before and after.startswith("sha256:")
    assert json.loads((ck / wid.DIGEST_NAME).read_text())["weights_id"] == after   # re-recorded
    assert len(hashes) == 1
    # a touched but unchanged shard: rehashed once, silently, same digest, record untouched
    record = (ck / wid.DIGEST_NAME).read_bytes()
    _touch_all(ck)
    assert _load_silently(ck) == after and len(hashes) == 2
    assert (ck / wid.DIGEST_NAME).read_bytes() == record
    assert _load_silently(ck) == after and len(hashes) == 2       # the stamp vouches now


def test_a_copy_with_new_mtimes_loads_silently_and_keeps_its_record(model, tmp_path, user_cache,
                                                                   hashes, monkeypatch):
    ck, copy = tmp_path / "ck", tmp_path / "copy"
    model.save_pretrained(ck, max_shard_bytes=256 << 10)
    hashes.clear()                             # saving hashed once; count the loads'
    expected = Model.from_pretrained(ck).weights_id
    shutil.copytree(ck, copy)                  # copy2 keeps mtimes; a clone does not:
    _touch_all(copy, by_ns=-(10**9))           # every shard gets another one
    record = (copy / wid.DIGEST_NAME).read_bytes()
    assert len(shard_files(copy)) > 1 and not hashes
    assert _load_silently(copy) == expected
    assert len(hashes) == 1                    # a moved mtime is never trusted unhashed
    assert (copy / wid.DIGEST_NAME).read_bytes() == record          # byte for byte
    stamp = wid.weights_stamp_path(copy)
    assert stamp.parent == user_cache / "weights-stamps" and stamp.is_file()
    assert json.loads(stamp.read_text())["weights_id"] == expected
    assert not list(stamp.parent.glob("*.tmp"))
    # the next load trusts the stamp: no hashing, no warning, record still untouched
    _no_hashing(monkeypatch)
    assert _load_silently(copy) == expected
    assert (copy / wid.DIGEST_NAME).read_bytes() == record
    assert Model.from_pretrained(ck).weights_id == expected        # the original needs no stamp
    assert not wid.weights_stamp_path(ck).exists()


def _stamped_copy(model, tmp_path, hashes):
    """(checkpoint dir, its weights_id) of a saved checkpoint whose mtimes all moved (a
    copy), loaded once: hashed once and stamped (`hashes` holds that one hash)."""
    ck = tmp_path / "ck"
    model.save_pretrained(ck)
    hashes.clear()                             # saving hashed once; count the loads'
    _touch_all(ck)
    return ck, _load_silently(ck)


def test_a_change_after_the_stamp_is_still_detected(model, tmp_path, user_cache, hashes):
    ck, expected = _stamped_copy(model, tmp_path, hashes)
    assert wid.weights_stamp_path(ck).is_file() and len(hashes) == 1
    _flip_one_weight(ck)                       # new bytes: the mtime moves past the stamp's
    with pytest.warns(UserWarning, match="recomputing"):
        changed = Model.from_pretrained(ck).weights_id
    assert changed != expected and len(hashes) == 2
    assert json.loads((ck / wid.DIGEST_NAME).read_text())["weights_id"] == changed  # re-recorded
    assert _load_silently(ck) == changed and len(hashes) == 2      # the new record matches


def test_a_stamp_vouches_only_for_its_record_and_its_facts(model, tmp_path, user_cache, hashes):
    ck, expected = _stamped_copy(model, tmp_path, hashes)
    stamp_path = wid.weights_stamp_path(ck)
    stamp = json.loads(stamp_path.read_text())
    # a stamp for another digest (the record was since rewritten): not used, rehashed
    stamp_path.write_text(json.dumps(dict(stamp, weights_id="sha256:" + "0" * 64)))
    assert _load_silently(ck) == expected and len(hashes) == 2
    assert json.loads(stamp_path.read_text()) == stamp             # re-stamped
    # a stamp for other facts (another size): not used
    name = next(iter(stamp["files"]))
    other = dict(stamp, files={name: dict(stamp["files"][name], size=1)})
    stamp_path.write_text(json.dumps(other))
    assert _load_silently(ck) == expected and len(hashes) == 3
    # a corrupt stamp is absent, not an error
    for junk in (b"", b"{not json", b"[]", json.dumps(dict(stamp, format="other/9")).encode()):
        stamp_path.write_bytes(junk)
        assert _load_silently(ck) == expected
    assert len(hashes) == 7
    assert _load_silently(ck) == expected and len(hashes) == 7     # the last rehash re-stamped


def test_an_unwritable_user_cache_still_loads(model, tmp_path, monkeypatch, hashes):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory would be")
    monkeypatch.setenv("DSV41_CACHE_DIR", str(blocker))
    ck = tmp_path / "ck"
    model.save_pretrained(ck)
    hashes.clear()                             # saving hashed once; count the loads'
    expected = Model.from_pretrained(ck).weights_id
    record = (ck / wid.DIGEST_NAME).read_bytes()
    _touch_all(ck)
    for n in (1, 2):                           # no stamp to remember it: each load hashes
        assert _load_silently(ck) == expected and len(hashes) == n
    assert (ck / wid.DIGEST_NAME).read_bytes() == record
    assert blocker.read_text() == "a file where the cache directory would be"


def test_a_link_at_the_stamp_is_neither_trusted_nor_written_through(model, tmp_path, user_cache,
                                                                     hashes):
    ck, expected = _stamped_copy(model, tmp_path, hashes)
    stamp_path = wid.weights_stamp_path(ck)
    good = stamp_path.read_bytes()
    target = tmp_path / "elsewhere.json"
    target.write_bytes(good)                   # a valid stamp, but behind a link
    stamp_path.unlink()
    stamp_path.symlink_to(target)
    assert _load_silently(ck) == expected and len(hashes) == 2
    assert not stamp_path.is_symlink() and stamp_path.read_bytes() == good   # replaced, not followed
    assert target.read_bytes() == good


def test_the_stamps_live_in_the_user_cache(tmp_path, monkeypatch):
    d = tmp_path / "ck"
    d.mkdir()
    key = wid.weights_stamp_path(d).name
    assert key == wid.weights_stamp_path(tmp_path / "." / "ck").name   # the resolved path names it
    monkeypatch.setenv("DSV41_CACHE_DIR", str(tmp_path / "c"))
    assert wid.weights_stamp_path(d) == tmp_path / "c" / "weights-stamps" / key
    monkeypatch.delenv("DSV41_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert wid.weights_stamp_path(d) == tmp_path / "xdg" / "dsv41" / "weights-stamps" / key
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")        # the XDG spec ignores it
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert wid.weights_stamp_path(d) == tmp_path / "home" / ".cache" / "dsv41" / "weights-stamps" / key


def test_checkpoint_without_record_has_no_identity_until_dsv41_digest(model, tmp_path, capsys):
    ck = tmp_path / "ck"
    model.save_pretrained(ck, max_shard_bytes=256 << 10)
    expected = Model.from_pretrained(ck).weights_id
    (ck / wid.DIGEST_NAME).unlink()            # a checkpoint written by another tool
    assert Model.from_pretrained(ck).weights_id is None
    assert main(["digest", str(ck)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == expected and "100%" in err and "hashing" in err   # progress bar on stderr
    assert Model.from_pretrained(ck).weights_id == expected
    assert main(["digest", "--quiet", str(ck)]) == 0 and capsys.readouterr().err == ""


def test_digest_cli_rejects_what_is_not_a_checkpoint(tmp_path, capsys):
    assert main(["digest", str(tmp_path / "missing")]) == 2
    assert "not a checkpoint" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)   # header length beyond the file
    assert main(["digest", str(tmp_path)]) == 2
    assert "dsv41 digest:" in capsys.readouterr().err


def test_synthetic_identity_follows_config_and_seed():
    a = Model.synthetic(TINY, seed=0)
    assert a.weights_id == wid.synthetic_weights_id(TINY.fingerprint(), 0)
    a.init_synthetic(1)                         # new weights, new identity
    assert a.weights_id == wid.synthetic_weights_id(TINY.fingerprint(), 1)
    assert torch.equal(a.head.weight, Model.synthetic(TINY, seed=1).head.weight)
