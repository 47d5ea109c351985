"""`dsv41 serve` as an operator stops it: SIGTERM while streams run, SIGINT when idle. Both
drain, close the cache (committing its queued SSD writes) and exit 0; after a restart every
block of every acknowledged request is in the store.

The server runs as a subprocess (`python -m dsv41 serve`) on a free port of 127.0.0.1,
bounded in time and killed by PID if it overstays."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

BLOCK = 16
DRAIN_S = 3.0
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    def __init__(self, tmp: Path, *args: str):
        self.port = _free_port()
        self.root = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(ROOT / "python"), "OMP_NUM_THREADS": "1"}
        self.log = open(tmp / f"serve-{self.port}.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dsv41", "serve", "--preset", "v41-tiny", "--device", "cpu", "--port",
             str(self.port), "--block-tokens", str(BLOCK), "--gpu-cache-mb", "16", "--swa-cache-mb", "64",
             "--drain-seconds", str(DRAIN_S), *args], env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(self.root + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the server did not start:\n{self.output()}")
            time.sleep(0.2)
        self.client = openai.OpenAI(base_url=self.root + "/v1", api_key="unused", max_retries=0, timeout=60)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def metric(self, name: str) -> float:
        for line in httpx.get(self.root + "/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self, sig: int, timeout: float) -> tuple[int, float]:
        """Sends sig; (exit code, seconds until it exited). Killed by PID past timeout."""
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the server outlived {timeout} s after signal {sig}:\n{self.output()}")
        return rc, time.monotonic() - t0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _prompt(i: int) -> str:
    # distinct from the first token on, so no two prompts share a block
    return f"{i} acknowledged request with its own context, block after block of it. " * 2


def test_sigterm_drains_then_every_acknowledged_block_survives_a_restart(tmp_path):
    store = str(tmp_path / "store")
    salt = {"cache_salt": "ops"}
    s = Serve(tmp_path, "--cache-dir", store)
    try:
        acked = []
        for i in range(4):
            r = s.client.completions.create(model="v41-tiny", prompt=_prompt(i), max_tokens=3, temperature=0,
                                            extra_body=salt)
            assert r.choices[0].finish_reason == "length"
            acked.append(_prompt(i))
        streamed = [f"{i} stream cut by the shutdown, " * 3 for i in range(4, 7)]
        streams = [s.client.completions.create(model="v41-tiny", prompt=p, max_tokens=3000, temperature=0,
                                               stream=True, extra_body=salt) for p in streamed]
        for st in streams:
            next(iter(st))                 # each stream is in the engine, decoding
        acked += streamed                  # their prompts' blocks were queued for the SSD just now
        rc, took = s.stop(signal.SIGTERM, DRAIN_S + 60)
        ends = []
        for st in streams:                 # what each stream got after its first chunk
            try:
                for _ in st:
                    pass
                ends.append("finished")
            except openai.APIError as e:
                ends.append(str(e))
        assert rc == 0, s.output()
        assert all("shutting down" in e for e in ends), ends
    finally:
        s.kill()

    # the restart, in this process (torch is loaded already): a fresh GPU tier, so every hit
    # below comes from the SSD
    from .conftest import LiveServer
    s = LiveServer(cache_dir=store)
    try:
        c = s.client()
        for prompt in acked:
            n = len(prompt.encode())                 # byte tokenizer: a token per byte
            before = s.metric('dsv41_engine_prompt_hit_tokens_total{tier="ssd"}')
            c.completions.create(model="v41-tiny", prompt=prompt + "and then?", max_tokens=1, temperature=0,
                                 extra_body=salt)
            assert s.metric('dsv41_engine_prompt_hit_tokens_total{tier="ssd"}') - before == n // BLOCK * BLOCK
    finally:
        s.stop()


def test_sigint_drains_and_dsv41_serve_returns_0(tmp_path):
    """`dsv41 serve` (its _run, in this process's main thread, where signals land): SIGINT
    with a stream in flight drains it, closes the cache and returns 0 (uvicorn alone
    re-raises the signal: a KeyboardInterrupt here)."""
    import gc
    import threading

    from dsv41.cli import build_parser
    from dsv41.server import cli as serve_cli

    port = _free_port()
    args = build_parser().parse_args(["serve", "--preset", "v41-tiny", "--device", "cpu", "--port", str(port),
                                      "--block-tokens", str(BLOCK), "--gpu-cache-mb", "16", "--swa-cache-mb", "64",
                                      "--cache-dir", str(tmp_path / "store"), "--drain-seconds", str(DRAIN_S)])
    seen: dict = {}

    def client():
        root = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(root + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        c = openai.OpenAI(base_url=root + "/v1", api_key="unused", max_retries=0, timeout=60)
        st = c.completions.create(model="v41-tiny", prompt="interrupted " * 4, max_tokens=3000, stream=True)
        next(iter(st))
        seen["t0"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)
        try:
            for _ in st:
                pass
        except openai.APIError as e:
            seen["end"] = str(e)

    t = threading.Thread(target=client, daemon=True)
    t.start()
    try:
        rc = serve_cli._run(args)
    finally:
        gc.unfreeze()
    t.join(30)
    assert rc == 0 and "shutting down" in seen.get("end", ""), seen
    assert time.monotonic() - seen["t0"] < DRAIN_S + 30
