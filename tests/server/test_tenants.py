"""Tenants: API keys, namespaces and what a response may say about the cache.

The probe is the attack of issue 30: a victim sends a prompt holding a secret digit; an
attacker sends the same prompt with each digit in turn and watches which one the cache
knows (cached_tokens, or the prefill work behind the time to first token)."""
from __future__ import annotations

import os

import httpx
import openai
import pytest

from dsv41.server.tenancy import KEY_FILE_MAX_BYTES, ApiKeys, Tenancy, Tenant

from .conftest import BLOCK, LiveServer

PROMPT = "Shared repository context for the tenant test. " * 6
HEAD = "Deploy notes for the staging cluster. " * 3 + "The door code is "
TAIL = ". Keep it safe and never share it with anyone outside the team, please. " * 2
DIGITS = "0257"            # candidates for the secret digit (7), few to keep the test short


def _cached(c, **kw) -> int | None:
    r = c.completions.create(model="v41-tiny", prompt=PROMPT + kw.pop("tail", "q"), max_tokens=2,
                             temperature=0, **kw)
    d = r.usage.prompt_tokens_details
    return None if d is None else d.cached_tokens


def _probe(server: LiveServer, victim: openai.OpenAI, attacker: openai.OpenAI, **kw) -> dict:
    """Per digit: the attacker's cached_tokens (None: not reported) and the tokens its
    prefill computed, after the victim sent digit 7."""
    victim.completions.create(model="v41-tiny", prompt=HEAD + "7" + TAIL, max_tokens=1, temperature=0, **kw)
    # the attacker's first request caches HEAD in its own namespace, so every digit below
    # starts from the same state
    attacker.completions.create(model="v41-tiny", prompt=HEAD + "x", max_tokens=1, temperature=0, **kw)
    out = {}
    for d in DIGITS:
        before = server.metric("dsv41_engine_prefill_tokens_total")
        r = attacker.completions.create(model="v41-tiny", prompt=HEAD + d + TAIL + "?", max_tokens=1,
                                        temperature=0, **kw)
        details = r.usage.prompt_tokens_details
        out[d] = (None if details is None else details.cached_tokens,
                  server.metric("dsv41_engine_prefill_tokens_total") - before)
    return out


def test_the_probe_recovers_a_digit_from_a_shared_namespace():
    """The control: with cached_tokens reported in a shared namespace (--cached-tokens
    always, no keys), the probe finds the digit both ways. The tests below run the same
    probe against the defaults."""
    s = LiveServer(cached_tokens="always")
    try:
        c = s.client()
        got = _probe(s, c, c)
        cached = {d: v[0] for d, v in got.items()}
        computed = {d: v[1] for d, v in got.items()}
        assert max(cached, key=cached.get) == "7" and cached["7"] >= cached["0"] + 2 * BLOCK
        assert min(computed, key=computed.get) == "7" and computed["7"] <= computed["0"] - 2 * BLOCK
    finally:
        s.stop()


def test_api_keys_isolate_tenants_from_the_probe():
    """Each key its own namespace: the attacker's probes see exactly the same cache state
    for every digit: equal cached_tokens and equal prefill work (so equal time)."""
    s = LiveServer(api_keys=("victim-key", "attacker-key"))
    try:
        got = _probe(s, s.client(api_key="victim-key"), s.client(api_key="attacker-key"))
        assert len({v for v in got.values()}) == 1, got
        assert got["7"][0] is not None and got["7"][0] >= BLOCK     # its own HEAD: reported
    finally:
        s.stop()


def test_default_namespace_hides_cached_tokens(live):
    """No keys, no salt: one shared namespace, so cached_tokens is not reported there (the
    control above shows what it would give away); a salted namespace reports it."""
    c = live.client()
    assert _cached(c, tail="a") is None and _cached(c, tail="b") is None
    got = _probe(live, c, c)
    assert {v[0] for v in got.values()} == {None}
    assert _cached(c, extra_body={"cache_salt": "mine"}, tail="c") == 0
    assert _cached(c, extra_body={"cache_salt": "mine"}, tail="d") > 0


def test_tenants_never_share_kv(live):
    c = live.client()
    assert _cached(c, extra_body={"cache_salt": "tenant-a"}) == 0
    assert _cached(c, extra_body={"cache_salt": "tenant-a"}, tail="r") > 0
    assert _cached(c, extra_headers={"X-Cache-Namespace": "tenant-a"}, tail="s") > 0   # same tenant
    assert _cached(c, extra_body={"cache_salt": "tenant-b"}) == 0
    assert _cached(c, extra_headers={"X-Cache-Namespace": "tenant-c"}) == 0


def test_keys_401_shared_tenants_and_salts(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# key tenant\nteam-key-1 team\nteam-key-2 team\n\nsolo-key\n")
    s = LiveServer(api_key_file=str(keys))
    try:
        for bad in (None, "wrong-key", "team"):
            headers = {} if bad is None else {"Authorization": f"Bearer {bad}"}
            r = httpx.post(s.base_url + "/completions", headers=headers,
                           json={"model": "v41-tiny", "prompt": "x", "max_tokens": 1})
            err = r.json()["error"]
            assert r.status_code == 401 and err["code"] == "invalid_api_key", r.text
            assert err["type"] == "invalid_request_error" and r.headers["www-authenticate"] == "Bearer"
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="nope").models.list()
        assert httpx.get(s.root + "/health").status_code == 200       # probes and scrapers stay open
        assert httpx.get(s.root + "/metrics").status_code == 200
        one, two, solo = (s.client(api_key=k) for k in ("team-key-1", "team-key-2", "solo-key"))
        assert _cached(one) == 0
        assert _cached(two, tail="r") > 0                        # declared to share one namespace
        assert _cached(solo, tail="s") == 0                      # its own
        assert _cached(one, extra_body={"cache_salt": "x"}, tail="t") == 0    # a salt subdivides
    finally:
        s.stop()


def test_require_salt():
    s = LiveServer(require_salt=True)
    try:
        c = s.client()
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="v41-tiny", prompt="x", max_tokens=1)
        assert e.value.response.json()["error"]["param"] == "cache_salt"
        assert _cached(c, extra_body={"cache_salt": "s1"}) == 0
        assert _cached(c, extra_headers={"X-Cache-Namespace": "s1"}, tail="r") > 0
    finally:
        s.stop()


def test_namespaces_are_injective_and_never_hold_a_key(tmp_path):
    t = Tenancy(ApiKeys.load(["k1"]))
    mine = t.keys.tenant("k1")
    assert mine.name.startswith("key-") and "k1" not in mine.name
    names = {t.namespace(Tenant(None), None)[0], t.namespace(Tenant(None), "a")[0],
             t.namespace(Tenant("team"), None)[0], t.namespace(Tenant("team"), "a")[0],
             t.namespace(mine, None)[0], t.namespace(Tenant(None), "team")[0]}
    assert len(names) == 6
    assert t.namespace(Tenant(None), None) == ("", False) and t.namespace(Tenant(None), "a") == ("/a", True)
    bad = tmp_path / "bad.txt"
    for text, msg in (("k1 team extra\n", "KEY TENANT"), ("k1 a/b\n", "tenant name"),
                      ("k1 key-x\n", "tenant name"), ("k1 a\nk1 b\n", "twice")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=msg):
            ApiKeys.load(key_file=bad)


def test_key_file_is_read_bounded(tmp_path):
    """A key file is read whole, so only a regular file of bounded size is read at all: a
    FIFO would block the server's start and /dev/zero would never end (issue 29 item 4)."""
    good = tmp_path / "keys.txt"
    good.write_text("# ops\nk1 team\n\nk2 team\nk3\n")
    keys = ApiKeys.load(key_file=good)
    assert len(keys) == 3 and keys.tenant("k1") == keys.tenant("k2") == Tenant("team")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big.txt"
    big.write_text("k1\n" * (KEY_FILE_MAX_BYTES // 3 + 1))
    binary = tmp_path / "binary"
    binary.write_bytes(b"k1 \xff\xfe\n")
    for path, msg in ((fifo, "not a regular file"), ("/dev/zero", "not a regular file"),
                      (tmp_path, "a directory"), (big, "allowed"), (binary, "not UTF-8")):
        with pytest.raises(ValueError, match=msg):
            ApiKeys.load(key_file=path)
    with pytest.raises(FileNotFoundError):
        ApiKeys.load(key_file=tmp_path / "missing")


def test_shared_prefix_hit_equals_uncached_output(live_exact):
    """A second request sharing a long prefix (not the first's continuation) hits the cache;
    with exact replay its greedy output is a cold prefill's."""
    c = live_exact.client()
    prefix = "Long shared system prompt with tools and a repository map. " * 4
    kw = dict(model="v41-tiny", temperature=0, extra_body={"cache_salt": "exact"})
    first = c.completions.create(prompt=prefix + "first question", max_tokens=2, **kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = c.completions.create(prompt=prefix + "second question", max_tokens=8, **kw)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    ids = live_exact.tokenizer.encode(prefix + "second question")
    assert second.choices[0].text == live_exact.reference(ids, 8)


def test_cache_dir_survives_a_restart(tmp_path):
    """--cache-dir: a restarted server finds the prefix on the SSD tier."""
    prompt = "Persistent prefix for the restart test. " * 5
    got = []
    for _ in range(2):
        s = LiveServer(cache_dir=str(tmp_path / "store"))
        try:
            r = s.client().completions.create(model="v41-tiny", prompt=prompt, max_tokens=2, temperature=0,
                                              extra_body={"cache_salt": "restart"})
            got.append(r.usage.prompt_tokens_details.cached_tokens)
            ssd_hits = s.on_engine(lambda e: e.cache.metrics.hit_tokens.value(tier="ssd"))
        finally:
            s.stop()
    assert got[0] == 0 and got[1] > 0 and ssd_hits > 0
