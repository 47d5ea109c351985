"""Contract parsing, hashing and the interval rule, on hand-made run records."""
from __future__ import annotations

import pytest

from dsv41.eval.contract import Contract, ContractError
from dsv41.eval.matrix import DIMENSIONS

CELL = {"hit": "end", "context": 64, "suffix": "short", "task": "passkey", "concurrency": 1,
        "output": "short", "evidence": "far_behind"}


def run(state, replay, prompt, repeat=0, **metrics):
    return {"coords": {**CELL, "state": state, "replay": replay, "prompt": prompt, "repeat": repeat},
            "metrics": metrics}


def contract(*crits, **top):
    import yaml

    return Contract.from_yaml(yaml.safe_dump({"criteria": list(crits), **top}))


def crit(**kw):
    c = {"id": "c", "metric": "kl_max", "stat": "max", "op": "<=", "threshold": 0.0}
    c.update(kw)
    return c


def test_hash_and_text():
    a = contract(crit())
    b = contract(crit(threshold=0.1))
    assert len(a.sha256) == 64 and a.sha256 != b.sha256
    assert "max(kl_max) <= 0" in a.criteria[0].text()


def test_zero_divergence_passes_only_when_all_zero():
    c = contract(crit(where={"state": ["swa_miss"], "replay": ["exact"]}))
    runs = [run("swa_miss", "exact", p, kl_max=0.0) for p in range(4)]
    runs += [run("swa_miss", "bounded", p, kl_max=0.5) for p in range(4)]   # not matched
    v = c.evaluate(runs)[0]
    assert v["pass"] and v["n"] == 4 and (v["lo"], v["hi"]) == (0.0, 0.0)
    runs[2]["metrics"]["kl_max"] = 1e-9
    v = c.evaluate(runs)[0]
    assert not v["pass"] and v["hi"] == 1e-9


def test_interval_rule():
    # mean 0.5 +- noise; threshold 0.6 lies inside the interval for few prompts -> fail,
    # above its upper end -> pass
    vals = [0.3, 0.7, 0.4, 0.6, 0.5, 0.45, 0.55, 0.35, 0.65, 0.5]
    runs = [run("swa_miss", "bounded", p, kl_first=v) for p, v in enumerate(vals)]
    mean = sum(vals) / len(vals)
    c = contract(crit(metric="kl_first", stat="mean", threshold=mean + 0.02))
    v = c.evaluate(runs)[0]
    assert v["lo"] < mean + 0.02 < v["hi"] and not v["pass"]
    c = contract(crit(metric="kl_first", stat="mean", threshold=0.9))
    assert c.evaluate(runs)[0]["pass"]
    c = contract(crit(metric="kl_first", stat="mean", op=">=", threshold=0.1))
    assert c.evaluate(runs)[0]["pass"]
    c = contract(crit(metric="kl_first", stat="mean", op=">", threshold=mean))
    assert not c.evaluate(runs)[0]["pass"]


def test_repeats_average_per_prompt_and_booleans():
    runs = [run("swa_miss", "bounded", 0, r, exact_match=(r == 0)) for r in range(2)]
    runs += [run("swa_miss", "bounded", 1, r, exact_match=True) for r in range(2)]
    c = contract(crit(metric="exact_match", stat="min", op=">=", threshold=0.5))
    v = c.evaluate(runs)[0]
    assert v["n"] == 2 and v["value"] == 0.5 and v["pass"]


def test_no_data_and_min_prompts_fail():
    c = contract(crit(where={"task": ["multihop"]}))
    v = c.evaluate([run("swa_miss", "exact", 0, kl_max=0.0)])[0]
    assert not v["pass"] and "no data" in v["reason"]
    c = contract(crit(min_prompts=3))
    assert not c.evaluate([run("swa_miss", "exact", p, kl_max=0.0) for p in range(2)])[0]["pass"]
    # metrics undefined for a run (valid on an unstructured task) do not count
    c = contract(crit(metric="valid", stat="mean", op=">=", threshold=1.0))
    assert not c.evaluate([run("swa_miss", "exact", 0, valid=None)])[0]["pass"]


def test_relative_to_pairs_prompts():
    runs = []
    for p, (on, off) in enumerate([(1.0, 2.0), (1.5, 2.0), (0.9, 1.0)]):
        runs += [run("swa_miss", "bounded", p, ttft_s=on), run("swa_miss", "off", p, ttft_s=off)]
    c = contract(crit(metric="ttft_s", stat="max", threshold=1.0, where={"state": ["swa_miss"], "replay": ["bounded"]},
                      relative_to={"replay": False}))          # unquoted YAML off
    v = c.evaluate(runs)[0]
    assert v["n"] == 3 and v["value"] == pytest.approx(0.9) and v["pass"]
    runs[4]["metrics"]["ttft_s"] = 1.2                         # prompt 2 bounded slower than off
    v = c.evaluate(runs)[0]
    assert v["value"] == pytest.approx(1.2) and not v["pass"]


@pytest.mark.parametrize("c, message", [
    (crit(metric="vibes"), "unknown metric"),
    (crit(stat="mode"), "unknown stat"),
    (crit(op="~"), "op must be"),
    (crit(threshold="low"), "threshold must be a number"),
    (crit(where={"colour": ["red"]}), "not a dimension"),
    (crit(where={"state": ["lukewarm"]}), "unknown state"),
    (crit(where={"replay": ["maybe"]}), "unknown replay"),
    (crit(extra=1), "unknown key"),
    ({"id": "x", "metric": "kl_max"}, "missing `op`"),
    (crit(min_prompts=0), "min_prompts"),
])
def test_errors(c, message):
    with pytest.raises(ContractError, match=message):
        contract(c)


def test_top_level_errors():
    with pytest.raises(ContractError, match="non-empty list"):
        Contract.from_yaml("criteria: []\n")
    with pytest.raises(ContractError, match="duplicate id"):
        contract(crit(), crit())
    with pytest.raises(ContractError, match="confidence"):
        contract(crit(), confidence=1.5)
    with pytest.raises(ContractError, match="not valid YAML"):
        Contract.from_yaml("criteria: [\n")
    assert set(CELL) == set(DIMENSIONS)
