"""Text in and out: the byte tokenizer, stop strings, and a checkpoint's tokenizer.json
with its chat template and stop token, served by `dsv41 serve --model DIR`."""
from __future__ import annotations

import json
import random

import pytest

from dsv41.server.generation import StopText
from dsv41.server.tokenizer import ByteTokenizer, HFTokenizer, TemplateError, load_tokenizer

from .conftest import BLOCK, LiveServer


def test_byte_tokenizer_and_incremental_decoding():
    tok = ByteTokenizer(256)
    text = "héllo → wörld\n"
    assert tok.encode(text) == list(text.encode()) and tok.decode(tok.encode(text)) == text
    rng = random.Random(0)
    ids = [rng.randrange(256) for _ in range(400)]        # mostly not valid UTF-8
    d = tok.detokenizer()
    assert "".join(d.add(t) for t in ids) + d.flush() == tok.decode(ids)
    assert tok.token_text(65) == "A" and tok.token_text(0xE2) == "bytes:\\xe2" and tok.token_bytes(0xE2) == [0xE2]
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "<|user|>\nhi\n<|assistant|>\n"
    with pytest.raises(ValueError, match="256"):
        ByteTokenizer(128)


def test_stop_text_holds_back_and_cuts_at_the_first_stop():
    st = StopText(["END", "xy"])
    assert st.push("abcE") == ("ab", False)        # the last len("END") - 1 characters wait
    assert st.push("N") == ("c", False)
    assert st.push("Dtail") == ("", True)          # "EN" + "D": nothing of the stop string shows
    st = StopText(["xy", "yz"])
    assert st.push("axyz") == ("a", True)         # the earliest stop wins
    assert StopText([]).push("abc") == ("abc", False)


def _checkpoint(tmp_path, model):
    """A v41-tiny checkpoint with a WordLevel tokenizer.json (w0..w253, <s>, </s>), a chat
    template and a generation config whose stop token is `eos`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path / "ckpt"
    model.save_pretrained(d)
    vocab = {f"w{i}": i for i in range(254)} | {"<s>": 254, "</s>": 255}
    t = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.add_special_tokens(["<s>", "</s>"])
    t.save(str(d / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'wizard' %}"
                "{{ raise_exception('no wizards') }}{% endif %}w1 {{ m['content'] }} w2 {% endfor %}"
                "{% if add_generation_prompt %}w3{% endif %}")
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": template}))
    return d


def test_checkpoint_tokenizer_served_with_template_and_stop_token(tmp_path):
    from dsv41.config import ModelConfig
    from dsv41.engine import Engine, SamplingParams
    from dsv41.model import Model
    from dsv41.server import ServeOptions

    model = Model.synthetic(ModelConfig.preset("v41-tiny"), seed=0)
    d = _checkpoint(tmp_path, model)
    tok = load_tokenizer(d, 256)
    assert isinstance(tok, HFTokenizer) and tok.eos_token_ids == (255,)
    msgs = [{"role": "system", "content": "w5 w6"}, {"role": "user", "content": "w7"}]
    text = tok.render_chat(msgs)
    assert text == "<s>w1 w5 w6 w2 w1 w7 w2 w3"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == [254, 1, 5, 6, 2, 1, 7, 2, 3]
    with pytest.raises(TemplateError, match="no wizards"):
        tok.render_chat([{"role": "wizard", "content": "x"}])
    out = Engine(model).generate([ids], SamplingParams(max_new_tokens=6))[0].output_tokens
    d2 = tok.detokenizer(ids)
    assert "".join(d2.add(t) for t in out) + d2.flush() == " " + tok.decode(out)
    # the generation config's stop token: make the model's 3rd greedy token the stop token
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [out[2]]}))
    live = LiveServer(ServeOptions(model=str(d), device="cpu", block_tokens=BLOCK, gpu_cache_mb=16, swa_cache_mb=64))
    try:
        c = live.client()
        assert [m.id for m in c.models.list().data] == ["ckpt"]
        r = c.chat.completions.create(model="ckpt", messages=msgs, max_tokens=6, temperature=0)
        assert r.usage.prompt_tokens == len(ids)
        assert live.tokenizer.eos_token_ids == tuple(sorted({out[2], 255}))
        k = next(i for i, t in enumerate(out) if t in (out[2], 255)) + 1   # a stop token ends it (included)
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == k
        want = live.tokenizer.decode(out[:k])
        assert r.choices[0].message.content.strip() == want.strip()
        with pytest.raises(Exception) as e:
            c.chat.completions.create(model="ckpt", messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                      extra_body={"bogus": 1})
        assert e.value.status_code == 400
    finally:
        live.stop()
