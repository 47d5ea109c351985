"""KV-cache byte accounting from a model config alone (docs/design.md#system,
docs/design.md#bytes-per-token).

Three ledgers: global KV (main KV + indexer keys, per token, GPU and SSD), SWA KV (per
sequence, bounded by the window) and the persistent prefix cache (per token). Every byte
size comes from dsv41.formats.layout, so a format change shows up here automatically;
the V4.1-Flash figure of 890 B/token is derived, never stated.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any

from .config import ModelConfig
from .formats import layout

__all__ = [
    "BudgetComparison",
    "KVBudget",
    "LayerBytes",
    "compare",
    "compressor_state_bytes",
    "format_budget_table",
    "index_key_bytes",
    "kv_budget",
    "main_entry_bytes",
    "swa_entry_bytes",
]

# The compressor's partial block is kept as the float32 projections it pools (kv and
# gate score, head_dim each) rather than the hidden states, which are larger.
_COMPRESSOR_STATE_ITEM_BYTES = 4


def main_entry_bytes(config: ModelConfig) -> int:
    """Bytes of one stored main-KV entry (one compressed token of one owning layer): for
    V4's fp8_v4 the packed entry the codec writes (584 B at head_dim 512, rope 64)."""
    return layout.main_kv_entry_bytes(config.main_kv_format, config.head_dim,
                                      config.rope_head_dim)


def index_key_bytes(config: ModelConfig) -> int:
    """Bytes of one MXFP4 indexer key."""
    return layout.mxfp4_bytes(config.index_head_dim)


def swa_entry_bytes(config: ModelConfig) -> int:
    """Bytes of one SWA KV entry (one token of one layer). V4 is assumed to store SWA in
    its main-KV entry format."""
    if config.main_kv_format == "nvfp4":
        return layout.fp8_swa_bytes(config.head_dim)
    return main_entry_bytes(config)


def compressor_state_bytes(config: ModelConfig, layer: int, tokens: int) -> int:
    """Bytes of one KV-source layer's compressor state after `tokens` tokens: the kv and
    score projections of the tokens % ratio tokens of the unfinished block (2 x head_dim
    wide with overlapping windows); with overlapping windows, once a block is complete,
    the first half (kv, score) of the last complete block; and the same for V4's indexer
    compressor (at index_head_dim) when the layer owns indexer keys."""
    p = config.layer_plan()[layer]
    m = p.compress_ratio
    dims = [config.head_dim] if p.owns_kv else []
    if p.owns_indexer_keys and config.indexer_compressor:
        dims.append(config.index_head_dim)
    total = 0
    for dim in dims:
        if m > 1:
            total += tokens % m * 2 * dim * (2 if p.overlap else 1)
        if p.overlap and tokens >= m:
            total += 2 * m * dim
    return total * _COMPRESSOR_STATE_ITEM_BYTES


@dataclass(frozen=True)
class LayerBytes:
    """Global-KV bytes per token stored by one owning layer."""

    layer: int
    part: str
    mode: str
    compress_ratio: int
    main_bytes_per_token: float
    index_bytes_per_token: float

    @property
    def total_bytes_per_token(self) -> float:
        return self.main_bytes_per_token + self.index_bytes_per_token


@dataclass(frozen=True)
class BudgetComparison:
    """A budget relative to the budget of model `name` (a ratio < 1: smaller than it)."""

    name: str
    global_ratio: float
    persistent_ratio: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class KVBudget:
    """The KV ledgers of one model, per token or per sequence (see docs/config.md)."""

    name: str
    main_kv_format: str
    main_entry_bytes: int
    index_key_bytes: int
    swa_bytes_per_token_per_layer: int
    per_layer: tuple[LayerBytes, ...]
    main_bytes_per_token: float
    indexer_bytes_per_token: float
    global_bytes_per_token: float
    swa_bytes_per_sequence: int
    # SWA checkpoints amortised per token (V4's persistent cache held them; V4.1's does not).
    persistent_swa_bytes_per_token: float
    persistent_bytes_per_token: float
    compressor_state_bytes_per_sequence: int
    config: ModelConfig = field(repr=False, compare=False)

    def bytes_for(self, tokens: int) -> dict[str, int]:
        """Exact bytes each ledger holds for one sequence of `tokens` tokens.

        A layer of ratio m stores floor(tokens / m) entries; the partial block is
        compressor state. The persistent ledger excludes compressor state because prefix
        cache blocks are multiples of every ratio.
        """
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        cfg = self.config
        main = indexer = state = 0
        for p in cfg.layer_plan():
            if p.owns_kv:
                main += tokens // p.compress_ratio * self.main_entry_bytes
                state += compressor_state_bytes(cfg, p.layer, tokens)
            if p.owns_indexer_keys:
                indexer += tokens // p.compress_ratio * self.index_key_bytes
        swa_live = min(tokens, cfg.sliding_window) * cfg.num_layers \
            * self.swa_bytes_per_token_per_layer
        checkpoints = tokens // cfg.persistent_swa_interval_tokens if cfg.persistent_swa else 0
        return {
            "main": main,
            "indexer": indexer,
            "global": main + indexer,
            "swa": swa_live,
            "compressor_state": state,
            "persistent": main + indexer + checkpoints * self.swa_bytes_per_sequence,
        }

    def to_dict(self, compare_to: KVBudget | None = None) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("config", "per_layer")}
        out["preset"] = self.name
        out["fingerprint"] = self.config.fingerprint()
        out["per_layer"] = [dict(asdict(row), total_bytes_per_token=row.total_bytes_per_token)
                            for row in self.per_layer]
        if compare_to is not None:
            out["vs"] = compare(self, compare_to).to_dict()
        return out


def kv_budget(config: ModelConfig) -> KVBudget:
    config.check_stored_formats()     # the budget counts the stored formats' bytes
    entry, key, swa = main_entry_bytes(config), index_key_bytes(config), swa_entry_bytes(config)
    rows = []
    main_total = index_total = Fraction(0)
    state = 0
    for p in config.layer_plan():
        if not (p.owns_kv or p.owns_indexer_keys):
            continue
        main = Fraction(entry, p.compress_ratio) if p.owns_kv else Fraction(0)
        index = Fraction(key, p.compress_ratio) if p.owns_indexer_keys else Fraction(0)
        main_total += main
        index_total += index
        if p.owns_kv:
            # the most a sequence holds: a block short of complete, after a complete one
            state += compressor_state_bytes(config, p.layer, 2 * p.compress_ratio - 1)
        rows.append(LayerBytes(p.layer, p.part, p.mode, p.compress_ratio,
                               float(main), float(index)))
    swa_seq = config.sliding_window * config.num_layers * swa
    persistent_swa = (Fraction(swa_seq, config.persistent_swa_interval_tokens)
                      if config.persistent_swa else Fraction(0))
    global_total = main_total + index_total
    return KVBudget(
        name=config.name,
        main_kv_format=config.main_kv_format,
        main_entry_bytes=entry,
        index_key_bytes=key,
        swa_bytes_per_token_per_layer=swa,
        per_layer=tuple(rows),
        main_bytes_per_token=float(main_total),
        indexer_bytes_per_token=float(index_total),
        global_bytes_per_token=float(global_total),
        swa_bytes_per_sequence=swa_seq,
        persistent_swa_bytes_per_token=float(persistent_swa),
        persistent_bytes_per_token=float(global_total + persistent_swa),
        compressor_state_bytes_per_sequence=state,
        config=config,
    )


def compare(a: KVBudget, b: KVBudget) -> BudgetComparison:
    """a relative to b (e.g. v41-flash vs v4-flash: about 1/4 global, 1/8 persistent)."""
    return BudgetComparison(
        name=b.name,
        global_ratio=a.global_bytes_per_token / b.global_bytes_per_token,
        persistent_ratio=a.persistent_bytes_per_token / b.persistent_bytes_per_token,
    )


def format_budget_table(budget: KVBudget, compare_to: KVBudget | None = None) -> str:
    cfg = budget.config
    lines = [
        f"KV budget: {budget.name}  (main KV {budget.main_kv_format} "
        f"{budget.main_entry_bytes} B/entry, indexer keys mxfp4 {budget.index_key_bytes} "
        f"B/entry, SWA {budget.swa_bytes_per_token_per_layer} B/token/layer)",
        "",
        f"{'layer':>5}  {'part':<8} {'mode':<8} {'ratio':>5}  {'main B/tok':>11}  "
        f"{'index B/tok':>11}  {'total B/tok':>11}",
    ]
    for r in budget.per_layer:
        lines.append(f"{r.layer:>5}  {r.part:<8} {r.mode:<8} {r.compress_ratio:>5}  "
                     f"{r.main_bytes_per_token:>11.2f}  {r.index_bytes_per_token:>11.2f}  "
                     f"{r.total_bytes_per_token:>11.2f}")
    swa_note = (f"  (global + SWA checkpoints {budget.persistent_swa_bytes_per_token:.2f}: "
                f"every layer's window once per {cfg.persistent_swa_interval_tokens} tokens)"
                if cfg.persistent_swa else "  (global only)")
    lines += [
        "",
        f"global KV + indexer keys   {budget.global_bytes_per_token:>12.2f} B/token  "
        f"(main {budget.main_bytes_per_token:.2f} + indexer "
        f"{budget.indexer_bytes_per_token:.2f})",
        f"persistent prefix cache    {budget.persistent_bytes_per_token:>12.2f} B/token"
        f"{swa_note}",
        f"SWA KV per sequence        {budget.swa_bytes_per_sequence:>12,} B  "
        f"({cfg.sliding_window} tokens x {cfg.num_layers} layers x "
        f"{budget.swa_bytes_per_token_per_layer} B)",
        f"compressor state per seq   {budget.compressor_state_bytes_per_sequence:>12,} B  "
        f"(at most)",
    ]
    if compare_to is not None:
        c = compare(budget, compare_to)
        lines.append(
            f"vs {c.name}: global {c.global_ratio:.3f}x "
            f"({budget.global_bytes_per_token:.2f} / {compare_to.global_bytes_per_token:.2f}), "
            f"persistent {c.persistent_ratio:.3f}x ({budget.persistent_bytes_per_token:.2f} / "
            f"{compare_to.persistent_bytes_per_token:.2f})")
    return "\n".join(lines)
