"""Engine: requests in, tokens and per-request statistics out, through the tiered cache.

    engine = Engine(model, cache=PrefixCache.for_model(model, CacheConfig(...)),
                    replay="bounded")     # or "exact", "off", ReplayConfig(...)
    outs = engine.generate([prompt_a, prompt_b], SamplingParams(max_new_tokens=32))
    for ev in engine.stream(prompt):      # StreamEvent per new token
        ...
    rid = engine.add_request(prompt, params); engine.step(); engine.events  # for servers
    engine.abort(rid)                     # a cancelled request lets go of everything

Each step (Engine.step) has three phases: admit (the scheduler picks waiting prompts from
side-effect-free estimates; nothing is pinned), plan (each admitted prompt's cache lookup
pins its blocks and promotes SSD hits, then path and state), run (their prefills and every
running decode in one model call, then sampling; sequences finish on a stop token or
max_new_tokens). States are written back to the cache after the prefill and at the end of
the output (engine/prefix.py; write_approximate=False caches only states equal to a full
prefill).

The engine refuses a cache built for another model (PrefixCache.bind): another config, KV
option or weights identity would make its hits wrong KV.
"""
from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator, Sequence as Seq
from typing import Callable

import torch

from ..cache import PrefixCache
from .. import profiling
from ..model import Model
from ..replay import ReplayConfig
from .prefix import PrefixIO
from .request import Request, RequestOutput, SamplingParams, StreamEvent, TokenLogprob
from .runner import ModelRunner
from .sampler import make_generator, sample
from .scheduler import Scheduler
from .sequence import Sequence, Status

__all__ = ["Engine"]


class Engine:
    def __init__(self, model: Model, cache: PrefixCache | None = None,
                 replay: ReplayConfig | str | None = "bounded", *, max_batch: int = 8,
                 max_prefill_tokens: int = 8192, write_approximate: bool = True,
                 clock: Callable[[], float] = time.perf_counter):
        self.model = model
        self.cache = cache
        self.replay = ReplayConfig.parse(replay)
        self.prefix = PrefixIO(model, cache, write_approximate)
        self.runner = ModelRunner(model)
        self.scheduler = Scheduler(max_batch, max_prefill_tokens)
        self.clock = clock
        self._ids = itertools.count()
        self._seqs: dict[str, Sequence] = {}
        self._events: list[StreamEvent] = []
        self.counters = {"requests": 0, "finished": 0, "aborted": 0, "steps": 0, "prefill_tokens": 0,
                         "replayed_tokens": 0, "decode_tokens": 0, "prompt_tokens": 0,
                         "preemptions": 0}
        self.paths = {p: 0 for p in ("cold", "both_hit", "encoder_replay", "recompute")}

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        """Closes the engine's cache (its queued SSD writes are committed); the model stays."""
        if self.cache is not None:
            self.cache.close()

    # ---- requests -----------------------------------------------------------------------

    def add_request(self, prompt, sampling: SamplingParams | None = None, *, namespace: str = "",
                    request_id: str | None = None, replay: ReplayConfig | str | None = None) -> str:
        sampling = sampling or SamplingParams()
        rc = self.replay if replay is None else ReplayConfig.parse(replay)
        if sampling.input_logprobs and rc.decoder_replay:
            raise ValueError("input logprobs need every prompt token through the decoder; "
                             "decoder replay runs it on the last window tokens only: turn "
                             "decoder_replay off for this request")
        ids = self.model._check_tokens(prompt, "prompt: ").tolist()
        if len(ids) + sampling.max_new_tokens > self.model.config.max_position_embeddings:
            raise ValueError(f"prompt ({len(ids)}) + max_new_tokens ({sampling.max_new_tokens}) "
                             f"exceeds max_position_embeddings")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._seqs:
            raise ValueError(f"request id {rid!r} is already in use")
        seq = Sequence(Request(rid, ids, sampling, namespace, rc), rc, self.clock())
        seq.generator = make_generator(sampling)
        self._seqs[rid] = seq
        self.scheduler.add(seq)
        self.counters["requests"] += 1
        return rid

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def request_counts(self) -> dict[str, int]:
        """Unfinished requests by phase: {"waiting": not yet prefilled (or preempted),
        "running": decoding}. For servers' gauges; the engine's internals stay its own."""
        return {"waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running)}

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancels an unfinished request: a waiting one just leaves the queue (it holds
        nothing), a running one drops its state and every cache reference it held; nothing
        more is cached for it. Returns its output so far (finish_reason "abort"), or None
        for an id that is not unfinished here."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        seq.finish_reason = "abort"
        self.scheduler.finish(seq)
        self.prefix.release(seq)
        seq.state = None
        seq.stats.output_tokens = len(seq.output)
        self.counters["aborted"] += 1
        return seq.to_output()

    @property
    def events(self) -> list[StreamEvent]:
        """The tokens the last step sampled, one StreamEvent each."""
        return self._events

    # ---- one step -----------------------------------------------------------------------

    @profiling.traced("engine.step")
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of the requests that finished in it."""
        self._events = []                    # stream events of this step only
        # admit: estimates only, so a prompt refused now holds no cache reference
        step = self.scheduler.schedule(self.prefix.estimate)
        if not step:
            return []
        # plan what was admitted: cache lookup (pins, SSD promotion), path, state
        for seq in step.prefills:
            self.prefix.plan(seq)
        # run
        self.counters["steps"] += 1
        t0 = self.clock()
        every = self.prefix.checkpoint_tokens
        logits = self.runner.run(step.prefills, step.decodes,
                                 self.prefix.prefill_checkpoints if every else None, self.prefix.checkpoint)
        now = self.clock()
        done: list[RequestOutput] = []
        for seq, lg in zip(step.prefills, logits[: len(step.prefills)]):
            self.scheduler.start(seq)
            st = seq.stats
            st.prefill_s = now - t0
            st.queue_s = t0 - seq.arrival
            self.paths[seq.plan.path] += 1
            self.counters["prefill_tokens"] += seq.plan.computed_tokens
            self.counters["replayed_tokens"] += seq.plan.replayed_tokens
            self.counters["prompt_tokens"] += len(seq.prompt)
            if seq.request.sampling.input_logprobs:
                seq.input_logprobs = _input_logprobs(seq.prompt, seq.plan.start, lg)
                lg = lg[-1]
            self.prefix.write_back(seq)
            st.ttft_s = now - seq.arrival
            seq.first_token_time = now
            self._emit(seq, lg, now, done)
        for seq, lg in zip(step.decodes, logits[len(step.prefills):]):
            self.counters["decode_tokens"] += 1
            if every and self.prefix.decode_checkpoint_due(seq):
                self.prefix.checkpoint(seq)  # V4's SWA checkpoint every `every` tokens
            self._emit(seq, lg, now, done)
        return done

    def _emit(self, seq: Sequence, logits: torch.Tensor, now: float, done: list) -> None:
        sp = seq.request.sampling
        tok = sample(logits, sp, seq.generator)
        if seq.output:
            seq.stats.token_latencies_s.append(now - seq.last_token_time)
        seq.last_token_time = now
        seq.output.append(tok)
        if sp.return_logits:
            seq.logits.append(logits.detach().clone())
        finished = None
        if tok in sp.stop_token_ids:
            finished = "stop"
        elif len(seq.output) >= sp.max_new_tokens:
            finished = "length"
        ev = StreamEvent(seq.request_id, tok, len(seq.output) - 1, finished is not None)
        if len(seq.output) == 1:
            ev.stats = seq.stats
        if sp.logprobs is not None:
            ev.logprobs = _token_logprobs(logits, tok, sp.logprobs)
            seq.logprobs.append(ev.logprobs)
        if finished:
            self._finish(seq, finished, now)
            ev.output = seq.to_output()
            done.append(ev.output)
        self._events.append(ev)

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        st = seq.stats
        st.output_tokens = len(seq.output)
        st.e2e_s = now - seq.arrival
        dec = now - seq.first_token_time
        st.decode_tokens_per_s = (len(seq.output) - 1) / dec if dec > 0 and len(seq.output) > 1 else 0.0
        self.prefix.write_back(seq)          # the output's blocks and end-of-output snapshot
        st.bytes.update({f"state_{k}": v for k, v in seq.state.nbytes().items()})
        self.prefix.release(seq)
        seq.state = None                     # free the KV; the output keeps the stats
        del self._seqs[seq.request_id]
        self.counters["finished"] += 1

    # ---- convenience --------------------------------------------------------------------

    def generate(self, prompts: Seq, sampling: SamplingParams | Seq[SamplingParams] | None = None,
                 *, namespace: str = "", replay=None,
                 progress: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Run prompts to completion (batched); outputs in the prompts' order."""
        if isinstance(sampling, (list, tuple)):
            params = list(sampling)
        else:
            params = [sampling] * len(prompts)
        rids = [self.add_request(p, sp, namespace=namespace, replay=replay)
                for p, sp in zip(prompts, params)]
        want = set(rids)
        outs: dict[str, RequestOutput] = {}
        while want - outs.keys():
            for out in self.step():
                if out.request_id in want:
                    outs[out.request_id] = out
                    if progress:
                        progress(out)
        return [outs[r] for r in rids]

    def stream(self, prompt, sampling: SamplingParams | None = None, *, namespace: str = "",
               replay=None) -> Iterator[StreamEvent]:
        """Yield each new token of one request as it is sampled (other requests in the
        engine progress in the same steps)."""
        rid = self.add_request(prompt, sampling, namespace=namespace, replay=replay)
        while True:
            self.step()
            events = self._events
            mine = [e for e in events if e.request_id == rid]
            yield from mine
            if any(e.finished for e in mine):
                return

    def memory_stats(self) -> dict[str, dict]:
        """The KV memory this engine can draw on, pool by pool: {pool: {"used", "free",
        "total", "unit"}}. "global_kv" counts the GPU pool's pages (cached or referenced
        blocks are used; evictable ones count as used until evicted); "swa_snapshots" the
        host snapshot tier's bytes. Empty without a cache."""
        out: dict[str, dict] = {}
        if self.cache is None:
            return out
        stats = self.cache.stats()
        gpu = stats["gpu"]
        out["global_kv"] = {"used": gpu["cached_blocks"], "free": gpu["free_blocks"],
                            "total": gpu["num_blocks"], "referenced": gpu["referenced_blocks"],
                            "unit": "pages"}
        swa = stats.get("swa")
        if swa is not None:
            out["swa_snapshots"] = {"used": swa["used_bytes"],
                                    "free": swa["capacity_bytes"] - swa["used_bytes"],
                                    "total": swa["capacity_bytes"], "unit": "bytes"}
        return out

    def metrics(self) -> dict:
        """Engine counters, paths taken, and the cache's statistics and metrics registry."""
        out = {"counters": dict(self.counters), "paths": dict(self.paths),
               "replay": {"encoder_replay": self.replay.encoder_replay,
                          "decoder_replay": self.replay.decoder_replay, "mode": self.replay.mode}}
        if self.cache is not None:
            out["cache"] = self.cache.stats()
        return out


def _token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The sampled token's log-probability under the model's distribution (before
    temperature and top-p) and the `top` most likely tokens'."""
    lp = torch.log_softmax(logits.detach().double().cpu(), dim=-1)
    best = torch.topk(lp, min(top, lp.numel())) if top else None
    alts = list(zip(best.indices.tolist(), best.values.tolist())) if best is not None else []
    return TokenLogprob(token, float(lp[token]), alts)


def _input_logprobs(prompt: list[int], start: int, logits: torch.Tensor) -> list[float | None]:
    """log p(prompt[i] | prompt[:i]) for the positions whose previous token's logits this
    prefill computed (i in (start, N)); None elsewhere (cached or first token)."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    out: list[float | None] = [None] * len(prompt)
    for r, i in enumerate(range(start + 1, len(prompt))):
        out[i] = float(lp[r, prompt[i]])
    return out
