"""Matrix loading, validation errors and expansion."""
from __future__ import annotations

import pytest
import yaml

from dsv41.eval import default_contract, default_matrix
from dsv41.eval.matrix import DIMENSIONS, Matrix, MatrixError, load_matrix, resolve_hit

BASE = {"hit": "after_boundary", "context": 64, "suffix": "short", "task": "passkey", "concurrency": 1,
        "output": "short", "evidence": "before_boundary"}


def mk(**over):
    d = {"block_tokens": 4, "cut_shift": -8, "base": dict(BASE),
         "dimensions": {k: [v] for k, v in BASE.items()}}
    d.update(over)
    return Matrix.from_yaml(yaml.safe_dump(d))


def test_default_matrix_and_contract_ship_and_expand():
    m = default_matrix()
    cells = m.expand(window=16)
    assert len(cells) == 1 + 1 + 2 + 2 + 4 + 1 + 1 + 3      # base + each other value of each dimension
    assert m.model == {"shipped": "v41-tiny-tasks"}
    assert len({c.id for c in cells}) == len(cells)
    assert m.replay == ["off", "bounded", "exact"]         # unquoted `off` in YAML is the switch
    assert len(m.sha256) == 64 and default_contract().criteria


def test_hit_positions():
    assert resolve_hit("start", 16, 4, 64, False) == 4
    assert resolve_hit("before_boundary", 16, 4, 64, False) == 12
    assert resolve_hit("after_boundary", 16, 4, 64, False) == 20
    assert resolve_hit("end", 16, 4, 64, False) == 64
    assert resolve_hit("end", 16, 4, 64, True) == 60        # H <= N - 1 with an empty suffix
    assert resolve_hit("W+9", 16, 4, 64, False) == 24       # aligned down
    assert resolve_hit("end-8", 16, 4, 64, False) == 56
    with pytest.raises(MatrixError, match="does not fit a context of 64"):
        resolve_hit(1000, 16, 4, 64, False)
    with pytest.raises(MatrixError, match="does not fit"):
        resolve_hit("after_boundary", 16, 4, 16, False)
    with pytest.raises(MatrixError, match="less than one block"):
        resolve_hit(3, 16, 4, 64, False)


def test_expand_modes_and_shift():
    m = mk(dimensions={**{k: [v] for k, v in BASE.items()}, "hit": ["start", "after_boundary", "end"],
                       "task": ["passkey", "multihop"]})
    cells = m.expand(16)
    assert [c["hit"] for c in cells] == ["after_boundary", "start", "end", "after_boundary"]
    by = {c.id: c for c in cells}
    start = next(c for c in cells if c["hit"] == "start")
    assert start.hit == 4 and start.shifted_hit == 12       # H - 8 leaves no block: shifted the other way
    end = next(c for c in cells if c["hit"] == "end")
    assert (end.hit, end.shifted_hit, end.window) == (64, 56, 16)
    g = mk(expand="grid", base=None, dimensions={**{k: [v] for k, v in BASE.items()},
                                                 "hit": ["start", "end"], "task": ["passkey", "multihop"]})
    assert len(g.expand(16)) == 4 and len(by) == 4
    with pytest.raises(MatrixError, match="multiple of block_tokens"):
        mk(cut_shift=-6).expand(16)


@pytest.mark.parametrize("change, message", [
    ({"colour": 1}, "unknown key"),
    ({"dimensions": {"hit": ["end"]}}, "missing dimension"),
    ({"dimensions": {**{k: [v] for k, v in BASE.items()}, "size": [1]}}, "unknown dimension"),
    ({"dimensions": {**{k: [v] for k, v in BASE.items()}, "task": ["poetry"]}}, "unknown task"),
    ({"dimensions": {**{k: [v] for k, v in BASE.items()}, "hit": ["middle"]}}, "bad hit position"),
    ({"dimensions": {**{k: [v] for k, v in BASE.items()}, "suffix": []}}, "non-empty list"),
    ({"dimensions": {**{k: [v] for k, v in BASE.items()}, "context": [64, 64]}}, "repeats a value"),
    ({"dimensions": {**{k: [v] for k, v in BASE.items()}, "output": ["huge"]}}, "bad output length"),
    ({"dimensions": {**{k: [v] for k, v in BASE.items()}, "concurrency": [0]}}, "positive integers"),
    ({"sampling": {"temperature": 0.0, "repeats": 3}}, "repeats > 1 with temperature 0"),
    ({"sampling": {"top_k": 5}}, "sampling"),
    ({"states": ["swa_miss"]}, "must include `cold`"),
    ({"replay": ["sometimes"]}, "replay"),
    ({"base": {"hit": "end"}}, "`base` must give one value"),
    ({"expand": "random"}, "expand"),
    ({"block_tokens": 0}, "block_tokens"),
    ({"cut_shift": 0}, "cut_shift"),
    ({"write_approximate": "yes"}, "write_approximate"),
    ({"model": {"name": "x"}}, "model"),
    ({"output_tokens": {"short": 2}}, "output_tokens"),
])
def test_errors_are_clear(change, message):
    with pytest.raises(MatrixError, match=message):
        mk(**change)


def test_bad_yaml_and_missing_file(tmp_path):
    with pytest.raises(MatrixError, match="not valid YAML"):
        Matrix.from_yaml("a: [1,\n")
    with pytest.raises(MatrixError, match="top level"):
        Matrix.from_yaml("- 1\n")
    with pytest.raises(MatrixError, match="cannot read matrix"):
        load_matrix(tmp_path / "nope.yaml")


def test_cells_that_do_not_fit_are_named():
    m = mk(dimensions={**{k: [v] for k, v in BASE.items()}, "hit": ["after_boundary", "end"],
                       "context": [64, 8]}, cut_shift=-4)
    with pytest.raises(MatrixError) as e:
        m.expand(16)
    assert "context=8" in str(e.value) and "window 16, block 4" in str(e.value)
    assert all(d in str(e.value) for d in ("hit=", "task="))
    assert set(DIMENSIONS) == set(BASE)
