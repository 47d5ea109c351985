"""/metrics as an operator reads it beside vLLM's: gauges that return to 0, finish reasons
as they happened, queue / prefill / decode histograms, the KV pools as
Engine.memory_stats() reports them, preemptions, process metrics, and the
system_fingerprint every response carries."""
from __future__ import annotations

import os
import resource
import subprocess
import time

import httpx

from dsv41.config import ModelConfig
from dsv41.model import Model
from dsv41.server.fingerprint import SystemFingerprint


def _samples(live, prefix: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(live.root + "/metrics").text.splitlines():
        if line.startswith(prefix) and not line.startswith("#"):
            name, v = line.rsplit(" ", 1)
            out[name] = float(v)
    return out


def test_gauges_return_to_0_after_the_last_request_is_aborted(live):
    c = live.client()
    stream = c.completions.create(model="v41-tiny", prompt="aborted by its client", max_tokens=3000,
                                  temperature=0, stream=True)
    next(iter(stream))
    assert live.metric("dsv41_engine_running_requests") == 1
    stream.close()
    live.wait_idle()
    deadline = time.monotonic() + 10
    while live.metric("dsv41_engine_running_requests") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live.metric("dsv41_engine_running_requests") == 0
    assert live.metric("dsv41_engine_waiting_requests") == 0
    assert live.metric("dsv41_server_pending_requests") == 0


def test_a_stop_string_counts_as_stop(live):
    c = live.client()
    prompt = "Finish reasons as they happened"
    full = c.completions.create(model="v41-tiny", prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    stop = full[4:6]
    live.wait_idle()
    before = {r: live.metric(f'dsv41_engine_requests_finished_total{{reason="{r}"}}') for r in ("stop", "abort")}
    r = c.completions.create(model="v41-tiny", prompt=prompt, max_tokens=12, temperature=0, stop=stop)
    assert r.choices[0].finish_reason == "stop"
    live.wait_idle()
    after = {r: live.metric(f'dsv41_engine_requests_finished_total{{reason="{r}"}}') for r in ("stop", "abort")}
    assert (after["stop"] - before["stop"], after["abort"] - before["abort"]) == (1, 0)


def test_request_phase_histograms(live):
    names = ("dsv41_engine_request_queue_seconds", "dsv41_engine_request_prefill_seconds",
             "dsv41_engine_request_decode_seconds", "dsv41_server_request_seconds")
    before = {n: live.metric(n + "_count") for n in names}
    r = live.client().completions.create(model="v41-tiny", prompt="phases " * 10, max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length"
    for n in names:
        assert live.metric(n + "_count") - before[n] == 1, n
    # prefill is part of the time to first token, decode part of the request's time
    assert live.metric("dsv41_engine_request_prefill_seconds_sum") <= \
        live.metric("dsv41_server_time_to_first_token_seconds_sum")
    assert live.metric("dsv41_engine_request_decode_seconds_sum") < live.metric("dsv41_server_request_seconds_sum")


def test_kv_pools_as_memory_stats_reports_them(live):
    live.client().completions.create(model="v41-tiny", prompt="pool usage " * 8, max_tokens=2, temperature=0)
    live.wait_idle()
    stats = live.on_engine(lambda e: e.memory_stats())
    got = _samples(live, "dsv41_engine_kv_pool")
    assert stats and set(stats) >= {"global_kv"}
    for pool, st in stats.items():
        for field, v in st.items():
            if field != "unit":
                assert got[f'dsv41_engine_kv_pool{{pool="{pool}",unit="{st["unit"]}",state="{field}"}}'] == v
        assert got[f'dsv41_engine_kv_pool_usage_ratio{{pool="{pool}"}}'] == st["used"] / st["total"]
    assert stats["global_kv"]["used"] > 0


def test_preemptions_follow_the_engine_counter(live):
    before = live.metric("dsv41_engine_preemptions_total")
    live.on_engine(lambda e: e.counters.__setitem__("preemptions", e.counters["preemptions"] + 2))
    live.client().completions.create(model="v41-tiny", prompt="after two preemptions", max_tokens=1)
    assert live.metric("dsv41_engine_preemptions_total") - before == 2


def test_process_metrics(live):
    """The in-process server's process metrics against what this process reads itself."""
    t = os.times()
    cpu_before = t.user + t.system
    held = [open(os.devnull) for _ in range(5)]
    try:
        got = _samples(live, "process_")
        fds = len(os.listdir("/proc/self/fd"))
    finally:
        for f in held:
            f.close()
    t = os.times()
    assert cpu_before <= got["process_cpu_seconds_total"] <= t.user + t.system + 0.05
    assert abs(got["process_open_fds"] - fds) <= 3          # the scrape's own socket(s) come and go
    assert got["process_max_fds"] == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    rss = int(subprocess.run(["ps", "-o", "rss=", "-p", str(os.getpid())], capture_output=True, text=True,
                             check=True).stdout) * 1024
    assert 0.8 * rss < got["process_resident_memory_bytes"] < 1.25 * rss
    assert got["process_virtual_memory_bytes"] >= got["process_resident_memory_bytes"]
    elapsed = int(subprocess.run(["ps", "-o", "etimes=", "-p", str(os.getpid())], capture_output=True, text=True,
                                 check=True).stdout)
    assert abs(got["process_start_time_seconds"] - (time.time() - elapsed)) < 3


def test_system_fingerprint_in_every_response(live):
    c = live.client()
    fp = live.server.fingerprint.value
    assert fp.startswith("fp_")
    r = c.completions.create(model="v41-tiny", prompt="fingerprint", max_tokens=2)
    assert r.system_fingerprint == fp
    chat = c.chat.completions.create(model="v41-tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert chat.system_fingerprint == fp
    chunks = list(c.chat.completions.create(model="v41-tiny", messages=[{"role": "user", "content": "x"}],
                                            max_tokens=2, stream=True))
    assert chunks and all(ch.system_fingerprint == fp for ch in chunks)
    assert all(ch.system_fingerprint == fp for ch in
               c.completions.create(model="v41-tiny", prompt="fp", max_tokens=2, stream=True))
    assert f'system_fingerprint="{fp}"' in httpx.get(live.root + "/metrics").text


def test_system_fingerprint_names_weights_and_build():
    cfg = ModelConfig.preset("v41-tiny")
    a, b = Model.synthetic(cfg, seed=0), Model.synthetic(cfg, seed=1)
    fa = SystemFingerprint.of(a, precision="reference", device="cpu").value
    assert fa == SystemFingerprint.of(Model.synthetic(cfg, seed=0), precision="reference", device="cpu").value
    fb = SystemFingerprint.of(b, precision="reference", device="cpu").value
    fc = SystemFingerprint.of(a, precision="bf16", device="cpu").value
    weights, build = fa.split("_")[1:]
    assert fb.split("_")[1] != weights and fb.split("_")[2] == build         # other weights, same build
    assert fc.split("_")[1] == weights and fc.split("_")[2] != build         # same weights, other path
