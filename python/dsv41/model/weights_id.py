"""The weights' identity: what the prefix cache keys a model's KV by, besides its config.

Two models with one config but different weights (two seeds, a base model and its
fine-tune) compute different KV for the same prompt, so the cache must never let one read
the other's blocks. Each model carries `weights_id` (str, or None when unknown):

    synthetic      "synthetic:<sha256 of config fingerprint and seed>"  (Model.synthetic)
    checkpoint     "sha256:<content digest of every tensor>"  recorded in weights_digest.json
    operator       any string given to Model.from_pretrained(dir, weights_id=...) or set
                   as model.weights_id (the operator vouches that equal ids mean equal weights)

The checkpoint digest covers each tensor's name, dtype, shape and bytes, in name order, so
it does not depend on how the tensors are split into shards. Hashing hundreds of GB takes
minutes, so it is computed once (`save_pretrained` writes the record; `dsv41 digest DIR`
does it for a checkpoint written elsewhere) and re-checked cheaply on every load: the
record keeps each shard's size, mtime and a hash of its safetensors header; when all of
them match, the record's digest is used without reading the weights.

A shard whose mtime changed is hashed again: a rewrite of the same size and header can
still change weights. A fresh `git clone`, `cp -r` or rsync without -t moves every mtime
but no weight, so the record must not be rewritten then (it may be a tracked file, or
read-only): when the recomputed digest equals the record's, the load is silent, the record
stays as it is, and a stamp in the user's cache remembers "these facts, this digest"
(`weights_stamp_path`: $DSV41_CACHE_DIR, else $XDG_CACHE_HOME/dsv41 or ~/.cache/dsv41,
then weights-stamps/<sha256 of the resolved directory>.json), so the next load of that
copy hashes nothing again. A stamp is only a cache: it is used only when its facts equal
the shards' current ones and its digest equals the record's, and one that is missing,
corrupt or unwritable costs one rehash. When the recomputed digest differs (the weights
really changed), the load warns and the record is rewritten when the directory allows.
A checkpoint without a record loads with weights_id None: the cache then keeps its memory
tiers and never touches the persistent store (it says so once, with the fix).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Iterable

from .safetensors_file import read_header

__all__ = ["DIGEST_NAME", "synthetic_weights_id", "compute_weights_digest", "record_weights_digest",
           "recorded_weights_digest", "check_weights_id", "weights_stamp_path"]

log = logging.getLogger("dsv41.model")

DIGEST_NAME = "weights_digest.json"
_RECORD_FORMAT = "dsv41.weights_digest/1"
_ALGORITHM = "sha256-tensors/1"  # name, dtype, shape, bytes of each tensor in name order
_CHUNK = 8 << 20
_STAMP_FORMAT = "dsv41.weights_stamp/1"
_MAX_STAMP = 64 << 20            # a stamp holds a few hundred bytes per shard

Progress = Callable[[int, int], None]   # (bytes hashed so far, bytes in all)


def check_weights_id(weights_id) -> str | None:
    if weights_id is None:
        return None
    if not isinstance(weights_id, str) or not weights_id.strip():
        raise TypeError(f"weights_id must be a non-empty str or None, got {weights_id!r}")
    return weights_id


def synthetic_weights_id(config_fingerprint: str, seed: int) -> str:
    """The identity of `init_synthetic(seed)` weights for a config: they are a pure function
    of both (model/synthetic.py)."""
    blob = json.dumps({"config": config_fingerprint, "seed": int(seed)}, sort_keys=True).encode()
    return "synthetic:" + hashlib.sha256(blob).hexdigest()


def _file_facts(directory: Path, files: Iterable[str]) -> dict[str, dict]:
    """What the cheap re-check compares: size, mtime and the header's hash of each shard."""
    out = {}
    for name in sorted(files):
        p = directory / name
        st = p.stat()
        out[name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                     "header_sha256": hashlib.sha256(read_header(p).raw).hexdigest()}
    return out


def compute_weights_digest(directory: str | Path, files: Iterable[str],
                           progress: Progress | None = None) -> str:
    """The content digest of the tensors in `files` (safetensors shards of `directory`)."""
    directory = Path(directory)
    tensors = []      # (name, file, dtype, shape, begin, end)
    for fname in sorted(set(files)):
        header = read_header(directory / fname)
        for name, info in header.tensors.items():
            tensors.append((name, fname, info["dtype"], info["shape"], *header.span(name)))
    tensors.sort()
    names = [t[0] for t in tensors]
    if len(set(names)) != len(names):
        raise ValueError(f"{directory}: a tensor name appears in more than one shard")
    total = sum(t[5] - t[4] for t in tensors)
    h = hashlib.sha256(_ALGORITHM.encode())
    done = 0
    handles: dict[str, object] = {}
    try:
        for name, fname, dtype, shape, begin, end in tensors:
            meta = json.dumps([name, dtype, shape]).encode()
            h.update(len(meta).to_bytes(8, "little") + meta + (end - begin).to_bytes(8, "little"))
            f = handles.get(fname) or handles.setdefault(fname, open(directory / fname, "rb"))
            f.seek(begin)
            left = end - begin
            while left:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    raise ValueError(f"{directory / fname}: truncated while reading tensor {name!r}")
                h.update(chunk)
                left -= len(chunk)
                done += len(chunk)
                if progress is not None:
                    progress(done, total)
    finally:
        for f in handles.values():
            f.close()
    return "sha256:" + h.hexdigest()


def _write_record(directory: Path, digest: str, facts: dict) -> None:
    record = {"format": _RECORD_FORMAT, "algorithm": _ALGORITHM, "weights_id": digest, "files": facts}
    tmp = directory / (DIGEST_NAME + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, directory / DIGEST_NAME)


def record_weights_digest(directory: str | Path, files: Iterable[str],
                          progress: Progress | None = None) -> str:
    """Computes the digest of the shards and records it in DIR/weights_digest.json."""
    directory = Path(directory)
    files = sorted(set(files))
    facts = _file_facts(directory, files)
    digest = compute_weights_digest(directory, files, progress)
    if _file_facts(directory, files) != facts:
        raise RuntimeError(f"{directory}: the shards changed while their digest was computed; run again")
    _write_record(directory, digest, facts)
    return digest


def _cache_root() -> Path:
    """dsv41's directory in the user's cache: $DSV41_CACHE_DIR, else $XDG_CACHE_HOME/dsv41
    (the XDG spec ignores a relative value), else ~/.cache/dsv41."""
    env = os.environ.get("DSV41_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "dsv41"
    return Path.home() / ".cache" / "dsv41"


def weights_stamp_path(directory: str | Path) -> Path:
    """Where the load of checkpoint `directory` keeps its stamp (see the module docstring)."""
    key = hashlib.sha256(os.fsencode(Path(directory).resolve())).hexdigest()
    return _cache_root() / "weights-stamps" / (key + ".json")


def _read_stamp(directory: Path) -> dict | None:
    """The stamp of `directory`, or None when it is absent, unreadable or not a stamp."""
    try:
        path = weights_stamp_path(directory)
        # O_NOFOLLOW: the stamp is our own regular file; a link there is not ours to trust
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with open(fd, "rb") as f:
            raw = f.read(_MAX_STAMP + 1)
        if len(raw) > _MAX_STAMP:
            return None
        stamp = json.loads(raw)
    except (OSError, ValueError, RuntimeError):   # RuntimeError: Path.home() without a home
        return None
    if not (isinstance(stamp, dict) and stamp.get("format") == _STAMP_FORMAT
            and stamp.get("algorithm") == _ALGORITHM
            and stamp.get("directory") == str(directory.resolve())
            and isinstance(stamp.get("weights_id"), str) and isinstance(stamp.get("files"), dict)):
        return None
    return stamp


def _write_stamp(directory: Path, digest: str, facts: dict) -> None:
    """Best effort: a cache that cannot be written costs the next load one rehash, nothing else."""
    try:
        path = weights_stamp_path(directory)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        stamp = {"format": _STAMP_FORMAT, "algorithm": _ALGORITHM, "directory": str(directory.resolve()),
                 "weights_id": digest, "files": facts}
        # a fresh temporary (O_EXCL, never an existing file or link) renamed over the stamp:
        # readers see the old stamp or the new one, and a link at the stamp's name is
        # replaced, not followed
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with open(fd, "w") as f:
                f.write(json.dumps(stamp, indent=1) + "\n")
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    except (OSError, RuntimeError) as e:
        log.debug("could not write the weights stamp of %s: %s", directory, e)


def recorded_weights_digest(directory: str | Path, files: Iterable[str]) -> str | None:
    """The checkpoint's recorded digest, re-checked cheaply against its shards. When a
    shard's size, mtime or header changed since, the digest is taken from this copy's stamp
    when that vouches for the current shards, else recomputed: equal to the record, it is
    stamped and the record left alone; different, it is re-recorded (when the directory is
    writable) with a warning. None when the checkpoint has no record."""
    directory = Path(directory)
    path = directory / DIGEST_NAME
    if not path.is_file():
        return None
    files = sorted(set(files))
    try:
        record = json.loads(path.read_text())
        ok = (record.get("format") == _RECORD_FORMAT and record.get("algorithm") == _ALGORITHM
              and isinstance(record.get("weights_id"), str))
    except (OSError, ValueError, AttributeError):
        ok = False
    facts = _file_facts(directory, files)
    if ok and record.get("files") == facts:
        return record["weights_id"]
    if ok:
        stamp = _read_stamp(directory)
        if stamp is not None and stamp["weights_id"] == record["weights_id"] and stamp["files"] == facts:
            return record["weights_id"]
    digest = compute_weights_digest(directory, files)
    if ok and digest == record["weights_id"]:
        # moved mtimes (a clone, a copy), same weights: remember it here, not in the record.
        # Only facts that held across the whole hash may vouch for it.
        if _file_facts(directory, files) == facts:
            _write_stamp(directory, digest, facts)
        return digest
    warnings.warn(f"{path} does not match the checkpoint's shards (they changed since it was "
                  f"recorded, or it is unreadable): recomputing the weights digest", stacklevel=3)
    try:
        _write_record(directory, digest, facts)
    except OSError as e:
        warnings.warn(f"could not rewrite {path} ({e}); the recomputed digest is used for this "
                      f"load only", stacklevel=3)
    return digest
