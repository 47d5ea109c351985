"""`dsv41 serve --model v41-tiny-tasks`: the shipped checkpoint by name, as `demo` and `eval`
take it, stopping on its EOS (id 2, from its generation_config.json) unless ignore_eos."""
from __future__ import annotations

import pytest

from dsv41.cli import build_parser
from dsv41.eval.tokenizer import EOS, CharTokenizer
from dsv41.server.cli import options_from_args
from dsv41.train.data import held_out

from .conftest import LiveServer

NAME = "v41-tiny-tasks"


@pytest.fixture(scope="module")
def shipped():
    args = build_parser().parse_args(["serve", "--model", NAME, "--device", "cpu", "--gpu-cache-mb", "16",
                                      "--swa-cache-mb", "64", "--block-tokens", "16"])
    s = LiveServer(options_from_args(args))
    yield s
    s.stop()


def _passkey_prompt() -> tuple[str, str]:
    tok = CharTokenizer(256)
    ex = held_out(tok, "passkey", 1, context_len=64, window=16)[0]
    return tok.decode(ex.tokens[:ex.prompt_len]), ex.answer["key"]


def test_the_shipped_model_is_served_by_name_and_stops_on_its_eos(shipped):
    assert shipped.tokenizer.eos_token_ids == (EOS,)
    c = shipped.client()
    assert [m.id for m in c.models.list().data] == [NAME]
    prompt, key = _passkey_prompt()
    r = c.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (key, "stop")
    assert r.usage.completion_tokens == len(key) + 1                  # the EOS is sampled, not shown
    parts = list(c.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == key and parts[-1].choices[0].finish_reason == "stop"


def test_ignore_eos_samples_past_it(shipped):
    prompt, key = _passkey_prompt()
    r = shipped.client().completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0,
                                            logprobs=0, extra_body={"ignore_eos": True})
    ch = r.choices[0]
    assert ch.finish_reason == "length" and r.usage.completion_tokens == 10
    assert ch.text.startswith(key) and "\x02" not in ch.text             # a special id never shows
    assert len(ch.logprobs.tokens) == 10


def test_serve_runs_on_the_runtime_asked_for(shipped):
    """`--runtime reference` serves on the per-sequence runtime; both answer alike."""
    assert shipped.engine.runtime.name == "paged"              # the default (auto)
    args = build_parser().parse_args(["serve", "--model", NAME, "--device", "cpu", "--gpu-cache-mb", "16",
                                      "--swa-cache-mb", "64", "--block-tokens", "16",
                                      "--runtime", "reference"])
    ref = LiveServer(options_from_args(args))
    try:
        assert ref.engine.runtime.name == "reference"
        prompt, key = _passkey_prompt()
        texts = [s.client().completions.create(model=NAME, prompt=prompt, max_tokens=16,
                                               temperature=0).choices[0].text
                 for s in (shipped, ref)]
        assert texts == [key, key]
    finally:
        ref.stop()
