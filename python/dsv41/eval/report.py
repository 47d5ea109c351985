"""The report: results.json, report.md (verdict per contract line, tables per dimension)
and PNG plots (matplotlib, Agg backend).

    summary = summarize(result, contract)          # verdicts + aggregates (plain dicts)
    write_report(result, contract, out_dir)        # files; returns the summary

Aggregates are per cell and per (state, replay): means of the per-run metrics with a
bootstrap interval over prompts (contract.confidence), latency percentiles (TTFT and the
time between output tokens, pooled over the cell's requests), the SWA pool miss rate
(requests with a global hit and no snapshot / requests with a global hit) and bytes per
ledger. Tables per dimension pool every cell that has the dimension's value (marginal).
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from .contract import Contract, run_metric
from .matrix import DIMENSIONS
from .stats import bootstrap_ci, latency_summary

__all__ = ["summarize", "write_report", "aggregate"]

_MEAN_METRICS = ("kl_first", "kl_max", "top1", "exact_match", "logits_equal", "first_diff", "success",
                 "valid", "decode_tok_s", "prefill_tok_s", "replayed_tokens", "prefill_tokens",
                 "global_bytes", "swa_bytes")
_BYTE_KEYS = ("global_read", "swa_read", "global_written", "swa_written")


def _all_runs(result: dict) -> list[dict]:
    return [r for c in result["cells"] for r in c["runs"]]


def aggregate(runs: list[dict], confidence: float = 0.95, n_boot: int = 1000) -> dict:
    """Aggregates of a set of runs (see the module docstring)."""
    out: dict = {"runs": len(runs)}
    for m in _MEAN_METRICS:
        per_prompt = defaultdict(list)
        for r in runs:
            v = run_metric(r, m)
            if v is not None:
                per_prompt[(_cell_key(r), r["coords"]["prompt"])].append(float(v))
        vals = [float(np.mean(v)) for v in per_prompt.values()]
        out[m] = bootstrap_ci(vals, "mean", confidence=confidence, n_boot=n_boot) if vals else None
    out["ttft_s"] = latency_summary([r["metrics"]["ttft_s"] for r in runs])
    out["token_latency_s"] = latency_summary([x for r in runs for t in r["turns"]
                                              for x in t["stats"]["token_latencies_s"]])
    hit = [r for r in runs if r["turns"][0]["stats"]["global_hit_tokens"] > 0]
    out["swa_miss_rate"] = (sum(1 for r in hit if r["metrics"]["swa_miss"]) / len(hit)) if hit else None
    out["bytes"] = {k: float(np.mean([r["turns"][0]["stats"]["bytes"].get(k, 0) for r in runs]))
                    for k in _BYTE_KEYS + ("state_global", "state_swa", "state_main", "state_indexer",
                                           "state_compressor_state")} if runs else {}
    paths: dict = defaultdict(int)
    for r in runs:
        paths[r["turns"][0]["stats"]["path"]] += 1
    out["paths"] = dict(sorted(paths.items()))
    return out


def _cell_key(r: dict) -> str:
    return ",".join(f"{k}={r['coords'][k]}" for k in DIMENSIONS)


def _groups(runs: list[dict]) -> list[tuple[str, str]]:
    seen = []
    for r in runs:
        k = (r["coords"]["state"], r["coords"]["replay"])
        if k not in seen:
            seen.append(k)
    return seen


def summarize(result: dict, contract: Contract) -> dict:
    runs = _all_runs(result)
    verdicts = contract.evaluate(runs)
    conf = contract.confidence
    cells = []
    for c in result["cells"]:
        groups = {}
        for st, rp in _groups(c["runs"]):
            sel = [r for r in c["runs"] if r["coords"]["state"] == st and r["coords"]["replay"] == rp]
            groups[f"{st}/{rp}"] = aggregate(sel, conf)
        cells.append({"cell_id": c["cell_id"], "cell": c["cell"], "groups": groups})
    dims = {}
    for d in DIMENSIONS:
        values = []
        for c in result["cells"]:
            v = c["cell"][d]
            if v not in values:
                values.append(v)
        if len(values) < 2:
            continue
        dims[d] = {}
        for v in values:
            sel = [r for r in runs if str(r["coords"][d]) == str(v)]
            dims[d][str(v)] = {f"{st}/{rp}": aggregate([r for r in sel if r["coords"]["state"] == st
                                                        and r["coords"]["replay"] == rp], conf, 500)
                               for st, rp in _groups(sel)}
    return {"verdict": "GO" if all(v["pass"] for v in verdicts) else "NO-GO", "verdicts": verdicts,
            "cells": cells, "dimensions": dims}


def _fmt(x, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e5):
            return f"{x:.{digits - 1}e}"
        return f"{x:.{digits}g}"
    return str(x)


def _ci(d) -> str:
    if not d or d.get("value") is None:
        return "-"
    if d["lo"] == d["hi"]:
        return _fmt(d["value"])
    return f"{_fmt(d['value'])} [{_fmt(d['lo'])}, {_fmt(d['hi'])}]"


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


_TABLE_COLS = ("state/replay", "runs", "paths", "KL first", "KL max", "top-1", "exact match",
               "first diff", "success", "valid", "replayed", "SWA miss", "TTFT p50/p95/p99 ms",
               "token p50/p95/p99 ms", "decode tok/s", "prefill tok/s")


def _row(name: str, a: dict) -> str:
    t, k = a["ttft_s"], a["token_latency_s"]
    cols = [name, str(a["runs"]), " ".join(f"{p}:{n}" for p, n in a["paths"].items()),
            _ci(a["kl_first"]), _ci(a["kl_max"]), _ci(a["top1"]), _ci(a["exact_match"]),
            _ci(a["first_diff"]), _ci(a["success"]), _ci(a["valid"]), _ci(a["replayed_tokens"]),
            _fmt(a["swa_miss_rate"]), f"{_ms(t['p50'])}/{_ms(t['p95'])}/{_ms(t['p99'])}",
            f"{_ms(k['p50'])}/{_ms(k['p95'])}/{_ms(k['p99'])}", _ci(a["decode_tok_s"]), _ci(a["prefill_tok_s"])]
    return "| " + " | ".join(cols) + " |"


def _table(groups: dict) -> list[str]:
    lines = ["| " + " | ".join(_TABLE_COLS) + " |", "|" + "---|" * len(_TABLE_COLS)]
    lines += [_row(name, a) for name, a in groups.items()]
    return lines


def _success_tables(summary: dict) -> list[str]:
    """Task success per state and replay switch, one column per value of the dimensions
    that decide what replay can cost: where the evidence sits relative to the replay
    boundary, and the task."""
    L: list[str] = []
    for dim in ("evidence", "task"):
        vals = summary["dimensions"].get(dim)
        if not vals:
            continue
        names = list(vals)
        groups = list(next(iter(vals.values())))
        L += [f"**by {dim}**", "", "| state/replay | " + " | ".join(names) + " |",
              "|" + "---|" * (len(names) + 1)]
        for g in groups:
            L.append(f"| {g} | " + " | ".join(
                _ci(vals[v][g]["success"]) + f" (n={vals[v][g]['runs']})" if g in vals[v] else "-"
                for v in names) + " |")
        L.append("")
    if not L:              # a matrix that varies neither
        return []
    return ["## Task success per state and replay switch", "",
            "Share of prompts the task's scorer accepts (95% bootstrap interval over prompts); "
            "each column pools the cells with that value (one factor at a time, so a column "
            "holds its own cells' prompts).", ""] + L


def _markdown(result: dict, summary: dict, contract: Contract, plots: list[str]) -> str:
    fr = result["frozen"]
    be = fr["backend"]
    L = [f"# dsv41 acceptance report: {summary['verdict']}", ""]
    L += [f"Matrix `{fr['matrix']['name']}` (sha256 `{fr['matrix']['sha256'][:16]}`), contract "
          f"`{fr['contract']['name']}` (sha256 `{fr['contract']['sha256'][:16]}`, recorded before the run "
          f"in frozen.json). Started {fr.get('started_at')}, finished {fr.get('finished_at')}"
          + (f", {fr.get('resumed_cells')} cell(s) resumed from an earlier run" if fr.get("resumed_cells") else "")
          + ".", ""]
    L += ["| frozen | value |", "|---|---|",
          f"| model | {be.get('model')} ({be.get('config_name')}) |",
          f"| kv fingerprint | `{be.get('kv_fingerprint')}` |",
          f"| weights sha256 | `{be.get('weights_sha256')}` |",
          f"| commit | `{(be.get('git') or {}).get('commit')}` (dirty: {(be.get('git') or {}).get('dirty')}) |",
          f"| device | {be.get('device')} ({be.get('device_name')}), torch {be.get('torch')}, {be.get('torch_threads')} threads |",
          f"| load average (1 min) at start / end | {fr.get('loadavg_start')} / {fr.get('loadavg_end')} "
          f"(timings are wall clock: a loaded machine inflates them) |",
          f"| window W / cache block | {fr['window']} / {fr['block_tokens']} tokens |",
          f"| sampling | {fr['sampling']} |", f"| cells / prompts per cell | {fr['cells']} / {fr['prompts_per_cell']} |",
          ""]
    L += ["## Verdict per contract line", "",
          f"A line passes only when its whole {contract.confidence:.0%} bootstrap interval (over prompts) "
          "satisfies the comparison; a line no run matches fails.", "",
          "| id | criterion | n | value | interval | verdict |", "|---|---|---|---|---|---|"]
    for v in summary["verdicts"]:
        L.append(f"| {v['id']} | {v['text']} | {v['n']} | {_fmt(v['value'])} | "
                 f"[{_fmt(v['lo'])}, {_fmt(v['hi'])}] | {'PASS' if v['pass'] else 'FAIL'} |")
    L += ["", f"**Overall: {summary['verdict']}** ({sum(v['pass'] for v in summary['verdicts'])} of "
          f"{len(summary['verdicts'])} lines pass).", ""]
    synthetic = (be.get("model") or {}).get("weights") == "synthetic"
    L += _success_tables(summary)
    L += ["## Tables per dimension", "",
          "Marginal: each row pools every cell with that value. KL in nats against full prefill "
          "(cold) of the same prompt and seed; intervals are bootstrap over prompts; latencies in ms. "
          + ("With synthetic weights task success is near chance: divergence is the signal."
             if synthetic else "Task success is the task scorer's verdict on the greedy output; "
             "cold/none is full prefill, so a state or switch costs accuracy where its success "
            "falls below that row."), ""]
    for d, vals in summary["dimensions"].items():
        L += [f"### {d}", ""]
        for v, groups in vals.items():
            L += [f"**{d} = {v}**", ""] + _table(groups) + [""]
    L += ["## Cells", ""]
    for c in summary["cells"]:
        cd = c["cell"]
        L += [f"### {c['cell_id']}", "", f"H = {cd['H']}, shifted H = {cd['H_shifted']}, W = {cd['W']}", ""]
        L += _table(c["groups"]) + [""]
    if plots:
        L += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(L)


def _plots(result: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = _all_runs(result)
    made = []
    # 1. divergence against the cut position relative to the window
    fig, ax = plt.subplots(figsize=(7, 4.5))
    any_pts = False
    for rp in sorted({r["coords"]["replay"] for r in runs if r["coords"]["state"] in ("swa_miss", "shifted")}):
        pts = [(r["cut_rel_window"], r["metrics"]["kl_first"]) for r in runs
               if r["coords"]["replay"] == rp and r["coords"]["state"] in ("swa_miss", "shifted")
               and r["metrics"].get("kl_first") is not None]
        if pts:
            any_pts = True
            xs, ys = zip(*pts)
            ax.scatter(xs, ys, label=f"replay {rp}", alpha=0.7, s=18)
    if any_pts:
        ax.set_yscale("symlog", linthresh=1e-6)
        ax.axvline(0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("cut position H - W (tokens; 0 = the window boundary)")
        ax.set_ylabel("KL(full prefill || run), first token (nats)")
        ax.set_title("Divergence against cut position (global hit, SWA miss)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "divergence_vs_cut.png", dpi=100)
        made.append("divergence_vs_cut.png")
    plt.close(fig)
    # 2. latency CDFs, replay on vs off, per concurrency
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    any_lat = False
    for rp in sorted({r["coords"]["replay"] for r in runs if r["coords"]["state"] == "swa_miss"}):
        for conc in sorted({int(r["coords"]["concurrency"]) for r in runs}):
            sel = [r for r in runs if r["coords"]["state"] == "swa_miss" and r["coords"]["replay"] == rp
                   and int(r["coords"]["concurrency"]) == conc]
            if not sel:
                continue
            any_lat = True
            for ax, vals in ((axes[0], [r["metrics"]["ttft_s"] for r in sel]),
                             (axes[1], [x for r in sel for t in r["turns"] for x in t["stats"]["token_latencies_s"]])):
                if vals:
                    v = np.sort(np.asarray(vals)) * 1000
                    ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=f"{rp}, conc {conc}")
    if any_lat:
        for ax, name in zip(axes, ("TTFT", "time between output tokens")):
            ax.set_xscale("log")
            ax.set_xlabel(f"{name} (ms, log scale)")
            ax.set_ylabel("fraction of requests" if name == "TTFT" else "fraction of tokens")
            ax.set_title(f"{name}: global hit, SWA miss")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "latency_cdf.png", dpi=100)
        made.append("latency_cdf.png")
    plt.close(fig)
    # 3. bytes per ledger
    groups = _groups(runs)
    keys = ("state_global", "state_swa", "global_read", "swa_read", "global_written", "swa_written")
    fig, ax = plt.subplots(figsize=(max(7, len(groups) * 0.9), 4.5))
    width = 0.8 / len(keys)
    for j, k in enumerate(keys):
        vals = [float(np.mean([r["turns"][0]["stats"]["bytes"].get(k, 0) for r in runs
                               if (r["coords"]["state"], r["coords"]["replay"]) == g])) for g in groups]
        ax.bar(np.arange(len(groups)) + j * width, vals, width, label=k)
    ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2)
    ax.set_xticklabels([f"{s}\n{r}" for s, r in groups], fontsize=7)
    ax.set_ylabel("bytes per request (mean)")
    ax.set_title("Bytes per ledger: final state, cache reads and writes")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "bytes_per_ledger.png", dpi=100)
    made.append("bytes_per_ledger.png")
    plt.close(fig)
    return made


def write_report(result: dict, contract: Contract, out_dir: str | Path, plots: bool = True) -> dict:
    """results.json, report.md and the PNGs into out_dir; returns the summary."""
    out = Path(out_dir)
    summary = summarize(result, contract)
    made = _plots(result, out) if plots else []
    doc = {"frozen": result["frozen"], "verdict": summary["verdict"], "verdicts": summary["verdicts"],
           "summary": {"cells": summary["cells"], "dimensions": summary["dimensions"]},
           "cells": result["cells"], "plots": made}
    (out / "results.json").write_text(json.dumps(doc, indent=1, default=_json_default))
    (out / "report.md").write_text(_markdown(result, summary, contract, made))
    return summary


def _json_default(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    raise TypeError(f"not JSON serializable: {type(x)}")
