"""What a caller hands the engine and what it gets back.

    params = SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_new_tokens=64,
                            stop_token_ids=(2,))
    out: RequestOutput  ->  out.output_tokens, out.finish_reason, out.stats (RequestStats)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from ..replay import ReplayConfig

__all__ = ["SamplingParams", "Request", "RequestStats", "RequestOutput", "StreamEvent", "TokenLogprob"]


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy (argmax); otherwise softmax(logits / temperature) restricted
    to the smallest set of tokens whose probability reaches top_p, drawn with a generator
    seeded by `seed` (per request: the same seed gives the same tokens in any batch).
    input_logprobs: the log-probability of each prompt token the prefill computed logits
    for (an error with decoder replay on). return_logits: keep every step's logits.
    logprobs: report each sampled token's log-probability and those of the `logprobs` most
    likely tokens (0: the sampled one only; None: nothing)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    input_logprobs: bool = False
    return_logits: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0 or None, got {self.logprobs}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    namespace: str = ""
    replay: ReplayConfig | None = None     # None: the engine's switches


@dataclass
class RequestStats:
    """Per-request statistics (docs/design.md#acceptance). Tokens are counts; times are seconds."""

    path: str = ""
    prompt_tokens: int = 0
    global_hit_tokens: int = 0        # aligned global-KV hit (GPU + SSD)
    gpu_hit_tokens: int = 0
    ssd_hit_tokens: int = 0
    swa_hit_tokens: int = 0           # SWA snapshot used (both_hit)
    replayed_tokens: int = 0          # cached tokens run again to rebuild SWA state
    prefill_tokens: int = 0           # tokens the prefill ran through the encoder
    decoder_prefill_tokens: int = 0   # ... and through the decoder
    replay_start: int = 0
    decoder_start: int = 0
    encoder_replay: bool = False
    decoder_replay: bool = False
    replay_mode: str = "bounded"
    global_exact: bool = True         # the state's global KV equals a full prefill's
    swa_exact: bool = True            # ... and so does its SWA state
    output_tokens: int = 0
    queue_s: float = 0.0
    ttft_s: float = 0.0               # arrival -> first output token
    prefill_s: float = 0.0            # the prefill step's model time
    token_latencies_s: list[float] = field(default_factory=list)   # between output tokens
    decode_tokens_per_s: float = 0.0
    e2e_s: float = 0.0
    bytes: dict[str, int] = field(default_factory=dict)   # per ledger

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TokenLogprob:
    """log p(token) under the model's distribution and the most likely (token, log p)."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt: list[int]
    output_tokens: list[int]
    finished: bool
    finish_reason: str | None         # "stop" (a stop token) | "length" | "abort"
    stats: RequestStats
    input_logprobs: list[float | None] | None = None
    logits: list[torch.Tensor] | None = None   # [vocab] per output token (return_logits)
    logprobs: list[TokenLogprob] | None = None  # per output token (SamplingParams.logprobs)

    def to_dict(self) -> dict:
        return {"request_id": self.request_id, "prompt_tokens": len(self.prompt),
                "output_tokens": self.output_tokens, "finished": self.finished,
                "finish_reason": self.finish_reason, "stats": self.stats.to_dict()}


@dataclass
class StreamEvent:
    """One new output token of a request (stream iterator); `output` is set on the last,
    `stats` (the request's statistics so far: path, hits, TTFT) on the first."""

    request_id: str
    token: int
    index: int
    finished: bool
    output: RequestOutput | None = None
    stats: RequestStats | None = None
    logprobs: TokenLogprob | None = None
