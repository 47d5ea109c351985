"""DevicePath: the device half of a read into device memory (RecordReader.read_into).

With a CUDA tensor and GPUDirect Storage the records go from the SSD straight into device
memory (cuFile); their data CRCs are computed there, and only each record's head (header,
token ids, key) comes back to the host for the rest of the check (the same C++ check as
the host path's). On the CPU the same steps run with pread and the host CRC, so the tests
run this path too.

What this path does not verify is not its to judge: RecordReader hands it to the host
path, whose verdict is final. When the host path serves what this path could not, this
path steps aside for the store (reason says why) and reads into device memory go through
host staging from then on.
"""
from __future__ import annotations

import logging
import os

import numpy as np
import torch

from .. import io as _io
from . import format as sf
from .fds import SegmentFds
from .index import SegmentFile
from .plan import RECORD_STATUS, plan_reads
from .state import StoreState

__all__ = ["DevicePath"]

log = logging.getLogger("dsv41.cache.store")


class DevicePath:
    def __init__(self, state: StoreState, fds: SegmentFds):
        self._state = state
        self._fds = fds
        self._gds_ok: bool | None = None  # the process has GPUDirect Storage (io_info, probe included)
        self.reason: str | None = None    # why this path stepped aside, or None while in use

    @property
    def gds_available(self) -> bool:
        """Whether reads into CUDA memory go SSD -> GPU: the process has GPUDirect Storage
        and this path has not stepped aside."""
        if self._gds_ok is None:
            self._gds_ok = bool(_io.io_info()["gds_available"])
        return self._gds_ok and self.reason is None

    def step_aside(self, reason: str) -> None:
        self.reason = reason
        log.warning("persistent store %s: the device read path steps aside, reads go through the host: %s",
                    self._state.path, reason)

    def read(self, recs: list, tokens: np.ndarray | None, key: bytes, dst: torch.Tensor,
             status: list[str]) -> tuple[str | None, set[int]]:
        """Reads `recs` into device staging, checks them and copies the verified payloads
        into their rows of dst; sets status[i] ("io" where a read failed: counted, for the
        host path to retry). Returns (why a device read failed, or None; the records whose
        device read or check failed)."""
        with self._fds.reading():
            return self._read(recs, tokens, key, dst, status)

    def _read(self, recs, tokens, key, dst, status):
        state = self._state
        P = state.identity.block_bytes
        with state.lock:
            groups, _ = plan_reads(state, self._fds, recs, status, links=True)
        staging = torch.empty(max(1, sum(g[2] for g in groups)), dtype=torch.uint8, device=dst.device)
        where, got, link, pos, why = {}, {}, {}, 0, None
        for seg, file_off, size, members, _, specs in groups:
            done, err = self._read_one(seg, staging, size, file_off, pos)
            why = why or err
            for i, (rel, span, *_, ph) in zip(members, specs):
                where[i] = pos + rel
                got[i] = span if done >= rel + span else max(0, done - rel)
                link[i] = ph
                if done < rel + span and (err or done < size):
                    status[i] = "io"  # failed or short: the host path decides
                    state.metrics.read_errors.inc(tier="ssd", kind="device")
                    why = why or f"a device read returned {done} of {size} bytes"
            pos += size
        failed = {i for i in range(len(recs)) if status[i] == "io" and i in where}
        live = [i for i in range(len(recs)) if status[i] == "ok"]
        if not live:
            return why, failed
        # The heads come back to the host first: their record_bytes say which range to
        # checksum. A head is header, token ids and key up to the payload: within any intact
        # record's span (a page-rounded head could run past a small packed record's end).
        head_bytes = sf.record_geometry(state.identity.block_tokens, len(key), P)[0]
        heads_dev = torch.stack([staging[where[i]: where[i] + head_bytes] if got[i] >= head_bytes
                                 else torch.zeros(head_bytes, dtype=torch.uint8, device=dst.device)
                                 for i in live])
        heads = heads_dev.cpu().numpy()
        hdr = heads[:, : sf.REC_HEADER_BYTES].copy().view(sf.REC_DTYPE).reshape(-1)
        ranges = []
        for k, i in enumerate(live):
            end = min(int(hdr["record_bytes"][k]), got[i])
            ranges.append((where[i] + sf.REC_HEADER_BYTES, max(0, end - sf.REC_HEADER_BYTES)))
        crcs = self._crcs(staging, ranges)
        specs = [(k * head_bytes, recs[i].span, recs[i].rid, recs[i].parent, recs[i].block_index, recs[i].hash,
                  i, crcs[k], got[i], link[i]) for k, i in enumerate(live)]
        codes = _io.check_heads(heads.reshape(-1), specs, tokens, key, P, head_bytes)
        for i, code in zip(live, codes):
            status[i] = RECORD_STATUS[code]
            if code and status[i] != "collision":
                failed.add(i)
        for k, i in enumerate(live):
            if status[i] == "ok":
                po = int(hdr["payload_offset"][k])
                dst[i].copy_(staging[where[i] + po: where[i] + po + P], non_blocking=True)
        return why, failed

    def _read_one(self, seg: SegmentFile, staging: torch.Tensor, size: int, file_off: int,
                  dev_off: int) -> tuple[int, str | None]:
        """(bytes read, why it failed or None) of one read into `staging`: cuFile on a CUDA
        device, the engine's pread elsewhere."""
        path = self._state.path / seg.name
        if staging.device.type == "cuda":
            try:
                f = self._fds.gds_file(seg)
            except (RuntimeError, OSError) as e:
                return 0, str(e)
            n = f.read(staging, size, file_off, dev_off)
            return (n, None) if n >= 0 else (0, f"cuFileRead of {path}: {_io.gds_error_string(n)}")
        with self._state.lock:
            try:
                fd = self._fds.fd(seg)
            except OSError as e:
                return 0, f"open {path}: {e.strerror or e}"
        [(done, err)] = self._state.engine.pread([(fd, file_off, size, staging.numpy(), dev_off)])
        return done, (f"pread of {path}: {os.strerror(err)}" if err else None)

    def _crcs(self, staging: torch.Tensor, ranges: list[tuple[int, int]]) -> list[int]:
        if not ranges:
            return []
        if staging.device.type == "cuda":
            off = torch.tensor([o for o, _ in ranges], dtype=torch.long, device=staging.device)
            ln = torch.tensor([n for _, n in ranges], dtype=torch.long, device=staging.device)
            return [c & 0xFFFFFFFF for c in _io.crc32c_device(staging, off, ln).cpu().tolist()]
        return self._state.engine.crc32c_many(staging.numpy(), ranges)
