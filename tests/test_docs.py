"""The docs stay true to what they cite: docs/performance.md's tables equal what the JSON in
bench/results/ says, every result file there is listed, and every `<page>.md#<anchor>` that
code or docs cite names a heading that exists (code comments cite docs/design.md by
anchor, so renaming a heading must fail here, not silently)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# Text that may cite a docs page by anchor.
CITING = ["README.md", "CONTRIBUTING.md", "docs", "python", "tests", "bench", "scripts", "include", "csrc"]
SUFFIXES = {".md", ".py", ".h", ".cuh", ".cpp", ".cu", ".sh", ".yaml", ".toml"}


def _perf_tables():
    spec = importlib.util.spec_from_file_location("perf_tables", ROOT / "scripts" / "perf_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_performance_tables_equal_the_result_files():
    doc = (DOCS / "performance.md").read_text()
    assert _perf_tables().render(doc) == doc, \
        "docs/performance.md differs from bench/results/: run python scripts/perf_tables.py --write"


def test_every_result_file_is_listed_in_performance_md():
    doc = (DOCS / "performance.md").read_text()
    results = ROOT / "bench" / "results"
    missing = [p.name for p in sorted(results.glob("*.json")) if p.name not in doc]
    missing += [p.name for p in sorted(results.iterdir()) if p.is_dir() and p.name not in doc]
    assert not missing, f"bench/results/ files that docs/performance.md does not list: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        s = _slug(line.lstrip("#"))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def _cited_pages(text: str, src: Path):
    for m in re.finditer(r"([\w./-]*?)\b([A-Za-z_][\w-]*\.md)#([\w-]+)", text):
        prefix, name, anchor = m.groups()
        here = src.parent / prefix / name
        for cand in (here, DOCS / name, ROOT / name):
            if cand.is_file():
                yield cand, anchor, m.group(0)
                break
        else:
            yield None, anchor, m.group(0)
    if src.suffix == ".md":
        for m in re.finditer(r"\]\(#([\w-]+)\)", text):
            yield src, m.group(1), m.group(0)


def test_every_cited_doc_anchor_exists():
    broken = []
    files = []
    for entry in CITING:
        p = ROOT / entry
        files += [p] if p.is_file() else [f for f in p.rglob("*") if f.suffix in SUFFIXES]
    for src in files:
        if "third_party" in src.parts or not src.is_file():
            continue
        for page, anchor, cite in _cited_pages(src.read_text(errors="replace"), src):
            if page is None or anchor not in _anchors(page):
                broken.append(f"{src.relative_to(ROOT)}: {cite}")
    assert not broken, "citations of headings that do not exist:\n" + "\n".join(broken)
