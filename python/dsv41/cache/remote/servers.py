"""Local remote-tier servers on loopback for tests, the demo and benchmarks: a Mooncake
master, one Mooncake storage process (`mooncake_client`, which mounts the memory segment
values live in) and a redis-server, each on a random free port of 127.0.0.1, started and
stopped by PID. These are the real servers (nothing home-made); this only launches them.

    python -m dsv41.cache.remote.servers start --state /tmp/dsv41-remote.json
    python -m dsv41.cache.remote.servers stop --state /tmp/dsv41-remote.json

(scripts/remote-servers.sh wraps both and prints the `dsv41 demo` flags.)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

__all__ = ["LocalServers", "free_port", "find_binary"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_binary(name: str) -> str:
    """A binary next to this Python (the venv's bin, where the mooncake wheel puts its
    servers), else on PATH, else /usr/sbin, /usr/bin."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if Path(p).exists()), None)
    if found is None:
        raise FileNotFoundError(f"{name} not found (mooncake_*: pip install mooncake-transfer-engine-non-cuda; "
                                "redis-server: apt-get install redis-server)")
    return found


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (prctl PR_SET_PDEATHSIG)."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)


def _http(url: str, timeout: float = 1.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode(errors="replace")


class LocalServers:
    def __init__(self, workdir: str | os.PathLike, *, mooncake: bool = True, redis: bool = True,
                 segment_bytes: int = 64 << 20, redis_maxmemory: str = "256mb", die_with_parent: bool = True):
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.want_mooncake, self.want_redis = mooncake, redis
        self.segment_bytes = max(segment_bytes, 16 << 20)  # mooncake_client's minimum
        self.redis_maxmemory = redis_maxmemory
        # Tests: a crashed test process must not leave servers behind (Linux: the kernel
        # sends SIGTERM when the process that started them dies). The CLI turns this off.
        self.die_with_parent = die_with_parent and sys.platform.startswith("linux")
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        self.env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")

    # ---- URLs -------------------------------------------------------------------------

    @property
    def blocks_url(self) -> str:
        return f"mooncake://127.0.0.1:{self.ports['master_rpc']}"

    @property
    def snapshots_url(self) -> str:
        return f"redis://127.0.0.1:{self.ports['redis']}/0"

    def flags(self) -> str:
        out = []
        if self.want_mooncake:
            out.append(f"--remote-blocks {self.blocks_url}")
        if self.want_redis:
            out.append(f"--remote-snapshots {self.snapshots_url}")
        return " ".join(out)

    # ---- processes --------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.dir / f"{name}.log", "ab")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
                             start_new_session=True, preexec_fn=_die_with_parent if self.die_with_parent else None)
        log.close()
        self.procs[name] = p
        return p

    def _wait(self, what: str, ready, timeout_s: float, proc: subprocess.Popen) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode}; see {self.dir}")
            try:
                if ready():
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{what} not ready after {timeout_s:g} s; see {self.dir}")

    def start_master(self, timeout_s: float = 30.0) -> None:
        self.ports.setdefault("master_rpc", free_port())
        self.ports["master_http"] = free_port()
        p = self._spawn("mooncake_master", [
            find_binary("mooncake_master"), f"--rpc_port={self.ports['master_rpc']}", "--rpc_address=127.0.0.1",
            f"--metrics_port={self.ports['master_http']}"])
        # Its RPC port opens before it can serve: wait for /health to say so.
        self._wait("mooncake_master", lambda: '"service_ready":true' in _http(self._master_http("/health")),
                   timeout_s, p)

    def _master_http(self, path: str) -> str:
        return f"http://127.0.0.1:{self.ports['master_http']}{path}"

    def capacity_bytes(self) -> int:
        """The master's view of mounted segment memory (0 until a storage process mounts)."""
        for line in _http(self._master_http("/metrics")).splitlines():
            if line.startswith("master_total_capacity_bytes "):
                return int(float(line.split()[1]))
        return 0

    def start_storage(self, timeout_s: float = 30.0) -> None:
        self.ports["storage"] = free_port()
        mb = self.segment_bytes >> 20
        p = self._spawn("mooncake_storage", [
            find_binary("mooncake_client"), "--host=127.0.0.1", f"--port={self.ports['storage']}",
            f"--global_segment_size={mb}MB", f"--master_server_address=127.0.0.1:{self.ports['master_rpc']}",
            "--metadata_server=P2PHANDSHAKE", "--protocol=tcp"])
        self._wait("mooncake storage process", lambda: self.capacity_bytes() > 0, timeout_s, p)

    def start_redis(self, timeout_s: float = 20.0) -> None:
        self.ports.setdefault("redis", free_port())
        p = self._spawn("redis", [
            find_binary("redis-server"), "--port", str(self.ports["redis"]), "--bind", "127.0.0.1",
            "--protected-mode", "yes", "--save", "", "--appendonly", "no", "--dir", str(self.dir),
            "--maxmemory", self.redis_maxmemory, "--maxmemory-policy", "volatile-lru"])

        def ping() -> bool:
            with socket.create_connection(("127.0.0.1", self.ports["redis"]), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        self._wait("redis-server", ping, timeout_s, p)

    def start(self) -> "LocalServers":
        try:
            if self.want_mooncake:
                self.start_master()
                self.start_storage()
            if self.want_redis:
                self.start_redis()
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs.pop(name, None)
        if p is None or p.poll() is not None:
            return
        try:
            os.kill(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=10)

    def restart_redis(self) -> None:
        self.kill("redis")
        self.start_redis()

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.procs.items() if p.poll() is None}

    def stop(self) -> None:
        for name in ("mooncake_storage", "mooncake_master", "redis"):
            self.kill(name, signal.SIGTERM)

    def __enter__(self) -> "LocalServers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _stop_state(state: Path) -> None:
    info = json.loads(state.read_text())
    for name, pid in info["pids"].items():
        try:
            os.kill(pid, signal.SIGTERM)
            print(f"stopped {name} (pid {pid})")
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    for pid in info["pids"].values():
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    state.unlink()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv41.cache.remote.servers", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["start", "stop"])
    ap.add_argument("--state", default="/tmp/dsv41-remote-servers.json", help="where the PIDs and ports are kept")
    ap.add_argument("--dir", default=None, help="logs (default: next to the state file)")
    ap.add_argument("--segment-mb", type=int, default=256, help="Mooncake storage segment size")
    a = ap.parse_args(argv)
    state = Path(a.state)
    if a.action == "stop":
        if not state.exists():
            print(f"no state file {state}: nothing to stop", file=sys.stderr)
            return 1
        _stop_state(state)
        return 0
    if state.exists():
        print(f"{state} exists: servers are running (stop them first)", file=sys.stderr)
        return 1
    s = LocalServers(a.dir or state.with_suffix(".d"), segment_bytes=a.segment_mb << 20, die_with_parent=False).start()
    # The servers outlive this process (own sessions); stop them with `stop`.
    state.write_text(json.dumps({"pids": s.pids(), "ports": s.ports, "blocks": s.blocks_url,
                                 "snapshots": s.snapshots_url, "logs": str(s.dir)}, indent=1))
    print(f"mooncake master 127.0.0.1:{s.ports['master_rpc']} (pid {s.procs['mooncake_master'].pid}), storage "
          f"process (pid {s.procs['mooncake_storage'].pid}, {a.segment_mb} MiB), redis 127.0.0.1:{s.ports['redis']} "
          f"(pid {s.procs['redis'].pid}); logs in {s.dir}", file=sys.stderr)
    print(s.flags())
    return 0


if __name__ == "__main__":
    sys.exit(main())
