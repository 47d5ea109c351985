"""--precision: the server runs the model on the path asked for (bf16 is the production path,
the default on CUDA; the CPU defaults to the float64 reference), and a bf16 server answers
through the official client with prefix-cache hits like the reference one."""
from __future__ import annotations

from dsv41.cli import build_parser
from dsv41.model.production import default_precision
from dsv41.server.cli import options_from_args

from .conftest import LiveServer


def test_precision_flag_and_default():
    args = build_parser().parse_args(["serve", "--preset", "v41-tiny", "--precision", "bf16"])
    assert options_from_args(args).precision == "bf16"
    assert options_from_args(build_parser().parse_args(["serve"])).precision is None
    assert default_precision("cpu") == "reference" and default_precision("cuda") == "bf16"


def test_bf16_server_serves_with_cache_hits():
    s = LiveServer(precision="bf16")
    try:
        assert s.on_engine(lambda e: e.model.precision) == "bf16"
        c = s.client()
        prompt = "Production path prefix for the precision test. " * 4
        kw = dict(model="v41-tiny", max_tokens=3, temperature=0, extra_body={"cache_salt": "bf16"})
        first = c.completions.create(prompt=prompt + "a", **kw)
        second = c.completions.create(prompt=prompt + "b", **kw)
        assert first.usage.completion_tokens == 3 and second.usage.completion_tokens == 3
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens > 0
    finally:
        s.stop()
