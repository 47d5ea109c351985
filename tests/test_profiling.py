"""dsv41.profiling: off and free by default; switched on, its NVTX ranges reach a real NVTX
tool, balanced, exceptions included, with the engine's counts in their payloads.

What is checked how. NVTX calls do nothing until a tool is injected (Nsight Systems
injects its own library through NVTX_INJECTION64_PATH). The test builds a small tool,
tests/nvtx_recorder.c, from the NVTX headers (CUDA's, or the ones the CUDA build of torch
ships) and injects it into a subprocess that runs tests/nvtx_workload.py with DSV41_NVTX=1.
The recorder writes what the NVTX library hands a tool (domain, range pushes and pops per
thread, registered names, payload schemas and payload bytes), so these tests check the
ranges as a profiler receives them, not a log of dsv41's own. The payloads are decoded
with the schemas the tool received and compared with the engine's own statistics.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from dsv41 import profiling

HERE = Path(__file__).resolve().parent
PYTHON_DIR = HERE.parent / "python"
INT64 = 17            # NVTX_PAYLOAD_ENTRY_TYPE_INT64
BLOCK = 16            # tests/nvtx_workload.py's block size


def _nvtx_include() -> str | None:
    roots = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include")]
    roots += glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "*", "include"))
    for r in roots:
        if os.path.exists(os.path.join(r, "nvtx3", "nvToolsExtPayload.h")):
            return r
    return None


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    """Builds the recorder, runs the workload under it; (events, schemas, workload output)."""
    pytest.importorskip("nvtx")
    cc = shutil.which("cc") or shutil.which("gcc")
    inc = _nvtx_include()
    if cc is None or inc is None:
        pytest.skip("needs a C compiler and the NVTX v3 headers (CUDA or torch's nvidia wheels)")
    tmp = tmp_path_factory.mktemp("nvtx")
    lib = tmp / "libnvtx_recorder.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-I", inc, "-o", str(lib),
                    str(HERE / "nvtx_recorder.c"), "-lpthread"], check=True, timeout=120)
    record = tmp / "record.tsv"
    env = dict(os.environ, NVTX_INJECTION64_PATH=str(lib), DSV41_NVTX_RECORD=str(record),
               DSV41_NVTX="1", PYTHONPATH=os.pathsep.join(
                   [str(PYTHON_DIR), os.environ.get("PYTHONPATH", "")]))
    env.pop("NVTX_DISABLE", None)
    r = subprocess.run([sys.executable, str(HERE / "nvtx_workload.py"), str(tmp / "store")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    events, schemas = [], {}
    for line in record.read_text().splitlines():
        kind, *f = line.split("\t")
        if kind == "schema":
            schemas[int(f[0])] = [(n, int(t), int(o)) for n, t, o in
                                  (e.split(":") for e in f[1].split(",") if e)]
        elif kind == "push":
            events.append(("push", int(f[0]), f[1], f[2], f[3]))
        elif kind == "pop":
            events.append(("pop", int(f[0]), f[1], None, None))
    return events, schemas, out


def _decode(payload: str, schemas: dict) -> dict:
    """An `ext:<schema>:<hex>` payload as {field: int}, through the received schemas."""
    assert payload.startswith("ext:"), payload
    _, sid, hexdata = payload.split(":")
    data = bytes.fromhex(hexdata)
    fields = {}
    for name, typ, off in schemas[int(sid)]:
        while typ != INT64 and typ in schemas:        # nvtx wraps int64 in its own schema
            typ = schemas[typ][0][1]
        assert typ == INT64, (name, typ)
        fields[name] = int.from_bytes(data[off:off + 8], "little", signed=True)
    return fields


def _ranges(events, schemas, name: str) -> list[dict]:
    return [_decode(e[4], schemas) if e[4].startswith("ext:") else {}
            for e in events if e[0] == "push" and e[3] == name]


def test_off_by_default_and_free():
    if os.environ.get(profiling.ENV, "") not in ("", "0"):
        pytest.skip(f"{profiling.ENV} is set in this environment")
    assert not profiling.enabled()
    assert profiling.scope("engine.step", requests=3) is profiling.NULL

    calls = []

    def counts(x):
        calls.append(x)
        return {"tokens": x}

    @profiling.traced("test.fn", counts)
    def fn(x):
        return x + 1

    assert fn(41) == 42 and calls == []          # off: the payload is never even computed


def test_enable_without_a_tool_stays_off():
    pytest.importorskip("nvtx")
    if os.environ.get("NVTX_INJECTION64_PATH"):
        pytest.skip("a profiler is attached to this process")
    try:
        assert profiling.enable() is False       # nvtx's no-op domain: nothing to emit to
        assert not profiling.enabled()
    finally:
        profiling.disable()


def test_ranges_are_balanced_per_thread_even_on_exceptions(recording):
    events, _, out = recording
    assert out["enabled"] and out["insert_raised"] and out["op_raised"]
    stacks: dict[int, list[str]] = {}
    for kind, tid, domain, name, _ in events:
        assert domain == profiling.DOMAIN
        st = stacks.setdefault(tid, [])
        if kind == "push":
            st.append(name)
        else:
            assert st, "a pop without an open range"
            st.pop()
    assert all(not s for s in stacks.values()), stacks
    # the failing op ran inside test.outer, and both ranges ended
    names = [(e[0], e[3]) for e in events]
    i = names.index(("push", "test.outer"))
    assert names[i:i + 4] == [("push", "test.outer"), ("push", "op.quantize_nvfp4"),
                              ("pop", None), ("pop", None)]
    # the failing insert's range ended too (balance above); it was emitted
    assert any(n == ("push", "cache.insert") for n in names)


def test_switching_off_inside_a_range_still_ends_it(recording):
    events, _, out = recording
    names = [(e[0], e[3]) for e in events]
    i = names.index(("push", "test.toggle"))
    assert names[i + 1] == ("pop", None)          # the op inside ran unrecorded
    assert ("push", "test.after_toggle") not in names and out["enabled_after_disable"] is False
    assert out["reenabled"] is True and ("push", "test.reenabled") in names


def test_every_engine_phase_and_op_launch_has_a_range(recording):
    events, _, _ = recording
    seen = {e[3] for e in events if e[0] == "push"}
    phases = {"engine.step", "engine.schedule", "engine.plan", "cache.lookup", "cache.ssd_promote",
              "cache.read_blocks", "replay.plan", "engine.prefill", "engine.encoder_replay",
              "engine.decode", "engine.sample", "engine.write_back", "cache.insert",
              "cache.ssd_write", "cache.put_snapshot"}
    ops = {"op.quantize_nvfp4", "op.quantize_mxfp4", "op.quantize_fp8_swa", "op.sparse_attention",
           "op.indexer_scores", "op.topk_visible"}
    assert phases <= seen, phases - seen
    assert ops <= seen, ops - seen


def test_payloads_carry_the_engines_counts(recording):
    events, schemas, out = recording
    runs = out["runs"]
    assert runs["cold"]["path"] == "cold" and runs["both_hit"]["path"] == "both_hit"
    assert runs["encoder_replay"]["path"] == "encoder_replay" and runs["ssd"]["ssd_hit_tokens"] > 0

    prefills = _ranges(events, schemas, "engine.prefill")
    assert {"requests": 1, "prefill_requests": 1, "prefill_tokens": runs["cold"]["prefill_tokens"],
            "replayed_tokens": 0, "decoder_tokens": runs["cold"]["prompt_tokens"],
            "decode_tokens": 0} in prefills
    assert any(p["prefill_tokens"] == runs["both_hit"]["prefill_tokens"] for p in prefills)
    # the expired-snapshot turn, and the SSD run (a new pool has no snapshot) when it replays
    replays = [r for r in runs.values() if r["path"] == "encoder_replay"]
    got = [(p["replayed_tokens"], p["prefill_tokens"], p["prefill_requests"])
           for p in _ranges(events, schemas, "engine.encoder_replay")]
    assert sorted(got) == sorted((r["replayed_tokens"], r["prefill_tokens"], 1) for r in replays)
    assert all(r["replayed_tokens"] > 0 for r in replays)
    decodes = _ranges(events, schemas, "engine.decode")
    assert len(decodes) == sum(r["output_tokens"] - 1 for r in runs.values())
    assert all(d["decode_tokens"] == 1 and d["prefill_requests"] == 0 for d in decodes)
    promoted = [p["blocks"] for p in _ranges(events, schemas, "cache.ssd_promote")]
    assert max(promoted) * BLOCK >= runs["ssd"]["ssd_hit_tokens"]
    lookups = [p["tokens"] for p in _ranges(events, schemas, "cache.lookup")]
    assert runs["cold"]["prompt_tokens"] in lookups
    ops = _ranges(events, schemas, "op.sparse_attention")
    assert ops and all(p["tokens"] >= 1 for p in ops)
