"""Checkpoints shipped inside the package (data files next to this module).

    from dsv41.checkpoints import resolve
    model = Model.from_pretrained(resolve("v41-tiny-tasks"))

`v41-tiny-tasks`: the v41-tiny model trained on the eval harness's tasks (docs/train.md;
its directory holds the recipe, the training log and plot next to the weights). It is
the default model of `dsv41 eval` and a `dsv41 demo --model` option.
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["SHIPPED", "resolve", "shipped_path"]

_HERE = Path(__file__).resolve().parent
SHIPPED = {"v41-tiny-tasks": "v41-tiny trained on the eval harness's tasks (docs/train.md)"}


def shipped_path(name: str) -> Path:
    """The directory of a shipped checkpoint; KeyError names the shipped ones."""
    if name not in SHIPPED:
        raise KeyError(f"no shipped checkpoint {name!r}; shipped: {', '.join(sorted(SHIPPED))}")
    path = _HERE / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the shipped checkpoint {name!r} is missing from {path} "
                                f"(an install without package data?)")
    return path


def resolve(name_or_dir: str | Path) -> Path:
    """A checkpoint directory: an existing directory as given, else a shipped name."""
    p = Path(name_or_dir)
    if p.is_dir() or str(name_or_dir) not in SHIPPED:
        return p
    return shipped_path(str(name_or_dir))
