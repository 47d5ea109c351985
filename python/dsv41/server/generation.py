"""One HTTP request's choices in flight: token events from the engine loop become text
pieces (detokenized, cut at stop strings), with logprobs, finish reasons and usage.

    gen = Generation(loop, tokenizer, prompts, params, n=2, stops=["\\n\\n"], namespace="a")
    async for piece in gen.pieces():      # Piece(index, text, logprobs, finish_reason)
        ...
    gen.usage()      # {"prompt_tokens", "completion_tokens", "total_tokens",
                     #  "prompt_tokens_details": {"cached_tokens"}}  (the last one optional)
    gen.cancel()     # in a finally: aborts whatever has not finished (client gone)

Choice i * n + j is the j-th sample of prompt i (seed + j when a seed is given, so every
choice of a seeded request is reproducible and they differ from one another). A stop string
ends its choice here and aborts its engine request; the text before it is returned, and a
stream never shows a piece of the stop string (up to len(longest stop) - 1 characters are
held back until they cannot start one).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..engine import SamplingParams, StreamEvent, TokenLogprob
from .loop import EngineLoop

__all__ = ["Generation", "Piece", "StopText"]


class StopText:
    """Finds the first stop string in a stream of text pieces."""

    def __init__(self, stops: list[str]):
        self.stops = list(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buf = ""

    def push(self, piece: str) -> tuple[str, bool]:
        """(text that is safe to emit, whether a stop string ended the text)."""
        self.buf += piece
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf = self.buf[: min(hits)], ""
            return out, True
        cut = max(0, len(self.buf) - self.hold)
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


@dataclass
class Piece:
    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)   # tokens since the last piece
    text_offsets: list[int] = field(default_factory=list)        # where each token's text starts
    finish_reason: str | None = None


class _Choice:
    def __init__(self, index: int, rid: str, prompt: list[int], tokenizer, stops: list[str]):
        self.index, self.rid = index, rid
        self.detok = tokenizer.detokenizer(prompt)
        self.stop = StopText(stops)
        self.tokens: list[int] = []
        self.text_len = 0                 # characters decoded so far (emitted or held)
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self._lp: list[TokenLogprob] = []
        self._offsets: list[int] = []

    def feed(self, ev: StreamEvent) -> Piece | None:
        self.tokens.append(ev.token)
        if ev.stats is not None:
            self.cached_tokens = ev.stats.prompt_tokens - ev.stats.prefill_tokens
        if ev.logprobs is not None:
            self._lp.append(ev.logprobs)
            self._offsets.append(self.text_len)
        new = self.detok.add(ev.token)
        if ev.finished:
            new += self.detok.flush()
        self.text_len += len(new)
        out, stopped = self.stop.push(new)
        if stopped:
            self.finish_reason = "stop"
        elif ev.finished:
            out += self.stop.flush()
            self.finish_reason = ev.output.finish_reason     # "stop" (a stop token) or "length"
        if not out and not self._lp and self.finish_reason is None:
            return None
        p = Piece(self.index, out, self._lp, self._offsets, self.finish_reason)
        self._lp, self._offsets = [], []
        return p


class Generation:
    def __init__(self, loop: EngineLoop, tokenizer, prompts: list[list[int]], params: SamplingParams,
                 *, n: int = 1, stops: list[str] = (), namespace: str = "", prefix: str = "req"):
        reqs = []
        for ids in prompts:
            for j in range(n):
                seed = params.seed + j if params.seed is not None else None
                reqs.append((ids, replace(params, seed=seed)))
        self.loop = loop
        self.prompts, self.n = prompts, n
        self.sub = loop.submit(reqs, namespace=namespace, prefix=prefix)   # may raise Overloaded
        self.choices = [_Choice(k, rid, reqs[k][0], tokenizer, list(stops))
                        for k, rid in enumerate(self.sub.request_ids)]
        self._by_rid = {c.rid: c for c in self.choices}

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    async def pieces(self):
        """Yields Pieces until every choice has finished; raises what the engine raised."""
        while not self.finished:
            rid, item = await self.sub.queue.get()
            if isinstance(item, BaseException):
                raise item
            c = self._by_rid[rid]
            if c.finish_reason is not None:     # tokens that were in flight past a stop string
                continue
            piece = c.feed(item)
            if c.finish_reason is not None and not item.finished:
                self.loop.abort([rid], reason="stop")   # a stop string ended it here
            if piece is not None:
                yield piece

    def cancel(self) -> None:
        """Aborts the engine requests of unfinished choices (idempotent)."""
        todo = [c.rid for c in self.choices if c.finish_reason is None]
        for c in self.choices:
            if c.finish_reason is None:
                c.finish_reason = "abort"
        if todo:
            self.loop.abort(todo)

    def usage(self, cached_tokens: bool = True) -> dict:
        """Prompt tokens count once per prompt (not per choice); cached tokens are the first
        choice's of each prompt (the prompt tokens its prefill did not compute), reported
        only when `cached_tokens` (the caller's own namespace: server/tenancy.py)."""
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.tokens) for c in self.choices)
        out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if cached_tokens:
            cached = sum(self.choices[i * self.n].cached_tokens for i in range(len(self.prompts)))
            out["prompt_tokens_details"] = {"cached_tokens": cached}
        return out
