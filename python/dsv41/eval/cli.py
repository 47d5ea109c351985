"""`dsv41 eval`: the acceptance harness on the command line.

Exit status: 0 when every contract line passes (GO), 1 when one fails (NO-GO), 2 on a bad
matrix, contract, model or output directory.
"""
from __future__ import annotations

import argparse
import json
import sys

from ..argcheck import device, output_dir, read_regular_file

INPUT_MAX_BYTES = 4 << 20   # a matrix or contract file: a few KB of YAML


def add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="run the replay acceptance matrix against a contract "
                                    "(docs/design.md#acceptance)",
                       description="Run every cell of MATRIX through the four cache states and the "
                                   "replay switches, judge CONTRACT, write report.md, results.json and "
                                   "plots into OUT. With no arguments: the shipped matrix and contract "
                                   "on the shipped trained model v41-tiny-tasks.")
    p.add_argument("--matrix", metavar="MATRIX.yaml", help="the matrix (default: the shipped one)")
    p.add_argument("--contract", metavar="CONTRACT.yaml", help="the pass criteria (default: the shipped one)")
    p.add_argument("--out", metavar="DIR", type=output_dir, default="dsv41-eval",
                   help="output directory (default: dsv41-eval); "
                   "an interrupted run there resumes")
    p.add_argument("--model", metavar="DIR|NAME", help="a checkpoint directory (save_pretrained "
                   "layout) or a shipped checkpoint's name (v41-tiny-tasks); overrides the matrix's model")
    p.add_argument("--device", type=device, default=None, help="cpu, cuda or cuda:N for the model (default cpu)")
    p.add_argument("--fresh", action="store_true", help="discard an earlier run in OUT instead of resuming")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--json", action="store_true", help="print the verdicts as JSON on stdout")
    p.set_defaults(func=_cmd_eval)


def _cmd_eval(args: argparse.Namespace) -> int:
    from . import ContractError, MatrixError, evaluate
    from .runner import RunError

    try:
        for path in (args.matrix, args.contract):   # a FIFO or /dev/zero would block or never end
            if path is not None:
                try:
                    read_regular_file(path, INPUT_MAX_BYTES).decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
        summary = evaluate(args.matrix, args.contract, args.out, model_dir=args.model, device=args.device,
                           progress=not args.no_progress, fresh=args.fresh, plots=not args.no_plots)
    except (MatrixError, ContractError, RunError, OSError, ValueError) as e:
        why = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.strerror and e.filename else e
        print(f"dsv41 eval: {why}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"verdict": summary["verdict"], "out": summary["out"],
                          "verdicts": summary["verdicts"]}, indent=2))
    else:
        for v in summary["verdicts"]:
            iv = "-" if v["lo"] is None else f"[{v['lo']:.4g}, {v['hi']:.4g}]"
            print(f"{'PASS' if v['pass'] else 'FAIL'}  {v['id']}: {v['text']}  n={v['n']} {iv}")
        print(f"{summary['verdict']}  report: {summary['out']}/report.md")
    return 0 if summary["verdict"] == "GO" else 1
