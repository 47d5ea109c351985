"""`dsv41 cache ...`: look after a persistent store directory.

    dsv41 cache stats DIR [--json]          records, bytes, namespaces, identity, recovery
    dsv41 cache verify DIR [--repair]       read and check every record (progress on stderr);
                                            exit status 1 when corruption is found
    dsv41 cache gc DIR [--ttl-hours H] [--capacity SIZE [--force]]
                                            expire, evict LRU to the capacity, reclaim space;
                                            a capacity below one record needs --force

stats and verify open the store read-only (safe beside a running writer); verify --repair
and gc take the writer lock, so they refuse to run while a server has the store open.
None of them creates a store: DIR must already hold one.

Exit status (every subcommand): 0 clean; 1 corruption found (verify: corrupt records,
damaged segments, segments of another store, record ids claimed twice, names that are links,
FIFOs or directories); 2 the store could not be opened (missing, not a directory, locked by
a writer, read-only filesystem, another model's manifest, a directory on the way that cannot
be searched) or bad arguments. Errors are one line on stderr, never a traceback.
"""
from __future__ import annotations

import argparse
import errno
import functools
import json
import math
import os
import stat
import sys
import time

__all__ = ["add_cache_parser", "ProgressBar", "parse_size", "positive_hours"]


def parse_size(text: str) -> int:
    """'512M', '10G', '1.5T', or plain bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = units.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in units else t
    try:
        value = float(number) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 10G)") from None
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte: {text!r}")
    if mult == 1 and value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole number of bytes: {text!r} (e.g. 512M, 10G)")
    return int(value)


def positive_hours(text: str) -> float:
    """--ttl-hours: a finite number of hours above zero (0 or less would expire everything)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of hours: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 hours, got {text!r} (0 or less would "
                                         f"expire every record)")
    return value


class ProgressBar:
    """A one-line progress bar on a stream (stderr), redrawn at most 10 times a second."""

    def __init__(self, stream=None, width: int = 30, label: str = "verify"):
        self.stream = stream or sys.stderr
        self.width, self.label = width, label
        self.t0 = time.perf_counter()
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        frac = done / total if total else 1.0
        fill = int(frac * self.width)
        rate = done / max(now - self.t0, 1e-9) / 1e6
        self.stream.write(f"\r{self.label} [{'#' * fill}{'.' * (self.width - fill)}] {frac * 100:5.1f}% "
                          f"{done / 1e6:,.1f}/{total / 1e6:,.1f} MB {rate:,.0f} MB/s")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()


def _fail(msg: str) -> None:
    print(f"dsv41 cache: {msg}", file=sys.stderr)


def _open(path: str, mode: str, **kw):
    from .hashing import sha256
    from .store import PersistentStore

    problem = _not_a_directory(path)   # the tools never create a store (the writer mode would)
    if problem:
        _fail(f"{path} {problem}: no persistent store there")
        return None
    try:
        store = PersistentStore(path, None, mode=mode, **kw)
    except OSError as e:  # StoreError and the OS's own (permissions, read-only filesystem)
        _fail(f"cannot open {path}: {e.strerror or e}")
        return None
    if store.identity.hash_name == "sha256":
        store.hash_fn = sha256  # lets verify recompute every block hash
    return store


def _not_a_directory(path: str) -> str | None:
    """Why path is not a directory one can open, in words; None when it is one."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "is a link to nothing" if os.path.islink(path) else "does not exist"
    except NotADirectoryError:
        return "does not exist (a component of the path is a file)"
    except PermissionError:
        return "cannot be reached: permission denied (a directory on the way cannot be searched)"
    except OSError as e:
        return f"cannot be looked at: {e.strerror or errno.errorcode.get(e.errno, e)}"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    return None


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def _no_traceback(cmd):
    """Any error a subcommand meets becomes one line on stderr and exit status 2."""
    @functools.wraps(cmd)
    def run(args) -> int:
        try:
            return cmd(args)
        except OSError as e:
            _fail(f"{e.strerror or e}" + (f": {e.filename}" if e.filename and e.filename not in str(e.strerror) else ""))
        except Exception as e:  # noqa: BLE001 - the promise is: never a traceback
            _fail(f"{type(e).__name__}: {e}")
        return 2
    return run


def _problems(found: dict) -> list[str]:
    """What opening the store found wrong besides bad records (stats and verify print it)."""
    out = []
    if found.get("foreign_segments"):
        out.append(f"{found['foreign_segments']} segment(s) belong to another store (another model, or "
                   f"a rewritten manifest): ignored")
    if found.get("colliding_records"):
        out.append(f"{found['colliding_records']} record(s) share an id with a different record (two stores "
                   f"merged into one directory?): neither copy is used")
    for u in found.get("unusable_files", []):
        out.append(f"skipped {u}")
    return out


@_no_traceback
def _cmd_stats(args) -> int:
    store = _open(args.dir, "r")
    if store is None:
        return 2
    with store:
        st = store.stats()
    if args.json:
        print(json.dumps(st, indent=2, default=str))
        return 0
    ident = st["identity"]
    lines = [
        f"store             {st['path']}",
        f"model             {ident['model_fingerprint'][:16]}...  layout {ident['layout_fingerprint'][:16]}...",
        f"format            store v{ident['store_format_version']}, payload v{ident['payload_format_version']}, "
        f"{ident['block_tokens']} tokens/block, {ident['block_bytes']:,} B/block, hash {ident['hash_name']}",
        f"records           {st['records']:,} in {st['segments']} segments"
        + (f" ({st['damaged_segments']} damaged)" if st["damaged_segments"] else ""),
        f"bytes             live {_human(st['live_bytes'])}, on disk {_human(st['file_bytes'])}",
        f"recovery          {st['recovery_seconds'] * 1e3:.1f} ms: " +
        ", ".join(f"{k} {v}" for k, v in st["recovery"].items() if v),
    ]
    for ns, d in sorted(st["namespaces"].items()):
        lines.append(f"namespace {ns!r:<8} {d['records']:,} records, {_human(d['bytes'])}")
    found = dict(st["recovery"], unusable_files=st["unusable_files"])
    lines += [f"problem           {p}" for p in _problems(found)]
    print("\n".join(lines))
    return 0


@_no_traceback
def _cmd_verify(args) -> int:
    store = _open(args.dir, "w" if args.repair else "r")
    if store is None:
        return 2
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    with store:
        report = store.verify(progress=ProgressBar() if show else None, repair=args.repair)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"verified {report['records']:,} records ({_human(report['bytes'])}): {report['ok']:,} ok, "
              f"{report['corrupt']:,} corrupt" + (f" {report['failed']}" if report["failed"] else "")
              + ("; block hashes recomputed" if report["hash_checked"] else ""))
        for f in report["failed_records"][:20]:
            print(f"  record {f['record_id']} in {f['segment']} at {f['offset']}: {f['problem']}")
        if report["damaged_segments"]:
            print(f"  {report['damaged_segments']} segment(s) with a damaged header or footer (records recovered by scanning)")
        for p in _problems(report):
            print(f"  {p}")
        if report["corrupt"] and args.repair:
            print("  corrupt records removed")
    return 1 if (report["corrupt"] or report["damaged_segments"] or report["foreign_segments"]
                 or report["colliding_records"] or report["unusable_files"]) else 0


def _one_record_bytes(st: dict) -> int:
    """The bytes one record of this store spans on disk (its payload at least)."""
    per_record = -(-st["live_bytes"] // st["records"]) if st["records"] else 0
    return max(st["identity"]["block_bytes"], per_record)


@_no_traceback
def _cmd_gc(args) -> int:
    kw = {"ttl_s": None if args.ttl_hours is None else args.ttl_hours * 3600.0}
    if args.capacity is not None:
        kw["capacity_bytes"] = args.capacity
    if args.capacity is not None and not args.force:
        # Checked on a read-only open: a writable store with the capacity set evicts down to
        # it as soon as it commits, which closing it does.
        store = _open(args.dir, "r")
        if store is None:
            return 2
        with store:
            st = store.stats()
        one = _one_record_bytes(st)
        if args.capacity < one:
            _fail(f"--capacity {_human(args.capacity)} is less than one record ({_human(one)}): gc would "
                  f"delete every record; give --force if that is what you want")
            return 2
    store = _open(args.dir, "w", **kw)
    if store is None:
        return 2
    with store:
        report = store.gc()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"expired {report['expired']}, evicted {report['evicted']}, segments deleted "
              f"{report['segments_deleted']}, compacted {report['segments_compacted']}, corrupt dropped "
              f"{report['corrupt_dropped']}; {_human(report['bytes_before'])} -> {_human(report['bytes_after'])}")
    return 0


def add_cache_parser(sub) -> None:
    """Adds `cache stats|verify|gc` to the dsv41 command's subparsers."""
    cache = sub.add_parser("cache", help="inspect, verify and clean a persistent prefix store directory",
                           description="exit status: 0 clean, 1 corruption found, 2 could not open the "
                           "store or bad arguments")
    csub = cache.add_subparsers(dest="cache_command", required=True)

    st = csub.add_parser("stats", help="records, bytes, namespaces and identity of a store")
    st.add_argument("dir")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=_cmd_stats)

    ve = csub.add_parser("verify", help="read and check every record; exit status 1 on corruption")
    ve.add_argument("dir")
    ve.add_argument("--repair", action="store_true", help="remove corrupt records (takes the writer lock)")
    ve.add_argument("--json", action="store_true")
    prog = ve.add_mutually_exclusive_group()
    prog.add_argument("--progress", dest="progress", action="store_true", default=None,
                      help="show the progress bar even when stderr is not a terminal")
    prog.add_argument("--no-progress", dest="progress", action="store_false")
    ve.set_defaults(func=_cmd_verify)

    gc = csub.add_parser("gc", help="expire, evict to the capacity, reclaim space (takes the writer lock)")
    gc.add_argument("dir")
    gc.add_argument("--ttl-hours", type=positive_hours, default=72.0,
                    help="expire records unused this long (default 72; must be > 0)")
    gc.add_argument("--capacity", type=parse_size, default=None, help="byte cap, e.g. 500G")
    gc.add_argument("--force", action="store_true",
                    help="accept a capacity below one record (gc then deletes every record)")
    gc.add_argument("--json", action="store_true")
    gc.set_defaults(func=_cmd_gc)
