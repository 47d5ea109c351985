"""`system_fingerprint`: which weights and which build produced a response.

    fp = SystemFingerprint.of(model, precision="reference", device="cpu")
    fp.value        # "fp_<12 hex: weights>_<12 hex: build>", in every response
    fp.parts        # what went into it, for the start-up log and /metrics

OpenAI's field says when "backend changes have been made that might impact determinism";
a seeded request gives the same output for as long as its fingerprint stays the same. Here
it has two halves, so an operator can tell which changed:

- weights: `model.weights_id` (the checkpoint's content digest, or config + seed for
  synthetic weights) and the model's KV fingerprint (config and every option that changes
  stored bytes);
- build: the dsv41 version, a SHA-256 of the compiled extension's file, the torch version,
  and the execution path (precision, device type).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SystemFingerprint"]


def _short(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def _file_digest(path: str | None) -> str | None:
    if not path or not Path(path).is_file():
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class SystemFingerprint:
    value: str
    parts: dict

    @classmethod
    def of(cls, model, *, precision: str, device: str) -> "SystemFingerprint":
        import torch

        from .. import build_info

        info = build_info()
        weights = {"weights_id": model.weights_id, "kv": model.kv_fingerprint()}
        build = {"version": info["version"], "extension_sha256": _file_digest(info.get("extension")),
                 "torch": torch.__version__, "precision": precision, "device": torch.device(device).type}
        value = f"fp_{_short(weights)}_{_short(build)}"
        return cls(value, {"weights": weights, "build": build})
