"""The cache package never imports the model or anything above itself (STYLE: formats <
ops < model < cache < engine < server/eval/cli). It knows a model only through duck typing
(PrefixCache.for_model/bind); engine/cache_adapter.py converts between the two."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import dsv41.cache
import pytest

CACHE_DIR = Path(dsv41.cache.__file__).parent
FORBIDDEN = ("dsv41.model", "dsv41.engine", "dsv41.eval", "dsv41.server", "dsv41.replay", "dsv41.cli")


def _imports(path: Path) -> list[str]:
    """Absolute names of every module a file imports (at any depth: also inside functions)."""
    rel = path.relative_to(CACHE_DIR.parent).with_suffix("")
    return _imports_of(path.read_text(), ["dsv41", *rel.parts[:-1]])  # a file's package (an __init__'s too)


def _imports_of(source: str, package: list[str]) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out += [mod] + [f"{mod}.{a.name}" for a in node.names]
    return out


def test_no_cache_module_imports_the_model_or_a_higher_layer():
    files = sorted(CACHE_DIR.rglob("*.py"))
    assert len(files) > 5
    bad = {str(f.relative_to(CACHE_DIR)): name for f in files for name in _imports(f)
           if name.startswith(FORBIDDEN)}
    assert not bad, f"cache modules import higher layers: {bad}"


def test_the_check_sees_relative_imports():
    """The AST check resolves `from ..model import X` (what cache/adapter.py used to do)."""
    names = _imports_of("from ..model import Model\nfrom . import hashing\ndef f():\n    import dsv41.engine\n",
                        ["dsv41", "cache"])
    assert {"dsv41.model", "dsv41.cache.hashing", "dsv41.engine"} <= set(names)
    store = _imports_of("from ...model import Model\n", ["dsv41", "cache", "store"])
    assert "dsv41.model" in store


def test_importing_the_cache_does_not_load_the_model():
    code = ("import sys, json; import dsv41; root = 'dsv41.model' in sys.modules; "
            "import dsv41.cache, dsv41.cache.manager, dsv41.cache.cli; "
            "print(json.dumps([root, 'dsv41.model' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": ":".join(p for p in sys.path if p), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    root, after = json.loads(out.stdout)
    if root:
        pytest.skip("the package root (dsv41/__init__.py) imports the model eagerly; the static "
                    "check above covers the cache's own imports")
    assert not after


# The prefix cache and its tiers on no import circle (cache/remote/hook.py once imported the
# manager back): tests/test_import_cycles.py holds the whole package to no circle at all.
