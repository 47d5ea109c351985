"""The per-sequence KV state, in the formats a server stores (docs/design.md#formats;
what each tier keeps: docs/design.md#tiers).

`SequenceState` holds, for one sequence:
  - `tokens` (the ids seen) and `position` (how many; the next token's position);
  - `main_kv[layer]`: the global main-KV entries of each KV-source (Full) layer, NVFP4
    codes [n, D/2] uint8 + E4M3 scales [n, D/16], one entry per complete block of
    `ratio` tokens, quantized after RoPE at the block's first position;
  - `index_keys[layer]`: the indexer keys of each layer that owns them (the Full layers),
    MXFP4 codes [n, Di/2] + UE8M0 scales [n, Di/32] (after RoPE and the optional Hadamard
    rotation: exactly what is scored);
  - `swa_values[layer]` / `swa_scales[layer]`: every layer's SWA ring, the last `window`
    tokens' SWA KV in FP8 E4M3 [W, D] + UE8M0 scales [W, D/32]; position p lives in slot
    p % W;
  - `pending[layer]`: the partial-block compressor state of each compressing KV source
    with ratio > 1: the kv and score projections (float32 [p, D] each; [p, 2D] with
    overlapping windows) of the p = position % ratio tokens of the unfinished block;
  - `extra`: V4's further compressor state, keyed by name: "overlap.<layer>" (the first
    half of the last complete block's kv and score, [ratio, D] each, for overlapping
    windows), "index.<layer>" and "overlap.index.<layer>" (the same for the indexer's own
    compressor, at index_head_dim).

The formats of main_kv, index_keys and the SWA rings are the model's KV codec's
(`kv_codec.py`): the stored formats above, V4's FP8 entry, or float32 in the reference
mode (kv_dtype="float32").

`nbytes()` counts what is stored (valid rows, not the spare capacity of the growable
buffers) and equals `kv_budget(config).bytes_for(position)` ledger by ledger.

Writes from a forward in progress are staged (`RowStore.stage`) and committed together at
the end, so a failed call leaves the state as it was. Hooks for the cache manager and
replay: `export_global` / `import_global` (global KV + indexer keys of a token range of
complete blocks) and `snapshot_swa` / `restore_swa` (SWA rings, compressor state, tokens
and the unaligned tail's global entries).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import formats
from ..budget import kv_budget
from ..config import ModelConfig
from ..ops import cache_ops
from .kv_codec import codec_for

__all__ = ["RowStore", "SequenceState", "SwaSnapshot", "state_bytes_equal", "state_diff"]


class RowStore:
    """Growable rows of a quantized pair (codes, scales).

    Rows [0, n) are committed; a forward stages new rows after them (`stage`), reads the
    committed and staged rows (`rows`), then `commit`s or `rollback`s. Capacity grows by
    doubling, so appends are amortized O(1) per row.

    `decoded(name, fn)` keeps a decoded copy of the rows (fn: the codec's row-wise decode),
    decoding only the rows written since the last call: a CPU decode step reads every key
    (the indexer) or many entries (attention) and would otherwise decode the whole store
    each step. Every write goes through stage / rollback / truncate, which mark the rows
    from the write on as stale, so the copy never outlives the rows it decodes. It is a
    derived cache: not counted in nbytes, not cloned.
    """

    def __init__(self, code_cols: int, code_dtype: torch.dtype, scale_cols: int,
                 scale_dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.codes = torch.zeros(0, code_cols, dtype=code_dtype, device=device)
        self.scales = torch.zeros(0, scale_cols, dtype=scale_dtype, device=device)
        self.n = 0
        self._end = 0
        self._decoded: dict[str, list] = {}     # name -> [rows decoded, buffer]

    def _stale_from(self, row: int) -> None:
        for entry in self._decoded.values():
            entry[0] = min(entry[0], row)

    def decoded(self, name: str, fn) -> torch.Tensor:
        """fn(codes, scales) of the committed and staged rows [0, end), from a copy that
        decodes only rows not decoded since they were written. fn must decode row by row
        (row i of its output depends on row i of its inputs only) and give the same shape
        and dtype each call; `name` keys the copy (one name per fn)."""
        end = self._end
        entry = self._decoded.setdefault(name, [0, None])
        done, buf = entry[0], entry[1]
        if done < end:
            new = fn(self.codes[done:end], self.scales[done:end])
            if buf is None or buf.shape[0] < end:
                grown = new.new_empty((max(end, 2 * (0 if buf is None else buf.shape[0]), 16),
                                       *new.shape[1:]))
                if buf is not None and done:
                    grown[:done] = buf[:done]
                entry[1] = buf = grown
            buf[done:end] = new
            entry[0] = end
        if buf is None:    # an empty store: fn's shape from zero rows
            return fn(self.codes[:0], self.scales[:0])
        return buf[:end]

    @property
    def row_bytes(self) -> int:
        return (self.codes.shape[1] * self.codes.element_size()
                + self.scales.shape[1] * self.scales.element_size())

    def nbytes(self) -> int:
        return self.n * self.row_bytes

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed and staged rows."""
        return self.codes[:self._end], self.scales[:self._end]

    def committed(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codes[:self.n], self.scales[:self.n]

    def _reserve(self, rows: int) -> None:
        cap = self.codes.shape[0]
        if rows <= cap:
            return
        new_cap = max(rows, 2 * cap, 16)
        for name in ("codes", "scales"):
            old = getattr(self, name)
            grown = torch.zeros(new_cap, old.shape[1], dtype=old.dtype, device=old.device)
            grown[:self._end] = old[:self._end]
            setattr(self, name, grown)

    def stage(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        m = codes.shape[0]
        self._reserve(self._end + m)
        self._stale_from(self._end)
        self.codes[self._end:self._end + m] = codes
        self.scales[self._end:self._end + m] = scales
        self._end += m

    def stage_quantized(self, fmt: str, x: torch.Tensor) -> None:
        """Quantize x [m, D] (float32) into the next m rows (fmt "nvfp4" or "mxfp4"). On CUDA
        the cache-write kernel (dsv41::quantize_<fmt>_scatter) writes the rows in place, with
        no temporary; on the CPU, formats.quantize_<fmt> and stage. Same bits either way."""
        if not x.is_cuda:
            self.stage(*getattr(formats, f"quantize_{fmt}")(x))
            return
        m = x.shape[0]
        self._reserve(self._end + m)
        self._stale_from(self._end)
        rows = torch.arange(self._end, self._end + m, device=x.device)
        cache_ops.quantize_scatter(fmt, x, self.codes, self.scales, rows)
        self._end += m

    def commit(self) -> None:
        self.n = self._end

    def rollback(self) -> None:
        self._end = self.n
        self._stale_from(self._end)

    def truncate(self, n: int) -> None:
        """Drop committed rows past n (for callers that rebuild a suffix)."""
        if not 0 <= n <= self.n:
            raise ValueError(f"truncate: n={n} outside [0, {self.n}]")
        self.n = self._end = n
        self._stale_from(n)

    def clone(self) -> RowStore:
        out = RowStore.__new__(RowStore)
        out.codes, out.scales = self.codes[:self.n].clone(), self.scales[:self.n].clone()
        out.n = out._end = self.n
        out._decoded = {}
        return out

    def equal(self, other: RowStore) -> bool:
        a, b = self.committed(), other.committed()
        return self.n == other.n and all(
            torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


@dataclass
class SwaSnapshot:
    """What a prefix-cache hit cannot rebuild from the global KV alone (docs/design.md#tiers):
    the SWA rings, the compressor's partial blocks, the token ids, and the global entries
    past the last aligned boundary (`aligned_to` tokens)."""

    config_fingerprint: str
    tokens: list[int]
    aligned_to: int
    swa_values: dict[int, torch.Tensor]
    swa_scales: dict[int, torch.Tensor]
    pending: dict[int, tuple[torch.Tensor, torch.Tensor]]
    tail: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    extra: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def nbytes(self) -> int:
        n = sum(t.numel() * t.element_size() for d in (self.swa_values, self.swa_scales)
                for t in d.values())
        n += sum(t.numel() * t.element_size()
                 for kv in (*self.pending.values(), *self.extra.values()) for t in kv)
        n += sum(t.numel() * t.element_size() for d in self.tail.values() for p in d.values()
                 for t in p)
        return n


class SequenceState:
    """One sequence's stored KV state (see the module docstring)."""

    def __init__(self, config: ModelConfig, *, device: torch.device | str = "cpu",
                 options: dict | None = None):
        self.config = config
        self.config_fingerprint = config.fingerprint()
        # Model options that change stored bytes (e.g. the indexer's Hadamard rotation).
        self.options = dict(options or {})
        self.device = torch.device(device)
        self.tokens: list[int] = []
        self.position = 0
        c = config
        self.codec = codec_for(c, self.options.get("kv_dtype", "stored"))
        D, Di, W = c.head_dim, c.index_head_dim, c.sliding_window
        main, swa, index = self.codec.main_spec(), self.codec.swa_spec(), self.codec.index_spec()
        self.main_kv: dict[int, RowStore] = {}
        self.index_keys: dict[int, RowStore] = {}
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.extra: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.swa_values: dict[int, torch.Tensor] = {}
        self.swa_scales: dict[int, torch.Tensor] = {}

        def empty(cols: int) -> tuple[torch.Tensor, torch.Tensor]:
            e = torch.zeros(0, cols, dtype=torch.float32, device=device)
            return e, e.clone()

        for p in c.layer_plan():
            width = 2 if p.overlap else 1
            if p.owns_kv:
                self.main_kv[p.layer] = RowStore(*main, device=device)
                if p.compress_ratio > 1:
                    self.pending[p.layer] = empty(width * D)
                if p.overlap:
                    self.extra[f"overlap.{p.layer}"] = empty(D)
            if p.owns_indexer_keys:
                self.index_keys[p.layer] = RowStore(*index, device=device)
                if c.indexer_compressor:
                    self.extra[f"index.{p.layer}"] = empty(width * Di)
                    if p.overlap:
                        self.extra[f"overlap.index.{p.layer}"] = empty(Di)
            self.swa_values[p.layer] = torch.zeros(W, swa.code_cols, dtype=swa.code_dtype,
                                                   device=device)
            self.swa_scales[p.layer] = torch.zeros(W, swa.scale_cols, dtype=swa.scale_dtype,
                                                   device=device)

    def comp_state(self, key: int | str) -> tuple[torch.Tensor, torch.Tensor]:
        """A compressor's partial-block (or overlap) state: `pending[key]` for an int
        key (the main compressor of that layer), `extra[key]` otherwise."""
        return self.pending[key] if isinstance(key, int) else self.extra[key]

    # ---- views ----------------------------------------------------------------------

    def kv_source_store(self, layer: int) -> RowStore:
        """The main-KV store a layer reads (its KV source's: Reuse and Reindex layers own
        none)."""
        src = self.config.layer_plan()[layer].kv_source
        if src is None:
            raise ValueError(f"layer {layer} is SWA-only and reads no global KV")
        return self.main_kv[src]

    def entries(self, layer: int) -> int:
        """Committed global entries of a KV-source layer."""
        return self.main_kv[layer].n

    def swa_positions(self) -> list[int]:
        """Positions whose SWA KV the rings hold (the last min(position, W) tokens)."""
        W = self.config.sliding_window
        return list(range(max(0, self.position - W), self.position))

    def nbytes(self) -> dict[str, int]:
        """Stored bytes per ledger: main, indexer, global, swa, compressor_state."""
        main = sum(s.nbytes() for s in self.main_kv.values())
        indexer = sum(s.nbytes() for s in self.index_keys.values())
        rows = min(self.position, self.config.sliding_window)
        swa = sum(rows * (v.shape[1] * v.element_size() + s.shape[1] * s.element_size())
                  for v, s in zip(self.swa_values.values(), self.swa_scales.values()))
        state = sum(t.numel() * t.element_size()
                    for kv in (*self.pending.values(), *self.extra.values()) for t in kv)
        return {"main": main, "indexer": indexer, "global": main + indexer, "swa": swa,
                "compressor_state": state}

    def check_budget(self) -> None:
        """Raise if the stored bytes disagree with kv_budget (a consistency check)."""
        want = kv_budget(self.config).bytes_for(self.position)
        have = self.nbytes()
        bad = {k: (have[k], want[k]) for k in have if have[k] != want[k]}
        if bad:
            raise AssertionError(f"state bytes disagree with kv_budget at position "
                                 f"{self.position}: {bad}")

    # ---- copies ---------------------------------------------------------------------

    def clone(self) -> SequenceState:
        out = SequenceState.__new__(SequenceState)
        out.config, out.config_fingerprint = self.config, self.config_fingerprint
        out.options, out.device = dict(self.options), self.device
        out.tokens, out.position = list(self.tokens), self.position
        out.main_kv = {k: v.clone() for k, v in self.main_kv.items()}
        out.index_keys = {k: v.clone() for k, v in self.index_keys.items()}
        out.pending = {k: (a.clone(), b.clone()) for k, (a, b) in self.pending.items()}
        out.extra = {k: (a.clone(), b.clone()) for k, (a, b) in self.extra.items()}
        out.codec = self.codec
        out.swa_values = {k: v.clone() for k, v in self.swa_values.items()}
        out.swa_scales = {k: v.clone() for k, v in self.swa_scales.items()}
        return out

    def _rollback(self) -> None:
        for store in (*self.main_kv.values(), *self.index_keys.values()):
            store.rollback()

    # ---- prefix-cache and replay hooks ----------------------------------------------

    def _block_multiple(self) -> int:
        ratios = [p.compress_ratio for p in self.config.layer_plan() if p.owns_kv]
        return math.lcm(*ratios) if ratios else 1

    def _check_range(self, start: int, end: int) -> None:
        m = self._block_multiple()
        if not (0 <= start <= end <= self.position) or start % m or end % m:
            raise ValueError(f"token range [{start}, {end}) must lie in [0, {self.position}] "
                             f"and be aligned to {m} (every compression ratio)")

    def export_global(self, start: int, end: int) -> dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
        """Copies of the main-KV entries and indexer keys covering tokens [start, end)
        (aligned to every ratio): {"main": {layer: (codes, scales)}, "index": {...}}."""
        self._check_range(start, end)
        out: dict[str, dict] = {"main": {}, "index": {}}
        for kind, stores in (("main", self.main_kv), ("index", self.index_keys)):
            for layer, store in stores.items():
                m = self.config.compress_ratios[layer]
                codes, scales = store.committed()
                out[kind][layer] = (codes[start // m:end // m].clone(),
                                    scales[start // m:end // m].clone())
        return out

    def import_global(self, start: int, payload: dict) -> None:
        """Append exported entries for tokens [start, ...): every store must hold exactly
        the entries of tokens [0, start). The position is not moved: run replay or
        `restore_swa` next (the entries are read as cached, never recomputed)."""
        m_all = self._block_multiple()
        if start % m_all:
            raise ValueError(f"import_global: start={start} is not aligned to {m_all}")
        for kind, stores in (("main", self.main_kv), ("index", self.index_keys)):
            if set(payload.get(kind, {})) != set(stores):
                raise ValueError(f"import_global: {kind} layers {sorted(payload.get(kind, {}))} "
                                 f"do not match this model's {sorted(stores)}")
            for layer, store in stores.items():
                if store.n != start // self.config.compress_ratios[layer]:
                    raise ValueError(f"import_global: layer {layer} holds {store.n} entries, "
                                     f"not the {start // self.config.compress_ratios[layer]} "
                                     f"of tokens [0, {start})")
        for kind, stores in (("main", self.main_kv), ("index", self.index_keys)):
            for layer, store in stores.items():
                codes, scales = payload[kind][layer]
                store.stage(codes.to(self.device), scales.to(self.device))
                store.commit()

    def seek_for_replay(self, tokens: list[int]) -> None:
        """Prepare a replay that starts after `tokens` (its first position s = len(tokens)):
        the state must hold imported global KV of a block-aligned prefix [0, H) with
        H >= s (import_global). The position moves to s; the SWA rings are not read before
        s (the replay passes swa_start = s) and the compressor state is empty at H."""
        s = len(tokens)
        m = self._block_multiple()
        for layer, store in (*self.main_kv.items(), *self.index_keys.items()):
            r = self.config.compress_ratios[layer]
            if store.n * r % m or store.n * r < s:
                raise ValueError(f"seek_for_replay: layer {layer} holds global KV of "
                                 f"{store.n * r} tokens, not an aligned prefix covering {s}")
        self.tokens, self.position = [int(t) for t in tokens], s
        self.pending = {k: (a[:0].clone(), b[:0].clone()) for k, (a, b) in self.pending.items()}

    def snapshot_swa(self, aligned_to: int | None = None) -> SwaSnapshot:
        """Snapshot the SWA rings, the compressor's partial blocks, the tokens and the
        global entries of tokens past `aligned_to` (default: the last multiple of every
        ratio at or before the position)."""
        m = self._block_multiple()
        if aligned_to is None:
            aligned_to = self.position // m * m
        self._check_range(aligned_to, aligned_to)
        tail: dict[str, dict] = {"main": {}, "index": {}}
        for kind, stores in (("main", self.main_kv), ("index", self.index_keys)):
            for layer, store in stores.items():
                codes, scales = store.committed()
                first = aligned_to // self.config.compress_ratios[layer]
                tail[kind][layer] = (codes[first:].clone(), scales[first:].clone())
        return SwaSnapshot(
            config_fingerprint=self.config_fingerprint, tokens=list(self.tokens),
            aligned_to=aligned_to,
            swa_values={k: v.clone() for k, v in self.swa_values.items()},
            swa_scales={k: v.clone() for k, v in self.swa_scales.items()},
            pending={k: (a.clone(), b.clone()) for k, (a, b) in self.pending.items()},
            tail=tail,
            extra={k: (a.clone(), b.clone()) for k, (a, b) in self.extra.items()})

    def restore_swa(self, snap: SwaSnapshot) -> None:
        """Restore a snapshot on a state whose global KV covers tokens [0, aligned_to)."""
        if snap.config_fingerprint != self.config_fingerprint:
            raise ValueError("restore_swa: the snapshot comes from another model config")
        for layer, store in self.main_kv.items():
            want = snap.aligned_to // self.config.compress_ratios[layer]
            if store.n != want:
                raise ValueError(f"restore_swa: layer {layer} holds {store.n} entries, the "
                                 f"snapshot expects {want} (tokens [0, {snap.aligned_to}))")
        for kind, stores in (("main", self.main_kv), ("index", self.index_keys)):
            for layer, store in stores.items():
                store.stage(*snap.tail[kind][layer])
                store.commit()
        self.tokens, self.position = list(snap.tokens), len(snap.tokens)
        self.swa_values = {k: v.clone() for k, v in snap.swa_values.items()}
        self.swa_scales = {k: v.clone() for k, v in snap.swa_scales.items()}
        self.pending = {k: (a.clone(), b.clone()) for k, (a, b) in snap.pending.items()}
        self.extra.update({k: (a.clone(), b.clone()) for k, (a, b) in snap.extra.items()})

    def __repr__(self) -> str:
        b = self.nbytes()
        return (f"SequenceState({self.config.name}, position={self.position}, "
                f"global={b['global']} B, swa={b['swa']} B, compressor={b['compressor_state']} B)")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def state_diff(a: SequenceState, b: SequenceState) -> list[str]:
    """What differs between two states' stored bytes (empty: bit-identical)."""
    out = []
    if a.config_fingerprint != b.config_fingerprint:
        return ["config"]
    if a.tokens != b.tokens or a.position != b.position:
        out.append(f"tokens/position ({a.position} vs {b.position})")
    for name in ("main_kv", "index_keys"):
        for layer in getattr(a, name):
            if not getattr(a, name)[layer].equal(getattr(b, name)[layer]):
                out.append(f"{name}[{layer}]")
    W = a.config.sliding_window
    slots = torch.tensor([p % W for p in a.swa_positions()], dtype=torch.long)
    for layer in a.swa_values:
        for name in ("swa_values", "swa_scales"):
            x, y = getattr(a, name)[layer], getattr(b, name)[layer]
            if not torch.equal(_bits(x[slots]), _bits(y[slots])):
                out.append(f"{name}[{layer}]")
    for layer in a.pending:
        for i, what in enumerate(("kv", "score")):
            x, y = a.pending[layer][i], b.pending[layer][i]
            if x.shape != y.shape or not torch.equal(_bits(x), _bits(y)):
                out.append(f"pending[{layer}].{what}")
    for key in a.extra:
        for i, what in enumerate(("kv", "score")):
            x, y = a.extra[key][i], b.extra[key][i]
            if x.shape != y.shape or not torch.equal(_bits(x), _bits(y)):
                out.append(f"extra[{key}].{what}")
    return out


def state_bytes_equal(a: SequenceState, b: SequenceState) -> bool:
    """True when two states store bit-identical bytes (tokens, global KV, indexer keys,
    the valid SWA ring slots, compressor state)."""
    return not state_diff(a, b)
