"""The `dsv41` command line, run as a user would (a subprocess)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dsv41.formats import layout


def dsv41(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsv41", *args], capture_output=True, text=True,
                          check=check, timeout=120)


def test_info_json_has_the_build_facts():
    info = json.loads(dsv41("info", "--json").stdout)
    assert {"cuda_compiled", "cuda_arch_list", "torch_version", "cuda_version"} <= set(info)


def test_kv_bytes_json_for_v41_flash():
    out = json.loads(dsv41("kv-bytes", "--preset", "v41-flash", "--json").stdout)
    # docs/design.md#bytes-per-token, recomputed here from the format sizes: 3 ratio-2 +
    # 1 ratio-1 owners.
    main, idx = layout.nvfp4_bytes(512), layout.mxfp4_bytes(128)
    assert out["global_bytes_per_token"] == 3 * main / 2 + main + 3 * idx / 2 + idx == 890
    assert out["persistent_bytes_per_token"] == 890
    assert out["swa_bytes_per_token_per_layer"] == layout.fp8_swa_bytes(512) == 528
    assert out["swa_bytes_per_sequence"] == 128 * 40 * 528
    assert out["vs"]["name"] == "v4-flash"
    assert 0.2 < out["vs"]["global_ratio"] < 0.3 and 0.1 < out["vs"]["persistent_ratio"] < 0.15


def test_kv_bytes_table_states_the_ratios():
    text = dsv41("kv-bytes").stdout
    assert "890.00 B/token" in text and "vs v4-flash" in text


def test_kv_bytes_reads_a_config_file(tmp_path):
    from dsv41.config import ModelConfig

    path = tmp_path / "config.json"
    ModelConfig.preset("v41-tiny").to_json(path)
    out = json.loads(dsv41("kv-bytes", "--config", str(path), "--json", "--compare", "none").stdout)
    assert out["global_bytes_per_token"] == 79.5 and "vs" not in out


@pytest.mark.parametrize("args, message", [
    (("kv-bytes", "--config", "/nonexistent/config.json"), "No such file"),
    (("kv-bytes", "--preset", "no-such-model"), "invalid choice"),
])
def test_bad_arguments_fail_with_a_message(args, message):
    r = dsv41(*args, check=False)
    assert r.returncode == 2 and message in r.stderr


def test_broken_config_file_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"text_config": {"hidden_size": 64}}))
    r = dsv41("kv-bytes", "--config", str(path), check=False)
    assert r.returncode == 2 and "dsv41 kv-bytes:" in r.stderr
