"""Text in and out for the server: a checkpoint's own tokenizer, or a byte-level one.

    tok = load_tokenizer(checkpoint_dir_or_None, vocab_size)
    ids = tok.encode("text")                                 # completions
    ids = tok.encode(tok.render_chat(messages), add_special_tokens=False)   # chat
    d = tok.detokenizer(prompt_ids); piece = d.add(token_id); ...; rest = d.flush()

A checkpoint directory with `tokenizer.json` gets a `tokenizers` tokenizer and the chat
template of its `tokenizer_config.json` (or `chat_template.jinja`), rendered by jinja2 in
a sandbox as Hugging Face does; stop tokens come from `generation_config.json` and the
tokenizer's `eos_token`.

Synthetic presets (and checkpoints without tokenizer.json) get ByteTokenizer: token id =
one byte of the UTF-8 text (ids 0..255, so any vocab of at least 256 ids) and
BYTE_CHAT_TEMPLATE. Its special tokens are those a checkpoint's `generation_config.json`
names (`eos_token_id`, `bos_token_id`: the shipped v41-tiny-tasks was trained with BOS 1 and
EOS 2, dsv41/eval/tokenizer.py): the EOS ids stop a request, and special ids never show in
the text. A preset has neither (synthetic weights never learned one: requests end at
max_tokens or a stop string). Its template:

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n ... <|assistant|>\\n

Output text is built by a detokenizer per choice, so streamed pieces always add up to the
non-streamed text (bytes that are not valid UTF-8 become U+FFFD).
"""
from __future__ import annotations

import codecs
import json
from pathlib import Path

__all__ = ["ByteTokenizer", "HFTokenizer", "ChatTemplate", "load_tokenizer", "BYTE_CHAT_TEMPLATE",
           "TemplateError"]

BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


class TemplateError(ValueError):
    """A chat template that fails on the given messages (raise_exception, bad syntax)."""


class ChatTemplate:
    """A Hugging Face chat template (jinja2, sandboxed, trim_blocks and lstrip_blocks)."""

    def __init__(self, source: str, **special: str | None):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"chat template: {e}") from e
        self.special = {k: v for k, v in special.items() if v is not None}

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        import jinja2
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special, **extra)
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template: {e}") from e


class _ByteDetokenizer:
    def __init__(self, special: frozenset[int]):
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._special = special

    def add(self, token: int) -> str:
        return self._dec.decode(bytes([token])) if 0 <= token < 256 and token not in self._special else ""

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class ByteTokenizer:
    """Token id = one byte of UTF-8 text (see the module docstring)."""

    name = "bytes"

    def __init__(self, vocab_size: int, *, eos_token_ids=(), special_ids=()):
        """eos_token_ids stop a request; they and special_ids (BOS) decode to nothing."""
        if vocab_size < 256:
            raise ValueError(f"the byte tokenizer needs a vocab of at least 256 ids, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(int(i) for i in eos_token_ids))
        self.special = frozenset(self.eos_token_ids) | frozenset(int(i) for i in special_ids)
        self.chat = ChatTemplate(BYTE_CHAT_TEMPLATE)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256 and int(i) not in self.special
                     ).decode("utf-8", errors="replace")

    def render_chat(self, messages: list[dict], **extra) -> str:
        return self.chat.render(messages, **extra)

    def detokenizer(self, prompt: list[int] = ()) -> _ByteDetokenizer:
        return _ByteDetokenizer(self.special)

    def token_bytes(self, token: int) -> list[int]:
        return [token] if 0 <= token < 256 else []

    def token_text(self, token: int) -> str:
        """The token as text for logprobs: the character, or "bytes:\\xNN" (OpenAI's
        spelling) for a byte that is not a whole UTF-8 character."""
        if 0 <= token < 128:
            return chr(token)
        return f"bytes:\\x{token:02x}" if token < 256 else ""


class _HFDetokenizer:
    """Incremental decoding of a `tokenizers` tokenizer (as vLLM does it): the tokens not
    yet emitted are decoded together with the ones before them (context, starting with the
    prompt's last few) and the new text is emitted once it does not end in an incomplete
    character (U+FFFD), so merges and leading spaces come out as in a whole decode."""

    CONTEXT = 5

    def __init__(self, tok, prompt: list[int]):
        self.tok = tok
        self.ids = list(prompt[-self.CONTEXT:])
        self.prefix = 0                 # start of the context
        self.read = len(self.ids)       # tokens already turned into emitted text

    def _new_text(self) -> str:
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        now = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
        return now[len(before):] if len(now) > len(before) else ""

    def add(self, token: int) -> str:
        self.ids.append(token)
        piece = self._new_text()
        if not piece or piece.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return piece

    def flush(self) -> str:
        piece = self._new_text()
        self.prefix, self.read = self.read, len(self.ids)
        return piece


class HFTokenizer:
    """A checkpoint's tokenizer.json (the `tokenizers` library) and chat template."""

    name = "tokenizer.json"

    def __init__(self, directory: str | Path, vocab_size: int):
        from tokenizers import Tokenizer

        d = Path(directory)
        self.tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        self.vocab_size = vocab_size
        cfg = _read_json(d / "tokenizer_config.json")
        bos, eos = _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token"))
        source = None
        if (d / "chat_template.jinja").exists():
            source = (d / "chat_template.jinja").read_text()
        elif isinstance(cfg.get("chat_template"), str):
            source = cfg["chat_template"]
        elif isinstance(cfg.get("chat_template"), list):    # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in cfg["chat_template"]}
            source = named.get("default") or next(iter(named.values()), None)
        self.chat = ChatTemplate(source, bos_token=bos, eos_token=eos) if source else None
        eos_ids = set(_generation_ids(d, "eos_token_id"))
        if eos is not None and self.tok.token_to_id(eos) is not None:
            eos_ids.add(self.tok.token_to_id(eos))
        self.eos_token_ids = tuple(sorted(int(i) for i in eos_ids))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: list[dict], **extra) -> str:
        if self.chat is None:
            raise TemplateError("this model's tokenizer has no chat template: use /v1/completions")
        return self.chat.render(messages, **extra)

    def detokenizer(self, prompt: list[int] = ()) -> _HFDetokenizer:
        return _HFDetokenizer(self.tok, list(prompt))

    def token_bytes(self, token: int) -> list[int]:
        return list(self.tok.decode([token], skip_special_tokens=False).encode("utf-8"))

    def token_text(self, token: int) -> str:
        return self.tok.id_to_token(token) or ""


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_str(v) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


def _generation_ids(d: Path, field: str) -> list[int]:
    """An id or a list of ids from generation_config.json (none when absent)."""
    v = _read_json(d / "generation_config.json").get(field)
    return [int(i) for i in (v if isinstance(v, list) else [v] if v is not None else [])]


def load_tokenizer(directory: str | Path | None, vocab_size: int) -> ByteTokenizer | HFTokenizer:
    """The checkpoint's tokenizer when `directory` has tokenizer.json, else ByteTokenizer
    with the special ids of its generation_config.json."""
    if directory is not None and (Path(directory) / "tokenizer.json").exists():
        return HFTokenizer(directory, vocab_size)
    if directory is None:
        return ByteTokenizer(vocab_size)
    d = Path(directory)
    return ByteTokenizer(vocab_size, eos_token_ids=_generation_ids(d, "eos_token_id"),
                         special_ids=_generation_ids(d, "bos_token_id"))
