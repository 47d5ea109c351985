"""bench/_meta.py: the commit a benchmark records is this project's, never that of a git
repository the checkout happens to sit in (the first GPU run recorded such a stranger's
commit: the tree was copied, without .git, into a folder inside another repository)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GIT = ["git", "-c", "user.name=dsv41 tests", "-c", "user.email=tests@dsv41.invalid", "-c", "init.defaultBranch=main"]

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _repo(path: Path) -> str:
    """A git repository at `path` with one commit of what is there; its short hash."""
    subprocess.run([*GIT, "init", "-q", str(path)], check=True, timeout=30)
    (path / "README").write_text(path.name + "\n")
    subprocess.run([*GIT, "-C", str(path), "add", "-A"], check=True, timeout=30)
    subprocess.run([*GIT, "-C", str(path), "commit", "-q", "-m", "one"], check=True, timeout=30)
    return subprocess.check_output(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], text=True).strip()


def _commit_seen_by(project: Path, **env) -> str:
    """What the project's copy of bench/_meta.py prints, run as gpu_check.sh runs it."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GIT_") and k != "DSV41_COMMIT"}
    p = subprocess.run([sys.executable, str(project / "bench" / "_meta.py")], capture_output=True, text=True,
                       timeout=60, env={**clean, **env})
    return p.stdout.strip()


def _project_copy(where: Path) -> Path:
    (where / "bench").mkdir(parents=True)
    shutil.copy(ROOT / "bench" / "_meta.py", where / "bench" / "_meta.py")
    return where


def test_a_copy_inside_another_repository_records_no_commit(tmp_path):
    outer = tmp_path / "outer"
    outer.mkdir()
    outer_commit = _repo(outer)
    project = _project_copy(outer / "work" / "dsv41")
    assert _commit_seen_by(project) == "unknown", f"recorded the enclosing repository's {outer_commit}"
    # gpu_check.sh passes the real commit on; benchmarks then record it.
    assert _commit_seen_by(project, DSV41_COMMIT="abc1234") == "abc1234"


def test_a_nested_checkout_records_its_own_commit(tmp_path):
    outer = tmp_path / "outer"
    outer.mkdir()
    outer_commit = _repo(outer)
    project = _project_copy(outer / "dsv41")
    own = _repo(project)
    assert own != outer_commit
    assert _commit_seen_by(project) == own
