"""What every command's input goes through: ranged argparse types, the bounded read of a
regular file, and the config-file boundary (config/json_io.read_config_file)."""
from __future__ import annotations

import argparse
import json
import os
import threading

import pytest

from dsv41.argcheck import FloatRange, IntRange, device, output_dir, read_regular_file
from dsv41.config import ConfigError, ModelConfig
from dsv41.config.json_io import CONFIG_MAX_BYTES, CONFIG_MAX_DEPTH, read_config_file


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


def test_read_config_file_checks_the_document_at_the_boundary(tmp_path):
    good = ModelConfig.preset("v41-tiny").to_hf_dict()

    count = iter(range(1000))

    def write(obj=None, raw=None):
        p = tmp_path / f"c{next(count)}.json"
        p.write_bytes(raw if raw is not None else json.dumps(obj).encode())
        return p
    assert ModelConfig.from_json(write(good)) == ModelConfig.preset("v41-tiny")
    nested = {"x": 1}
    for _ in range(CONFIG_MAX_DEPTH - 2):   # with the top-level object: CONFIG_MAX_DEPTH levels
        nested = {"x": nested}
    assert read_config_file(write({**good, "deep": nested}))["deep"]          # exactly the limit
    edge = json.loads(json.dumps(good))
    edge["max_position_embeddings"] = 2**53 - 1
    assert read_config_file(write(edge))
    cases = {
        "top level": write([good]), "null": write(raw=b"null"),
        "nested deeper": write({**good, "deep": {"x": nested}}),
        "deeper than": write(raw=b"[" * 100_000 + b"]" * 100_000),
        "out of range": write({**good, "n": -(2**53)}),
        "NaN": write(raw=json.dumps(good).encode()[:-1] + b', "x": NaN}'),
        "Infinity": write(raw=b'{"x": -Infinity}'),
        "not UTF-8": write(raw=b'{"x": "\xff"}'),
        "not JSON": write(raw=b"{"),
        "more than": write(raw=b" " * (CONFIG_MAX_BYTES + 1) + b"{}"),
    }
    for says, path in cases.items():
        with pytest.raises(ConfigError, match=says):
            read_config_file(path)
    for doc in ([1], None, "x"):
        with pytest.raises(ConfigError, match="a config is a JSON object"):
            ModelConfig.from_dict(doc)
    bad_type = json.loads(json.dumps(good))
    bad_type["layer_types"] = 5
    del bad_type["compress_ratios"]
    with pytest.raises(ConfigError, match="malformed config"):
        ModelConfig.from_dict(bad_type)
