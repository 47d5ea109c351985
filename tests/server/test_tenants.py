"""Tenants: cache_salt or the X-Cache-Namespace header picks the cache namespace; one
tenant's cached prefix is invisible to another."""
from __future__ import annotations

PROMPT = "Shared repository context for the tenant test. " * 6


def _cached(c, **kw) -> int:
    r = c.completions.create(model="v41-tiny", prompt=PROMPT + kw.pop("tail", "q"), max_tokens=2,
                             temperature=0, **kw)
    return r.usage.prompt_tokens_details.cached_tokens


def test_tenants_never_share_kv(live):
    c = live.client()
    assert _cached(c, extra_body={"cache_salt": "tenant-a"}) == 0
    assert _cached(c, extra_body={"cache_salt": "tenant-a"}, tail="r") > 0
    assert _cached(c, extra_headers={"X-Cache-Namespace": "tenant-a"}, tail="s") > 0   # same tenant
    assert _cached(c, extra_body={"cache_salt": "tenant-b"}) == 0
    assert _cached(c, extra_headers={"X-Cache-Namespace": "tenant-c"}) == 0
    assert _cached(c) == 0                                                  # no tenant: its own namespace
    assert _cached(c, tail="t") > 0


def test_shared_prefix_hit_equals_uncached_output(live_exact):
    """A second request sharing a long prefix (not the first's continuation) hits the cache;
    with exact replay its greedy output is a cold prefill's."""
    c = live_exact.client()
    prefix = "Long shared system prompt with tools and a repository map. " * 4
    first = c.completions.create(model="v41-tiny", prompt=prefix + "first question", max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = c.completions.create(model="v41-tiny", prompt=prefix + "second question", max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    ids = live_exact.tokenizer.encode(prefix + "second question")
    assert second.choices[0].text == live_exact.reference(ids, 8)


def test_cache_dir_survives_a_restart(tmp_path):
    """--cache-dir: a restarted server finds the prefix on the SSD tier."""
    from .conftest import LiveServer

    prompt = "Persistent prefix for the restart test. " * 5
    got = []
    for _ in range(2):
        s = LiveServer(cache_dir=str(tmp_path / "store"))
        try:
            r = s.client().completions.create(model="v41-tiny", prompt=prompt, max_tokens=2, temperature=0)
            got.append(r.usage.prompt_tokens_details.cached_tokens)
            ssd_hits = s.on_engine(lambda e: e.cache.metrics.hit_tokens.value(tier="ssd"))
        finally:
            s.stop()
    assert got[0] == 0 and got[1] > 0 and ssd_hits > 0
