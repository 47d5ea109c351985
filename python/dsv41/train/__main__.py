"""python -m dsv41.train --out DIR [--steps N --seed S ...]: train the small task model."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from .loop import Recipe, train


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv41.train", description=__doc__)
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    kinds = {"int": int, "float": float, "str": str}     # the scalar fields of Recipe
    for f in dataclasses.fields(Recipe):
        if f.type in kinds:
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=kinds[f.type], default=None,
                            help=f"default {f.default!r}")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    over = {f.name: getattr(args, f.name) for f in dataclasses.fields(Recipe)
            if getattr(args, f.name, None) is not None}
    recipe = Recipe(**over)
    final = train(recipe, args.out, progress=not args.quiet)
    json.dump({"held_out_exact": final}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
