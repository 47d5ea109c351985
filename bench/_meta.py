"""What every benchmark records about where it ran (torch-free, so light drivers can use it).

    python bench/_meta.py        # prints the project's short commit (scripts/gpu_check.sh)
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    return subprocess.check_output(["git", *args], text=True, cwd=ROOT, stderr=subprocess.DEVNULL,
                                   timeout=10).strip()


def git_commit() -> str | None:
    """The project's short commit hash: DSV41_COMMIT when set (a GPU run works on a copy of
    the tree without .git, and scripts/gpu_check.sh passes the commit on), else HEAD of the
    git checkout whose top is this project's root. None otherwise: a copy of the tree that
    merely sits inside another repository must not record that repository's commit."""
    given = os.environ.get("DSV41_COMMIT", "").strip()
    if given and given != "unknown":
        return given
    try:
        if Path(_git("rev-parse", "--show-toplevel")).resolve() != ROOT:
            return None
        return _git("rev-parse", "--short", "HEAD") or None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    commit = git_commit()
    print(commit or "unknown")
    sys.exit(0 if commit else 1)
