"""The harness's Backend (runner.py) on the real serving engine, `dsv41.Engine`.

Each `run` call builds what the state needs and nothing else:
  cold          Engine(model, cache=None): every turn is a full prefill.
  warm          a fresh PrefixCache (GPU pool + SWA pool on a manual clock, no SSD tier);
                prompt[:H] of every request is generated once with replay off and
                max_new_tokens=1, which writes its blocks and its SWA snapshot at H.
  warm_expired  the same, then the clock jumps past the SWA TTL: the snapshots expire (a
                global hit with an SWA miss, counted by the SWA pool as expiries).
Then one Engine(model, cache, replay=<switch>, max_batch=min(max_batch, len(requests)))
runs every request's turns, all requests submitted together (concurrency; above
max_batch they queue: saturation), with return_logits. Prompts run in chunks of the
engine's step budget, which gives the one-shot prefill's values (docs/paged.md).

Switches: off = ReplayConfig("off") (recompute), bounded = encoder replay of the last W
cached tokens, exact = the oracle (replays far enough back to equal full prefill),
decoder = bounded encoder replay + decoder replay.
"""
from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import torch

from .runner import BackendRequest, RunError, Turn

__all__ = ["EngineBackend", "REPLAY_SWITCHES", "weights_sha256", "git_commit"]


def _switch(name: str):
    from ..replay import ReplayConfig

    table = {"off": ReplayConfig.parse("off"), "bounded": ReplayConfig.parse("bounded"),
             "exact": ReplayConfig.parse("exact"), "decoder": ReplayConfig(decoder_replay=True)}
    if name not in table:
        raise ValueError(f"unknown replay switch {name!r}; one of {list(table)}")
    return table[name]


REPLAY_SWITCHES = ("off", "bounded", "exact", "decoder")


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def weights_sha256(model) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes), sorted by name."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def git_commit(path: str | Path | None = None) -> dict:
    """The commit of the dsv41 source tree this process imports (None outside a checkout)."""
    where = Path(path) if path else Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip() != "" if sha else None
    except (OSError, subprocess.SubprocessError):
        sha, dirty = None, None
    return {"commit": sha, "dirty": dirty}


class EngineBackend:
    def __init__(self, model, *, block_tokens: int = 4, max_batch: int = 8, write_approximate: bool = True,
                 swa_ttl_s: float = 60.0,
                 gpu_capacity_bytes: int = 1 << 28, swa_capacity_bytes: int = 1 << 28,
                 model_source: dict | None = None):
        try:
            from ..engine import Engine  # noqa: F401  (fail here, clearly, without the engine)
        except ImportError as e:
            raise RunError(f"the harness runs requests through dsv41.Engine, which this build "
                           f"does not have ({e})") from None

        self.model = model
        cfg = model.config
        self.window = cfg.sliding_window
        self.vocab_size = cfg.vocab_size
        self.block_tokens = block_tokens
        self.max_batch = max_batch
        self.write_approximate = write_approximate
        self.swa_ttl_s = swa_ttl_s
        self.gpu_capacity_bytes = gpu_capacity_bytes
        self.swa_capacity_bytes = swa_capacity_bytes
        self.model_source = model_source or {}
        self._weights = None

    def describe(self) -> dict:
        import dsv41
        from .._build import build_info

        if self._weights is None:
            self._weights = weights_sha256(self.model)
        info = build_info()
        return {"engine": "dsv41.Engine", "dsv41_version": dsv41.__version__,
                "model": self.model_source, "config_name": self.model.config.name,
                "config": self.model.config.to_dict(), "config_fingerprint": self.model.config.fingerprint(),
                "kv_fingerprint": self.model.kv_fingerprint(), "weights_sha256": self._weights,
                "device": str(self.model.device),
                "device_name": (torch.cuda.get_device_name(self.model.device)
                                if self.model.device.type == "cuda" else "cpu"),
                "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                "build": {k: info.get(k) for k in ("cuda_compiled", "cuda_arch_list", "torch_version")
                          if k in info},
                "git": git_commit(), "block_tokens": self.block_tokens, "max_batch": self.max_batch,
                "write_approximate": self.write_approximate, "swa_ttl_s": self.swa_ttl_s}

    def _cache(self):
        from ..cache import CacheConfig, PrefixCache

        clock = _Clock()
        cc = CacheConfig(block_tokens=self.block_tokens, device=str(self.model.device),
                         gpu_capacity_bytes=self.gpu_capacity_bytes,
                         swa_capacity_bytes=self.swa_capacity_bytes, swa_ttl_s=self.swa_ttl_s,
                         store_dir=None)
        return PrefixCache.for_model(self.model, cc, clock=clock), clock

    def run(self, requests: list[BackendRequest], state: str, replay: str, sampling: dict) -> list[list[Turn]]:
        from ..engine import Engine, SamplingParams

        rc = _switch(replay)
        cache = None
        if state != "cold":
            if state not in ("warm", "warm_expired"):
                raise ValueError(f"unknown backend state {state!r}")
            cache, clock = self._cache()
            warm = Engine(self.model, cache=cache, replay="off", max_batch=max(1, len(requests)))
            prefixes = [r.turns[0][:r.cached_tokens] for r in requests]
            if any(len(p) < self.block_tokens for p in prefixes):
                raise ValueError("a warm state needs at least one cached block per request")
            warm.generate(prefixes, SamplingParams(max_new_tokens=1))
            if state == "warm_expired":
                clock.t += 2 * self.swa_ttl_s + 1.0
        eng = Engine(self.model, cache=cache, replay=rc, max_batch=min(self.max_batch, max(1, len(requests))),
                     write_approximate=self.write_approximate)
        params = [SamplingParams(temperature=float(sampling["temperature"]), top_p=float(sampling["top_p"]),
                                 seed=r.seed, max_new_tokens=int(sampling["max_new_tokens"]),
                                 stop_token_ids=tuple(sampling.get("stop_token_ids", ())), return_logits=True)
                  for r in requests]
        n_turns = len(requests[0].turns)
        if any(len(r.turns) != n_turns for r in requests):
            raise ValueError("every request of a group needs the same number of turns")
        results: list[list[Turn]] = [[] for _ in requests]
        for t in range(n_turns):
            outs = eng.generate([r.turns[t] for r in requests], params)
            for i, o in enumerate(outs):
                results[i].append(Turn(output_tokens=list(o.output_tokens), logits=list(o.logits),
                                       stats=o.stats.to_dict()))
        return results
