"""The acceptance harness (docs/design.md#acceptance): the replay go/no-go matrix as a tool.

    from dsv41.eval import evaluate
    summary = evaluate()                                   # shipped matrix + contract, v41-tiny
    summary = evaluate("matrix.yaml", "contract.yaml", out="eval-out", model_dir="ckpt/")
    summary["verdict"]        # "GO" | "NO-GO"; summary["verdicts"]: one per contract line

Command line: `dsv41 eval [--matrix M] [--contract C] [--out DIR] [--model DIR]`.
Modules: matrix (the YAML, cells), contract (criteria, bootstrap verdicts), tasks (prompt
generators and scorers), metrics, runner (states x replay switches, resumable), backend
(dsv41.Engine), report (report.md, results.json, PNGs). docs/eval.md has the details.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from .contract import Contract, ContractError, load_contract
from .matrix import Matrix, MatrixError, load_matrix

__all__ = ["evaluate", "default_matrix", "default_contract", "load_model", "Matrix", "Contract",
           "MatrixError", "ContractError", "load_matrix", "load_contract"]


def _default_text(name: str) -> str:
    return resources.files("dsv41.eval").joinpath("defaults", name).read_text()


def default_matrix() -> Matrix:
    return Matrix.from_yaml(_default_text("matrix.yaml"), "defaults/matrix.yaml")


def default_contract() -> Contract:
    return Contract.from_yaml(_default_text("contract.yaml"), "defaults/contract.yaml")


def load_model(spec: dict, model_dir: str | None = None, device: str | None = None):
    """(model, source record): a checkpoint directory or shipped checkpoint name (model_dir,
    spec["checkpoint"] or spec["shipped"]; dsv41.checkpoints) or a synthetic preset
    (spec["preset"], spec["seed"])."""
    from ..checkpoints import resolve, shipped_path
    from ..config import ModelConfig
    from ..model import Model

    dev = device or "cpu"
    if model_dir is None and spec.get("shipped"):
        path = shipped_path(spec["shipped"])
        return Model.from_pretrained(path, device=dev), {"shipped": spec["shipped"]}
    path = model_dir or spec.get("checkpoint")
    if path:
        path = resolve(path)
        return Model.from_pretrained(path, device=dev), {"checkpoint": str(Path(path).resolve())}
    seed = int(spec.get("seed", 0))
    return (Model.synthetic(ModelConfig.preset(spec["preset"]), seed=seed, device=dev),
            {"preset": spec["preset"], "seed": seed, "weights": "synthetic"})


def evaluate(matrix: str | Path | Matrix | None = None, contract: str | Path | Contract | None = None,
             out: str | Path = "dsv41-eval", *, model=None, model_dir: str | None = None,
             device: str | None = None, progress: bool = True, fresh: bool = False,
             plots: bool = True) -> dict:
    """Run (or resume) the matrix against the contract and write the report into `out`.
    Returns the summary (verdict, verdicts, aggregates) plus "out"."""
    import shutil

    from .backend import EngineBackend
    from .report import write_report
    from .runner import run_matrix

    mx = matrix if isinstance(matrix, Matrix) else (load_matrix(matrix) if matrix else default_matrix())
    ct = contract if isinstance(contract, Contract) else (load_contract(contract) if contract else default_contract())
    if model is None:
        model, source = load_model(mx.model, model_dir, device)
    else:
        source = {"object": type(model).__name__}
    out = Path(out)
    if fresh and out.exists():
        for name in ("frozen.json", "cells.jsonl", "results.json", "report.md"):
            (out / name).unlink(missing_ok=True)
    backend = EngineBackend(model, block_tokens=mx.block_tokens, max_batch=mx.max_batch,
                            write_approximate=mx.write_approximate, model_source=source)
    result = run_matrix(mx, ct, backend, out, progress=progress)
    summary = write_report(result, ct, out, plots=plots)
    return {**summary, "out": str(out)}
