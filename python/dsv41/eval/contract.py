"""Pass criteria, written down (and hashed) before a run; judged with bootstrap intervals.

A contract file:

    name: default
    confidence: 0.95          # two-sided bootstrap interval level
    bootstrap: 2000           # resamples
    criteria:
      - id: oracle_equals_full_prefill
        metric: kl_max        # a per-run metric (METRICS below)
        stat: max             # mean | median | max | min | p50 | p95 | p99 over prompts
        op: "<="              # <=, <, >=, >, ==
        threshold: 0.0
        where: {state: [swa_miss, shifted], replay: [exact]}   # any dimension, state, replay
        relative_to: {replay: off}    # optional: the value is the per-prompt ratio
                                      # metric(where) / metric(where with these overrides)
        min_prompts: 2        # optional (default 1): fewer matching prompts fails

Evaluation: the runs matching `where` are grouped per prompt (a cell's prompt index;
repeats averaged), giving one value per prompt; the statistic's percentile-bootstrap
interval over those prompts is computed. **The rule: a criterion passes only when every
point of the interval satisfies the comparison** (for <=: hi <= threshold; for >=: lo >=
threshold; for ==: lo == hi == threshold). A criterion no run matches fails ("no data").
"""
from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .matrix import DIMENSIONS, REPLAY_MODES, STATES, normalize_replay
from .stats import bootstrap_ci, stat_names
from .yamldoc import YamlDocument

__all__ = ["ContractError", "Criterion", "Contract", "load_contract", "METRICS", "run_metric"]

# per-run metrics a criterion can name (see runner.py for how each is measured)
METRICS = {
    "kl_first": "KL(full prefill || run) of the first generated token's distribution (nats)",
    "kl_mean": "mean KL over the aligned generated steps",
    "kl_max": "max KL over the aligned generated steps",
    "top1": "fraction of aligned steps whose argmax equals full prefill's",
    "exact_match": "1 when every generated token equals full prefill's",
    "first_diff": "index of the first generated token that differs (output length when none)",
    "logits_equal": "1 when every aligned step's logits equal full prefill's bit for bit",
    "success": "task success (1/0)",
    "valid": "structured-output validity (1/0; structured tasks only)",
    "ttft_s": "arrival to first token, seconds",
    "prefill_s": "the prefill step's time, seconds",
    "e2e_s": "arrival to last token, seconds",
    "token_latency_p50_s": "median time between output tokens of the request",
    "token_latency_p99_s": "p99 time between output tokens of the request",
    "decode_tok_s": "output tokens per second after the first",
    "prefill_tok_s": "prompt tokens made ready per second of prefill (prompt_tokens / prefill_s)",
    "replayed_tokens": "cached tokens run again to rebuild SWA state",
    "prefill_tokens": "tokens the prefill ran through the encoder",
    "swa_miss": "1 when the request had a global hit but no SWA snapshot",
    "global_bytes": "global KV + indexer bytes of the request's final state",
    "swa_bytes": "SWA KV bytes of the request's final state",
}

_OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt, "==": operator.eq}
_CRIT_KEYS = {"id", "metric", "stat", "op", "threshold", "where", "relative_to", "min_prompts", "description"}


class ContractError(ValueError):
    pass


def run_metric(run: dict, metric: str):
    """The value of a per-run metric from a run record (None when not defined for it)."""
    v = run.get("metrics", {}).get(metric)
    if isinstance(v, bool):
        return float(v)
    return v


@dataclass
class Criterion:
    id: str
    metric: str
    stat: str
    op: str
    threshold: float
    where: dict = field(default_factory=dict)
    relative_to: dict | None = None
    min_prompts: int = 1
    description: str = ""

    def matches(self, run: dict, where: dict | None = None) -> bool:
        for key, allowed in (where if where is not None else self.where).items():
            if str(run["coords"].get(key)) not in {str(a) for a in allowed}:
                return False
        return True

    def text(self) -> str:
        rel = f" relative to {self.relative_to}" if self.relative_to else ""
        return f"{self.stat}({self.metric}{rel}) {self.op} {self.threshold:g} where {self.where or 'all'}"


@dataclass
class Contract(YamlDocument):
    error = ContractError  # not fields: YamlDocument's hooks
    default_source = "contract"

    criteria: list[Criterion]
    name: str = "contract"
    confidence: float = 0.95
    bootstrap: int = 2000
    text: str = ""



    @classmethod
    def from_dict(cls, data, source: str = "contract") -> "Contract":
        def err(msg):
            return ContractError(f"{source}: {msg}")

        if not isinstance(data, dict):
            raise err("the top level must be a mapping")
        bad = set(data) - {"name", "confidence", "bootstrap", "criteria"}
        if bad:
            raise err(f"unknown key(s) {sorted(bad)}")
        conf = data.get("confidence", 0.95)
        if not isinstance(conf, (int, float)) or not 0 < conf < 1:
            raise err(f"confidence must be in (0, 1), got {conf!r}")
        nb = data.get("bootstrap", 2000)
        if not isinstance(nb, int) or nb < 100:
            raise err(f"bootstrap must be an integer >= 100, got {nb!r}")
        crits = data.get("criteria")
        if not isinstance(crits, list) or not crits:
            raise err("`criteria` must be a non-empty list")
        out, ids = [], set()
        for i, c in enumerate(crits):
            where_ = f"criterion {i}"
            if not isinstance(c, dict):
                raise err(f"{where_} must be a mapping")
            if "id" in c:
                where_ = f"criterion {c['id']!r}"
            bad = set(c) - _CRIT_KEYS
            if bad:
                raise err(f"{where_}: unknown key(s) {sorted(bad)}; allowed {sorted(_CRIT_KEYS)}")
            for k in ("id", "metric", "op", "threshold"):
                if k not in c:
                    raise err(f"{where_}: missing `{k}`")
            if c["id"] in ids:
                raise err(f"{where_}: duplicate id")
            ids.add(c["id"])
            if c["metric"] not in METRICS:
                raise err(f"{where_}: unknown metric {c['metric']!r}; one of {sorted(METRICS)}")
            stat = c.get("stat", "mean")
            if stat not in stat_names():
                raise err(f"{where_}: unknown stat {stat!r}; one of {stat_names()}")
            if c["op"] not in _OPS:
                raise err(f"{where_}: op must be one of {list(_OPS)}, got {c['op']!r}")
            if not isinstance(c["threshold"], (int, float)) or isinstance(c["threshold"], bool):
                raise err(f"{where_}: threshold must be a number")
            wh = {}
            for key in ("where", "relative_to"):
                w = c.get(key) or {}
                if not isinstance(w, dict):
                    raise err(f"{where_}: `{key}` must be a mapping")
                for k, v in w.items():
                    if k not in (*DIMENSIONS, "state", "replay"):
                        raise err(f"{where_}: `{key}` key {k!r} is not a dimension, state or replay")
                    vals = v if isinstance(v, list) else [v]
                    if k == "replay":
                        vals = [normalize_replay(x) for x in vals]
                    if k == "state" and any(x not in STATES for x in vals):
                        raise err(f"{where_}: unknown state in {vals}; one of {list(STATES)}")
                    if k == "replay" and any(x not in REPLAY_MODES for x in vals):
                        raise err(f"{where_}: unknown replay mode in {vals}; one of {list(REPLAY_MODES)}")
                    w[k] = vals
                wh[key] = w
            mp = c.get("min_prompts", 1)
            if not isinstance(mp, int) or mp < 1:
                raise err(f"{where_}: min_prompts must be an integer >= 1")
            out.append(Criterion(id=str(c["id"]), metric=c["metric"], stat=stat, op=c["op"],
                                 threshold=float(c["threshold"]), where=wh["where"],
                                 relative_to=wh["relative_to"] or None, min_prompts=mp,
                                 description=str(c.get("description", ""))))
        return cls(criteria=out, name=str(data.get("name", "contract")), confidence=float(conf), bootstrap=nb)

    # ---- judging ------------------------------------------------------------------------

    def evaluate(self, runs: list[dict], seed: int = 0) -> list[dict]:
        """One verdict per criterion: {id, text, n, value, lo, hi, pass, reason}."""
        return [self._judge(c, runs, seed + i) for i, c in enumerate(self.criteria)]

    def _judge(self, c: Criterion, runs: list[dict], seed: int) -> dict:
        vals = _per_prompt(runs, c, c.where)
        if c.relative_to:
            base = _per_prompt(runs, c, {**c.where, **c.relative_to})
            # pair the prompt with its baseline run: same cell (minus the overridden keys)
            paired = {}
            for key, v in vals.items():
                bkey = _baseline_key(key, c.relative_to)
                if bkey in base and base[bkey] not in (0, 0.0):
                    paired[key] = v / base[bkey]
            vals = paired
        out = {"id": c.id, "text": c.text(), "metric": c.metric, "stat": c.stat, "op": c.op,
               "threshold": c.threshold, "description": c.description}
        if len(vals) < c.min_prompts or not vals:
            return {**out, "n": len(vals), "value": None, "lo": None, "hi": None, "pass": False,
                    "reason": f"no data (matching prompts: {len(vals)}, need {c.min_prompts})"}
        ci = bootstrap_ci(list(vals.values()), c.stat, confidence=self.confidence,
                          n_boot=self.bootstrap, seed=seed)
        f = _OPS[c.op]
        ok = bool(f(ci["lo"], c.threshold) and f(ci["hi"], c.threshold))
        reason = (f"{self.confidence:.0%} interval [{ci['lo']:.6g}, {ci['hi']:.6g}] "
                  f"{'inside' if ok else 'not inside'} {c.op} {c.threshold:g}")
        return {**out, **ci, "pass": ok, "reason": reason}


def _unit(run: dict, drop: tuple[str, ...] = ()) -> tuple:
    co = run["coords"]
    return tuple((k, str(co.get(k))) for k in (*DIMENSIONS, "state", "replay", "prompt") if k not in drop)


def _per_prompt(runs: list[dict], c: Criterion, where: dict) -> dict:
    """{unit key: value averaged over repeats} of the runs matching where."""
    acc = defaultdict(list)
    for r in runs:
        if not c.matches(r, where):
            continue
        v = run_metric(r, c.metric)
        if v is None:
            continue
        acc[_unit(r)].append(float(v))
    return {k: float(np.mean(v)) for k, v in acc.items()}


def _baseline_key(key: tuple, overrides: dict) -> tuple:
    d = dict(key)
    for k, vals in overrides.items():
        d[k] = str(vals[0])
    return tuple((k, d[k]) for k, _ in key)


def load_contract(path: str | Path) -> Contract:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ContractError(f"cannot read contract {p}: {e.strerror}") from None
    return Contract.from_yaml(text, str(p))
