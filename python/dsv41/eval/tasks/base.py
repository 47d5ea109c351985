"""What every task generator shares: evidence placement relative to the replay boundary,
filler, the prompt layout and the instance record.

Prompt layout (token positions; one token per character, tokenizer.py):

    [BOS] filler .. evidence .. filler          context: `context_len` tokens (cacheable)
    suffix                                      the new, uncached turn: kind "short" (the
                                                question), "long" (a long tool output, then
                                                the question) or "empty" (no new turn: the
                                                question is the context's last text)

Evidence placement is relative to the bounded-replay boundary b = H - W (H the cache-hit
position, W the sliding window): bounded replay re-runs [b, H), so tokens before b reach
the suffix only through global KV.

    before_boundary   the main evidence piece ends at b (the last tokens not replayed)
    across_boundary   the piece straddles b (half before, half after)
    far_behind        the piece starts right after BOS, far behind the window
    in_window         the piece ends at H (inside the replayed window)

Positions are clamped to the context (the placed start is recorded, with its offset
from b, so a report never claims a placement that did not fit).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from ..tokenizer import CharTokenizer

__all__ = ["PLACEMENTS", "SUFFIX_KINDS", "TaskInstance", "Task", "filler", "build_prompt",
           "first_number", "first_json_object", "TaskError"]

PLACEMENTS = ("before_boundary", "across_boundary", "far_behind", "in_window")
SUFFIX_KINDS = ("empty", "short", "long")

_WORDS = ("the river runs past old stone walls and quiet fields where farmers keep sheep "
          "under grey skies while travellers rest by the road telling long stories about "
          "distant towns markets bridges and ships that sail at dawn across cold water").split()


class TaskError(ValueError):
    """An instance that cannot be built with the requested sizes."""


def filler(rng: random.Random, n: int) -> str:
    """Exactly n characters of deterministic word filler (no digits, no braces)."""
    parts: list[str] = []
    size = 0
    while size < n:
        w = rng.choice(_WORDS) + " "
        parts.append(w)
        size += len(w)
    return "".join(parts)[:n]


@dataclass
class TaskInstance:
    task: str
    prompt: list[int]                  # token ids: context + suffix
    context_len: int
    evidence: list[tuple[int, int]]    # [start, end) token spans, main piece first
    placement: str
    boundary: int                      # b = H - W the placement was computed against
    answer: dict                       # what the scorer needs
    followup: list[int] = field(default_factory=list)   # the second turn's new tokens

    @property
    def evidence_offset(self) -> int:
        """Start of the main evidence piece relative to the replay boundary."""
        return self.evidence[0][0] - self.boundary

    def meta(self) -> dict:
        return {"task": self.task, "prompt_tokens": len(self.prompt), "context_len": self.context_len,
                "evidence": [list(e) for e in self.evidence], "placement": self.placement,
                "boundary": self.boundary, "evidence_offset": self.evidence_offset,
                "answer": self.answer}


def _main_start(placement: str, length: int, hit: int, window: int) -> int:
    b = hit - window
    if placement == "before_boundary":
        return b - length
    if placement == "across_boundary":
        return b - length // 2
    if placement == "far_behind":
        return 1
    if placement == "in_window":
        return hit - length
    raise TaskError(f"unknown evidence placement {placement!r}; one of {', '.join(PLACEMENTS)}")


def build_prompt(tok: CharTokenizer, rng: random.Random, *, task: str, pieces: list[str],
                 question: str, answer: dict, context_len: int, suffix: str, long_tokens: int,
                 hit: int, window: int, placement: str, followup: str = "") -> TaskInstance:
    """Lay out pieces[0] at `placement`, the other pieces spread over the rest of the
    context (in order, not overlapping), and the question at the end (see module doc)."""
    if suffix not in SUFFIX_KINDS:
        raise TaskError(f"unknown suffix kind {suffix!r}; one of {', '.join(SUFFIX_KINDS)}")
    q_in_context = suffix == "empty"
    body = context_len - 1 - (len(question) if q_in_context else 0)   # minus BOS
    need = sum(len(p) for p in pieces)
    if need > body:
        raise TaskError(f"{task}: context of {context_len} tokens cannot hold its evidence "
                        f"({need} tokens) and question")
    main = pieces[0]
    start = min(max(1, _main_start(placement, len(main), hit, window)), 1 + body - len(main))
    # other pieces: evenly over the free space, in order, skipping the main span
    spans = [(start, start + len(main))]
    others = pieces[1:]
    if others:
        spans += _spread(others, [(1, start), (start + len(main), 1 + body)], task)
    text = [" "] * body
    for (a, _), p in zip(spans, [main, *others]):
        text[a - 1:a - 1 + len(p)] = list(p)
    fill = filler(rng, body)
    covered = [False] * body
    for a, e in spans:
        for i in range(a - 1, e - 1):
            covered[i] = True
    chars = "".join(t if c else f for t, f, c in zip(text, fill, covered))
    ctx = [tok.bos] + tok.encode(chars) + (tok.encode(question) if q_in_context else [])
    assert len(ctx) == context_len
    if suffix == "short":
        suf = tok.encode(question)
    elif suffix == "long":
        suf = tok.encode("\nTOOL OUTPUT: " + filler(rng, long_tokens) + question)
    else:
        suf = []
    return TaskInstance(task=task, prompt=ctx + suf, context_len=context_len, evidence=spans,
                        placement=placement, boundary=hit - window, answer=answer,
                        followup=tok.encode(followup) if followup else [])


def _spread(pieces: list[str], regions: list[tuple[int, int]], task: str) -> list[tuple[int, int]]:
    """Place pieces in order, evenly spaced over the free regions [a, b) (a piece never
    crosses a region's end); first fit when spacing does not work out."""
    regions = [(a, b) for a, b in regions if b > a]
    free = sum(b - a for a, b in regions)
    need = sum(len(p) for p in pieces)
    if need > free:
        raise TaskError(f"{task}: no room for {len(pieces)} more evidence pieces")
    for gap in ((free - need) // (len(pieces) + 1), 0):
        out, r, pos = [], 0, regions[0][0] if regions else 0
        for p in pieces:
            pos += gap
            while r < len(regions) and pos + len(p) > regions[r][1]:
                r += 1
                if r < len(regions):
                    pos = regions[r][0]
            if r >= len(regions):
                break
            out.append((pos, pos + len(p)))
            pos += len(p)
        else:
            return out
    raise TaskError(f"{task}: its evidence pieces do not fit around the main piece")


class Task:
    """A task generator and its scorer. Subclasses set `name`, `pieces_for(rng)` ->
    (pieces, question, answer, followup), `reference_outputs(answer)` and
    `score(answer, outputs)`."""

    name = ""
    structured = False      # scored for structured-output validity

    def make(self, tok: CharTokenizer, seed: int, *, context_len: int, suffix: str, hit: int,
             window: int, placement: str, long_tokens: int = 48) -> TaskInstance:
        rng = random.Random(f"{self.name}:{seed}")
        pieces, question, answer, followup = self.pieces_for(rng)
        return build_prompt(tok, rng, task=self.name, pieces=pieces, question=question,
                            answer=answer, context_len=context_len, suffix=suffix,
                            long_tokens=long_tokens, hit=hit, window=window,
                            placement=placement, followup=followup)

    def pieces_for(self, rng: random.Random):  # pragma: no cover - abstract
        raise NotImplementedError

    def reference_outputs(self, answer: dict) -> list[str]:  # pragma: no cover - abstract
        """The text of each turn a perfect model answers (the first turn, then the
        follow-up's), without the stop token: what `score` accepts and dsv41.train
        teaches."""
        raise NotImplementedError

    def score(self, answer: dict, outputs: list[str]) -> dict:
        """outputs: the decoded text of each turn. Returns {"success": bool,
        "valid": bool | None (None: not a structured task)}."""
        raise NotImplementedError  # pragma: no cover - abstract


def first_number(text: str) -> str | None:
    """The first run of digits in text, or None."""
    run = []
    for ch in text:
        if ch.isdigit():
            run.append(ch)
        elif run:
            break
    return "".join(run) or None


def first_json_object(text: str):
    """The first balanced {...} in text parsed as JSON: (object or None, found_braces)."""
    import json

    start = text.find("{")
    if start < 0:
        return None, False
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                try:
                    obj = json.loads(text[start:i + 1])
                except ValueError:
                    return None, True
                return (obj if isinstance(obj, dict) else None), True
    return None, True
