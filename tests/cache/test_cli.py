"""`dsv41 cache stats|verify|gc`, in process through dsv41.cli.main and once as a user
would run it (a subprocess)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dsv41.cache.store import format as sf
from dsv41.cache.cli import parse_size
from dsv41.cli import main

from .helpers import B, LAYOUT, key, open_store, rand_tokens, write_chain


@pytest.fixture
def store_dir(tmp_path):
    rng = np.random.default_rng(0)
    with open_store(tmp_path) as st:
        for ns in ("alpha", "beta", "beta"):
            write_chain(st, rand_tokens(rng, 3 * B), key(ns))
    return tmp_path


def test_stats(store_dir, capsys):
    assert main(["cache", "stats", str(store_dir)]) == 0
    out = capsys.readouterr().out
    assert "9 in 3 segments" in out and "'beta'" in out and f"{LAYOUT.block_bytes:,} B/block" in out
    assert main(["cache", "stats", str(store_dir), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["records"] == 9 and st["namespaces"]["beta"]["records"] == 6
    assert main(["cache", "stats", str(store_dir / "nope")]) == 2


def test_verify_reports_corruption_with_a_nonzero_exit(store_dir, capsys):
    assert main(["cache", "verify", str(store_dir), "--progress"]) == 0
    cap = capsys.readouterr()
    assert "9 ok, 0 corrupt" in cap.out and "block hashes recomputed" in cap.out and "100.0%" in cap.err
    with open_store(store_dir, mode="r") as st:
        info = st.record_info(st.record_ids()[4])
    with open(store_dir / info["segment"], "r+b") as f:
        f.seek(info["offset"] + 1000)
        f.write(b"\xff\x00\xff")
    assert main(["cache", "verify", str(store_dir), "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "1 corrupt" in out and f"record {info['record_id']}" in out
    assert main(["cache", "verify", str(store_dir), "--repair", "--json", "--no-progress"]) == 1
    assert json.loads(capsys.readouterr().out)["corrupt"] == 1
    assert main(["cache", "verify", str(store_dir), "--no-progress"]) == 0


def test_gc_and_the_writer_lock(store_dir, capsys):
    with open_store(store_dir):
        assert main(["cache", "gc", str(store_dir)]) == 2
        assert "already open for writing" in capsys.readouterr().err
    # 9 packed records (16 KiB) fit 40K once compacted into one segment: a cap below that
    # must evict.
    assert main(["cache", "gc", str(store_dir), "--capacity", "16K", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["evicted"] > 0 and rep["bytes_after"] <= 16 * 1024
    names = [n for n in os.listdir(store_dir) if sf.parse_segment_name(n)]
    assert sum(os.path.getsize(store_dir / n) for n in names) == rep["bytes_after"]


def test_sizes():
    assert parse_size("10G") == 10 << 30 and parse_size("512MiB") == 512 << 20 and parse_size("4096") == 4096
    with pytest.raises(Exception):
        parse_size("lots")


def test_as_a_command(store_dir):
    r = subprocess.run([sys.executable, "-m", "dsv41", "cache", "verify", str(store_dir)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "9 ok" in r.stdout, r.stderr
