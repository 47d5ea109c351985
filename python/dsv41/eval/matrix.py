"""The acceptance matrix (docs/design.md#acceptance): load and validate the YAML, expand it
to cells.

    m = load_matrix("matrix.yaml")          # or Matrix.from_dict(...); MatrixError on bad input
    cells = m.expand(window=W, block=B)     # list[Cell], each with its resolved positions

A matrix file (every key but `dimensions` optional; defaults shown):

    name: default
    model: {preset: v41-tiny, seed: 0}    # or {checkpoint: DIR} or {shipped: v41-tiny-tasks};
                                          # `--model DIR|NAME` overrides
    block_tokens: 4                       # cache block; a multiple of every compress ratio
    prompts_per_cell: 2                   # raised to the cell's concurrency when lower
    max_batch: 8                          # the engine's batch limit: higher concurrency queues
    write_approximate: true               # the engine caches a replayed turn's state for
                                          # that conversation's next turn (false: strict)
    seed: 0                               # task instance seeds start here
    sampling: {temperature: 0.0, top_p: 1.0, repeats: 1, seed: 0}   # repeats > 1 needs temperature > 0
    states: [cold, both_hit, swa_miss, shifted]
    replay: [off, bounded, exact]         # also: decoder (bounded encoder + decoder replay)
    cut_shift: -8                         # tokens added to H for the `shifted` state
    long_suffix_tokens: 48                # tool-output tokens of the `long` suffix
    output_tokens: {short: 4, long: 12}   # `multi` = two turns of `short`
    expand: one_at_a_time                 # or grid (the full product)
    base: {...}                           # one value per dimension (one_at_a_time only)
    dimensions:
      hit: [start, before_boundary, after_boundary, end]   # or ints, "W+8", "W-4", "end-8"
      context: [96, 192]                  # context tokens before the uncached suffix
      suffix: [empty, short, long]
      task: [passkey, multihop, extraction, code_edit, tool_loop]
      concurrency: [1, 4]
      output: [short, long, multi]
      evidence: [before_boundary, across_boundary, far_behind, in_window]

Cache-hit positions H (the end of the cached prefix; all aligned down to the block):
start = one block; before_boundary = W - block; after_boundary = W + block; end = the
whole context (at most N - 1: the prompt's last token is always computed). The `shifted`
state uses H + cut_shift, or H - cut_shift when that would leave no cached block or pass
the context. one_at_a_time runs the base cell and, per dimension, each other value with
the rest at base (how the minimum variants of docs/design.md#acceptance are usually
covered); grid runs every combination.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path


from .tasks import PLACEMENTS, SUFFIX_KINDS, TASKS
from .yamldoc import YamlDocument

__all__ = ["MatrixError", "Matrix", "Cell", "load_matrix", "DIMENSIONS", "STATES", "REPLAY_MODES"]

DIMENSIONS = ("hit", "context", "suffix", "task", "concurrency", "output", "evidence")
STATES = ("cold", "both_hit", "swa_miss", "shifted")
REPLAY_MODES = ("off", "bounded", "exact", "decoder")
OUTPUTS = ("short", "long", "multi")
HIT_NAMES = ("start", "before_boundary", "after_boundary", "end")
_HIT_EXPR = re.compile(r"^(W|end)\s*([+-])\s*(\d+)$")
_TOP = {"version", "name", "model", "block_tokens", "prompts_per_cell", "max_batch", "write_approximate", "seed", "sampling", "states",
        "replay", "cut_shift", "long_suffix_tokens", "output_tokens", "expand", "base", "dimensions"}


class MatrixError(ValueError):
    pass


@dataclass(frozen=True)
class Cell:
    values: tuple[tuple[str, object], ...]     # (dimension, value) in DIMENSIONS order
    hit: int                  # H, tokens
    shifted_hit: int          # H of the shifted state
    prompt_tokens: int        # the context; the suffix adds its tokens
    window: int = 0           # the model's sliding window W the positions were resolved for

    def __getitem__(self, dim: str):
        return dict(self.values)[dim]

    @property
    def id(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.values)

    def to_dict(self) -> dict:
        return {"id": self.id, **dict(self.values), "H": self.hit, "H_shifted": self.shifted_hit,
                "W": self.window}


@dataclass
class Matrix(YamlDocument):
    error = MatrixError  # not fields: YamlDocument's hooks
    default_source = "matrix"

    dimensions: dict[str, list]
    name: str = "default"
    model: dict = field(default_factory=lambda: {"preset": "v41-tiny", "seed": 0})
    block_tokens: int = 4
    prompts_per_cell: int = 2
    max_batch: int = 8
    write_approximate: bool = True
    seed: int = 0
    sampling: dict = field(default_factory=lambda: {"temperature": 0.0, "top_p": 1.0, "repeats": 1, "seed": 0})
    states: list[str] = field(default_factory=lambda: list(STATES))
    replay: list[str] = field(default_factory=lambda: ["off", "bounded", "exact"])
    cut_shift: int = -8
    long_suffix_tokens: int = 48
    output_tokens: dict = field(default_factory=lambda: {"short": 4, "long": 12})
    expand_mode: str = "one_at_a_time"
    base: dict = field(default_factory=dict)
    text: str = ""            # the YAML as given (hashed and recorded)


    # ---- loading ------------------------------------------------------------------------


    @classmethod
    def from_dict(cls, data, source: str = "matrix") -> "Matrix":
        def err(msg):
            return MatrixError(f"{source}: {msg}")

        if not isinstance(data, dict):
            raise err("the top level must be a mapping")
        unknown = set(data) - _TOP
        if unknown:
            raise err(f"unknown key(s) {sorted(unknown)}; allowed: {sorted(_TOP)}")
        dims = data.get("dimensions")
        if not isinstance(dims, dict) or not dims:
            raise err("`dimensions` must be a non-empty mapping of dimension -> list of values")
        bad = set(dims) - set(DIMENSIONS)
        if bad:
            raise err(f"unknown dimension(s) {sorted(bad)}; allowed: {list(DIMENSIONS)}")
        missing = [d for d in DIMENSIONS if d not in dims]
        if missing:
            raise err(f"missing dimension(s) {missing}: give each at least one value")
        for d, vals in dims.items():
            if not isinstance(vals, list) or not vals:
                raise err(f"dimension `{d}` must be a non-empty list")
            if len(set(map(str, vals))) != len(vals):
                raise err(f"dimension `{d}` repeats a value: {vals}")
            for v in vals:
                _check_value(d, v, err)
        m = cls(dimensions={d: list(dims[d]) for d in DIMENSIONS})
        m.name = str(data.get("name", m.name))
        model = data.get("model", m.model)
        if not isinstance(model, dict) or len({"preset", "checkpoint", "shipped"} & set(model)) != 1 or \
                set(model) - {"preset", "checkpoint", "shipped", "seed"}:
            raise err("`model` must be {preset: NAME, seed: INT}, {checkpoint: DIR} or "
                      "{shipped: NAME} (dsv41.checkpoints)")
        m.model = dict(model)
        for key, lo in (("block_tokens", 1), ("prompts_per_cell", 1), ("max_batch", 1), ("seed", 0), ("long_suffix_tokens", 0)):
            if key in data:
                v = data[key]
                if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                    raise err(f"`{key}` must be an integer >= {lo}, got {v!r}")
                setattr(m, key, v)
        if "write_approximate" in data:
            if not isinstance(data["write_approximate"], bool):
                raise err("`write_approximate` must be true or false")
            m.write_approximate = data["write_approximate"]
        if "cut_shift" in data:
            v = data["cut_shift"]
            if not isinstance(v, int) or isinstance(v, bool) or v == 0:
                raise err(f"`cut_shift` must be a non-zero integer (tokens), got {v!r}")
            m.cut_shift = v
        if "sampling" in data:
            s = data["sampling"]
            if not isinstance(s, dict) or set(s) - {"temperature", "top_p", "repeats", "seed"}:
                raise err("`sampling` takes temperature, top_p, repeats, seed")
            m.sampling = {**m.sampling, **s}
        s = m.sampling
        if not (isinstance(s["temperature"], (int, float)) and s["temperature"] >= 0):
            raise err("sampling.temperature must be >= 0")
        if not (isinstance(s["top_p"], (int, float)) and 0 < s["top_p"] <= 1):
            raise err("sampling.top_p must be in (0, 1]")
        if not (isinstance(s["repeats"], int) and s["repeats"] >= 1):
            raise err("sampling.repeats must be an integer >= 1")
        if s["repeats"] > 1 and s["temperature"] == 0:
            raise err("sampling.repeats > 1 with temperature 0 repeats identical greedy runs; "
                      "set a temperature or repeats: 1")
        for key, allowed in (("states", STATES), ("replay", REPLAY_MODES)):
            if key in data:
                v = data[key]
                if key == "replay" and isinstance(v, list):
                    v = [normalize_replay(x) for x in v]
                if not isinstance(v, list) or not v or any(x not in allowed for x in v) or len(set(v)) != len(v):
                    raise err(f"`{key}` must be a non-empty list of distinct values from {list(allowed)}, got {v!r}")
                setattr(m, key, list(v))
        if "cold" not in m.states:
            raise err("`states` must include `cold`: divergence is measured against full prefill")
        if "output_tokens" in data:
            o = data["output_tokens"]
            if not isinstance(o, dict) or set(o) != {"short", "long"} or \
                    any(not isinstance(x, int) or x < 1 for x in o.values()):
                raise err("`output_tokens` must be {short: INT >= 1, long: INT >= 1}")
            m.output_tokens = dict(o)
        mode = data.get("expand", m.expand_mode)
        if mode not in ("one_at_a_time", "grid"):
            raise err(f"`expand` must be one_at_a_time or grid, got {mode!r}")
        m.expand_mode = mode
        base = data.get("base")
        if mode == "one_at_a_time":
            if base is None:
                base = {d: dims[d][0] for d in DIMENSIONS}
            if not isinstance(base, dict) or set(base) != set(DIMENSIONS):
                raise err(f"`base` must give one value for each dimension {list(DIMENSIONS)}")
            for d, v in base.items():
                _check_value(d, v, err)
            m.base = dict(base)
        elif base is not None:
            raise err("`base` is only used with expand: one_at_a_time")
        return m

    # ---- cells --------------------------------------------------------------------------

    def expand(self, window: int, block: int | None = None) -> list[Cell]:
        """Every cell with its positions resolved for a model with sliding window `window`.
        Raises MatrixError naming each cell whose positions do not fit."""
        block = block or self.block_tokens
        if self.cut_shift % block:
            raise MatrixError(f"cut_shift ({self.cut_shift}) must be a multiple of block_tokens ({block})")
        if self.expand_mode == "grid":
            combos = [dict(zip(DIMENSIONS, vals)) for vals in itertools.product(*(self.dimensions[d] for d in DIMENSIONS))]
        else:
            combos, seen = [dict(self.base)], set()
            for d in DIMENSIONS:
                for v in self.dimensions[d]:
                    if str(v) != str(self.base[d]):
                        combos.append({**self.base, d: v})
        cells, errors, seen = [], [], set()
        for c in combos:
            values = tuple((d, c[d]) for d in DIMENSIONS)
            key = ",".join(f"{k}={v}" for k, v in values)
            if key in seen:
                continue
            seen.add(key)
            n = int(c["context"])      # the suffix adds its tokens; H must stay below N
            try:
                h = resolve_hit(c["hit"], window, block, c["context"], c["suffix"] == "empty")
                top = n - 1 if c["suffix"] == "empty" else n
                hs = h + self.cut_shift
                if not block <= hs <= top:          # try the other direction
                    hs = h - self.cut_shift
                if not block <= hs <= top:
                    raise MatrixError(f"neither H {self.cut_shift:+d} nor H {-self.cut_shift:+d} "
                                      f"(H = {h}) keeps a cached block inside the context")
            except MatrixError as e:
                errors.append(f"  cell {key}: {e}")
                continue
            cells.append(Cell(values=values, hit=h, shifted_hit=hs, prompt_tokens=n, window=window))
        if errors:
            raise MatrixError("cells whose cut points do not fit (window %d, block %d):\n%s"
                              % (window, block, "\n".join(errors)))
        return cells


def normalize_replay(v):
    """YAML 1.1 reads an unquoted `off` as False: take it as the replay switch "off"."""
    return "off" if v is False else v


def resolve_hit(spec, window: int, block: int, context: int, empty_suffix: bool) -> int:
    """Tokens of the cached prefix for a hit-position spec (module docstring)."""
    limit = context - 1 if empty_suffix else context     # H <= N - 1
    if isinstance(spec, int) and not isinstance(spec, bool):
        h = spec
    elif spec == "start":
        h = block
    elif spec == "before_boundary":
        h = window - block
    elif spec == "after_boundary":
        h = window + block
    elif spec == "end":
        h = limit
    else:
        mt = _HIT_EXPR.match(str(spec))
        if not mt:
            raise MatrixError(f"bad hit position {spec!r}")
        ref = window if mt.group(1) == "W" else limit
        h = ref + (1 if mt.group(2) == "+" else -1) * int(mt.group(3))
    if h > limit:
        raise MatrixError(f"hit position {spec!r} (H = {h}) does not fit a context of {context} tokens "
                          f"(H <= {limit})")
    h = h // block * block
    if h < block:
        raise MatrixError(f"hit position {spec!r} gives H = {h}, less than one block ({block})")
    return h


def _check_value(dim: str, v, err) -> None:
    if dim == "hit":
        if not ((isinstance(v, int) and not isinstance(v, bool) and v > 0) or v in HIT_NAMES
                or _HIT_EXPR.match(str(v))):
            raise err(f"bad hit position {v!r}: one of {list(HIT_NAMES)}, a positive int, or W+k / W-k / end-k")
    elif dim in ("context", "concurrency"):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise err(f"`{dim}` values must be positive integers, got {v!r}")
    elif dim == "suffix":
        if v not in SUFFIX_KINDS:
            raise err(f"bad suffix kind {v!r}: one of {list(SUFFIX_KINDS)}")
    elif dim == "task":
        if v not in TASKS:
            raise err(f"unknown task {v!r}: one of {list(TASKS)}")
    elif dim == "output":
        if v not in OUTPUTS:
            raise err(f"bad output length {v!r}: one of {list(OUTPUTS)}")
    elif dim == "evidence":
        if v not in PLACEMENTS:
            raise err(f"bad evidence placement {v!r}: one of {list(PLACEMENTS)}")


def load_matrix(path: str | Path) -> Matrix:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise MatrixError(f"cannot read matrix {p}: {e.strerror}") from None
    return Matrix.from_yaml(text, str(p))
