"""What one forward call carries through the layers: the sequences (segments) it extends,
their positions, and the writes it stages before committing them to the states.

A batch is a list of segments, one per sequence, whose tokens are concatenated along the
token axis for the per-token layers (projections, norms, MoE); attention and the indexer
run per segment against that segment's state.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from .state import SequenceState

__all__ = ["ForwardContext", "Segment", "swa_index"]


def swa_index(start: int, count: int, window: int, swa_start: int = 0,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """SWA slots seen by the queries at positions start .. start+count-1.

    The buffer the op reads is [ring (window slots, position p in slot p % window);
    the new tokens' SWA KV (slot window + p - start)]. Query i sees positions
    [max(swa_start, i - window + 1), i] (docs/design.md#replay; swa_start = 0 for a plain
    prefill), listed oldest first in slot j = p - (i - window + 1); others are -1.
    Returns int32 [count, window]; for a few queries on the CPU (a decode step) one tensor shared
    between calls with the same arguments (every layer of a forward asks for the same one):
    read it, never write it.
    """
    args = (int(start), int(count), int(window), int(swa_start), torch.device(device))
    shared = count <= 16 and args[-1].type == "cpu"
    return _swa_index_shared(*args) if shared else _swa_index(*args)


def _swa_index(start: int, count: int, window: int, swa_start: int,
               device: torch.device) -> torch.Tensor:
    i = torch.arange(start, start + count, device=device)[:, None]
    p = i - window + 1 + torch.arange(window, device=device)[None, :]
    ok = (p >= max(swa_start, 0)) & (p <= i)
    slot = torch.where(p >= start, window + p - start, p % window)
    return torch.where(ok, slot, -1).to(torch.int32)


_swa_index_shared = functools.lru_cache(maxsize=32)(_swa_index)


@dataclass
class Segment:
    """One sequence inside a forward call."""

    state: SequenceState
    tokens: torch.Tensor          # int64 [T]
    offset: int                   # first row of this segment in the batch
    swa_start: int = 0
    # Replay (docs/replay.md): global KV of positions < cached_until is already in the
    # state and is read as cached (the compressor skips those tokens). None: nothing past
    # the state's position is cached.
    cached_until: int | None = None
    # A decoder segment of decoder replay covers the call's tokens from `base` on: it
    # starts at state.position + base and commits only its SWA rings.
    base: int = 0
    # Staged writes, committed after the last layer.
    swa_new: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Compressor state keyed like SequenceState.comp_state (int: pending, str: extra).
    pending_new: dict[int | str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Per-call selections shared between layers: index source -> [T, K] entry ids; the
    # candidate positions of the candidate source layer.
    topk: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: torch.Tensor | None = None

    @property
    def start(self) -> int:
        return self.state.position + self.base

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.length)

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.start, self.start + self.length, device=self.tokens.device)

    def commit(self, advance: bool = True) -> None:
        """Apply the staged writes: global entries, SWA rings, compressor state, tokens
        (advance=False: the SWA rings only, for a decoder-replay segment)."""
        st = self.state
        W = st.config.sliding_window
        for store in (*st.main_kv.values(), *st.index_keys.values()):
            store.commit()
        keep = min(self.length, W)
        slots = torch.arange(self.start + self.length - keep, self.start + self.length,
                             device=self.tokens.device) % W
        for layer, (values, scales) in self.swa_new.items():
            st.swa_values[layer][slots] = values[-keep:]
            st.swa_scales[layer][slots] = scales[-keep:]
        if not advance:
            return
        for key, value in self.pending_new.items():
            (st.pending if isinstance(key, int) else st.extra)[key] = value
        st.tokens.extend(int(t) for t in self.tokens.tolist())
        st.position += self.length


@dataclass
class ForwardContext:
    segments: list[Segment]
    positions: torch.Tensor       # int64 [total tokens]
    dense: bool = False           # the dense baseline: every visible global entry, no top-k
    trace: dict | None = None     # per-layer records for tests and tools (one segment only)

    @classmethod
    def build(cls, segments: list[Segment], *, dense: bool = False,
              trace: dict | None = None) -> ForwardContext:
        positions = torch.cat([s.positions for s in segments])
        return cls(segments, positions, dense, trace)

    def record(self, layer: int, **values) -> None:
        if self.trace is not None:
            self.trace.setdefault(layer, {}).update(values)
