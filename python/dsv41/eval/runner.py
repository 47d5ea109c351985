"""Drives every cell of the matrix through the four cache states and the replay switches.

    backend = EngineBackend(model, block_tokens=4)        # backend.py: the real dsv41.Engine
    result = run_matrix(matrix, contract, backend, out_dir) # report.py writes the report

The Backend protocol is what the harness needs from a serving engine; `backend.py`
implements it on `dsv41.Engine`:

    backend.window, backend.vocab_size, backend.block_tokens, backend.describe() -> dict
    backend.run(requests: list[BackendRequest], state, replay, sampling) -> list[list[Turn]]

`state` is one of
    "cold"          no cache: every turn is a full prefill (the reference)
    "warm"          a cache that holds prompt[:cached_tokens]: global KV blocks and the SWA
                    snapshot at that point (both hit)
    "warm_expired"  the same, then the SWA snapshots expire (global hit, SWA miss)
and every request of the list runs concurrently (submitted together to one engine).
Turns run in order in the same engine and cache.

The cache states of docs/design.md#acceptance on top of that: cold -> "cold"; both_hit ->
"warm" at H; swa_miss -> "warm_expired" at H; shifted -> "warm_expired" at H + cut_shift.
Each non-cold state runs under every replay switch of the matrix ("off" recomputes,
"bounded" replays W tokens, "exact" is the oracle that replays far enough back to equal
full prefill, "decoder" adds decoder replay); cold runs once per prompt and repeat (replay
"none").

Multi-turn output: turn 2's prompt is turn 1's prompt + the *full-prefill* turn-1 output +
the task's follow-up, the same tokens in every state, so turn-2 divergence is measured on
identical inputs (the cache contents differ: what each path wrote back).

Resumable: one JSON line per finished cell in OUT/cells.jsonl; a rerun with the same
matrix, contract and model skips the cells already there.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from .contract import Contract
from .matrix import Cell, Matrix
from .stats import divergence, latency_summary, percentile
from .tasks import TASKS, TaskInstance
from .tokenizer import EOS, CharTokenizer

__all__ = ["Backend", "BackendRequest", "Turn", "run_matrix", "RunError", "Progress", "STATE_MAP"]

STATE_MAP = {"cold": "cold", "both_hit": "warm", "swa_miss": "warm_expired", "shifted": "warm_expired"}


class RunError(RuntimeError):
    pass


@dataclass
class BackendRequest:
    turns: list[list[int]]     # the full prompt of each turn
    cached_tokens: int         # H: the prefix the cache holds before the request (0 for cold)
    seed: int | None           # sampling seed (None: greedy)


@dataclass
class Turn:
    output_tokens: list[int]
    logits: list[torch.Tensor]         # [vocab] per generated token
    stats: dict                        # see backend.py: path, hits, replayed, timings, bytes


class Backend(Protocol):
    window: int
    vocab_size: int
    block_tokens: int

    def describe(self) -> dict: ...

    def run(self, requests: list[BackendRequest], state: str, replay: str,
            sampling: dict) -> list[list[Turn]]: ...


class Progress:
    """A one-line progress bar on stderr (units of engine requests by default; the
    training loop counts steps, the accuracy tool prompts)."""

    def __init__(self, total: int, stream=None, enabled: bool = True, *, unit: str = "runs",
                 label_width: int = 60):
        self.total, self.done, self.t0 = max(total, 1), 0, time.perf_counter()
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.label = ""
        self.unit, self.label_width = unit, label_width

    def advance(self, n: int, label: str = "") -> None:
        self.done += n
        self.label = label or self.label
        if not self.enabled:
            return
        frac = min(self.done / self.total, 1.0)
        el = time.perf_counter() - self.t0
        eta = el / frac - el if frac > 0 else 0.0
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        w = self.label_width
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} {self.unit} {el:5.0f}s eta {eta:5.0f}s  "
                          f"{self.label[:w]:<{w}}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def output_len(matrix: Matrix, output: str) -> tuple[int, int]:
    """(tokens per turn, turns) of an output-length kind."""
    if output == "multi":
        return matrix.output_tokens["short"], 2
    return matrix.output_tokens[output], 1


def cell_prompts(matrix: Matrix, cell: Cell) -> int:
    return max(matrix.prompts_per_cell, int(cell["concurrency"]))


def runs_per_cell(matrix: Matrix, cell: Cell) -> int:
    n = cell_prompts(matrix, cell) * matrix.sampling["repeats"]
    other = [s for s in matrix.states if s != "cold"]
    return n * (1 + len(other) * len(matrix.replay))


def build_instances(matrix: Matrix, cell: Cell, tok: CharTokenizer, window: int) -> list[TaskInstance]:
    task = TASKS[cell["task"]]
    out = []
    for p in range(cell_prompts(matrix, cell)):
        inst = task.make(tok, matrix.seed + p, context_len=int(cell["context"]), suffix=cell["suffix"],
                         hit=cell.hit, window=window, placement=cell["evidence"],
                         long_tokens=matrix.long_suffix_tokens)
        n = len(inst.prompt)
        for h in (cell.hit, cell.shifted_hit):
            if not 0 < h <= n - 1:
                raise RunError(f"cell {cell.id}: cut {h} does not fit a prompt of {n} tokens")
        out.append(inst)
    return out


def _turn_prompts(inst: TaskInstance, ref_outputs: list[list[int]] | None, turns: int) -> list[list[int]]:
    prompts = [list(inst.prompt)]
    if turns > 1:
        if ref_outputs is None:
            raise RunError("a multi-turn run needs the full-prefill outputs of turn 1")
        prompts.append(list(inst.prompt) + list(ref_outputs[0]) + list(inst.followup))
    return prompts


def _run_metrics(turns: list[Turn], ref: list[Turn] | None, inst: TaskInstance, tok: CharTokenizer) -> dict:
    """The per-run metrics (contract.METRICS) of one request."""
    t0 = turns[0].stats
    score = TASKS[inst.task].score(inst.answer, [tok.decode(t.output_tokens) for t in turns])
    lat = [x for t in turns for x in t.stats["token_latencies_s"]]
    m = {
        "success": bool(score["success"]), "valid": score["valid"],
        "ttft_s": t0["ttft_s"], "prefill_s": t0["prefill_s"],
        "e2e_s": sum(t.stats["e2e_s"] for t in turns),
        "token_latency_p50_s": percentile(lat, 50), "token_latency_p99_s": percentile(lat, 99),
        "decode_tok_s": t0["decode_tokens_per_s"] if t0["decode_tokens_per_s"] > 0 else None,
        "prefill_tok_s": t0["prompt_tokens"] / t0["prefill_s"] if t0["prefill_s"] > 0 else None,
        "replayed_tokens": t0["replayed_tokens"], "prefill_tokens": t0["prefill_tokens"],
        "swa_miss": (t0["global_hit_tokens"] > 0 and t0["swa_hit_tokens"] == 0),
        "global_bytes": t0["bytes"].get("state_global"), "swa_bytes": t0["bytes"].get("state_swa"),
    }
    if ref is not None:
        divs = [divergence(r.output_tokens, r.logits, t.output_tokens, t.logits) for r, t in zip(ref, turns)]
        kls_w = [(d["kl_mean"], d["aligned_steps"]) for d in divs]
        steps = sum(w for _, w in kls_w)
        fd, offset = None, 0
        for d, r in zip(divs, ref):
            if d["first_diff"] is not None:
                fd = offset + d["first_diff"]
                break
            offset += len(r.output_tokens)
        m.update({
            "kl_first": divs[0]["kl_first"],
            "kl_mean": sum(k * w for k, w in kls_w) / steps,
            "kl_max": max(d["kl_max"] for d in divs),
            "top1": sum(d["top1"] * d["aligned_steps"] for d in divs) / steps,
            "exact_match": all(d["exact_match"] for d in divs),
            "first_diff": fd if fd is not None else sum(len(r.output_tokens) for r in ref),
            "logits_equal": all(d["logits_equal"] for d in divs),
        })
        m["divergence_turns"] = divs
    return m


def _summarize_turn(t: Turn) -> dict:
    s = dict(t.stats)
    return {"output_tokens": t.output_tokens, "stats": s}


def run_cell(matrix: Matrix, cell: Cell, backend: Backend, tok: CharTokenizer,
             progress: Progress | None = None) -> dict:
    """Every state x replay x prompt x repeat of one cell; returns the cell record."""
    insts = build_instances(matrix, cell, tok, backend.window)
    per_turn, n_turns = output_len(matrix, cell["output"])
    conc = int(cell["concurrency"])
    samp = dict(matrix.sampling)
    samp["max_new_tokens"] = per_turn
    samp["stop_token_ids"] = [EOS]
    runs: list[dict] = []
    for rep in range(matrix.sampling["repeats"]):
        seeds = [None if samp["temperature"] == 0 else samp["seed"] + 1000 * rep + p for p in range(len(insts))]
        # 1. cold (the reference): turn by turn, so turn 2 can be built from its output
        ref: list[list[Turn]] = [[] for _ in insts]
        for t in range(n_turns):
            for w0 in range(0, len(insts), conc):
                idx = list(range(w0, min(w0 + conc, len(insts))))
                reqs = [BackendRequest([_turn_prompts(insts[i], [x.output_tokens for x in ref[i]], t + 1)[t]],
                                       0, seeds[i]) for i in idx]
                outs = backend.run(reqs, "cold", "off", samp)
                for i, o in zip(idx, outs):
                    ref[i].append(o[0])
                if progress:
                    progress.advance(len(idx) if t == n_turns - 1 else 0, f"{cell.id} cold")
        for i, inst in enumerate(insts):
            runs.append(_record(cell, "cold", "none", i, rep, inst, ref[i], None, tok))
        # 2. the cached states under each replay switch
        for state in matrix.states:
            if state == "cold":
                continue
            h = cell.shifted_hit if state == "shifted" else cell.hit
            for replay in matrix.replay:
                for w0 in range(0, len(insts), conc):
                    idx = list(range(w0, min(w0 + conc, len(insts))))
                    reqs = [BackendRequest(_turn_prompts(insts[i], [x.output_tokens for x in ref[i]], n_turns),
                                           h, seeds[i]) for i in idx]
                    outs = backend.run(reqs, STATE_MAP[state], replay, samp)
                    for i, o in zip(idx, outs):
                        runs.append(_record(cell, state, replay, i, rep, insts[i], o, ref[i], tok, h))
                    if progress:
                        progress.advance(len(idx), f"{cell.id} {state}/{replay}")
    return {"cell_id": cell.id, "cell": cell.to_dict(), "instances": [i.meta() for i in insts], "runs": runs}


def _record(cell: Cell, state: str, replay: str, prompt: int, repeat: int, inst: TaskInstance,
            turns: list[Turn], ref: list[Turn] | None, tok: CharTokenizer, hit: int = 0) -> dict:
    metrics = _run_metrics(turns, ref, inst, tok)
    div_turns = metrics.pop("divergence_turns", None)
    return {"coords": {**dict(cell.values), "state": state, "replay": replay, "prompt": prompt,
                       "repeat": repeat},
            "cut": hit or None, "cut_rel_window": (hit - cell.window) if hit else None,
            "evidence_offset": inst.evidence_offset,
            "metrics": metrics, "divergence_turns": div_turns,
            "turns": [_summarize_turn(t) for t in turns],
            "text": [tok.decode(t.output_tokens) for t in turns]}


# ---- the whole matrix -------------------------------------------------------------------

def run_matrix(matrix: Matrix, contract: Contract, backend: Backend, out_dir: str | Path, *,
               progress: bool = True, frozen_extra: dict | None = None) -> dict:
    """Run (or resume) every cell; write OUT/frozen.json first, OUT/cells.jsonl per cell.
    Returns {"frozen", "cells": [cell records]}; report.write_report turns it into files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = CharTokenizer(backend.vocab_size)
    cells = matrix.expand(backend.window, backend.block_tokens)
    frozen = {
        "matrix": {"name": matrix.name, "sha256": matrix.sha256, "text": matrix.text},
        "contract": {"name": contract.name, "sha256": contract.sha256, "text": contract.text},
        "backend": backend.describe(),
        "sampling": matrix.sampling, "seed": matrix.seed, "prompts_per_cell": matrix.prompts_per_cell,
        "block_tokens": backend.block_tokens, "window": backend.window,
        "tokenizer": "dsv41.eval.tokenizer.CharTokenizer (ASCII code points, BOS=1, EOS=2)",
        "cells": len(cells),
        "loadavg_start": _loadavg(), "cpu_count": os.cpu_count(),
        **(frozen_extra or {}),
    }
    for c in cells:                 # every prompt must build before anything runs
        try:
            build_instances(matrix, c, tok, backend.window)
        except ValueError as e:
            raise RunError(f"cell {c.id}: {e}") from None
    identity = {k: frozen[k] for k in ("matrix", "contract")}
    identity["model"] = frozen["backend"].get("kv_fingerprint")
    identity["weights"] = frozen["backend"].get("weights_sha256")
    fpath = out / "frozen.json"
    if fpath.exists():
        old = json.loads(fpath.read_text())
        old_id = {k: old[k] for k in ("matrix", "contract")}
        old_id["model"] = old["backend"].get("kv_fingerprint")
        old_id["weights"] = old["backend"].get("weights_sha256")
        if old_id != identity:
            raise RunError(f"{out} holds a run of another matrix, contract or model; "
                           f"use a new --out directory (or --fresh to start over)")
        frozen["resumed_from"] = old.get("started_at")
        frozen["started_at"] = old.get("started_at")
    else:
        frozen["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    _atomic_write(fpath, json.dumps(frozen, indent=2))      # recorded before anything runs
    (out / "contract.yaml").write_text(contract.text)
    (out / "matrix.yaml").write_text(matrix.text)
    done = _read_cells(out / "cells.jsonl")
    todo = [c for c in cells if c.id not in done]
    bar = Progress(sum(runs_per_cell(matrix, c) for c in todo), enabled=progress)
    with open(out / "cells.jsonl", "a") as f:
        for c in todo:
            rec = run_cell(matrix, c, backend, tok, bar)
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
            done[c.id] = rec
    bar.close()
    frozen["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    frozen["resumed_cells"] = len(cells) - len(todo)
    frozen["loadavg_end"] = _loadavg()
    _atomic_write(fpath, json.dumps(frozen, indent=2))
    return {"frozen": frozen, "cells": [done[c.id] for c in cells]}


def _read_cells(path: Path) -> dict:
    """Finished cells of an earlier run; a torn last line (killed mid-write) is dropped."""
    done = {}
    if not path.exists():
        return done
    lines = path.read_text().split("\n")
    good = []
    for ln in lines:
        if not ln.strip():
            continue
        try:
            rec = json.loads(ln)
        except ValueError:
            continue
        done[rec["cell_id"]] = rec
        good.append(ln)
    path.write_text("".join(g + "\n" for g in good))
    return done


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
