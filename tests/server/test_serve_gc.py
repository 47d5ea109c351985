"""`dsv41 serve` takes what start-up built out of the garbage collector's full passes."""
from __future__ import annotations

import gc

from dsv41.cli import build_parser
from dsv41.server import cli as serve_cli


def test_serve_freezes_what_start_up_built(monkeypatch):
    seen = {}

    def fake_serve(self, *args, **kw):  # instead of serving: what the collector would walk now
        seen["frozen"] = gc.get_freeze_count()
        seen["tracked"] = len(gc.get_objects())

    monkeypatch.setattr(serve_cli.Server, "serve", fake_serve)
    args = build_parser().parse_args(["serve", "--preset", "v41-tiny", "--no-prefix-cache"])
    gc.unfreeze()
    try:
        assert serve_cli._run(args) == 0
    finally:
        gc.unfreeze()  # the rest of the test session collects as before
    # torch and the model alone are well over 100K objects; out of reach, a full pass walks
    # only the few left.
    assert seen["frozen"] > 100_000, seen
    assert seen["tracked"] < seen["frozen"] // 10, seen
