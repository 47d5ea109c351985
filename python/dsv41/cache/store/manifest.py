"""The store's identity (MANIFEST.json) and its one writer (flock on LOCK).

The manifest says which model, layout and formats wrote the store; a process whose
identity differs either gets StoreMismatchError or (on_mismatch="empty") an empty,
read-only tier. Checking it takes no lock and writes nothing, so a mismatching process
never disturbs the store's rightful writer.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import socket
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..errors import StoreError, StoreLockedError, StoreMismatchError
from . import files as _files
from . import format as sf

__all__ = ["StoreIdentity", "read_manifest", "write_manifest", "WriterLock"]

_MAX_MANIFEST_BYTES = 1 << 20


@dataclass(frozen=True)
class StoreIdentity:
    """What must match between a store directory and the process that opens it."""

    model_fingerprint: str
    layout_fingerprint: str
    block_tokens: int
    block_bytes: int
    payload_format_version: int
    hash_name: str
    digest_bytes: int
    store_format_version: int = sf.STORE_FORMAT_VERSION

    @property
    def store_id(self) -> bytes:
        canon = json.dumps(self.__dict__, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(canon).digest()


def read_manifest(path: Path, identity: StoreIdentity | None, on_mismatch: str,
                  warn: bool = True) -> tuple[StoreIdentity | None, str | None]:
    """(identity, mismatch) of the store at `path`: the manifest's identity, or `identity`
    with the reason when they differ and on_mismatch is "empty" (warned once when `warn`).
    (None, None) when there is no manifest yet. Raises StoreError for a damaged manifest
    and StoreMismatchError for a mismatch with on_mismatch "error"."""
    mpath = path / sf.MANIFEST_NAME
    try:
        fd = _files.open_regular(mpath, os.O_RDONLY)
    except FileNotFoundError:
        return None, None
    try:
        with os.fdopen(fd, "rb") as f:
            text = f.read(_MAX_MANIFEST_BYTES)
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise ValueError("not a JSON object")
        if fields.get("checksum") != sf.manifest_checksum(fields):
            raise ValueError("checksum mismatch")
        found = StoreIdentity(**{k: fields[k] for k in StoreIdentity.__dataclass_fields__})
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise StoreError(errno.EINVAL, f"{mpath} is damaged or not a dsv41 manifest ({e})") from None
    if found.store_format_version != sf.STORE_FORMAT_VERSION:
        problem = (f"store format version {found.store_format_version}, this dsv41 reads "
                   f"version {sf.STORE_FORMAT_VERSION}")
    elif identity is not None and identity != found:
        diffs = [f"{k}: store has {getattr(found, k)!r}, this process {getattr(identity, k)!r}"
                 for k in StoreIdentity.__dataclass_fields__ if getattr(found, k) != getattr(identity, k)]
        problem = "; ".join(diffs)
    else:
        return found, None
    msg = (f"persistent store {path} belongs to another model, layout or format ({problem}). "
           f"Point the cache at another directory, or open it as an empty tier "
           f"(on_mismatch='empty'); its entries are never mixed with this model's")
    if on_mismatch == "error":
        raise StoreMismatchError(errno.EINVAL, msg)
    if warn:
        warnings.warn(msg + " -- opened as an empty, read-only tier", stacklevel=4)
    return (identity if identity is not None else found), problem


def write_manifest(path: Path, identity: StoreIdentity) -> None:
    fields = dict(identity.__dict__)
    fields.update(magic="dsv41-persistent-prefix-store",
                  created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    fields["checksum"] = sf.manifest_checksum(fields)
    tmp = path / (sf.MANIFEST_NAME + ".tmp")
    with os.fdopen(_files.create_exclusive(tmp), "w") as f:
        json.dump(fields, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / sf.MANIFEST_NAME)
    _files.fsync_dir(path)


class WriterLock:
    """flock on LOCK, holding the writer's pid (named in the error a second writer gets)."""

    def __init__(self, path: Path):
        lock_path = path / sf.LOCK_NAME
        try:
            fd = _files.open_regular(lock_path, os.O_RDWR | os.O_CREAT)
        except _files.NotRegularFileError:
            raise
        except OSError as e:
            raise StoreError(e.errno, f"cannot open the persistent store {path} for writing "
                             f"({e.strerror}): a read-only filesystem or directory needs mode='r'",
                             str(lock_path)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                owner = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise StoreLockedError(
                errno.EBUSY, f"persistent store {path} is already open for writing by "
                f"{owner}; one writer per directory: open it read-only (mode='r') or stop that process",
                str(lock_path)) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is not None:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            finally:
                os.close(self.fd)
                self.fd = None
