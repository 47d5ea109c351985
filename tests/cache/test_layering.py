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


def _import_graph() -> dict[str, set[str]]:
    """Module -> the cache modules it imports (at any depth, TYPE_CHECKING imports too)."""
    mods = {}
    for f in CACHE_DIR.rglob("*.py"):
        parts = list(f.relative_to(CACHE_DIR.parent).with_suffix("").parts)
        mods[".".join(["dsv41"] + (parts[:-1] if parts[-1] == "__init__" else parts))] = f
    graph = {}
    for name, f in mods.items():
        out = set()
        for imported in _imports(f):
            while imported and imported not in mods:   # a name inside a module: the module
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                out.add(imported)
        graph[name] = out
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_the_prefix_cache_and_its_tiers_are_on_no_import_cycle():
    """PrefixCache reaches the tiers through cache/tiers (the protocol); no tier imports the
    manager back (cache/remote/hook.py once did, for its type hints)."""
    graph = _import_graph()
    assert "dsv41.cache.tiers.ssd" in graph and "dsv41.cache.manager" in graph
    mine = ("dsv41.cache.manager", "dsv41.cache.match", "dsv41.cache.tiers", "dsv41.cache.remote")
    bad = [sorted(c) for c in _cycles(graph) if any(m.startswith(mine) for m in c)]
    assert not bad, f"import cycles through the prefix cache or its tiers: {bad}"
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
