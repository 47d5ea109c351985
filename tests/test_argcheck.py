"""What every command's input goes through: ranged argparse types and the bounded read of a
regular file."""
from __future__ import annotations

import argparse
import os
import threading

import pytest

from dsv41.argcheck import FloatRange, IntRange, device, output_dir, read_regular_file


def test_int_and_float_ranges():
    t = IntRange(1, 10)
    assert t("1") == 1 and t(" 10 ") == 10
    for bad in ("0", "11", "1.5", "abc", "", "nan", "0x5", "9" * 40):
        with pytest.raises(argparse.ArgumentTypeError):
            t(bad)
    assert IntRange(0)("12345678901234567890") == 12345678901234567890   # no upper bound
    f = FloatRange(0, 5, lo_open=True)
    assert f("5") == 5.0 and f("1e-3") == 1e-3
    for bad in ("0", "-1", "5.1", "nan", "inf", "-inf", "1e999", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            f(bad)
    assert FloatRange(0, 5)("0") == 0.0


def test_device_and_output_dir(tmp_path):
    assert [device(d) for d in ("cpu", "cuda", "cuda:3")] == ["cpu", "cuda", "cuda:3"]
    for bad in ("gpu", "cuda:", "cuda:-1", "cpu:0", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            device(bad)
    f = tmp_path / "f"
    f.write_text("x")
    assert output_dir(str(tmp_path)) == str(tmp_path)
    assert output_dir(str(tmp_path / "new" / "deeper")) == str(tmp_path / "new" / "deeper")   # to be created
    for bad, says in ((str(f), "a file"), (str(f / "sub"), "file"), ("/dev/null", "device"), ("", "empty")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            output_dir(bad)


def test_read_regular_file_never_blocks_on_a_fifo_or_device(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    done = threading.Event()
    errors = []

    def read(path):
        try:
            read_regular_file(path, 100)
        except ValueError as e:
            errors.append(str(e))
        done.set()
    for path in (fifo, "/dev/zero", tmp_path):
        done.clear()
        threading.Thread(target=read, args=(path,), daemon=True).start()
        assert done.wait(10), f"reading {path} blocked"
    assert [("not a regular file" in e) or ("a directory" in e) for e in errors] == [True] * 3
    big = tmp_path / "big"
    big.write_bytes(b"x" * 101)
    with pytest.raises(ValueError, match="more than the 100 bytes"):
        read_regular_file(big, 100)
    assert read_regular_file(big, 101) == b"x" * 101
    with pytest.raises(FileNotFoundError):
        read_regular_file(tmp_path / "missing", 100)
