"""Metrics registry: values, dict export, and valid Prometheus text exposition."""
from __future__ import annotations

import re

import pytest

from dsv41.cache.metrics import CacheMetrics, MetricsRegistry

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(\\.|[^"\\])*"'
                     r'(,[a-zA-Z_][a-zA-Z0-9_]*="(\\.|[^"\\])*")*)\})? (-?[0-9.e+-]+|\+Inf|NaN)$')


def check_exposition(text: str) -> dict:
    """Parses Prometheus text format strictly enough to catch malformed output."""
    types, samples = {}, {}
    for line in text.strip().split("\n"):
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram") and name not in types
            types[name] = kind
            continue
        m = _SAMPLE.match(line)
        assert m, f"bad sample line: {line!r}"
        base = m.group(1)
        for suffix in ("_bucket", "_sum", "_count"):
            if base.endswith(suffix) and base[: -len(suffix)] in types:
                base = base[: -len(suffix)]
        assert base in types, f"sample {line!r} before its TYPE"
        samples[line.rsplit(" ", 1)[0]] = float(line.rsplit(" ", 1)[1].replace("+Inf", "inf"))
    return samples


def test_counter_gauge_histogram_values():
    r = MetricsRegistry()
    c = r.counter("x_total", "x", ["tier"])
    c.inc(2, tier="gpu")
    c.inc(tier="gpu")
    assert c.value(tier="gpu") == 3 and c.value(tier="ssd") == 0
    with pytest.raises(ValueError):
        c.inc(-1, tier="gpu")
    with pytest.raises(ValueError):
        c.inc(1)
    h = r.histogram("lat_seconds", "lat", buckets=(0.1, 1.0))
    for v in (0.05, 0.5, 0.5, 5.0):
        h.observe(v)
    snap = h.snapshot()
    assert snap["count"] == 4 and snap["sum"] == pytest.approx(6.05)
    assert snap["buckets"] == {"0.1": 1, "1": 3, "+Inf": 4}
    d = r.to_dict()
    assert d["x_total"] == {"tier=gpu": 3} and d["lat_seconds"]["count"] == 4


def test_prometheus_text_is_valid():
    m = CacheMetrics()
    m.record_lookup(100, {"gpu": 64, "ssd": 0, "swa": 10})
    m.lookup_seconds.observe(0.003)
    m.evictions.inc(tier="gpu", cause="capacity")
    m.checksum_failures.inc(kind='we"ird\\label\n')
    text = m.to_prometheus()
    samples = check_exposition(text)
    assert samples['dsv41_cache_hit_tokens_total{tier="gpu"}'] == 64
    assert samples["dsv41_cache_lookups_total"] == 1
    assert samples['dsv41_cache_lookup_seconds_bucket{le="+Inf"}'] == samples["dsv41_cache_lookup_seconds_count"] == 1
    assert samples['dsv41_cache_hit_rate{tier="gpu"}'] == pytest.approx(0.64)
    assert 'kind="we\\"ird\\\\label\\n"' in text
    # Buckets are cumulative.
    buckets = [v for k, v in samples.items() if k.startswith("dsv41_cache_lookup_seconds_bucket")]
    assert buckets == sorted(buckets)
