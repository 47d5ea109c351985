"""The weights' identity of a checkpoint: recorded by save_pretrained and `dsv41 digest`,
independent of sharding, re-checked cheaply on load, recomputed when a shard changed."""
from __future__ import annotations

import json
import os

import pytest
import torch
from dsv41.cli import main
from dsv41.config import ModelConfig
from dsv41.model import Model
from dsv41.model import weights_id as wid
from dsv41.model.checkpoint import shard_files

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
    _, header, data_at = wid._read_header(path)
    name = next(k for k in header if k != "__metadata__")
    begin = data_at + header[name]["data_offsets"][0]
    with open(path, "r+b") as f:
        f.seek(begin)
        b = f.read(4)
        f.seek(begin)
        f.write(bytes([b[0] ^ 1]) + b[1:])


def test_a_changed_shard_is_detected_and_rehashed(model, tmp_path):
    ck = tmp_path / "ck"
    model.save_pretrained(ck)
    before = Model.from_pretrained(ck).weights_id
    _flip_one_weight(ck)                       # the mtime moves with the write
    with pytest.warns(UserWarning, match="recomputing"):
        after = Model.from_pretrained(ck).weights_id
    assert after != before and after.startswith("sha256:")
    assert json.loads((ck / wid.DIGEST_NAME).read_text())["weights_id"] == after   # re-recorded
    # a touched but unchanged shard: rehashed once, same digest
    shard = ck / shard_files(ck)[0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.warns(UserWarning, match="recomputing"):
        assert Model.from_pretrained(ck).weights_id == after


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
