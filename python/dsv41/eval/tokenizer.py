"""The harness's tiny deterministic tokenizer: one token per ASCII character.

Task prompts are text, turned into token ids that fit any vocab of at least 128 ids:
printable ASCII (32..126) and newline map to their code points, BOS = 1 and EOS = 2 are
the two specials (EOS is the stop token of every request). It is reversible on that
alphabet (`decode(encode(s)) == s`); ids it does not know decode to nothing.

A checkpoint trained on another tokenizer sees these prompts as arbitrary ids: its task
scores are then meaningless and divergence from full prefill is the signal
(docs/design.md#acceptance).
"""
from __future__ import annotations

__all__ = ["CharTokenizer", "BOS", "EOS"]

BOS = 1
EOS = 2
_TEXT = frozenset([10, *range(32, 127)])


class CharTokenizer:
    def __init__(self, vocab_size: int):
        if vocab_size < 128:
            raise ValueError(f"the harness tokenizer needs a vocab of at least 128 ids, got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos, self.eos = BOS, EOS

    def encode(self, text: str) -> list[int]:
        out = []
        for i, ch in enumerate(text):
            c = ord(ch)
            if c not in _TEXT:
                raise ValueError(f"character {ch!r} at {i} is outside the harness alphabet "
                                 f"(printable ASCII and newline)")
            out.append(c)
        return out

    def decode(self, ids) -> str:
        return "".join(chr(int(i)) for i in ids if int(i) in _TEXT)
