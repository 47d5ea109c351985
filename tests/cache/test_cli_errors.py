"""`dsv41 cache` exit codes (issue 10, section 4): 0 clean, 1 corruption found, 2 could not
open the store or bad arguments; one line on stderr, never a traceback."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from dsv41.cache.store import format as sf
from dsv41.cache.store import files as _files
from dsv41.cli import main

from .helpers import B, key, open_store, rand_tokens, write_chain


@pytest.fixture
def store_dir(tmp_path):
    rng = np.random.default_rng(0)
    with open_store(tmp_path / "s") as st:
        for _ in range(2):
            write_chain(st, rand_tokens(rng, 3 * B), key())
    return tmp_path / "s"


def run(argv, capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err
    return code, cap.out, cap.err


@pytest.mark.parametrize("ttl", ["-1", "0", "nan", "inf", "soon"])
def test_gc_refuses_a_ttl_that_is_not_positive(store_dir, capsys, ttl):
    code, _, err = run(["cache", "gc", str(store_dir), "--ttl-hours", ttl], capsys)
    assert code == 2 and "--ttl-hours" in err
    with open_store(store_dir, mode="r") as st:
        assert len(st) == 6  # nothing was expired


@pytest.mark.parametrize("cap", ["0.5", "0", "-5G", "lots", "1e400"])
def test_gc_refuses_a_capacity_that_is_not_a_size(store_dir, capsys, cap):
    code, _, err = run(["cache", "gc", str(store_dir), "--capacity", cap], capsys)
    assert code == 2 and "--capacity" in err


@pytest.mark.parametrize("cmd", [["stats"], ["verify"], ["verify", "--repair"], ["gc"]])
def test_a_path_that_is_a_file_or_missing(tmp_path, capsys, cmd):
    f = tmp_path / "file"
    f.write_text("not a store")
    code, _, err = run(["cache", cmd[0], str(f)] + cmd[1:], capsys)
    assert code == 2 and "not a directory" in err
    missing = tmp_path / "missing"
    code, _, err = run(["cache", cmd[0], str(missing)] + cmd[1:], capsys)
    assert code == 2 and "does not exist" in err and not missing.exists()  # gc must not create it
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run(["cache", cmd[0], str(empty)] + cmd[1:], capsys)
    assert code == 2 and "not a dsv41 persistent store" in err and os.listdir(empty) == []


def test_a_read_only_filesystem(store_dir, capsys, monkeypatch):
    """The writer's first write is opening LOCK; on a read-only filesystem it fails with
    EROFS (simulated: the tests run as root, which permissions do not stop)."""
    real = _files.open_regular

    def refuse_writes(path, flags, mode=0o644):
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, flags, mode)

    monkeypatch.setattr(_files, "open_regular", refuse_writes)
    code, _, err = run(["cache", "gc", str(store_dir)], capsys)
    assert code == 2 and "Read-only file system" in err and "mode='r'" in err
    code, out, _ = run(["cache", "verify", str(store_dir), "--no-progress"], capsys)
    assert code == 0 and "6 ok" in out  # reading needs no writes


def test_a_directory_named_like_a_segment(store_dir, capsys):
    (store_dir / sf.segment_name(7, b"\x07" * 16)).mkdir()
    code, out, _ = run(["cache", "stats", str(store_dir)], capsys)
    assert code == 0 and "is a directory" in out
    code, out, _ = run(["cache", "verify", str(store_dir), "--no-progress"], capsys)
    assert code == 1 and "6 ok, 0 corrupt" in out and "is a directory" in out
    code, _, _ = run(["cache", "gc", str(store_dir)], capsys)
    assert code == 0


def test_another_models_manifest_with_on_disk_segments_is_exit_1_not_0(store_dir, capsys):
    import json
    m = json.loads((store_dir / sf.MANIFEST_NAME).read_text())
    m["model_fingerprint"] = "f" * 64
    m["checksum"] = sf.manifest_checksum(m)
    (store_dir / sf.MANIFEST_NAME).write_text(json.dumps(m))
    code, out, _ = run(["cache", "verify", str(store_dir), "--no-progress"], capsys)
    assert code == 1 and "0 records" in out and "belong to another store" in out
