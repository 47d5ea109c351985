"""Shared constants and value checks of the config package (no dsv41 imports)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "DEFAULT_BETA_FAST",
    "DEFAULT_BETA_SLOW",
    "MAIN_KV_FORMATS",
    "SCORING_FUNCS",
    "ConfigError",
    "as_float",
    "as_int",
    "normalise_rope_scaling",
    "ratio_supported",
    "supported_ratios_text",
]


class ConfigError(ValueError):
    """An invalid or incomplete model configuration."""


MAIN_KV_FORMATS = ("nvfp4", "fp8_v4")
# Router scores (model/moe.py): V4's sqrtsoftplus, and the sigmoid and softmax that
# DeepSeek's reference and transformers also define.
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


def ratio_supported(fmt: str, ratio: int) -> bool:
    """Whether layers of a `fmt` model may compress by `ratio` (0: SWA-only). NVFP4 is
    V4.1's format, whose compressors are defined at ratios 1 and 2; fp8_v4 is
    DeepSeek-V4's, whose compressors (gated, with a position bias) pool blocks of any
    m >= 2 tokens (V4-Flash: CSA 4, HCA 128; transformers' `compress_rates` change them).
    A V4 compressor at m = 1 has a gate and position bias that dsv41's ratio-1 (V4.1)
    compressor does not, so fp8_v4 refuses it."""
    if fmt == "nvfp4":
        return ratio in (0, 1, 2)
    return ratio == 0 or ratio >= 2


def supported_ratios_text(fmt: str) -> str:
    return "0, 1, 2" if fmt == "nvfp4" else "0 and any ratio >= 2"

# Assumed YaRN betas when a config gives only factor and original length (the DeepSeek-V3
# defaults; the V4.1 release does not state them).
DEFAULT_BETA_FAST = 32.0
DEFAULT_BETA_SLOW = 1.0


def as_int(name: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ConfigError(f"{name}: expected an integer, got {value!r}")


def as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}: expected a number, got {value!r}")
    return float(value)


def normalise_rope_scaling(rs: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The canonical YaRN dict {factor, original_max_position_embeddings, beta_fast,
    beta_slow}, or None. Other keys (mscale, attention_factor, rope_theta, ...) are
    dropped: V4's compress RoPE does not scale cos/sin (transformers forces
    attention_factor=1.0 for it)."""
    if rs is None:
        return None
    if not isinstance(rs, Mapping):
        raise ConfigError(f"rope_scaling: expected a dict or None, got {rs!r}")
    kind = rs.get("type", rs.get("rope_type", "yarn"))
    if kind != "yarn":
        raise ConfigError(f"rope_scaling: only YaRN is supported, got type {kind!r}")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in rs:
            raise ConfigError(f"rope_scaling: missing required key {key!r}")
    out = {
        "factor": as_float("rope_scaling.factor", rs["factor"]),
        "original_max_position_embeddings": as_int(
            "rope_scaling.original_max_position_embeddings",
            rs["original_max_position_embeddings"]),
        "beta_fast": as_float("rope_scaling.beta_fast", rs.get("beta_fast", DEFAULT_BETA_FAST)),
        "beta_slow": as_float("rope_scaling.beta_slow", rs.get("beta_slow", DEFAULT_BETA_SLOW)),
    }
    if out["factor"] < 1 or out["original_max_position_embeddings"] <= 0:
        raise ConfigError(f"rope_scaling: factor must be >= 1 and the original length "
                          f"positive, got {out}")
    return out
