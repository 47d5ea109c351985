"""The CI smoke run: `dsv41 eval` end to end on v41-tiny through the real engine, one cell,
checking the report's structure, that a contract line which must fail does fail (zero
divergence for bounded replay with the cut past the window) and one which must pass does
pass (the exact-replay oracle against full prefill), resume, and the frozen record."""
from __future__ import annotations

import hashlib
import json
import time

import pytest

pytest.importorskip("dsv41.engine", reason="needs the engine (dsv41.Engine)")

from dsv41 import Model, ModelConfig  # noqa: E402
from dsv41.cli import main  # noqa: E402

MATRIX = """\
name: smoke
model: {preset: v41-tiny, seed: 0}
block_tokens: 4
prompts_per_cell: 2
states: [cold, swa_miss, shifted]
replay: [bounded, exact]
cut_shift: 8                  # H = 20 and 28: both past the window boundary (W = 16)
output_tokens: {short: 2, long: 4}
base: {hit: after_boundary, context: 40, suffix: short, task: passkey, concurrency: 1,
       output: short, evidence: before_boundary}
dimensions:
  hit: [after_boundary]
  context: [40]
  suffix: [short]
  task: [passkey]
  concurrency: [1]
  output: [short]
  evidence: [before_boundary]
"""

CONTRACT = """\
name: smoke
confidence: 0.95
bootstrap: 500
criteria:
  - id: oracle_equals_full_prefill      # must pass
    metric: kl_max
    stat: max
    op: "<="
    threshold: 0.0
    where: {state: [swa_miss, shifted], replay: [exact]}
  - id: oracle_logits_bit_exact         # must pass
    metric: logits_equal
    stat: min
    op: ">="
    threshold: 1.0
    where: {state: [swa_miss, shifted], replay: [exact]}
  - id: bounded_zero_divergence         # must fail: bounded replay past the window is approximate
    metric: kl_first
    stat: max
    op: "<="
    threshold: 0.0
    where: {state: [swa_miss, shifted], replay: [bounded]}
"""


def test_smoke_run(tmp_path, capsys):
    mpath, cpath, out = tmp_path / "matrix.yaml", tmp_path / "contract.yaml", tmp_path / "out"
    mpath.write_text(MATRIX)
    cpath.write_text(CONTRACT)
    t0 = time.perf_counter()
    rc = main(["eval", "--matrix", str(mpath), "--contract", str(cpath), "--out", str(out), "--json"])
    elapsed = time.perf_counter() - t0
    cap = capsys.readouterr()
    assert rc == 1, cap.err                                   # NO-GO: one line must fail
    printed = json.loads(cap.out)
    assert printed["verdict"] == "NO-GO"
    assert "runs" in cap.err and "[" in cap.err                # the progress bar went to stderr

    res = json.loads((out / "results.json").read_text())
    v = {x["id"]: x for x in res["verdicts"]}
    assert v["oracle_equals_full_prefill"]["pass"] and v["oracle_equals_full_prefill"]["n"] == 4
    assert v["oracle_equals_full_prefill"]["hi"] == 0.0
    assert v["oracle_logits_bit_exact"]["pass"]
    bz = v["bounded_zero_divergence"]
    assert not bz["pass"] and bz["n"] == 4 and bz["hi"] > 0.0

    # frozen before the run: matrix, contract (text + sha256), model, device, torch, sampling
    fr = res["frozen"]
    assert fr["matrix"]["sha256"] == hashlib.sha256(MATRIX.encode()).hexdigest()
    assert fr["contract"]["sha256"] == hashlib.sha256(CONTRACT.encode()).hexdigest()
    assert fr["contract"]["text"] == CONTRACT
    model = Model.synthetic(ModelConfig.preset("v41-tiny"), seed=0)
    assert fr["backend"]["kv_fingerprint"] == model.kv_fingerprint()
    assert len(fr["backend"]["weights_sha256"]) == 64 and fr["backend"]["torch"]
    assert fr["backend"]["model"] == {"preset": "v41-tiny", "seed": 0, "weights": "synthetic"}
    assert fr["sampling"]["temperature"] == 0.0 and fr["window"] == 16 and fr["block_tokens"] == 4
    assert json.loads((out / "frozen.json").read_text())["started_at"] == fr["started_at"]

    # the runs: 2 prompts x (cold + 2 states x 2 switches)
    (cell,) = res["cells"]
    runs = cell["runs"]
    assert len(runs) == 2 * (1 + 2 * 2)
    assert cell["cell"]["H"] == 20 and cell["cell"]["H_shifted"] == 28
    for r in runs:
        st, rp = r["coords"]["state"], r["coords"]["replay"]
        s = r["turns"][0]["stats"]
        if st == "cold":
            assert s["path"] == "cold" and rp == "none" and "kl_first" not in r["metrics"]
            continue
        H = 20 if st == "swa_miss" else 28
        assert s["path"] == "encoder_replay" and s["global_hit_tokens"] == H and s["swa_hit_tokens"] == 0
        assert r["metrics"]["swa_miss"] is True and r["cut_rel_window"] == H - 16
        if rp == "bounded":
            assert s["replayed_tokens"] == 16 and not s["global_exact"]
            assert r["metrics"]["kl_first"] > 0.0
        else:
            assert s["replay_start"] == 0 and s["global_exact"]   # L (W - 1) = 120 reaches back to 0
            assert r["metrics"]["kl_max"] == 0.0 and r["metrics"]["exact_match"]
        for key in ("ttft_s", "prefill_tok_s", "top1", "first_diff", "success", "global_bytes", "swa_bytes"):
            assert r["metrics"][key] is not None, key
        assert r["metrics"]["global_bytes"] > 0 and r["metrics"]["swa_bytes"] > 0

    # the report
    md = (out / "report.md").read_text()
    for part in ("# dsv41 acceptance report: NO-GO", "## Verdict per contract line", "## Cells",
                 "| oracle_equals_full_prefill |", "| PASS |", "| FAIL |", "swa_miss/bounded",
                 "![divergence_vs_cut.png]", "![latency_cdf.png]", "![bytes_per_ledger.png]"):
        assert part in md, part
    for png in ("divergence_vs_cut.png", "latency_cdf.png", "bytes_per_ledger.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    agg = res["summary"]["cells"][0]["groups"]
    assert agg["swa_miss/bounded"]["swa_miss_rate"] == 1.0
    assert agg["swa_miss/bounded"]["replayed_tokens"]["value"] == 16.0
    assert agg["cold/none"]["ttft_s"]["count"] == 2

    # resume: nothing reruns, the cell is read back
    lines = (out / "cells.jsonl").read_text()
    t1 = time.perf_counter()
    rc = main(["eval", "--matrix", str(mpath), "--contract", str(cpath), "--out", str(out), "--no-progress"])
    assert rc == 1 and (out / "cells.jsonl").read_text() == lines
    assert json.loads((out / "results.json").read_text())["frozen"]["resumed_cells"] == 1
    resumed = time.perf_counter() - t1
    assert resumed < elapsed
    capsys.readouterr()

    # another contract on the same directory is refused before anything runs
    cpath.write_text(CONTRACT.replace("threshold: 1.0", "threshold: 0.5"))
    rc = main(["eval", "--matrix", str(mpath), "--contract", str(cpath), "--out", str(out)])
    assert rc == 2 and "another matrix, contract or model" in capsys.readouterr().err
    print(f"smoke run {elapsed:.1f} s, resume {resumed:.1f} s")


def test_interrupted_run_resumes(tmp_path):
    """A run killed in its second cell resumes there: the first cell is not rerun."""
    from dsv41.eval import Contract, Matrix
    from dsv41.eval.backend import EngineBackend
    from dsv41.eval.runner import run_matrix

    mx = Matrix.from_yaml(MATRIX.replace("states: [cold, swa_miss, shifted]", "states: [cold]")
                          .replace("prompts_per_cell: 2", "prompts_per_cell: 1")
                          .replace("output_tokens: {short: 2, long: 4}", "output_tokens: {short: 1, long: 2}")
                          .replace("  hit: [after_boundary]", "  hit: [after_boundary, end]"))
    ct = Contract.from_yaml(CONTRACT)
    model = Model.synthetic(ModelConfig.preset("v41-tiny"), seed=0)

    class Interrupted(EngineBackend):
        calls = 0

        def run(self, *a, **k):
            Interrupted.calls += 1
            if Interrupted.calls == 2:              # one call per cell here; die in cell 2
                raise KeyboardInterrupt
            return super().run(*a, **k)

    with pytest.raises(KeyboardInterrupt):
        run_matrix(mx, ct, Interrupted(model, block_tokens=4), tmp_path, progress=False)
    first = (tmp_path / "cells.jsonl").read_text()
    assert first.count("\n") == 1 and json.loads(first)["cell"]["hit"] == "after_boundary"

    class Counting(EngineBackend):
        calls = 0

        def run(self, *a, **k):
            Counting.calls += 1
            return super().run(*a, **k)

    res = run_matrix(mx, ct, Counting(model, block_tokens=4), tmp_path, progress=False)
    assert Counting.calls == 1 and res["frozen"]["resumed_cells"] == 1
    assert [c["cell"]["hit"] for c in res["cells"]] == ["after_boundary", "end"]
    assert (tmp_path / "cells.jsonl").read_text().startswith(first)
    assert res["cells"][1]["runs"][-1]["turns"][0]["stats"]["path"] == "cold"
