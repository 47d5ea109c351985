"""The extension boundary: one module (dsv41._ext) loads the compiled extension, the low
layers import it rather than the package root, and the root imports the model, config,
cache and engine only when one of their names is first used."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules_after(code: str) -> set[str]:
    prog = f"import sys, json\n{code}\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith('dsv41'))))"
    p = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(ROOT / "python"), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    return set(json.loads(p.stdout.strip().splitlines()[-1]))


def test_importing_the_formats_does_not_load_the_model():
    mods = _modules_after("import dsv41.formats")
    assert "dsv41._C" in mods and "dsv41._ext" in mods
    assert not {m for m in mods if m.split(".")[1:2] and m.split(".")[1] in ("model", "engine", "cache", "config", "eval", "replay")}, mods


def test_lazy_root_names_still_resolve():
    mods = _modules_after("import dsv41\nassert dsv41.ModelConfig.preset('v41-tiny')\n"
                          "assert callable(dsv41.kv_budget) and dsv41.Model and dsv41.build_info()['version']\n"
                          "assert dsv41.Engine and 'Model' in dir(dsv41)")
    assert {"dsv41.model", "dsv41.engine", "dsv41.config"} <= mods


def test_only_the_ext_module_imports_the_extension():
    # `from .. import _C` (or `from dsv41 import _C`) anywhere but _ext.py would run the
    # package root first and bypass the one place that loads the extension.
    pattern = re.compile(r"^\s*from (\.+|dsv41) import (\w+,\s*)*_C\b", re.M)
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "python" / "dsv41").rglob("*.py")
                 if p.name != "_ext.py" and pattern.search(p.read_text())]
    assert offenders == []
