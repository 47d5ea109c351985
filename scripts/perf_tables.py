"""Build the tables of docs/performance.md from the JSON files in bench/results/.

Each table sits between `<!-- table:NAME -->` and `<!-- /table:NAME -->` in
docs/performance.md. `--write` rewrites those regions; `--check` exits 1 when any of them
differs from what the JSON says (tests/test_performance_doc.py runs it), so a number in a
table is always the number in its file. Prose around the tables is written by hand.

    python scripts/perf_tables.py --write
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "performance.md"

# What each run measured, where the JSON itself does not say (from bench/results/README.md
# and the commits named). Keyed by file name.
STORE_WHAT = {
    "bench_cache_cpu_2026-11-29_f5f8c05.json": "first store run; old baseline (one raw call for all bytes)",
    "bench_cache_store_cpu_2026-12-01_2394ec7.json": "old baseline; load 12-14",
    "bench_cache_store_cpu_2026-12-01_38d065f.json": "old baseline; records encoded in C++ on the I/O threads",
    "bench_cache_store_cpu_2026-12-01_5d551f2_rerun.json": "old baseline; the code before 38d065f (git archive)",
    "bench_cache_store_cpu_2026-12-01_e16f1a8.json": "new baseline (7bea6ce); CPU-starved at nice 19 beside a training run",
    "bench_cache_store_cpu_2026-12-01_e16f1a8_run2.json": "as above",
    "bench_cache_store_cpu_2026-12-01_d999104_newbench.json": "store before the store-speed branch (git archive), new bench",
    "bench_cache_store_cpu_2026-12-01_d999104_newbench_run2.json": "as above, alternated with 22daab0",
    "bench_cache_store_cpu_2026-12-01_d999104_newbench_run3.json": "as above",
    "bench_cache_store_cpu_2026-12-01_22daab0.json": "store-speed branch: one writer thread, layout in one numpy step",
    "bench_cache_store_cpu_2026-12-01_22daab0_run2.json": "as above",
    "bench_cache_store_cpu_2026-12-01_22daab0_run3.json": "as above",
    "bench_cache_store_cpu_2026-12-01_641da7b_quiet.json": "merged main, quieter machine",
    "bench_cache_store_cpu_2026-12-01_3be4b0c_run1.json": "a segment sealed in one engine call",
    "bench_cache_store_cpu_2026-12-01_3be4b0c_run2.json": "as above",
    "bench_cache_store_cpu_2026-12-01_3be4b0c_run3.json": "as above",
    "bench_cache_store_cpu_2026-12-02_0d0bc51_run1.json": "store format 1, whole 2 MiB huge pages for staging",
    "bench_cache_store_cpu_2026-12-02_0d0bc51_run2.json": "as above",
    "bench_cache_store_cpu_2026-12-02_0d0bc51_run3.json": "as above",
    "bench_cache_store_cpu_2026-12-02_75c53f1_run1.json": "format 2 (packed records) with put_chain",
    "bench_cache_store_cpu_2026-12-02_75c53f1_run2.json": "as above",
    "bench_cache_store_cpu_2026-12-02_75c53f1_run3.json": "as above",
    "bench_cache_store_cpu_2026-12-02_2cab0ad_run1.json": "one tracked object per index record",
    "bench_cache_store_cpu_2026-12-02_2cab0ad_run2.json": "as above",
    "bench_cache_store_cpu_2026-12-02_2cab0ad_run3.json": "as above",
    "bench_cache_store_cpu_2026-12-02_0b4ec50_run1.json": "garbage collected before each timed write",
    "bench_cache_store_cpu_2026-12-02_0b4ec50_run2.json": "as above",
    "bench_cache_store_cpu_2026-12-02_0b4ec50_run3.json": "as above",
    "bench_cache_store_cpu_2026-12-02_2dd8864_run1.json": "group seal (the code of b171236, in a checkout lost before it landed)",
    "bench_cache_store_cpu_2026-12-02_2dd8864_run2.json": "as above",
    "bench_cache_store_cpu_2026-12-02_2dd8864_run3.json": "as above",
    "bench_cache_store_cpu_2026-12-03_1d7753f_run1.json": "before AVX2 CRC, one-pass read plan, group seal; alternated with 1eaafc0",
    "bench_cache_store_cpu_2026-12-03_1d7753f_run2.json": "as above",
    "bench_cache_store_cpu_2026-12-03_1eaafc0_run1.json": "after the group seal, AVX2 CRC and one-pass read plan; alternated with 1d7753f",
    "bench_cache_store_cpu_2026-12-03_1eaafc0_run2.json": "as above",
    "bench_cache_store_cpu_2026-12-03_b171236_run1.json": "a commit's segments sealed as one group",
    "bench_cache_store_cpu_2026-12-03_b171236_run2.json": "as above",
    "bench_cache_store_cpu_2026-12-03_b171236_run3.json": "as above",
}
REMOTE_WHAT = {
    "e2aea2f": "first tier; raw Redis = pipelined SET/GET; load 10-11",
    "ca0978e": "a run of blocks encoded in one buffer",
    "6358ea8": "merged main",
    "641da7b": "merged main, quieter machine",
    "66ad66d": "batch verification, Redis MSET/MGET in the caller's thread; raw Redis = MSET/MGET",
    "268ef52": "chain ids, encode and check in one C++ call each",
    "3ca8aa7": "before the put/get path work",
    "713ca82": "after the put/get path work, alternated with the old tier",
    "783a0d3": "after: Mooncake staging + batch_put_from, Redis sendmsg, MGET read into rows",
    "afc198d": "after the merge with the store's read work (folded CRC-32C)",
    "c0f6c34": "Guarded prefers one warm worker",
    "713b136": "after the store's AVX2 CRC-32C",
}


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _f(x, nd=2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _date(d: dict) -> str:
    s = d.get("date") or (d.get("provenance") or {}).get("date") or ""
    return str(s)[:10] or "-"


def _load_avg(d: dict) -> str:
    la = d.get("load_average_start", d.get("loadavg_start"))
    if isinstance(la, list):
        la = la[0]
    return "-" if la is None else f"{la:.1f}"


def _args(cmd: str | None, script: str) -> str:
    """The command line without the interpreter, the script and the output path."""
    if not cmd:
        return "not recorded"
    cmd = re.sub(r"\s--json\s+\S+", "", cmd)
    cmd = re.sub(r"^.*?" + re.escape(script) + r"\s*", "", cmd)
    return f"`{cmd.strip()}`" if cmd.strip() else "(defaults)"


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _pair(a, b) -> str:
    return f"{_f(a)}/{_f(b)}" if a is not None or b is not None else "-"


def store_table() -> str:
    rows = []
    files = sorted(RESULTS.glob("bench_cache*.json"), key=lambda p: (_date(_load(p.name)), _load(p.name).get("date", ""), p.name))
    for p in files:
        d = _load(p.name)
        s = d.get("store") or {}
        k4, k64 = s.get("4096", {}), s.get("65536", {})
        rows.append([
            f"`{p.name}`", STORE_WHAT.get(p.name, "-"), _args(d.get("command"), "bench_cache.py"),
            f"{d.get('cpus', '-')} cores, load {_load_avg(d)}", _date(d), d.get("commit") or "none",
            _pair(k4.get("write_ratio_vs_raw"), k4.get("write_ratio_vs_raw_median_of_runs")),
            _pair(k64.get("write_ratio_vs_raw"), k64.get("write_ratio_vs_raw_median_of_runs")),
            _pair(k4.get("read_ratio_vs_raw"), k4.get("read_ratio_vs_raw_median_of_runs")),
            _pair(k64.get("read_ratio_vs_raw"), k64.get("read_ratio_vs_raw_median_of_runs")),
            f"{_f(k4.get('read_ratio_vs_raw_interleaved'))} / {_f(k64.get('read_ratio_vs_raw_interleaved'))}",
            f"{_f(k4.get('raw_read_gbps'), 1)} / {_f(k4.get('raw_write_gbps'), 1)}",
        ])
    return _table(["file", "what", "command (`bench/bench_cache.py ...`)", "machine", "date", "commit",
                   "writes 4K", "writes 64K", "reads 4K", "reads 64K", "reads prefix by prefix 4K / 64K",
                   "raw read / write GB/s, 4K"], rows)


def _remote_files() -> list[Path]:
    files = list(RESULTS.glob("bench_remote_cpu_*.json")) + list(RESULTS.glob("remote-cpu-*.json"))
    return sorted(files, key=lambda p: (_load(p.name)["date"], p.name))


def remote_table() -> str:
    rows = []
    for p in _remote_files():
        d = _load(p.name)
        cells = {}
        for payload in d["io"]:
            size = "tiny" if payload["payload"].startswith("v41-tiny") else "flash"
            for b in payload["backends"].values():
                t, pr = b.get("tier_over_raw", {}), b.get("tier_over_raw_paired", {})
                for op in ("put", "get"):
                    paired = f" ({_f(pr[op])})" if op in pr else ""
                    cells[(b["backend"], op, size)] = f"{_f(t.get(op))}{paired}"
        commit = d.get("commit") or "none"
        what = REMOTE_WHAT.get(commit, "-")
        if "newrotation" in p.name:
            what = "the tier of 3ca8aa7 under the bench of 783a0d3 (whole-run rotation)"
        rows.append([f"`{p.name}`", what, _args(d.get("command"), "bench_remote.py"),
                     f"{d.get('cpus', '-')} cores, load {_load_avg(d)}", _date(d), commit]
                    + [f"{cells.get((be, op, 'tiny'), '-')} / {cells.get((be, op, 'flash'), '-')}"
                       for be, op in (("mooncake", "put"), ("mooncake", "get"), ("redis", "put"), ("redis", "get"))])
    return _table(["file", "what", "command (`bench/bench_remote.py ...`)", "machine", "date", "commit",
                   "Mooncake put tiny / flash", "Mooncake get", "Redis put", "Redis get"], rows)


def resume_table() -> str:
    rows = []
    for p in _remote_files():
        d = _load(p.name)
        for r in d.get("resume_ttft") or []:
            ms = [r[k]["ttft_s"] * 1e3 for k in ("cold", "local_ssd", "remote")]
            rows.append([f"`{p.name}`", _date(d), d.get("commit") or "none", f"{d['cpus']} cores, load {_load_avg(d)}",
                         str(r["prefix_tokens"]), f"{ms[0]:.0f}", f"{ms[1]:.0f}", f"{ms[2]:.0f}",
                         _f(r.get("cold_over_remote")), "yes" if r.get("same_first_token") else "no"])
    return _table(["file", "date", "commit", "machine", "prefix tokens", "cold ms", "local SSD + host SWA ms",
                   "remote only ms", "cold / remote", "same first token"], rows)


def replay_tables() -> tuple[str, str]:
    thr, ttft = [], []
    for p in sorted(RESULTS.glob("replay-cpu-*.json")):
        d = _load(p.name)
        for r in d.get("decoder_replay_prefill") or []:
            off, on = r["decoder_replay_off"], r["decoder_replay_on"]
            thr.append([f"`{p.name}`", _args(d.get("command"), "bench_replay.py"), _date(d) if d.get("date") else "2026-11-29",
                        d.get("commit") or "not recorded",
                        f"{d['cpu_count']} cores, load {off['loadavg_before']:.1f} to {on['loadavg_after']:.1f}",
                        f"{r['batch']} x {r['prompt_tokens']}", f"{off['seconds']:.1f}", f"{on['seconds']:.1f}",
                        f"{r['measured_speedup']:.2f}", f"{r['flop_ratio']:.2f}"])
        for r in d.get("ttft") or []:
            ttft.append([f"`{p.name}`", d.get("commit") or "not recorded", str(r["prefix_tokens"]),
                         f"{r['cold']['ttft_s']:.2f} ({r['cold']['prefill_tokens']})",
                         f"{r['encoder_replay']['ttft_s']:.2f} ({r['encoder_replay']['prefill_tokens']}, "
                         f"{r['encoder_replay']['replayed_tokens']} replayed)",
                         f"{r['both_hit']['ttft_s']:.2f} ({r['both_hit']['prefill_tokens']})",
                         _f(r["cold_over_replay"]), _f(r["cold_over_both_hit"])])
    return (_table(["file", "command (`bench/bench_replay.py ...`)", "date", "commit", "machine", "batch x prompt",
                    "replay off s", "decoder replay on s", "on / off", "FLOP ratio"], thr),
            _table(["file", "commit", "prefix + 32 tokens", "cold s (computed)", "encoder replay s",
                    "both hit s", "cold / replay", "cold / both hit"], ttft))


def model_table() -> str:
    rows = []
    for p in sorted(RESULTS.glob("bench_model_cpu_*.json")):
        d = _load(p.name)
        prov = d["provenance"]
        for r in d["results"]:
            rows.append([f"`{p.name}`", f"`{prov['command'].split('bench_model.py')[1].split('--json')[0].strip()}`",
                         prov["date"], prov["commit"].split()[0], prov["device"].split("(")[1].split(";")[0],
                         str(r["length"]),
                         f"{r['sparse']['prefill_tokens_per_s']:.0f}", f"{r['dense']['prefill_tokens_per_s']:.0f}",
                         f"{r['prefill_speedup']:.2f}", f"{r['sparse']['decode_tokens_per_s']:.1f}",
                         f"{r['dense']['decode_tokens_per_s']:.2f}", f"{r['decode_speedup']:.2f}"])
    return _table(["file", "command (`bench/bench_model.py ...`)", "date", "commit", "machine", "tokens",
                   "CSA2 prefill tok/s", "dense prefill tok/s", "CSA2 / dense", "CSA2 decode tok/s",
                   "dense decode tok/s", "CSA2 / dense"], rows)


def transformers_table() -> str:
    rows = []
    names = sorted(p.name for p in RESULTS.glob("vs-transformers-cpu-*.json")) + \
        sorted(p.name for p in RESULTS.glob("production-vs-reference-cpu-*.json"))
    for name in names:
        d = _load(name)
        for r in d["results"]:
            rows.append([f"`{name}`", _args(d.get("command"), "bench_vs_transformers.py"), _date(d), d["commit"],
                         f"1 thread, load {r['load_average_1m_before']:.1f}", str(r["tokens"]),
                         f"{r['transformers_tokens_per_s']:.0f}", f"{r['dsv41_stored_tokens_per_s']:.0f}",
                         f"{r['dsv41_float32_tokens_per_s']:.0f}",
                         _f(r.get("dsv41_production_tokens_per_s"), 0),
                         _f(r.get("dsv41_stored_vs_transformers_speed")),
                         _f(r.get("dsv41_production_vs_reference_speed")),
                         _f(r.get("dsv41_production_vs_transformers_speed")),
                         _f(r.get("dsv41_production_vs_transformers_cpu_speed"))])
    return _table(["file", "command (`bench/bench_vs_transformers.py ...`)", "date", "commit", "machine", "tokens",
                   "transformers fp32 tok/s", "dsv41 reference (stored KV) tok/s", "dsv41 float32 KV tok/s",
                   "dsv41 production tok/s", "reference / transformers", "production / reference",
                   "production / transformers", "production / transformers, CPU time"], rows)


def v4_scheme_table() -> str:
    rows = []
    for p in sorted(RESULTS.glob("v4-scheme-cpu-*.json")):
        d = _load(p.name)
        s = d["schemes"]
        r = d["ratios_v41_over_v4"]
        c = d["computed_ratios_v41_over_v4"]
        rows.append([f"`{p.name}`", _args(d["command"], "bench_v4_scheme.py"), d["date"][:10], d["commit"],
                     d["machine"].replace(": noisy timings", ""), f"{s['v4']['bytes_written']['per_token']:.1f} / {s['v41']['bytes_written']['per_token']:.1f}",
                     f"{r['bytes_written_per_token']:.3f}", f"{c['tiny']['persistent_ratio']:.3f}",
                     f"{r['bytes_on_disk']:.3f}",
                     f"{s['v4']['resume_ttft_ms_median']:.0f} / {s['v41']['resume_ttft_ms_median']:.0f} / "
                     f"{s['v4_nockpt']['resume_ttft_ms_median']:.0f}",
                     f"{d['v4_checkpoints_vs_recompute_resume_ttft']:.1f}"])
    return _table(["file", "command (`bench/bench_v4_scheme.py ...`)", "date", "commit", "machine",
                   "bytes written per session token, V4 / V4.1", "V4.1 / V4 written", "computed (tiny presets)",
                   "V4.1 / V4 on disk", "resume TTFT ms: V4 checkpoint / V4.1 replay / V4 recompute",
                   "recompute / checkpoint"], rows)


def serve_table() -> str:
    rows = []
    for p in sorted(RESULTS.glob("serve-cpu-*.json")):
        d = _load(p.name)
        on, off, r = d["runs"]["cache_on"], d["runs"]["cache_off"], d["on_vs_off"]
        rows.append([f"`{p.name}`", _args(d["command"], "bench_serve.py"), d["date"][:10], d["commit"],
                     f"{d['machine']['cpus']} cores, load {on['loadavg_1m'][0]:.1f}",
                     f"{on['ttft_ms']['median']:.0f} / {off['ttft_ms']['median']:.0f}",
                     f"{on['output_throughput_tok_s']:.1f} / {off['output_throughput_tok_s']:.1f}",
                     f"{on['prompt_cache_hit_rate']:.2f}", _f(r["ttft_median_ratio"]), _f(r["ttft_p99_ratio"]),
                     _f(r["output_throughput_ratio"])])
    return _table(["file", "command (`bench/bench_serve.py ...`)", "date", "commit", "machine",
                   "TTFT median ms, cache on / off", "output tok/s on / off", "prompt tokens from cache",
                   "TTFT median on / off", "TTFT p99 on / off", "throughput on / off"], rows)


def tiers_table() -> str:
    rows = []
    for p in sorted(RESULTS.glob("bench_tiers_cpu_*.json")):
        d = _load(p.name)
        adopt = {r["tokens"]: r for r in d.get("adopt", [])}
        for r in d.get("promote", []):
            a = adopt.get(r["tokens"], {})
            rows.append([f"`{p.name}`", _args(d.get("command"), "bench_tiers.py"), _date(d), d.get("commit") or "none",
                         f"{d.get('cpus', '-')} cores, load {_load_avg(d)}", f"{r['tokens'] // 1024}K",
                         f"{r['reuse_ms']:.1f} / {r['per_call_ms']:.1f} / {r['floor_ms']:.1f}",
                         _f(r["per_call_over_reuse"]),
                         f"{a['adopt_ms']:.1f} / {a['insert_ms']:.1f}" if a else "-",
                         _f(a.get("adopt_over_insert")),
                         f"{a['adopt_flush_ms']:.0f} / {a['insert_flush_ms']:.0f}" if a else "-"])
    return _table(["file", "command (`bench/bench_tiers.py ...`)", "date", "commit", "machine", "prefix",
                   "promotion ms: reused staging / staging per call / store.load alone",
                   "per call / reused", "adopt / insert ms (request path)", "adopt / insert",
                   "flush after adopt / insert ms"], rows)


def formats_table() -> str:
    rows = []
    for p in sorted(RESULTS.glob("kv-formats-cpu-*.json")):
        d = _load(p.name)
        for r in d["results"]:
            rows.append([f"`{p.name}`", _args(d["command"], "bench_kv_formats.py"), d["date"], d["commit"],
                         f"load {d['load_average_1m']:.1f}", r["preset"], r["main_kv_format"], str(r["tokens"]),
                         f"{r['kl_mean']:.2e}", f"{r['top1_agreement']:.3f}"])
    return _table(["file", "command (`bench/bench_kv_formats.py ...`)", "date", "commit", "machine", "preset",
                   "main KV", "tokens", "KL mean vs float32", "top-1 agreement"], rows)


def codecs_table() -> str:
    rows = []
    for p in sorted(RESULTS.glob("codecs-cpu-*.json")):
        d = _load(p.name)
        for r in d["results"]:
            rows.append([f"`{p.name}`", d["date"][:10], d["commit"], f"{d['cpu_threads']} threads, {r['device']}; load not recorded",
                         f"{r['codec']} {r['op']}", f"{r['op_s'] * 1e3:.1f}", f"{r['reference_s'] * 1e3:.0f}",
                         f"{r['speedup_vs_reference']:.1f}"])
    return _table(["file", "date", "commit", "machine", "codec", "op ms", "float32 reference ms",
                   "reference / op"], rows)


# The dsv41 path of each bench/micro group; the other rows of the group are its baselines.
MICRO_MEASURED = {"hash_blocks", "match", "store", "pack", "unpack", "traced_off", "bounded", "exact"}


def micro_table() -> str:
    d = _load("micro-cpu-baseline.json")
    groups: dict[str, dict[str, float]] = {}
    for b in d["benchmarks"]:
        name = b["name"].split("[")[1].rstrip("]")
        groups.setdefault(b["group"], {})[name] = b["stats"]["min"]
    rows = []
    for g, items in groups.items():
        measured = [n for n in items if n in MICRO_MEASURED or n.endswith("-op")]
        base = [n for n in items if n not in measured]
        for m in measured:
            for b in base:
                rows.append([g, f"{m} {items[m] * 1e3:.3f}", f"{b} {items[b] * 1e3:.3f}", f"{items[b] / items[m]:.2f}"])
    head = (f"`micro-cpu-baseline.json`: `pytest bench/micro` (docs/profiling.md), commit "
            f"{d['commit_info']['id'][:7]}, {d['datetime'][:10]}, "
            f"{d['machine_info'].get('cpu', {}).get('count', '-')} cores; minimum of the rounds.\n\n")
    return head + _table(["group (`bench/micro/`)", "dsv41, min ms", "baseline, min ms", "baseline / dsv41"], rows)


def gpu_table() -> str:
    d = json.loads((RESULTS / "gpu-h200-2026-12-04" / "gpu_check.json").read_text())
    rows = []
    for impl in ("attention_mma", "attention_wgmma"):
        b = d["benchmarks"][impl]
        for r in b["results"]:
            rows.append([impl.split("_")[1], f"T={r['T']}, {r['keys_per_query']} keys", f"{r['kernel_s'] * 1e6:.1f}",
                         f"{r['kernel_TFLOPs']:.1f}", f"{r['torch_bf16_s'] * 1e6:.0f}", f"{r['speedup_vs_torch']:.1f}"])
    b = d["benchmarks"]["topk"]
    for r in b["results"]:
        rows.append(["indexer + top-512", f"T={r['T']}, N={r['N']}", f"{r['indexer_plus_topk_s'] * 1e6:.1f}", "-",
                     f"{r['torch_topk_s'] * 1e6:.1f} (torch.topk alone)", f"{r['topk_speedup_vs_torch']:.2f} (top-k)"])
    head = (f"`gpu-h200-2026-12-04/gpu_check.json`: `scripts/gpu_check.sh`, {d['gpu']['name']}, "
            f"{d['date'][:10]}, commit {d['commit']}; 64 heads, 512-dim FP4 entries, 128 window + 512 "
            "selected keys per query.\n\n")
    return head + _table(["kernel", "shape", "us", "TFLOP/s", "torch baseline us", "baseline / kernel"], rows)


def decode_table() -> str:
    rows = []
    for p in sorted(RESULTS.glob("bench_decode_*.json")):
        d = _load(p.name)
        m = d["machine"]
        where = m["gpu"] or f"{m['cpus']} cores, {m['threads']} thread, load {m['load'][0]:.1f}"
        for r in d["batches"]:
            med, po = r["median_ms"], r["paged_ops"]
            ro = r.get("reference_ops")
            rows.append([f"`{p.name}`", d["date"], d["commit"] or "none", where, d["preset"],
                         str(r["batch"]), str(r["context"]), _f(med["paged_ms"], 1),
                         _f(med.get("paged_graphs_ms"), 2) if "paged_graphs_ms" in med else "-",
                         _f(med["reference_ms"], 1) if "reference_ms" in med else "-",
                         _f(r.get("ratio_paged_vs_reference")),
                         f"{po['ops_per_layer']:.1f} / {ro['ops_per_layer']:.1f}" if ro else f"{po['ops_per_layer']:.1f}",
                         f"{po['launches_per_layer']:.1f}",
                         f"{po['host_syncs']} / {ro['host_syncs']}" if ro else str(po["host_syncs"]),
                         _f(r["ops_ratio_vs_batch1"])])
    return _table(["file", "date", "commit", "machine", "model", "batch", "context", "paged ms/step",
                   "graphs ms/step", "per-sequence ms/step", "per-sequence / paged",
                   "aten ops/layer: paged / per-sequence", "launches/layer (paged)",
                   "host syncs/step: paged / per-sequence", "paged ops vs batch 1"], rows)


def transformers_decode_table() -> str:
    rows = []
    for name in sorted(p.name for p in RESULTS.glob("vs-transformers-decode-cpu-*.json")):
        d = _load(name)
        for r in d["results"]:
            rows.append([f"`{name}`", _args(d.get("command"), "bench_vs_transformers.py"), _date(d), d["commit"],
                         f"1 thread, load {r['load_average_1m_before']:.1f}", str(r["tokens"]),
                         str(r["decode_steps"]),
                         f"{r['decode_transformers_ms']:.1f} / {r['decode_transformers_cpu_ms']:.1f}",
                         f"{r['decode_dsv41_production_ms']:.1f} / {r['decode_dsv41_production_cpu_ms']:.1f}",
                         f"{r['decode_dsv41_float32_ms']:.1f} / {r['decode_dsv41_float32_cpu_ms']:.1f}",
                         _f(r["decode_dsv41_production_vs_transformers_speed"]),
                         _f(r["decode_dsv41_production_vs_transformers_cpu_speed"])])
    return _table(["file", "command (`bench/bench_vs_transformers.py ...`)", "date", "commit", "machine",
                   "context", "steps", "transformers ms/step (wall / CPU)",
                   "dsv41 production ms/step (wall / CPU)", "dsv41 float32 KV ms/step (wall / CPU)",
                   "production / transformers", "production / transformers, CPU time"], rows)


def tables() -> dict[str, str]:
    thr, ttft = replay_tables()
    return {"store": store_table(), "remote": remote_table(), "remote-resume": resume_table(),
            "replay-throughput": thr, "replay-ttft": ttft, "model": model_table(),
            "transformers": transformers_table(), "transformers-decode": transformers_decode_table(),
            "v4-scheme": v4_scheme_table(), "serve": serve_table(),
            "tiers": tiers_table(), "decode": decode_table(),
            "kv-formats": formats_table(), "codecs": codecs_table(), "micro": micro_table(), "gpu": gpu_table()}


def render(doc: str) -> str:
    for name, body in tables().items():
        pat = re.compile(rf"(<!-- table:{re.escape(name)} -->\n).*?(<!-- /table:{re.escape(name)} -->)", re.S)
        if not pat.search(doc):
            raise SystemExit(f"docs/performance.md has no region for table {name!r}")
        doc = pat.sub(lambda m: m.group(1) + body + "\n" + m.group(2), doc)
    return doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help="rewrite the table regions of docs/performance.md")
    g.add_argument("--check", action="store_true", help="exit 1 if docs/performance.md is out of date")
    a = ap.parse_args()
    if a.write or a.check:
        doc = DOC.read_text()
        new = render(doc)
    if a.write:
        DOC.write_text(new)
    elif a.check:
        if new != doc:
            print("docs/performance.md does not match bench/results/: run python scripts/perf_tables.py --write",
                  file=sys.stderr)
            return 1
    else:
        for name, body in tables().items():
            print(f"## {name}\n\n{body}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
