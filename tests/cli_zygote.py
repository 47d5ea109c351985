"""Runs `dsv41` command lines as forked children of one process that imported dsv41 once
(tests/test_cli_hostile.py): a fresh interpreter per case pays ~3-5 s of torch import on
a busy 2-core machine, a fork a few milliseconds. Each child is a whole `dsv41` process
from the command's point of view: its own process group, stdin /dev/null, stdout and stderr
to files, `main(argv)`, then what the interpreter's exit does that can hang (joining
threads that are not daemon threads, atexit hooks) before os._exit skips the teardown of
torch's modules (~2 s a process here); optionally unprivileged: run as root, the child
drops the capabilities that let root search and read any directory, so a directory of mode
000 stops it as it stops any user (files root owns stay readable to it as their owner). At most `jobs` children run at once; one that outlives its deadline
is killed with its process group and reported as timed out.

    python tests/cli_zygote.py < cases.json > results.json

cases.json: {"jobs": 2, "timeout_s": 20, "cwd": DIR, "cases": [{"argv": [...], "unprivileged": false}, ...]}
results.json: one object per case: rc (exit status, or -signal), stdout, stderr, seconds,
timed_out.
"""
from __future__ import annotations

import atexit
import importlib
import json
import os
import signal
import sys
import tempfile
import threading
import time


def _drop_dac_capabilities() -> None:
    """(root only) Clears CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (capset(2), Linux)."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    hdr, data = Header(0x20080522, 0), (Data * 2)()   # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(hdr), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    keep = ~((1 << 1) | (1 << 2))   # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
    data[0].effective &= keep
    data[0].permitted &= keep
    data[0].inheritable &= keep
    if libc.capset(ctypes.byref(hdr), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def _child(argv: list[str], out: str, err: str, unprivileged: bool) -> None:
    """In the forked child: never returns; exits with the status `dsv41 ARGV` would."""
    os.setpgid(0, 0)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    if unprivileged and os.geteuid() == 0:
        _drop_dac_capabilities()
    from dsv41.cli import main
    sys.argv = ["dsv41"] + argv
    try:
        code = main(argv)
    except SystemExit as e:   # argparse's errors, and commands that exit themselves
        code = e.code
    except BaseException:     # what the interpreter would print before exiting with 1
        import traceback
        traceback.print_exc()
        code = 1
    threading._shutdown()     # the interpreter's exit: joins non-daemon threads (and their atexit)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


def run(cases: list[dict], jobs: int, timeout_s: float) -> list[dict]:
    results: list[dict | None] = [None] * len(cases)
    running: dict[int, tuple[int, float, str, str]] = {}   # pid -> case index, start, out, err
    todo = list(range(len(cases)))[::-1]
    tmp = tempfile.mkdtemp(prefix="dsv41-cli-zygote-")
    while todo or running:
        while todo and len(running) < jobs:
            i = todo.pop()
            out, err = os.path.join(tmp, f"{i}.out"), os.path.join(tmp, f"{i}.err")
            for p in (out, err):
                open(p, "w").close()
                os.chmod(p, 0o666)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                try:
                    _child(cases[i]["argv"], out, err, bool(cases[i].get("unprivileged")))
                finally:
                    os._exit(70)   # only when _child itself failed before main
            running[pid] = (i, time.monotonic(), out, err)
        pid, status = os.waitpid(-1, os.WNOHANG)
        now = time.monotonic()
        if pid == 0:
            for p, (i, t0, _, _) in list(running.items()):
                if now - t0 > timeout_s:
                    try:
                        os.killpg(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    results[i] = {"timed_out": True}
            time.sleep(0.005)
            continue
        i, t0, out, err = running.pop(pid)
        res = results[i] or {"timed_out": False}
        res.update(rc=os.waitstatus_to_exitcode(status), seconds=now - t0,
                   stdout=open(out, errors="replace").read(), stderr=open(err, errors="replace").read())
        results[i] = res
        os.unlink(out)
        os.unlink(err)
    os.rmdir(tmp)
    return results


def main() -> int:
    req = json.load(sys.stdin)
    import dsv41.cli   # the imports every child would otherwise repeat
    dsv41.cli.build_parser()
    for name in req.get("preload", []):
        importlib.import_module(name)
    os.chdir(req.get("cwd", "."))
    results = run(req["cases"], req.get("jobs", 2), req.get("timeout_s", 20.0))
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
