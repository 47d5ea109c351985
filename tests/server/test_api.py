"""The OpenAI endpoints through the official `openai` client: completions and chat,
streamed and not, stop strings, seeds, n, logprobs, usage, models, health, metrics."""
from __future__ import annotations

import httpx
import pytest

from .conftest import BLOCK

SYSTEM = "You are a careful assistant for the dsv41 runtime. Answer briefly. " * 2


def test_completion_text_and_token_prompt(live):
    c = live.client()
    prompt = "The tiered prefix cache keeps"
    r = c.completions.create(model="v41-tiny", prompt=prompt, max_tokens=8, temperature=0)
    ids = live.tokenizer.encode(prompt)
    assert r.object == "text_completion" and r.model == "v41-tiny" and len(r.choices) == 1
    assert r.choices[0].text == live.reference(ids, 8)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 8, len(ids) + 8)
    # the same prompt as token ids gives the same answer
    r2 = c.completions.create(model="v41-tiny", prompt=ids, max_tokens=8, temperature=0)
    assert r2.choices[0].text == r.choices[0].text and r2.usage.prompt_tokens == len(ids)
    # several prompts: one choice each, usage counts every prompt once
    r3 = c.completions.create(model="v41-tiny", prompt=[prompt, "Another one"], max_tokens=3, temperature=0)
    assert [ch.index for ch in r3.choices] == [0, 1]
    assert r3.choices[0].text == live.reference(ids, 3)
    assert r3.usage.prompt_tokens == len(ids) + len("Another one") and r3.usage.completion_tokens == 6


def test_chat_and_streaming_equal_non_streaming(live):
    c = live.client()
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is SWA replay?"}]
    r = c.chat.completions.create(model="v41-tiny", messages=msgs, max_tokens=10, temperature=0)
    ids = live.chat_ids(msgs)
    assert ids[:len("<|system|>\n")] == list(b"<|system|>\n") and ids[-len("<|assistant|>\n"):] == list(b"<|assistant|>\n")
    text = r.choices[0].message.content
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert text == live.reference(ids, 10) and r.usage.prompt_tokens == len(ids)
    stream = c.chat.completions.create(model="v41-tiny", messages=msgs, max_tokens=10, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(ch.usage is None for ch in chunks[:-1])
    # completions stream too
    s = c.completions.create(model="v41-tiny", prompt="Stream me", max_tokens=6, temperature=0, stream=True)
    parts = list(s)
    assert "".join(p.choices[0].text for p in parts) == live.reference(live.tokenizer.encode("Stream me"), 6)
    assert parts[-1].choices[0].finish_reason == "length"


def test_stop_strings_streamed_and_not(live):
    c = live.client()
    prompt = "Stop strings cut the text"
    full = c.completions.create(model="v41-tiny", prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    k = max(3, len(full) // 2)
    stop = full[k:k + 2]
    k = full.find(stop)
    r = c.completions.create(model="v41-tiny", prompt=prompt, max_tokens=16, temperature=0, stop=[stop, "never"])
    assert r.choices[0].text == full[:k] and r.choices[0].finish_reason == "stop"
    s = c.completions.create(model="v41-tiny", prompt=prompt, max_tokens=16, temperature=0, stop=stop, stream=True)
    parts = list(s)
    assert "".join(p.choices[0].text for p in parts) == full[:k]
    assert parts[-1].choices[0].finish_reason == "stop"
    live.wait_idle()
    assert live.referenced_blocks() == 0


def test_seeded_sampling_and_n(live):
    c = live.client()
    kw = dict(model="v41-tiny", prompt="Sampling with a seed", max_tokens=8, temperature=0.9, top_p=0.95)
    a = c.completions.create(seed=7, **kw).choices[0].text
    assert c.completions.create(seed=7, **kw).choices[0].text == a
    many = c.completions.create(seed=7, n=3, **kw)
    texts = [ch.text for ch in many.choices]
    assert [ch.index for ch in many.choices] == [0, 1, 2] and texts[0] == a
    assert texts[1] == c.completions.create(seed=8, **kw).choices[0].text
    assert len(set(texts)) == 3
    assert many.usage.completion_tokens == 24 and many.usage.prompt_tokens == len("Sampling with a seed")
    greedy = c.chat.completions.create(model="v41-tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, temperature=0, n=2)
    assert len(greedy.choices) == 2 and greedy.choices[0].message.content == greedy.choices[1].message.content


def test_logprobs(live):
    c = live.client()
    r = c.completions.create(model="v41-tiny", prompt="Log probabilities", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert v <= 0 and len(top) == 2 and max(top.values()) == v and top[tok] == v   # greedy: the best
    ch = c.chat.completions.create(model="v41-tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                   temperature=0, logprobs=True, top_logprobs=3)
    content = ch.choices[0].logprobs.content
    assert len(content) == 3 and all(len(e.top_logprobs) == 3 for e in content)
    assert all(e.top_logprobs[0].logprob == e.logprob and len(e.bytes) == 1 for e in content)


def test_models_health_metrics(live):
    c = live.client()
    assert [m.id for m in c.models.list().data] == ["v41-tiny"]
    assert c.models.retrieve("v41-tiny").id == "v41-tiny"
    root = live.base_url[:-3]
    assert httpx.get(root + "/health").json() == {"status": "ok"}
    c.completions.create(model="v41-tiny", prompt="metrics " * 8, max_tokens=2, temperature=0)
    text = httpx.get(root + "/metrics").text
    for needle in ("dsv41_server_time_to_first_token_seconds_bucket", "dsv41_server_inter_token_latency_seconds_count",
                   'dsv41_server_http_requests_total{endpoint="/v1/completions",status="200"}',
                   'dsv41_engine_requests_by_path_total{path="cold"}', "dsv41_engine_steps_total",
                   'dsv41_cache_hit_tokens_total{tier="gpu"}', 'dsv41_engine_prompt_hit_tokens_total{tier="swa"}',
                   "dsv41_engine_replayed_tokens_total", 'dsv41_engine_requests_finished_total{reason="length"}'):
        assert needle in text, needle
    line = next(x for x in text.splitlines() if x.startswith("dsv41_server_time_to_first_token_seconds_count"))
    assert int(line.split()[-1]) >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_usage_reports_cached_prompt_tokens(live, stream):
    """A conversation's next turn resumes from the previous turn's end (both hit): its
    cached_tokens are the tokens it did not compute, its output that of a cold prefill."""
    c = live.client()
    salt = f"turns-{stream}"
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    r1 = c.chat.completions.create(model="v41-tiny", messages=msgs, max_tokens=4, temperature=0,
                                   extra_body={"cache_salt": salt})
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "second"}]
    kw = dict(model="v41-tiny", messages=msgs, max_tokens=6, temperature=0, extra_body={"cache_salt": salt})
    if stream:
        chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        usage, text = chunks[-1].usage, "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    else:
        r2 = c.chat.completions.create(**kw)
        usage, text = r2.usage, r2.choices[0].message.content
    assert usage.prompt_tokens_details.cached_tokens > BLOCK * 4
    assert text == live.reference(live.chat_ids(msgs), 6)
