"""NVTX ranges, so an Nsight Systems timeline of dsv41 reads like the engine's own story.

Off by default, and then nearly free: a range is one check of a module global (no NVTX
call, no payload built), small next to the cheapest function it wraps
(bench/micro/test_profiling_overhead.py measures it; docs/profiling.md has the figures).
Switch it on with `DSV41_NVTX=1` in the environment (read when dsv41 is imported) or from
Python:

    from dsv41 import profiling
    profiling.enable()      # True when a tool (Nsight Systems) receives the ranges
    profiling.disable()

    with profiling.scope("engine.step", requests=3, tokens=512):   # counts -> the payload
        ...

    @profiling.traced("cache.lookup", lambda self, tokens, *a, **k: {"tokens": len(tokens)})
    def match(self, tokens, ...): ...

    @profiling.op("op.sparse_attention")     # custom-op launch; tokens = leading dim of arg 0
    def sparse_attention(q, ...): ...

Every range is pushed in the NVTX domain "dsv41", named `<layer>.<what>` (engine.*,
cache.*, replay.*, op.*) with the layer as its NVTX category, and carries its counts
(requests, tokens, blocks, ...) as a structured NVTX payload of int64 fields, which
Nsight Systems shows per range. Ranges are popped on every exit, exceptions included.
Enabled with no tool attached (a plain `python` run), nvtx hands out its no-op domain and
dsv41 stays off: `enable()` returns False. docs/profiling.md says how to capture a
profile. This module imports nothing from dsv41 (formats, ops, cache and engine use it).
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Callable

__all__ = ["ENV", "DOMAIN", "NULL", "enable", "disable", "enabled", "scope", "traced", "op"]

ENV = "DSV41_NVTX"
DOMAIN = "dsv41"

# ARGB colours per layer (ints, so nvtx needs no matplotlib).
_COLORS = {"engine": 0xFF4C72B0, "cache": 0xFF55A868, "replay": 0xFF8172B2,
           "op": 0xFFDD8452, "model": 0xFFC44E52}

_domain = None            # the nvtx Domain while ranges are emitted, else None


class _Null:
    """What scope() returns while profiling is off."""
    __slots__ = ()

    def __enter__(self):
        return None

    def __exit__(self, *exc) -> bool:
        return False


NULL = _Null()   # the scope while off: entering and leaving it does nothing


def enable(on: bool = True) -> bool:
    """Emit ranges from now on (on=False: stop). Returns whether they are emitted, i.e. a
    tool such as Nsight Systems is attached to NVTX; without one it stays off (free)."""
    global _domain
    if not on:
        _domain = None
        return False
    try:
        import nvtx
    except ImportError as e:
        raise RuntimeError("dsv41 profiling needs the nvtx package: pip install nvtx") from e
    d = nvtx.get_domain(DOMAIN)      # a no-op stand-in unless a tool is attached
    _domain = d if isinstance(d, nvtx.Domain) else None
    return _domain is not None


def disable() -> None:
    enable(False)


def enabled() -> bool:
    """Whether ranges are being emitted now."""
    return _domain is not None


@functools.lru_cache(maxsize=None)
def _dtype(fields: tuple[str, ...]):
    import numpy as np
    return np.dtype([(f, np.int64) for f in fields])


def _attributes(d, name: str, counts: dict | None):
    payload = None
    if counts:
        import numpy as np
        payload = np.array(tuple(int(v) for v in counts.values()), dtype=_dtype(tuple(counts)))
    layer = name.partition(".")[0]
    return d.get_event_attributes(message=name, color=_COLORS.get(layer, 0xFF8C8C8C),
                                  category=layer, payload=payload)


class _Range:
    __slots__ = ("_d", "_attrs")

    def __init__(self, d, name: str, counts: dict | None):
        self._d = d                   # pops in the domain it pushed in, whatever enable() does
        self._attrs = _attributes(d, name, counts)

    def __enter__(self):
        self._d.push_range(self._attrs)
        return self

    def __exit__(self, *exc) -> bool:
        self._d.pop_range()
        return False


def scope(name: str, **counts: int):
    """A context manager: one NVTX range `name` with `counts` as its payload."""
    d = _domain
    if d is None:
        return NULL
    return _Range(d, name, counts)


def _counts(fn: Callable | None, args, kwargs) -> dict | None:
    """The payload of a traced call. A failing count (bad arguments) gives no payload: the
    call itself then raises its own, clearer error inside the range."""
    if fn is None:
        return None
    try:
        return fn(*args, **kwargs)
    except Exception:
        return None


def traced(name: str, counts: Callable[..., dict] | None = None):
    """Decorator: every call runs inside range `name`; counts(*args, **kwargs) -> payload."""
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            d = _domain
            if d is None:
                return fn(*args, **kwargs)
            with _Range(d, name, _counts(counts, args, kwargs)):
                return fn(*args, **kwargs)
        return wrapper
    return deco


def _leading_dim(x: Any = None, *args, **kwargs) -> dict:
    return {"tokens": int(x.shape[0]) if getattr(x, "ndim", 0) else 1}


def op(name: str, counts: Callable[..., dict] = _leading_dim):
    """traced() for a custom-op launch; by default tokens = the first argument's leading
    dimension (the token axis of every activation the model passes)."""
    return traced(name, counts)


def _from_env() -> None:
    if os.environ.get(ENV, "").strip() not in ("", "0"):
        try:
            enable()
        except RuntimeError as e:
            warnings.warn(f"{ENV} is set but profiling stays off: {e}", RuntimeWarning, stacklevel=2)


_from_env()
