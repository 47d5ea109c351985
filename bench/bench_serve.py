"""`dsv41 serve` under an agent-shaped load over HTTP, prefix cache on vs off in one run.

The load: S concurrent sessions (agents) share one system prompt and tool schema; each runs
T turns (a user message or a tool result, then the streamed reply, which joins the history
as the assistant message); sessions with an odd index go idle for longer than the server's
SWA snapshot TTL before their last turn, so that turn's prefix has global KV but no SWA
snapshot (bounded replay). The shared system prompt is sent once by itself first (not
timed), as an agent framework warming its prefix would. The same load runs against two servers started here as
subprocesses, one with the prefix cache and one with --no-prefix-cache (same model,
seed and flags otherwise), one after the other.

Per run, in the style of vLLM's benchmark_serving: requests, duration, input/output tokens,
request and token throughput, TTFT mean/median/p99, TPOT (time per output token after the
first) and ITL (between streamed chunks); plus prompt tokens served from the cache
(usage.prompt_tokens_details.cached_tokens) and the server's cache hit rate per tier and
cache paths, the server's mean queue / prefill / decode time and its KV pools (from
/metrics), and how the server stopped (SIGTERM: exit code and seconds). Then on/off ratios.

    PYTHONPATH=python python bench/bench_serve.py --sessions 8 --turns 4 --json out.json

TTFT is measured by the client (request sent -> first content chunk). On a shared machine
the client, the server and other jobs compete for the same cores: the load average before
and after each run is recorded, and numbers move from run to run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

from _meta import git_commit  # noqa: E402  (bench/ is on sys.path when run as a script)


def log(msg: str) -> None:
    print(f"[bench_serve] {msg}", file=sys.stderr, flush=True)


# ---- the server -------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args, cache: bool):
        self.port = free_port()
        cmd = [sys.executable, "-m", "dsv41", "serve", "--preset", args.preset, "--port", str(self.port),
               "--block-tokens", str(args.block_tokens), "--swa-ttl", str(args.swa_ttl),
               "--max-batch", str(args.max_batch), "--device", args.device]
        if not cache:
            cmd.append("--no-prefix-cache")
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS=str(args.torch_threads))
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 120.0) -> None:
        import httpx
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.proc.stderr.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("the server did not become ready")

    def metrics(self) -> str:
        import httpx
        return httpx.get(self.url + "/metrics", timeout=10).text

    def stop(self) -> dict:
        """SIGTERM, as an operator stops it: {"exit_code", "seconds"} (a clean drain exits
        0; the server is killed past 60 s and then the code is None)."""
        t0 = time.monotonic()
        self.proc.terminate()
        try:
            rc = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            rc = None
        return {"exit_code": rc, "seconds": time.monotonic() - t0}


# ---- the load ---------------------------------------------------------------------------

def _text(rng, n: int) -> str:
    words = ["cache", "block", "replay", "window", "token", "agent", "tool", "file", "patch", "test",
             "error", "return", "value", "index", "layer", "state", "query", "key", "grep", "build"]
    out = []
    while sum(len(w) + 1 for w in out) < n:
        out.append(rng.choice(words))
    return " ".join(out)[:n]


def workload(args):
    import random
    rng = random.Random(args.seed)
    system = "You are a coding agent. Tools: read_file(path), grep(pattern), run_tests(). " + _text(rng, args.system_chars)
    sessions = []
    for s in range(args.sessions):
        turns = []
        for t in range(args.turns):
            kind = "tool" if t % 2 else "user"
            n = args.tool_chars if kind == "tool" else args.user_chars
            turns.append(f"[{kind} {s}.{t}] " + _text(rng, n))
        sessions.append(turns)
    return system, sessions


async def run_load(args, url: str) -> list[dict]:
    from openai import AsyncOpenAI

    system, sessions = workload(args)
    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    records: list[dict] = []

    async def session(s: int, turns: list[str]):
        msgs = [{"role": "system", "content": system}]
        for t, content in enumerate(turns):
            late = s % 2 == 1 and t == len(turns) - 1 and len(turns) > 1
            if late:
                await asyncio.sleep(args.swa_ttl + 1.0)     # idle past the SWA snapshot TTL
            msgs.append({"role": "user", "content": content})
            t0 = time.perf_counter()
            first, stamps, text, usage = None, [], "", None
            stream = await client.chat.completions.create(
                model=args.preset, messages=msgs, max_tokens=args.max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"cache_salt": "bench"})
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].delta.content:
                    stamps.append(now)
                    first = first or now
                    text += chunk.choices[0].delta.content
                if chunk.usage is not None:
                    usage = chunk.usage
            end = time.perf_counter()
            msgs.append({"role": "assistant", "content": text})
            out_tokens = usage.completion_tokens
            records.append({
                "session": s, "turn": t, "after_idle": late, "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.prompt_tokens_details.cached_tokens, "output_tokens": out_tokens,
                "ttft_s": (first or end) - t0, "e2e_s": end - t0,
                "tpot_s": ((end - (first or end)) / (out_tokens - 1)) if out_tokens > 1 else None,
                "itl_s": [b - a for a, b in zip(stamps, stamps[1:])]})

    # the agent framework sends the shared system prompt once by itself (as rendered text,
    # so its SWA snapshot sits where the conversations part: docs/serve.md)
    warm = "<|system|>\n" + system + "\n"
    await client.completions.create(model=args.preset, prompt=warm, max_tokens=1, temperature=0,
                                    extra_body={"cache_salt": "bench"})
    t0 = time.perf_counter()
    await asyncio.gather(*(session(s, turns) for s, turns in enumerate(sessions)))
    await client.close()
    return records, time.perf_counter() - t0


# ---- summary ----------------------------------------------------------------------------

def _pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _stats_ms(xs) -> dict:
    xs = [x for x in xs if x is not None]
    return {"mean": statistics.fmean(xs) * 1e3 if xs else None, "median": _pct(xs, 50) * 1e3 if xs else None,
            "p99": _pct(xs, 99) * 1e3 if xs else None}


def _prom(text: str, name: str) -> dict[str, float]:
    """{label string or "": value} of one metric in Prometheus text."""
    out = {}
    for line in text.splitlines():
        m = re.match(rf"^{name}(\{{[^}}]*\}})? (\S+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


def summarize(records, duration, metrics_text) -> dict:
    inp = sum(r["prompt_tokens"] for r in records)
    out = sum(r["output_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    lookups = sum(_prom(metrics_text, "dsv41_cache_lookup_tokens_total").values())
    hits = {k.split('"')[1]: v for k, v in _prom(metrics_text, "dsv41_cache_hit_tokens_total").items()}
    paths = {k.split('"')[1]: int(v) for k, v in _prom(metrics_text, "dsv41_engine_requests_by_path_total").items()}
    phases = {}        # the server's own view, from its histograms (vLLM's request_*_time_seconds)
    for phase in ("queue", "prefill", "decode"):
        total = sum(_prom(metrics_text, f"dsv41_engine_request_{phase}_seconds_sum").values())
        count = sum(_prom(metrics_text, f"dsv41_engine_request_{phase}_seconds_count").values())
        phases[phase] = 1e3 * total / count if count else None
    pools = {}
    for labels, v in _prom(metrics_text, "dsv41_engine_kv_pool").items():
        kv = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        pools.setdefault(kv["pool"], {"unit": kv["unit"]})[kv["state"]] = v
    return {
        "successful_requests": len(records), "duration_s": duration,
        "total_input_tokens": inp, "total_output_tokens": out,
        "request_throughput": len(records) / duration, "output_throughput_tok_s": out / duration,
        "total_token_throughput_tok_s": (inp + out) / duration,
        "ttft_ms": _stats_ms([r["ttft_s"] for r in records]),
        "ttft_after_idle_ms": _stats_ms([r["ttft_s"] for r in records if r["after_idle"]]),
        "tpot_ms": _stats_ms([r["tpot_s"] for r in records]),
        "itl_ms": _stats_ms([x for r in records for x in r["itl_s"]]),
        "cached_prompt_tokens": cached, "prompt_cache_hit_rate": cached / inp if inp else 0.0,
        "cache_tier_hit_rate": {t: (v / lookups if lookups else 0.0) for t, v in hits.items()},
        "paths": paths, "server_mean_ms": phases, "kv_pools_at_end": pools,
    }


def print_result(title: str, s: dict) -> None:
    w = 50
    p = print
    p(f"{' ' + title + ' ':=^{w}}")
    rows = [("Successful requests:", s["successful_requests"]), ("Benchmark duration (s):", s["duration_s"]),
            ("Total input tokens:", s["total_input_tokens"]), ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", s["request_throughput"]),
            ("Output token throughput (tok/s):", s["output_throughput_tok_s"]),
            ("Total Token throughput (tok/s):", s["total_token_throughput_tok_s"])]
    for k, v in rows:
        p(f"{k:<40}{v:<10.2f}" if isinstance(v, float) else f"{k:<40}{v:<10}")
    for head, key, name in (("Time to First Token", "ttft_ms", "TTFT"),
                            ("TTFT, turns after an idle past the SWA TTL", "ttft_after_idle_ms", "TTFT"),
                            ("Time per Output Token (excl. 1st token)", "tpot_ms", "TPOT"),
                            ("Inter-token Latency", "itl_ms", "ITL")):
        p(f"{head:-^{w}}")
        for stat in ("mean", "median", "p99"):
            v = s[key][stat]
            p(f"{stat.capitalize() + ' ' + name + ' (ms):':<40}{v:<10.2f}" if v is not None else
              f"{stat.capitalize() + ' ' + name + ' (ms):':<40}-")
    p(f"{'Prefix cache':-^{w}}")
    p(f"{'Cached prompt tokens:':<40}{s['cached_prompt_tokens']}")
    p(f"{'Prompt tokens from cache (%):':<40}{s['prompt_cache_hit_rate'] * 100:.1f}")
    for t, v in sorted(s["cache_tier_hit_rate"].items()):
        p(f"{'Hit rate, tier ' + t + ' (%):':<40}{v * 100:.1f}")
    p(f"{'Paths:':<40}{', '.join(f'{k} {v}' for k, v in sorted(s['paths'].items()))}")
    p(f"{'Server: queue / prefill / decode':-^{w}}")
    for phase, v in s["server_mean_ms"].items():
        p(f"{'Mean ' + phase + ' (ms):':<40}{v:<10.2f}" if v is not None else f"{'Mean ' + phase + ' (ms):':<40}-")
    if "shutdown" in s:
        p(f"{'SIGTERM -> exit (code, s):':<40}{s['shutdown']['exit_code']}, {s['shutdown']['seconds']:.2f}")
    p("=" * w)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="v41-tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-chars", type=int, default=1200, help="shared prefix (byte tokenizer: chars = tokens)")
    ap.add_argument("--user-chars", type=int, default=60)
    ap.add_argument("--tool-chars", type=int, default=240)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--swa-ttl", type=float, default=3.0, help="the servers' SWA snapshot TTL (s)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="the servers' intra-op threads (OMP_NUM_THREADS); tiny models gain nothing from more")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    result = {"bench": "bench_serve", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "command": "python bench/bench_serve.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "commit": git_commit(), "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
              "config": vars(args), "runs": {}}
    for name, cache in (("cache_on", True), ("cache_off", False)):
        srv = ServerProcess(args, cache)
        try:
            srv.wait_ready()
            log(f"{name}: server on port {srv.port}; {args.sessions} sessions x {args.turns} turns")
            load0 = os.getloadavg()[0]
            records, duration = asyncio.run(run_load(args, srv.url))
            s = summarize(records, duration, srv.metrics())
            s["loadavg_1m"] = [load0, os.getloadavg()[0]]
            s["server_command"] = " ".join(srv.cmd[1:])
            s["requests"] = records
        finally:
            shutdown = srv.stop()
        s["shutdown"] = shutdown
        result["runs"][name] = s
        print_result(f"dsv41 serve, prefix cache {'on' if cache else 'off'}", s)
    on, off = result["runs"]["cache_on"], result["runs"]["cache_off"]
    result["on_vs_off"] = {
        "ttft_median_ratio": on["ttft_ms"]["median"] / off["ttft_ms"]["median"],
        "ttft_p99_ratio": on["ttft_ms"]["p99"] / off["ttft_ms"]["p99"],
        "output_throughput_ratio": on["output_throughput_tok_s"] / off["output_throughput_tok_s"],
    }
    print(f"{' cache on vs off ':=^50}")
    for k, v in result["on_vs_off"].items():
        print(f"{k + ':':<40}{v:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        log(f"wrote {args.json}")
    return 0




if __name__ == "__main__":
    sys.exit(main())
