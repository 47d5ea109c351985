"""One tiny, synchronous call of one CUDA kernel against its CPU path, for scripts/gpu_check.sh.

    python scripts/gpu_smoke.py --list
    python scripts/gpu_smoke.py CASE [--json PATH]

Each case runs in its own process (gpu_check.sh starts one per case), so a sticky CUDA
error (an illegal address poisons the whole context) shows which kernel faulted instead of
failing every later call. A case builds small inputs on the CPU, runs the op on CUDA,
synchronizes, and compares with the CPU op (the C++ loop or the float64 reference) on the
same inputs: bit-exact where the kernel is specified bit-exact, within a stated bound
otherwise. The result is one JSON object (ok, error, max_err, bound, seconds).
Also the workload of compute-sanitizer in gpu_check.sh (cases `attention_small`, `topk`).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.cpu().view(torch.uint8) if a.element_size() == 1 else a.cpu(),
                                              b.view(torch.uint8) if b.element_size() == 1 else b)


def _codecs(fmt: str):
    from dsv41 import formats

    x = torch.randn(37, 256, generator=_gen(1)) * 3
    x[0, :7] = 0.0
    q = getattr(formats, f"quantize_{fmt}")
    codes, scales = q(x)
    codes_d, scales_d = q(x.cuda())
    torch.cuda.synchronize()
    deq = getattr(formats, f"dequantize_{fmt}")
    back = deq(codes_d, scales_d)
    torch.cuda.synchronize()
    ok = _same(codes_d, codes) and _same(scales_d, scales) and torch.equal(back.cpu(), deq(codes, scales))
    return {"ok": ok, "what": "quantize + dequantize bit-exact against the C++ CPU loop"}


def _scatter(fmt: str):
    from dsv41 import formats
    from dsv41.ops import cache_ops

    x = torch.randn(9, 512, generator=_gen(2))
    codes, scales = getattr(formats, f"quantize_{fmt}")(torch.zeros(20, 512))
    rows = torch.tensor([3, 0, -1, 19, 7, 8, 11, 2, 4])
    c_cpu, s_cpu = codes.clone(), scales.clone()
    cache_ops.quantize_scatter(fmt, x, c_cpu, s_cpu, rows)
    c_dev, s_dev = codes.cuda(), scales.cuda()
    cache_ops.quantize_scatter(fmt, x.cuda(), c_dev, s_dev, rows.cuda())
    torch.cuda.synchronize()
    return {"ok": _same(c_dev, c_cpu) and _same(s_dev, s_cpu), "what": "scatter bit-exact against the CPU op"}


def _copy(engine: str):
    from dsv41.ops import cache_ops

    host = torch.randint(0, 256, (40, 4104), generator=_gen(3), dtype=torch.int64).to(torch.uint8).pin_memory()
    dev = torch.zeros(50, 4104, dtype=torch.uint8, device="cuda")
    src, dst = torch.randperm(40, generator=_gen(4))[:25], torch.randperm(50, generator=_gen(5))[:25]
    side = torch.cuda.Stream()  # the copy engines' batched path is skipped on the legacy stream
    with torch.cuda.stream(side):
        idx_s, idx_d = (src, dst) if engine == "copy_engine" else (src.cuda(), dst.cuda())
        cache_ops.copy_blocks(host, idx_s, dev, idx_d, engine)
        back = torch.zeros_like(host).pin_memory()
        cache_ops.copy_blocks(dev, idx_d, back, idx_s, engine)
    torch.cuda.synchronize()
    ok = torch.equal(dev.cpu()[dst], host[src]) and torch.equal(back[src], host[src])
    return {"ok": ok, "what": f"copy_blocks engine={engine}: host -> device -> host bit-exact"}


def _dequant_tricks():
    from dsv41 import formats
    from dsv41.ops import cache_ops

    x = torch.randn(16, 256, generator=_gen(6))
    ok = True
    for fmt in ("nvfp4", "mxfp4", "fp8_swa"):
        codes, scales = getattr(formats, f"quantize_{fmt}")(x)
        got = cache_ops.dequant_tricks(fmt, codes.cuda(), scales.cuda())
        torch.cuda.synchronize()
        ok &= torch.equal(got.cpu(), cache_ops.dequant_tricks(fmt, codes, scales))
    return {"ok": bool(ok), "what": "fast bf16 decoders bit-exact against the CPU decoders"}


def _attention(impl: str, T: int = 3, K: int = 512, H: int = 64, D: int = 512):
    """impl: the plan's kernel ("" = auto: the default choice, ops.attention_plan)."""
    from dsv41 import formats, ops

    g = _gen(7)
    W, Ns, Ng = 128, 300, 2 * K + 5
    swa_values, swa_scales = formats.quantize_fp8_swa(torch.randn(Ns, D, generator=g))
    kv_codes, kv_scales = formats.quantize_nvfp4(torch.randn(Ng, D, generator=g))
    swa_idx = torch.randint(0, Ns, (T, W), generator=g, dtype=torch.int32)
    kv_idx = torch.randint(0, Ng, (T, K), generator=g, dtype=torch.int32)
    swa_idx[:, -5:] = -1
    kv_idx[0, :] = -1
    args = [torch.randn(T, H, D, generator=g), swa_values, swa_scales, swa_idx, kv_codes, kv_scales, kv_idx,
            torch.randn(H, generator=g)]
    plan = ops.attention_plan(T, H, D, swa_width=W, topk=K, device="cuda", kernel=impl or "auto")
    out, lse = ops.sparse_attention(*[a.cuda() for a in args], D ** -0.5, plan=plan)
    torch.cuda.synchronize()
    ref_out, ref_lse = torch.ops.dsv41.sparse_attention(*args, D ** -0.5)
    err = ((out.cpu().double() - ref_out.double()).norm() / ref_out.double().norm()).item()
    lse_err = (lse.cpu().double() - ref_lse.double()).abs().max().item()
    bound = 1e-2  # bf16 operands, fp32 accumulation: METHOD.md puts this between 1e-3 and 1e-2
    finite = bool(torch.isfinite(out.cpu()).all())
    return {"ok": finite and err < bound and lse_err < 1e-2 and not plan.fallback, "max_err": err,
            "lse_max_abs_err": lse_err, "bound": bound, "kernel": plan.kernel, "splits": plan.num_splits,
            "what": f"sparse_attention kernel={plan.kernel} H={H} D={D} T={T}: ||out-ref||/||ref||"}


def _indexer(at: bool):
    from bench_topk import indexer_error_bound

    from dsv41 import formats

    g = _gen(8)
    T, Hi, Di, N = 3, 32, 128, 1000
    qc, qs = formats.quantize_mxfp4(torch.randn(T, Hi, Di, generator=g))
    kc, ks = formats.quantize_mxfp4(torch.randn(N, Di, generator=g))
    w = torch.randn(T, Hi, generator=g) * (Hi * Di) ** -0.5
    args = [qc, qs, w, kc, ks]
    if at:
        idx = torch.randint(0, N, (T, 200), generator=g, dtype=torch.int32)
        idx[:, -9:] = -1
        got = torch.ops.dsv41.indexer_scores_at(*[a.cuda() for a in args], idx.cuda())
        ref = torch.ops.dsv41.indexer_scores_at(*args, idx)
        bound = indexer_error_bound(*args).gather(1, idx.clamp(min=0).long())
    else:
        got = torch.ops.dsv41.indexer_scores(*[a.cuda() for a in args])
        ref = torch.ops.dsv41.indexer_scores(*args)
        bound = indexer_error_bound(*args)
    torch.cuda.synchronize()
    got = got.cpu()
    fin = torch.isfinite(ref)
    same_inf = torch.equal(torch.isneginf(got), torch.isneginf(ref))
    excess = ((got - ref).abs()[fin].double() / bound[fin]).max().item()
    return {"ok": same_inf and excess <= 1.0, "max_err_over_bound": excess,
            "what": "indexer scores within the fp32-accumulation bound of bench_topk.indexer_error_bound"}


def _topk():
    scores = torch.randn(4, 70000, generator=_gen(9))
    visible = torch.tensor([70000, 600, 512, 33333], dtype=torch.int32)
    got = torch.ops.dsv41.topk_visible(scores.cuda(), visible.cuda(), 512)
    torch.cuda.synchronize()
    return {"ok": torch.equal(got.cpu(), torch.ops.dsv41.topk_visible(scores, visible, 512)),
            "what": "top-512 exact against the reference"}


def _candidates():
    scores = torch.randn(3, 20000, generator=_gen(10))
    visible = torch.tensor([20000, 5000, 17], dtype=torch.int32)
    got = torch.ops.dsv41.candidate_blocks(scores.cuda(), visible.cuda(), 64, 32)
    torch.cuda.synchronize()
    return {"ok": torch.equal(got.cpu(), torch.ops.dsv41.candidate_blocks(scores, visible, 64, 32)),
            "what": "candidate blocks exact against the reference"}


def _crc32c():
    from dsv41._ext import _C
    from dsv41.cache import io

    data = torch.randint(0, 256, (100_000,), generator=_gen(11), dtype=torch.int64).to(torch.uint8)
    ranges = [(0, 1), (3, 4095), (100, 61_440), (7, 99_993)]
    off = torch.tensor([o for o, _ in ranges], device="cuda")
    ln = torch.tensor([n for _, n in ranges], device="cuda")
    got = [c & 0xFFFFFFFF for c in _C.io.crc32c_device(data.cuda(), off, ln).cpu().tolist()]
    return {"ok": got == [io.crc32c(data[o:o + n].numpy()) for o, n in ranges], "what": "device CRC32C"}


CASES = {
    "codecs_nvfp4": lambda: _codecs("nvfp4"),
    "codecs_mxfp4": lambda: _codecs("mxfp4"),
    "codecs_fp8_swa": lambda: _codecs("fp8_swa"),
    "scatter_nvfp4": lambda: _scatter("nvfp4"),
    "scatter_mxfp4": lambda: _scatter("mxfp4"),
    "scatter_fp8_swa": lambda: _scatter("fp8_swa"),
    "copy_blocks_kernel": lambda: _copy("kernel"),
    "copy_blocks_copy_engine": lambda: _copy("copy_engine"),
    "dequant_tricks": _dequant_tricks,
    "attention_small": lambda: _attention("", T=1, K=64),
    "attention_wgmma_small": lambda: _attention("wgmma", T=1, K=64),
    "attention_mma": lambda: _attention(""),
    "attention_wgmma": lambda: _attention("wgmma"),
    "attention_generic": lambda: _attention("generic"),
    "attention_mma_d128": lambda: _attention("mma", T=4, K=128, H=8, D=128),   # v41-small's heads
    "attention_mma_d64": lambda: _attention("mma", T=4, K=8, H=4, D=64),       # v41-tiny's
    "indexer_scores": lambda: _indexer(False),
    "indexer_scores_at": lambda: _indexer(True),
    "topk": _topk,
    "candidate_blocks": _candidates,
    "crc32c_device": _crc32c,
}


def run(case: str) -> dict:
    t0 = time.perf_counter()
    try:
        import dsv41.ops  # noqa: F401  (registers every op)

        res = CASES[case]()
    except Exception as e:  # the report must say what failed, and how
        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
    res = {"case": case, **res, "seconds": round(time.perf_counter() - t0, 3)}
    res["ok"] = bool(res["ok"])
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("case", nargs="?", choices=sorted(CASES))
    p.add_argument("--list", action="store_true", help="print the case names, one a line")
    p.add_argument("--json", metavar="PATH", help="write the result here too")
    args = p.parse_args(argv)
    if args.list or not args.case:
        print("\n".join(CASES))
        return 0
    if not torch.cuda.is_available():
        res = {"case": args.case, "ok": False, "error": "no CUDA GPU visible"}
    else:
        res = run(args.case)
    text = json.dumps(res)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
