"""The model's SequenceState <-> the cache's payloads. It lives in the engine because it
knows both sides: dsv41.cache never imports the model, it moves flat block buffers and
opaque snapshots (TensorSnapshot).

    blocks = export_blocks(cache.layout, state, start_block, n_blocks)  # after a prefill
    cache.insert(tokens, blocks, match=m)
    cache.put_snapshot(tokens, snapshot_to_cache(state.snapshot_swa(aligned_to)))
    ...
    state = model.new_state()
    import_blocks(cache.layout, state, cache.read_blocks(m))            # global KV of the hit
    state.restore_swa(snapshot_from_cache(m.snapshot))                   # exact resume

`aligned_to` for a snapshot is the cache's block boundary at or before the position
(`snapshot_boundary`), so the snapshot carries exactly the global KV of the tail that no
block holds.
"""
from __future__ import annotations

import torch

from ..cache.layout import BlockLayout
from ..cache.swa_pool import TensorSnapshot
from ..model import SequenceState, SwaSnapshot

__all__ = ["SNAPSHOT_FORMAT", "export_blocks", "import_blocks", "snapshot_to_cache",
           "snapshot_from_cache", "snapshot_boundary"]

_KINDS = {"main": ("main_codes", "main_scales"), "index": ("index_codes", "index_scales")}
# The TensorSnapshot format of an SWA snapshot, written by both runtimes (paged_kv.py too).
SNAPSHOT_FORMAT = "dsv41.model.SwaSnapshot/1"


def export_blocks(layout: BlockLayout, state: SequenceState, start_block: int, n_blocks: int) -> torch.Tensor:
    """Blocks [start_block, start_block + n_blocks) of a state's global KV and indexer keys as
    uint8 [n_blocks, block_bytes] payloads (on the state's device)."""
    B = layout.block_tokens
    exported = state.export_global(start_block * B, (start_block + n_blocks) * B)
    sources = {}
    for kind, (codes_name, scales_name) in _KINDS.items():
        for layer, (codes, scales) in exported[kind].items():
            sources[(layer, codes_name)] = codes
            sources[(layer, scales_name)] = scales
    return layout.pack(sources, 0, n_blocks)


def import_blocks(layout: BlockLayout, state: SequenceState, blocks: torch.Tensor, start_block: int = 0) -> None:
    """Appends the global KV of cached blocks to a state that holds exactly blocks
    [0, start_block) (SequenceState.import_global checks it)."""
    blocks = layout.check_blocks(blocks, "blocks")
    n = blocks.shape[0]
    dest: dict = {}
    payload: dict = {"main": {}, "index": {}}
    for s in layout.arrays:
        dest[(s.layer, s.kind)] = torch.empty((n * s.entries, s.width), dtype=s.dtype, device=blocks.device)
    layout.unpack(blocks, dest)
    for kind, (codes_name, scales_name) in _KINDS.items():
        for layer in layout.layers:
            if (layer, codes_name) in dest:
                payload[kind][layer] = (dest[(layer, codes_name)], dest[(layer, scales_name)])
    state.import_global(start_block * layout.block_tokens, payload)


def snapshot_boundary(layout: BlockLayout, position: int) -> int:
    """The cache block boundary at or before `position`: where a snapshot's tail starts."""
    return position // layout.block_tokens * layout.block_tokens


def snapshot_to_cache(snap: SwaSnapshot) -> TensorSnapshot:
    """The model's SWA snapshot as the cache's opaque TensorSnapshot."""
    tensors = {"tokens": torch.tensor(snap.tokens, dtype=torch.int64)}
    for layer, t in snap.swa_values.items():
        tensors[f"swa_values.{layer}"] = t
        tensors[f"swa_scales.{layer}"] = snap.swa_scales[layer]
    for layer, (kv, score) in snap.pending.items():
        tensors[f"pending.{layer}.kv"] = kv
        tensors[f"pending.{layer}.score"] = score
    for key, (kv, score) in snap.extra.items():  # V4 compressor state (keys contain dots)
        tensors[f"extra:{key}:kv"] = kv
        tensors[f"extra:{key}:score"] = score
    for kind, layers in snap.tail.items():
        for layer, (codes, scales) in layers.items():
            tensors[f"tail.{kind}.{layer}.codes"] = codes
            tensors[f"tail.{kind}.{layer}.scales"] = scales
    meta = {"format": SNAPSHOT_FORMAT, "config_fingerprint": snap.config_fingerprint,
            "aligned_to": snap.aligned_to, "tail_kinds": sorted(snap.tail)}
    return TensorSnapshot(len(snap.tokens), tensors, meta)


def snapshot_from_cache(cs: TensorSnapshot, device: str | torch.device | None = None) -> SwaSnapshot:
    """The inverse of snapshot_to_cache (tensors moved to `device` when given)."""
    if cs.meta.get("format") != SNAPSHOT_FORMAT:
        raise ValueError(f"not a model snapshot (format {cs.meta.get('format')!r})")
    t = {k: (v if device is None else v.to(device)) for k, v in cs.tensors.items()}
    swa_values, swa_scales, pending, tail = {}, {}, {}, {k: {} for k in cs.meta["tail_kinds"]}
    extra = {}
    for name in t:
        if name.startswith("extra:"):
            key, what = name[len("extra:"):].rsplit(":", 1)
            if what == "kv":
                extra[key] = (t[name], t[f"extra:{key}:score"])
            continue
        parts = name.split(".")
        if parts[0] == "swa_values":
            layer = int(parts[1])
            swa_values[layer], swa_scales[layer] = t[name], t[f"swa_scales.{layer}"]
        elif parts[0] == "pending" and parts[2] == "kv":
            layer = int(parts[1])
            pending[layer] = (t[name], t[f"pending.{layer}.score"])
        elif parts[0] == "tail" and parts[3] == "codes":
            tail[parts[1]][int(parts[2])] = (t[name], t[f"tail.{parts[1]}.{parts[2]}.scales"])
    return SwaSnapshot(config_fingerprint=cs.meta["config_fingerprint"], tokens=t["tokens"].tolist(),
                         aligned_to=int(cs.meta["aligned_to"]), swa_values=dict(sorted(swa_values.items())),
                         swa_scales=dict(sorted(swa_scales.items())), pending=dict(sorted(pending.items())),
                         tail=tail, extra=extra)
