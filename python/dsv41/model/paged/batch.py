"""The batch descriptor of one paged step, built on the host from what the scheduler knows.

A step runs the tokens of several sequences (segments) through the model at once: a decode
is one token, a prefill chunk many, a replay a chunk whose SWA window and cached global KV
are bounded (docs/replay.md). `build_batch` turns each segment's host facts (`SeqChunk`:
tokens, first position, SWA/compressor slot, page table, replay bounds) into the index
tensors the layers need, so the forward runs with no per-sequence Python loop and never
reads a device value on the host:

  - rows: the step's tokens concatenated, segment after segment (`tokens`, `positions`);
  - SWA: `swa_idx[r, c]`, the row of the SWA tensor holding position p - W + 1 + c for the
    query at row r (p its position; -1 outside [max(swa_start, p - W + 1), p]); ring rows
    `slot * W + q % W` hold positions before the step, the step's own positions are read
    from where this step writes them (`swa_dst`);
  - global KV: for each compress ratio m, `entry_rows[b, j]`: the pool row of segment b's
    j-th entry (page table[j // E] * E + j % E, E = page_tokens / m; -1 past its pages),
    and `visible[r] = (p + 1) // m`;
  - compressor: the entries the step completes (`Compression`), each as the m state rows
    its tokens' projections are gathered from, the pool row it is written to and its first
    position; and which rows stay pending in the slot after the step.

Two layouts of the per-step rows (`decode_only`): when every segment runs exactly one
token, each token's SWA KV and compressor projections are written straight into its
slot's ring and state rows (a query at p never reads the row p overwrites, p - W), and
the step's shapes depend only on the segment count: that is the step a CUDA graph
captures. Otherwise the step's rows go to scratch rows after the slots' (`scratch_base`)
and the ones that stay are moved into the slots after the layer (`*_move_src/dst`).

Decoder replay (SeqChunk.decoder_start): the decoder layers run only on a segment's tokens
from decoder_start on. `dec` is then a second `View` of those rows (`dec_rows` selects
them from the encoder's); the decoder's Full layer still compresses every row (its KV is
projected from the encoder's final hidden state), so compression is described once, over
the encoder's rows.

Padding for CUDA graphs (`pad_to`): extra one-token segments on a padding slot with no
pages: they read nothing real and every write they make lands in the padding slot or is
dropped (row -1).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Sequence

import numpy as np
import torch

__all__ = ["SeqChunk", "View", "Compression", "Batch", "BatchShape", "build_batch"]


@dataclass
class SeqChunk:
    """One segment of a step, in host terms.

    tokens run from `start` (the sequence's position). `slot`: its SWA ring and compressor
    state slot. `pages`: its page table, covering at least [0, start + len(tokens)) (pages
    of a cached prefix first). swa_start: the first position any query's SWA window may
    reach (replay; 0 otherwise). cached_until: global KV of positions < cached_until is in
    the pages already and is read, never recomputed (a multiple of every ratio; tokens
    before it rebuild SWA only). decoder_start / decoder_swa_start: decoder replay (the
    decoder runs on positions >= decoder_start; its SWA window starts at decoder_swa_start).
    all_logits: logits of every token (else of the last)."""

    tokens: Sequence[int]
    start: int
    slot: int
    pages: Sequence[int]
    swa_start: int = 0
    cached_until: int | None = None
    decoder_start: int | None = None
    decoder_swa_start: int | None = None
    all_logits: bool = False
    logits: bool = True


@dataclass
class View:
    """What the layers of one part (encoder, or decoder under decoder replay) need per row."""

    positions: torch.Tensor            # int64 [R]
    seg: torch.Tensor                  # int64 [R] the segment of each row
    swa_idx: torch.Tensor              # int32 [R, W] rows of the SWA tensor (-1: none)
    swa_dst: torch.Tensor              # int64 [R] where each row's SWA KV is written
    swa_move_src: torch.Tensor         # int64 [M] scratch rows that stay in the ring...
    swa_move_dst: torch.Tensor         # int64 [M] ...and their ring rows
    visible: dict[int, torch.Tensor]   # ratio -> int64 [R] entries each row sees


@dataclass
class Compression:
    """The global entries a step completes at one compress ratio m, over the encoder rows.

    m > 1: the compressor state tensor of a layer has `num_slots * m` slot rows (slot s
    holds the pending tokens of its current block in rows s * m + q % m), then one trash
    row (`trash`), then the scratch rows of a step. `src` [N, m]: the rows an entry's m
    tokens are gathered from; `dst` [N] pool rows (-1: not written, padding); `pos` [N]
    first positions. `kv_dst` [R]: where each row's projections are written (the trash row
    for rows whose global KV is cached: they are never read); `keep_src` /
    `keep_dst`: rows that stay pending, moved into the slot after pooling (empty in a
    decode-only step, which writes the slot rows directly). m == 1: one entry per row,
    `dst` [R] (-1 for cached rows), `pos` = the rows' positions."""

    ratio: int
    dst: torch.Tensor
    pos: torch.Tensor
    src: torch.Tensor | None = None
    kv_dst: torch.Tensor | None = None
    keep_src: torch.Tensor | None = None
    keep_dst: torch.Tensor | None = None


@dataclass(frozen=True)
class BatchShape:
    """The host facts a step's shapes (and a captured graph) depend on."""

    segments: int
    rows: int
    decode_only: bool
    entry_caps: tuple[tuple[int, int], ...]   # (ratio, entries per segment row of entry_rows)
    decoder_rows: int | None                  # None: the decoder runs on every row


@dataclass
class Batch:
    tokens: torch.Tensor                       # int64 [R]
    enc: View
    dec: View | None                           # decoder-replay rows, or None (same as enc)
    dec_rows: torch.Tensor | None              # int64 [Rd] rows of enc the decoder runs on
    entry_rows: dict[int, torch.Tensor]        # ratio -> int32 [S, E_cap]
    comp: dict[int, Compression]               # ratio -> entries this step completes
    logit_rows: torch.Tensor                   # int64 [L] rows (decoder rows with dec)
    logit_counts: list[int]                    # logits per segment (host)
    shape: BatchShape
    window: int
    scratch_swa: int                           # first scratch row of the SWA tensors
    scratch_comp: dict[int, int] = field(default_factory=dict)  # ratio -> first scratch row

    @staticmethod
    def comp_rows(num_slots: int, ratio: int, max_rows: int) -> int:
        """Rows of a ratio's compressor state tensor: slots, the trash row, scratch."""
        return num_slots * ratio + 1 + max_rows

    @staticmethod
    def swa_rows(num_slots: int, window: int, max_rows: int) -> int:
        """Rows of an SWA tensor: each slot's ring, then a step's scratch rows."""
        return num_slots * window + max_rows

    @property
    def decode_only(self) -> bool:
        return self.shape.decode_only

    def view(self, decoder: bool) -> View:
        return self.dec if decoder and self.dec is not None else self.enc

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The same batch with every tensor on `device`."""
        def mv(x):
            if isinstance(x, torch.Tensor):
                return x.to(device, non_blocking=non_blocking)
            if isinstance(x, dict):
                return {k: mv(v) for k, v in x.items()}
            if isinstance(x, (View, Compression)):
                return type(x)(**{f.name: mv(getattr(x, f.name)) for f in fields(x)})
            return x
        return Batch(**{f.name: mv(getattr(self, f.name)) for f in fields(self)})

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the batch, in a fixed order (a graph's static inputs)."""
        out: list[torch.Tensor] = []

        def walk(x):
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif isinstance(x, dict):
                for k in sorted(x):
                    walk(x[k])
            elif isinstance(x, (View, Compression)):
                for f in fields(x):
                    walk(getattr(x, f.name))
        for f in fields(self):
            walk(getattr(self, f.name))
        return out


def _i64(a) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))


def _i32(a) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))


def _entry_table(pages: np.ndarray, n_pages: int, per_page: int, cap: int) -> np.ndarray:
    """Pool rows of entries [0, cap) of a page table (-1 past its pages)."""
    j = np.arange(cap, dtype=np.int64)
    page = j // per_page
    ok = page < n_pages
    rows = np.full(cap, -1, dtype=np.int64)
    rows[ok] = pages[page[ok]] * per_page + j[ok] % per_page
    return rows


class _Part:
    """Host arrays of one View while it is built."""

    def __init__(self):
        self.pos, self.seg, self.swa_idx, self.swa_dst = [], [], [], []
        self.move_src, self.move_dst = [], []
        self.rows = 0

    def view(self, ratios, window) -> View:
        pos = np.concatenate(self.pos) if self.pos else np.zeros(0, np.int64)
        return View(positions=_i64(pos), seg=_i64(np.concatenate(self.seg) if self.seg else pos),
                    swa_idx=_i32(np.concatenate(self.swa_idx) if self.swa_idx
                                 else np.zeros((0, window))),
                    swa_dst=_i64(np.concatenate(self.swa_dst) if self.swa_dst else pos),
                    swa_move_src=_i64(np.concatenate(self.move_src) if self.move_src else []),
                    swa_move_dst=_i64(np.concatenate(self.move_dst) if self.move_dst else []),
                    visible={m: _i64((pos + 1) // m) for m in ratios})

    def add(self, b: int, pos: np.ndarray, slot: int, swa_start: int, window: int,
            decode_only: bool, scratch: int) -> None:
        """Rows of segment b at positions pos (consecutive), its SWA window bounded below by
        swa_start; scratch: the first scratch row of the SWA tensors."""
        W, n = window, pos.size
        if not n:
            return
        first = int(pos[0])
        rows = self.rows + np.arange(n)
        q = pos[:, None] - W + 1 + np.arange(W)[None, :]             # [n, W] positions seen
        ok = (q >= max(swa_start, 0)) & (q <= pos[:, None])
        ring = slot * W + q % W
        if decode_only:
            idx, dst = ring, slot * W + pos % W
        else:
            own = scratch + self.rows + (q - first)                   # this step's rows
            idx = np.where(q >= first, own, ring)
            dst = scratch + rows
            keep = pos >= pos[-1] - W + 1                             # the last W tokens
            self.move_src.append(dst[keep])
            self.move_dst.append(slot * W + pos[keep] % W)
        self.pos.append(pos)
        self.seg.append(np.full(n, b, np.int64))
        self.swa_idx.append(np.where(ok, idx, -1))
        self.swa_dst.append(dst)
        self.rows += n


def _bucket_entries(n: int, cap: int | None) -> int:
    if cap is not None:
        if n > cap:
            raise ValueError(f"a segment needs {n} entries, more than the capacity {cap}")
        return cap
    return max(n, 1)


def build_batch(chunks: Sequence[SeqChunk], *, window: int, page_tokens: int,
                ratios: Sequence[int], num_slots: int, decoder: bool = True,
                pad_to: int | None = None, pad_slot: int | None = None,
                pad_logits: bool = False, context_cap: int | None = None,
                comp_ratios: Sequence[int] | None = None) -> Batch:
    """The Batch of `chunks` (see the module docstring).

    window: W; page_tokens: tokens per page; ratios: the compress ratios of the model's KV
    sources (entry tables and visibility are built for each); comp_ratios: those whose
    entries the model compresses (default: ratios); num_slots: slots of the SWA and
    compressor state tensors (their scratch rows follow); decoder: the model has decoder
    layers (encoder-decoder V4.1) so decoder replay applies. pad_to: add one-token padding
    segments on pad_slot up to this many segments (a decode graph's bucket; pad_logits:
    compute their logits rows too, after the real ones, so the logits have the bucket's
    shape); context_cap:
    tokens the entry tables cover (a graph's context bucket; default the longest segment).
    """
    if not chunks:
        raise ValueError("build_batch: no segments")
    W, P = int(window), int(page_tokens)
    ratios = sorted({int(m) for m in ratios if m})
    comp_ratios = ratios if comp_ratios is None else sorted({int(m) for m in comp_ratios if m})
    for m in ratios:
        if P % m:
            raise ValueError(f"page_tokens={P} is not a multiple of compress ratio {m}")
    chunks = list(chunks)
    for b, c in enumerate(chunks):
        _check_chunk(b, c, P, ratios, num_slots)
    if pad_to is not None:
        if pad_slot is None or not 0 <= pad_slot < num_slots:
            raise ValueError(f"build_batch: pad_to needs a pad_slot in [0, {num_slots})")
        if len(chunks) > pad_to:
            raise ValueError(f"{len(chunks)} segments do not fit the bucket of {pad_to}")
        chunks += [SeqChunk([0], 0, pad_slot, [], logits=pad_logits)] * (pad_to - len(chunks))
    S = len(chunks)
    decode_only = all(len(c.tokens) == 1 for c in chunks)
    scratch_swa = num_slots * W
    enc, dec = _Part(), _Part()
    use_dec = decoder and any(c.decoder_start is not None and c.decoder_start > c.start
                              for c in chunks)
    tokens, dec_rows, logit_rows, logit_counts = [], [], [], []
    ends = []
    for b, c in enumerate(chunks):
        n = len(c.tokens)
        pos = c.start + np.arange(n, dtype=np.int64)
        base = enc.rows
        tokens.append(np.asarray(c.tokens, dtype=np.int64))
        enc.add(b, pos, c.slot, c.swa_start, W, decode_only, scratch_swa)
        ends.append(c.start + n)
        if use_dec:
            d = c.start if c.decoder_start is None else max(c.start, c.decoder_start)
            dswa = c.swa_start if c.decoder_swa_start is None else c.decoder_swa_start
            keep = pos >= d
            dbase = dec.rows
            dec_rows.append(base + np.flatnonzero(keep))
            dec.add(b, pos[keep], c.slot, dswa, W, decode_only, scratch_swa)
            out_base, out_n = dbase, int(keep.sum())
        else:
            out_base, out_n = base, n
        if not c.logits:
            logit_counts.append(0)
        elif c.all_logits:
            if out_n != n:
                raise ValueError(f"segment {b}: all_logits needs the decoder on every token")
            logit_rows.append(out_base + np.arange(n))
            logit_counts.append(n)
        else:
            if out_n == 0:
                raise ValueError(f"segment {b}: its last token does not reach the decoder "
                                 f"(decoder_start past the chunk): no logits to return")
            logit_rows.append(np.array([out_base + out_n - 1]))
            logit_counts.append(1)
    max_end = max(ends)
    cap_tokens = max_end if context_cap is None else int(context_cap)
    entry_rows = {}
    for m in ratios:
        per_page = P // m
        cap = _bucket_entries(-(-max_end // m), None if context_cap is None
                              else -(-cap_tokens // m))
        entry_rows[m] = _i32(np.stack([_entry_table(np.asarray(c.pages, np.int64), len(c.pages),
                                                    per_page, cap) for c in chunks]))
    comp, scratch_comp = {}, {}
    for m in comp_ratios:
        comp[m], scratch_comp[m] = _compression(chunks, m, P // m, num_slots, decode_only,
                                                entry_rows[m])
    shape = BatchShape(S, enc.rows, decode_only,
                       tuple((m, int(entry_rows[m].shape[1])) for m in ratios),
                       dec.rows if use_dec else None)
    return Batch(tokens=_i64(np.concatenate(tokens)), enc=enc.view(ratios, W),
                 dec=dec.view(ratios, W) if use_dec else None,
                 dec_rows=_i64(np.concatenate(dec_rows)) if use_dec else None,
                 entry_rows=entry_rows, comp=comp,
                 logit_rows=_i64(np.concatenate(logit_rows) if logit_rows else []),
                 logit_counts=logit_counts, shape=shape, window=W,
                 scratch_swa=scratch_swa, scratch_comp=scratch_comp)


def _check_chunk(b: int, c: SeqChunk, P: int, ratios: list[int], slots: int) -> None:
    n = len(c.tokens)
    where = f"segment {b}"
    if n < 1:
        raise ValueError(f"{where}: no tokens")
    if c.start < 0 or not 0 <= c.slot < slots:
        raise ValueError(f"{where}: start={c.start}, slot={c.slot} (of {slots}) out of range")
    if not 0 <= c.swa_start <= c.start:
        raise ValueError(f"{where}: swa_start={c.swa_start} must lie in [0, {c.start}]")
    if ratios and len(c.pages) * P < c.start + n:
        raise ValueError(f"{where}: {len(c.pages)} pages of {P} tokens do not cover positions "
                         f"[0, {c.start + n})")
    if c.cached_until is not None:
        H = c.cached_until
        if H < c.start or any(H % m for m in ratios):
            raise ValueError(f"{where}: cached_until={H} must be at or after start={c.start} "
                             f"and a multiple of every ratio {ratios}")
        if len(c.pages) * P < H:
            raise ValueError(f"{where}: cached_until={H} past its pages")


def _compression(chunks: list[SeqChunk], m: int, per_page: int, num_slots: int,
                 decode_only: bool, entry_rows: torch.Tensor) -> tuple[Compression, int]:
    """The entries the chunks complete at ratio m (see Compression); returns it and the
    first scratch row of the ratio's compressor-state tensor."""
    table = entry_rows.numpy()
    trash = num_slots * m
    scratch = trash + 1
    if m == 1:
        dst, pos = [], []
        for b, c in enumerate(chunks):
            p = c.start + np.arange(len(c.tokens))
            cached = p < (c.cached_until or 0)
            j = np.minimum(p, table.shape[1] - 1)
            rows = table[b, j].astype(np.int64)
            dst.append(np.where(cached | (p >= table.shape[1]), -1, rows))
            pos.append(p)
        return Compression(1, _i64(np.concatenate(dst)), _i64(np.concatenate(pos))), scratch
    src, dst, pos, kv_dst, keep_src, keep_dst = [], [], [], [], [], []
    row = 0
    for b, c in enumerate(chunks):
        n = len(c.tokens)
        p = c.start + np.arange(n)
        first = max(c.start, c.cached_until or 0)     # tokens before it: global KV cached
        live = p >= first
        slot_rows = c.slot * m + p % m
        if decode_only:
            kv_dst.append(np.where(live, slot_rows, trash))
            e = int(p[0]) // m
            done = live[0] and int(p[0]) % m == m - 1
            src.append(c.slot * m + np.arange(m))
            dst.append(table[b, e] if done and e < table.shape[1] else -1)
            pos.append(e * m)
            row += 1
            continue
        step_rows = scratch + row + np.arange(n)
        kv_dst.append(np.where(live, step_rows, trash))
        end = c.start + n
        for e in range(first // m, end // m):         # blocks completed in this step
            q = e * m + np.arange(m)
            src.append(np.where(q >= c.start, scratch + row + (q - c.start), c.slot * m + q % m))
            dst.append(table[b, e])
            pos.append(e * m)
        tail = live & (p >= end // m * m)              # the new partial block stays pending
        keep_src.append(step_rows[tail])
        keep_dst.append(slot_rows[tail])
        row += n
    src_a = np.stack(src) if src else np.zeros((0, m), np.int64)
    return Compression(m, dst=_i64(np.asarray(dst, np.int64).reshape(-1)),
                       pos=_i64(np.asarray(pos, np.int64).reshape(-1)), src=_i64(src_a),
                       kv_dst=_i64(np.concatenate(kv_dst)),
                       keep_src=_i64(np.concatenate(keep_src) if keep_src else []),
                       keep_dst=_i64(np.concatenate(keep_dst) if keep_dst else [])), scratch
