"""Every error case answers OpenAI's error JSON with the right status, naming the field."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from .conftest import LiveServer


def _err(excinfo) -> dict:
    return excinfo.value.body if isinstance(excinfo.value.body, dict) and "message" in excinfo.value.body \
        else excinfo.value.response.json()["error"]


def test_unknown_model_404(live):
    c = live.client()
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    body = e.value.response.json()["error"]
    assert body["code"] == "model_not_found" and body["param"] == "model" and "gpt-4" in body["message"]
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")


@pytest.mark.parametrize("kw, param", [
    (dict(temperature=5), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(logprobs=9), "logprobs"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(presence_penalty=1.0), "presence_penalty"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(extra_body={"frobnicate": 1}), "frobnicate"),
    (dict(prompt=[1, 2, 999]), "prompt"),
    (dict(prompt=""), "prompt"),
    (dict(prompt=[7] * 5000), "prompt"),
    (dict(max_tokens=4000, prompt=[7] * 200), "max_tokens"),
    (dict(extra_body={"cache_salt": "a"}, extra_headers={"X-Cache-Namespace": "b"}), "cache_salt"),
])
def test_invalid_completion_400_names_the_field(live, kw, param):
    c = live.client()
    args = dict(model="v41-tiny", prompt="hello", max_tokens=2) | kw
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(**args)
    body = e.value.response.json()["error"]
    assert e.value.status_code == 400 and body["param"] == param and body["type"] == "invalid_request_error"
    assert body["message"]
    if param in ("prompt", "max_tokens") and isinstance(kw.get("prompt"), list) and len(kw["prompt"]) > 100:
        assert body["code"] == "context_length_exceeded" and "4096" in body["message"]


@pytest.mark.parametrize("field, value, expected", [
    ("stream", "yes", "a boolean"),
    ("max_tokens", "5", "an integer"),
    ("temperature", "0", "a number"),
    ("n", True, "an integer"),
    ("seed", 1.5, "an integer"),
    ("logprobs", False, "an integer"),
])
def test_wrong_json_types_400_naming_the_field(live, field, value, expected):
    """Strict types, as OpenAI: a value of the wrong JSON type is refused, never coerced."""
    body = {"model": "v41-tiny", "prompt": "hello", "max_tokens": 2, field: value}
    r = httpx.post(live.base_url + "/completions", json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == field and err["type"] == "invalid_request_error", r.text
    assert expected in err["message"] and field in err["message"]
    chat = {"model": "v41-tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, field: value}
    if field != "logprobs":
        r = httpx.post(live.base_url + "/chat/completions", json=chat)
        assert r.status_code == 400 and r.json()["error"]["param"] == field
    r = httpx.post(live.base_url + "/completions", json={**body, "prompt": [1, True, 3], field: 1 if
                                                         field != "stream" else False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_invalid_chat_and_bodies(live):
    c = live.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="v41-tiny", messages=[{"role": "wizard", "content": "x"}])
    assert e.value.response.json()["error"]["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="v41-tiny", messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    assert e.value.response.json()["error"]["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="v41-tiny", messages=[])
    assert e.value.response.json()["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="v41-tiny", messages=[{"role": "user", "content": "x" * 5000}])
    assert e.value.response.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(live.base_url + "/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(live.base_url + "/completions", json={"prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    r = httpx.get(live.base_url + "/nothing-here")
    assert r.status_code == 404 and "error" in r.json()


def test_full_queue_503_then_recovers():
    s = LiveServer(max_pending=2)
    try:
        async def main():
            client = s.async_client()
            streams = [await client.completions.create(model="v41-tiny", prompt=f"hold {i}", max_tokens=3000,
                                                       temperature=0, stream=True) for i in range(2)]
            for st in streams:
                await st.__anext__()          # both are in the engine
            with pytest.raises(openai.APIStatusError) as e:
                await client.completions.create(model="v41-tiny", prompt="one too many", max_tokens=1)
            assert e.value.status_code == 503 and e.value.response.json()["error"]["code"] == "overloaded"
            assert e.value.response.headers["retry-after"] == "1"
            with pytest.raises(openai.APIStatusError) as e:     # n counts: 2 choices do not fit either
                await client.completions.create(model="v41-tiny", prompt="x", max_tokens=1, n=3)
            assert e.value.status_code == 503
            for st in streams:
                await st.close()
            await client.close()
        asyncio.run(asyncio.wait_for(main(), 60))
        s.wait_idle()
        assert s.referenced_blocks() == 0
        r = s.client().completions.create(model="v41-tiny", prompt="room again", max_tokens=2)
        assert r.choices[0].finish_reason == "length"
        text = httpx.get(s.base_url[:-3] + "/metrics").text
        assert "dsv41_server_rejected_requests_total 2" in text
    finally:
        s.stop()
