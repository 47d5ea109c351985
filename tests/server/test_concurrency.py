"""Continuous batching under load: 32 concurrent streaming clients sharing a system prompt
get what each would get alone; clients that leave mid-stream are cancelled; afterwards the
engine holds no cache reference."""
from __future__ import annotations

import asyncio

import httpx

CLIENTS = 32
SYSTEM = "You are the dsv41 agent. Tools: read_file, grep, run_tests. Be brief. " * 2


def _messages(i: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"task {i}: fix bug {i * 7}"}]


async def _stream(client, i: int, max_tokens: int, leave_after: int | None = None):
    stream = await client.chat.completions.create(
        model="v41-tiny", messages=_messages(i), max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"cache_salt": "load"})
    text, usage, n = "", None, 0
    async for chunk in stream:
        n += 1
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
        if leave_after is not None and n >= leave_after:
            await stream.close()          # the client goes away mid-stream
            return None, None
    return text, usage


def _run_clients(live, max_tokens, leave):
    async def main():
        client = live.async_client()
        try:
            return await asyncio.wait_for(asyncio.gather(*(
                _stream(client, i, max_tokens[i], leave[i]) for i in range(CLIENTS))), timeout=120)
        finally:
            await client.close()
    return asyncio.run(main())


def test_32_streaming_clients_then_half_disconnect(live):
    c = live.client()
    # the agent framework warms the shared system prompt once, as rendered text (the SWA
    # snapshot at its end lets every conversation resume exactly: path both_hit)
    warm = live.tokenizer.render_chat([{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
    assert live.chat_ids(_messages(0))[:len(warm)] == live.tokenizer.encode(warm)
    c.completions.create(model="v41-tiny", prompt=warm, max_tokens=1, temperature=0,
                         extra_body={"cache_salt": "load"})
    paths = live.on_engine(lambda e: dict(e.paths))
    want = [live.reference(live.chat_ids(_messages(i)), 4) for i in range(CLIENTS)]

    out = _run_clients(live, [4] * CLIENTS, [None] * CLIENTS)
    assert [t for t, _ in out] == want
    assert all(u.completion_tokens == 4 and u.prompt_tokens_details.cached_tokens >= len(SYSTEM) for _, u in out)
    live.wait_idle()
    assert live.referenced_blocks() == 0
    assert live.on_engine(lambda e: e.paths["both_hit"]) - paths["both_hit"] == CLIENTS

    # half of them leave after two chunks of a long answer; the rest must be unaffected
    aborted = live.on_engine(lambda e: e.counters["aborted"])
    leave = [2 if i % 2 else None for i in range(CLIENTS)]
    out = _run_clients(live, [4 if i % 2 == 0 else 400 for i in range(CLIENTS)], leave)
    assert [t for i, (t, _) in enumerate(out) if i % 2 == 0] == want[::2]
    live.wait_idle()
    assert live.referenced_blocks() == 0
    assert live.on_engine(lambda e: e.counters["aborted"]) - aborted == CLIENTS // 2
    assert live.on_engine(lambda e: len(e.scheduler.waiting) + len(e.scheduler.running)) == 0
    assert live.server.loop._pending == 0


def test_non_streaming_client_that_times_out_is_cancelled(live):
    before = live.on_engine(lambda e: e.counters["aborted"])
    body = {"model": "v41-tiny", "prompt": "a long answer nobody waits for", "max_tokens": 3000, "temperature": 0}
    try:
        httpx.post(live.base_url + "/completions", json=body, timeout=1.0)
        raise AssertionError("expected a client timeout")
    except httpx.TimeoutException:
        pass
    live.wait_idle()
    assert live.on_engine(lambda e: e.counters["aborted"]) == before + 1
    assert live.referenced_blocks() == 0
