"""Servers on 127.0.0.1 (free ports) for the server tests: `dsv41 serve`'s app on uvicorn in
a thread of this process (its engine is reachable for checks), stopped by its handle."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from dsv41.engine import Engine, SamplingParams
from dsv41.server import ServeOptions, Server

BLOCK = 16


class LiveServer:
    """`dsv41 serve`'s Server and HTTP stack (transport limits, drain) on a free port, its
    uvicorn in a thread of this process. Keyword options are ServeOptions fields."""

    def __init__(self, opts: ServeOptions | None = None, **options):
        options.setdefault("drain_s", 2.0)
        opts = opts or ServeOptions(preset="v41-tiny", device="cpu", block_tokens=BLOCK, gpu_cache_mb=16,
                                    swa_cache_mb=64, **options)
        self.server = Server(opts)
        self.api_key = opts.api_keys[0] if opts.api_keys else "unused"
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.root = f"http://127.0.0.1:{self.port}"
        self.base_url = self.root + "/v1"
        self.uv = self.server.http_server(log_level="error")
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uv.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)

    @property
    def engine(self) -> Engine:
        return self.server.engine

    @property
    def tokenizer(self):
        return self.server.tokenizer

    def on_engine(self, fn, timeout: float = 30.0):
        """fn(engine) run on the engine thread between steps."""
        return self.server.loop.call_sync(fn).result(timeout)

    def referenced_blocks(self) -> int:
        return self.on_engine(lambda e: e.cache.pool.stats()["referenced_blocks"])

    def wait_idle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.on_engine(lambda e: e.has_unfinished()):
            if time.monotonic() > deadline:
                raise TimeoutError("the engine did not go idle")
            time.sleep(0.05)

    def client(self, **kw):
        from openai import OpenAI
        kw.setdefault("api_key", self.api_key)
        return OpenAI(base_url=self.base_url, max_retries=0, timeout=60, **kw)

    def async_client(self, **kw):
        from openai import AsyncOpenAI
        kw.setdefault("api_key", self.api_key)
        return AsyncOpenAI(base_url=self.base_url, max_retries=0, timeout=60, **kw)

    def metric(self, name: str) -> float:
        """One sample of /metrics by its name with labels, e.g. 'x_total{reason="stop"}' (0
        when absent)."""
        import httpx
        for line in httpx.get(self.root + "/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def reference(self, ids: list[int], max_tokens: int) -> str:
        """Greedy text of `ids` on the same model without a cache, alone in a fresh engine.
        Call it while the server is idle."""
        out = Engine(self.engine.model).generate([ids], SamplingParams(max_new_tokens=max_tokens))[0]
        return self.tokenizer.decode(out.output_tokens)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.render_chat(messages), add_special_tokens=False)

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(15)
        self.server.close()
        self.sock.close()


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    """v41-tiny's ops are far too small to gain from intra-op threads, and on a loaded
    2-core machine every parallel region waits for a descheduled worker (measured: a 30x64
    by 64x64 matmul took ~25 ms with 2 threads, a 100-token prefill 7 s vs 0.3 s with 1)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="package")
def live():
    """The default server: bounded replay, as `dsv41 serve` runs. Shared by every test
    module (tests keep apart through their own prompts and tenants)."""
    s = LiveServer()
    yield s
    s.stop()


@pytest.fixture(scope="package")
def live_exact():
    """A server replaying exactly (the oracle mode): its cache hits never change outputs."""
    s = LiveServer(replay="exact")
    yield s
    s.stop()
