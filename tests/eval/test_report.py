"""The report's structure from hand-made run records (fixture data, not measurements):
verdict rows, the GO/NO-GO line, tables per dimension, aggregates, plots."""
from __future__ import annotations

import json

from dsv41.eval.contract import Contract
from dsv41.eval.report import aggregate, write_report

CELL = {"hit": "end", "context": 64, "suffix": "short", "task": "passkey", "concurrency": 1,
        "output": "short", "evidence": "far_behind"}


def run(cell, state, replay, prompt, kl, ttft, hit):
    stats = {"path": {"cold": "cold", "swa_miss": "encoder_replay"}[state], "global_hit_tokens": hit,
             "swa_hit_tokens": 0, "token_latencies_s": [0.01, 0.02], "bytes": {"state_global": 100, "state_swa": 50}}
    m = {"ttft_s": ttft, "swa_miss": hit > 0, "replayed_tokens": 16 if hit else 0, "success": False, "valid": None}
    if state != "cold":
        m.update(kl_first=kl, kl_max=kl, top1=1.0, exact_match=kl == 0, first_diff=4, logits_equal=kl == 0)
    return {"coords": {**cell, "state": state, "replay": replay, "prompt": prompt, "repeat": 0},
            "cut": hit or None, "cut_rel_window": (hit - 16) if hit else None, "metrics": m,
            "turns": [{"output_tokens": [1, 2], "stats": stats}], "text": ["ab"]}


def result():
    cells = []
    for ctx in (64, 128):
        cell = {**CELL, "context": ctx}
        runs = []
        for p in range(3):
            runs.append(run(cell, "cold", "none", p, None, 0.05, 0))
            runs.append(run(cell, "swa_miss", "exact", p, 0.0, 0.03, ctx))
            runs.append(run(cell, "swa_miss", "bounded", p, 0.001 * (p + 1), 0.02, ctx))
        cells.append({"cell_id": f"context={ctx}", "cell": {**cell, "id": f"context={ctx}", "H": ctx,
                                                            "H_shifted": ctx - 8, "W": 16}, "runs": runs})
    frozen = {"matrix": {"name": "m", "sha256": "a" * 64, "text": ""},
              "contract": {"name": "c", "sha256": "b" * 64, "text": ""},
              "backend": {"kv_fingerprint": "f", "config_name": "v41-tiny", "device": "cpu"},
              "sampling": {"temperature": 0.0}, "window": 16, "block_tokens": 4, "cells": 2, "prompts_per_cell": 3}
    return {"frozen": frozen, "cells": cells}


CONTRACT = """
criteria:
  - {id: oracle, metric: kl_max, stat: max, op: "<=", threshold: 0, where: {replay: [exact]}}
  - {id: bounded, metric: kl_first, stat: mean, op: "<=", threshold: 0.01, where: {replay: [bounded]}}
"""


def test_report_files_and_structure(tmp_path):
    s = write_report(result(), Contract.from_yaml(CONTRACT), tmp_path)
    assert s["verdict"] == "GO" and [v["pass"] for v in s["verdicts"]] == [True, True]
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# dsv41 acceptance report: GO")
    assert "| oracle |" in md and "| bounded |" in md and "**Overall: GO** (2 of 2 lines pass)" in md
    assert "### context" in md and "**context = 64**" in md and "**context = 128**" in md
    assert "### hit" not in md                     # a dimension with one value gets no table
    doc = json.loads((tmp_path / "results.json").read_text())
    assert set(doc) >= {"frozen", "verdict", "verdicts", "summary", "cells", "plots"}
    assert sorted(doc["plots"]) == ["bytes_per_ledger.png", "divergence_vs_cut.png", "latency_cdf.png"]
    g = doc["summary"]["cells"][0]["groups"]["swa_miss/bounded"]
    assert g["kl_first"]["value"] == 0.002 and g["swa_miss_rate"] == 1.0 and g["paths"] == {"encoder_replay": 3}
    assert doc["summary"]["cells"][0]["groups"]["cold/none"]["swa_miss_rate"] is None
    strict = Contract.from_yaml(CONTRACT.replace("threshold: 0.01", "threshold: 0.001"))
    s = write_report(result(), strict, tmp_path, plots=False)
    assert s["verdict"] == "NO-GO" and "| FAIL |" in (tmp_path / "report.md").read_text()


def test_aggregate_latency_and_bytes():
    runs = [run(CELL, "swa_miss", "bounded", p, 0.0, t, 64) for p, t in enumerate([0.01, 0.02, 0.03, 0.04])]
    a = aggregate(runs)
    assert a["runs"] == 4 and a["ttft_s"]["p50"] == 0.025 and a["ttft_s"]["count"] == 4
    assert a["token_latency_s"]["count"] == 8 and a["bytes"]["state_global"] == 100.0
    assert a["replayed_tokens"]["value"] == 16.0 and a["exact_match"]["value"] == 1.0


def test_success_tables_per_evidence_and_task():
    from dsv41.eval.report import _success_tables

    def agg(v, runs):
        return {"success": {"value": v, "lo": v, "hi": v}, "runs": runs}

    summary = {"dimensions": {
        "evidence": {"before_boundary": {"cold/none": agg(1.0, 4), "swa_miss/bounded": agg(0.5, 4)},
                     "far_behind": {"cold/none": agg(1.0, 2), "swa_miss/bounded": agg(1.0, 2)}},
        "hit": {"end": {"cold/none": agg(1.0, 6)}}}}
    lines = _success_tables(summary)
    assert lines[0] == "## Task success per state and replay switch"
    assert "| state/replay | before_boundary | far_behind |" in lines
    assert "| swa_miss/bounded | 0.5 (n=4) | 1 (n=2) |" in lines
    assert not any("by task" in x for x in lines)            # no task dimension given
    assert _success_tables({"dimensions": {"hit": {}}}) == []
