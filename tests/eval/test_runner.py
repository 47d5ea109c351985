"""Runner pieces that need no engine: the resumable cell log, run counts, progress."""
from __future__ import annotations

import io
import json

from dsv41.eval import default_matrix
from dsv41.eval.runner import Progress, _read_cells, build_instances, cell_prompts, runs_per_cell
from dsv41.eval.tokenizer import CharTokenizer


def test_torn_last_line_is_dropped(tmp_path):
    p = tmp_path / "cells.jsonl"
    p.write_text(json.dumps({"cell_id": "a", "runs": []}) + "\n" + '{"cell_id": "b", "ru')
    done = _read_cells(p)
    assert list(done) == ["a"]
    assert p.read_text() == json.dumps({"cell_id": "a", "runs": []}) + "\n"
    assert _read_cells(tmp_path / "missing.jsonl") == {}


def test_run_counts_and_instances():
    m = default_matrix()
    cells = m.expand(16)
    base = cells[0]
    assert cell_prompts(m, base) == 10
    assert runs_per_cell(m, base) == 10 * (1 + 3 * 3)
    conc4 = next(c for c in cells if c["concurrency"] == 4)
    assert cell_prompts(m, conc4) == 10
    insts = build_instances(m, base, CharTokenizer(256), 16)
    assert len(insts) == 10 and insts[0].prompt != insts[1].prompt
    assert all(len(i.prompt) > base.shifted_hit and len(i.prompt) > base.hit for i in insts)


def test_progress_bar():
    s = io.StringIO()
    p = Progress(4, stream=s)
    p.advance(1, "cell a")
    p.advance(3)
    p.close()
    out = s.getvalue()
    assert "1/4 runs" in out and "4/4 runs" in out and out.endswith("\n") and "cell a" in out


def test_cli_rejects_a_bad_matrix_before_running(tmp_path, capsys):
    from dsv41.cli import main

    bad = tmp_path / "m.yaml"
    bad.write_text("dimensions: {hit: [sideways]}\n")
    assert main(["eval", "--matrix", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "m.yaml: missing dimension(s)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
