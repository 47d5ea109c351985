"""The replay planner: which cache path a prompt takes and which token ranges run where.

    cfg = ReplayConfig.parse("bounded")          # or "exact", "off", a ReplayConfig
    plan = plan_prompt(model_config, n_prompt, global_hit=H, snapshot_tokens=P,
                       replay=cfg, align=block_tokens)
    plan.path            # "cold" | "both_hit" | "encoder_replay" | "recompute"
    plan.start           # first position this prefill computes (the state's position)
    plan.swa_start       # no query's SWA window reaches before it
    plan.cached_until    # global KV of [0, cached_until) is imported and read as cached
    plan.decoder_start   # decoder layers run on [decoder_start, N) only

The rules (docs/replay.md, docs/design.md#replay), with W the sliding window, L the layers and
L_enc the encoder layers:
  - cold (no global hit): full prefill, start 0.
  - both hit (an SWA snapshot of a prefix P <= N - 1 whose blocks the global hit holds):
    restore it and prefill [P, N) - exactly what a live session would compute. A snapshot
    is preferred to replay whenever one exists (exact beats approximate).
  - global hit H, no snapshot, encoder replay on: bounded replay of [s, H) with
    s = max(0, H - W), then the suffix [H, N); the replayed tokens rebuild SWA state only.
    Exact mode (the oracle) replays from far enough back to equal full prefill:
    s = max(0, H - L (W - 1)) when every layer runs on the replayed tokens, or
    s = max(0, min(H, N - W) - L_enc (W - 1)) with decoder replay on (then only the encoder
    runs before N - W; docs/design.md#exact-replay names this encoder part L_enc (W - 1)).
  - global hit, no snapshot, encoder replay off (or a model with overlapping compressor
    windows, V4, whose carried window the cached KV lacks): recompute the whole prompt.
  - decoder replay on: decoder layers run on [max(start, N - W), N) only.
Cut points: H is a multiple of `align` (the cache block, itself a multiple of every compress
ratio) and at most N - 1, so the prompt's last token always runs (its logits); a hit that
is not aligned is cut down to the boundary below it. A hit shorter than the window (H < W)
replays [0, H): that equals full prefill of the prefix (only the global KV is read).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from . import profiling
from .config import ModelConfig

__all__ = ["ReplayConfig", "ReplayPlan", "plan_prompt", "PATHS"]

PATHS = ("cold", "both_hit", "encoder_replay", "recompute")


@dataclass(frozen=True)
class ReplayConfig:
    """The replay switches. mode "bounded" replays the last W cached tokens
    (docs/design.md#encoder-replay); "exact" replays far enough back to equal full prefill
    (the oracle, docs/design.md#exact-replay)."""

    encoder_replay: bool = True
    decoder_replay: bool = False
    mode: str = "bounded"

    def __post_init__(self):
        if self.mode not in ("bounded", "exact"):
            raise ValueError(f"replay mode must be 'bounded' or 'exact', got {self.mode!r}")

    @classmethod
    def parse(cls, value: "ReplayConfig | str | None") -> "ReplayConfig":
        """ReplayConfig, or "bounded" / "exact" / "off" (no encoder or decoder replay)."""
        if value is None:
            return cls()
        if isinstance(value, ReplayConfig):
            return value
        if value == "bounded":
            return cls()
        if value == "exact":
            return cls(mode="exact")
        if value == "off":
            return cls(encoder_replay=False, decoder_replay=False)
        raise ValueError(f"replay must be a ReplayConfig or one of 'bounded', 'exact', 'off'; "
                         f"got {value!r}")

    def with_(self, **changes) -> "ReplayConfig":
        return replace(self, **changes)


@dataclass(frozen=True)
class ReplayPlan:
    path: str
    prompt_tokens: int
    global_hit: int            # aligned global-KV hit (tokens) the cache offered
    snapshot_tokens: int       # the SWA snapshot used (both_hit), else 0
    import_tokens: int         # global KV imported into the state before the prefill
    start: int                 # first position this prefill computes
    swa_start: int
    cached_until: int | None
    decoder_start: int
    global_exact: bool         # the state's global KV equals a full prefill's
    swa_exact: bool            # ... and so do its SWA rings and compressor state

    @property
    def computed_tokens(self) -> int:
        """Tokens run through the encoder (replayed + new)."""
        return self.prompt_tokens - self.start

    @property
    def replayed_tokens(self) -> int:
        """Cached tokens run again to rebuild SWA state (their global KV is read)."""
        return (self.cached_until - self.start) if self.cached_until is not None else 0

    @property
    def decoder_tokens(self) -> int:
        return self.prompt_tokens - self.decoder_start

    @property
    def decoder_replay(self) -> bool:
        return self.decoder_start > self.start

    def to_dict(self) -> dict:
        return {"path": self.path, "prompt_tokens": self.prompt_tokens,
                "global_hit": self.global_hit, "snapshot_tokens": self.snapshot_tokens,
                "import_tokens": self.import_tokens, "start": self.start,
                "swa_start": self.swa_start, "cached_until": self.cached_until,
                "decoder_start": self.decoder_start, "replayed_tokens": self.replayed_tokens,
                "computed_tokens": self.computed_tokens, "decoder_tokens": self.decoder_tokens,
                "global_exact": self.global_exact, "swa_exact": self.swa_exact}


def align_hit(hit: int, n_prompt: int, align: int) -> int:
    """The usable global hit: a multiple of `align` and at most n_prompt - 1."""
    if align <= 0:
        raise ValueError(f"align must be positive, got {align}")
    return max(0, min(int(hit), n_prompt - 1)) // align * align


@profiling.traced("replay.plan", lambda config, n_prompt, **k: {
    "tokens": n_prompt, "global_hit": k.get("global_hit", 0), "snapshot_tokens": k.get("snapshot_tokens", 0)})
def plan_prompt(config: ModelConfig, n_prompt: int, *, global_hit: int = 0,
                snapshot_tokens: int = 0, replay: ReplayConfig | str | None = None,
                align: int | None = None) -> ReplayPlan:
    """Decide the path and token ranges of one prompt of n_prompt tokens (see the module
    docstring for the rules)."""
    cfg = ReplayConfig.parse(replay)
    if n_prompt < 1:
        raise ValueError("a prompt needs at least one token")
    ratios = [r for r in config.compress_ratios[:config.num_layers] if r > 0]
    ratio_lcm = math.lcm(*ratios) if ratios else 1
    align = align or ratio_lcm
    if align % ratio_lcm:
        raise ValueError(f"align={align} is not a multiple of every compress ratio ({ratio_lcm})")
    W, L, L_enc = config.sliding_window, config.num_layers, config.num_encoder_layers
    N = n_prompt
    H = align_hit(global_hit, N, align)
    P = int(snapshot_tokens)
    if P and not (0 < P <= N - 1 and P // align * align <= H):
        raise ValueError(f"snapshot of {P} tokens is not usable for a prompt of {N} with an "
                         f"aligned global hit of {H}")
    if P:
        path, start, swa_start, cached, imported = "both_hit", P, 0, None, P // align * align
        global_exact = True
    elif H and cfg.encoder_replay and not config.overlap_compress_ratios:
        # (V4's overlapping windows carry the previous block's projections, which the
        # cached global KV does not hold: such models recompute instead of replaying)
        if cfg.mode == "exact":
            if cfg.decoder_replay:
                start = max(0, min(H, N - W) - L_enc * (W - 1))
            else:
                start = max(0, H - L * (W - 1))
        else:
            start = max(0, H - W)
        path, swa_start, cached, imported = "encoder_replay", start, H, H
        global_exact = cfg.mode == "exact" or start == 0
    else:
        path = "recompute" if H else "cold"
        start, swa_start, cached, imported, global_exact = 0, 0, None, 0, True
    decoder_start = max(start, N - W) if cfg.decoder_replay else start
    swa_exact = global_exact and decoder_start == start
    return ReplayPlan(path=path, prompt_tokens=N, global_hit=H, snapshot_tokens=P,
                      import_tokens=imported, start=start, swa_start=swa_start,
                      cached_until=cached, decoder_start=decoder_start,
                      global_exact=global_exact, swa_exact=swa_exact)
