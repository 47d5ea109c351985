"""Engine: requests in, tokens and per-request statistics out, through the tiered cache.

    engine = Engine(model, cache=PrefixCache.for_model(model, CacheConfig(...)),
                    replay="bounded")     # or "exact", "off", ReplayConfig(...)
    outs = engine.generate([prompt_a, prompt_b], SamplingParams(max_new_tokens=32))
    for ev in engine.stream(prompt):      # StreamEvent per new token
        ...
    rid = engine.add_request(prompt, params); engine.step(); engine.events  # for servers
    engine.abort(rid)                     # a cancelled request lets go of everything

Each step (Engine.step) has four phases: admit (the scheduler picks waiting prompts from
side-effect-free estimates; nothing is pinned), plan (each admitted prompt's cache lookup
pins its blocks and promotes SSD hits, then path and KV), prepare (KV memory for every
token of the step; when the paged runtime runs out, the newest sequence is preempted and
recomputed later), run (prefill chunks and every running decode in one model call, then
sampling; sequences finish on a stop token or max_new_tokens). KV is written back to the
cache after the prompt and at the end of the output (engine/prefix.py; write_approximate=
False caches only states equal to a full prefill).

runtime: "auto" (default: the paged runtime - one page pool that is the cache's GPU tier,
a batched step, decode CUDA graphs on a GPU, chunked prefill - for every model it
supports, else the per-sequence reference runtime), "paged" or "reference"
(engine/runtime.py).

The engine refuses a cache built for another model (PrefixCache.bind): another config, KV
option or weights identity would make its hits wrong KV.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence as Seq
from typing import Callable

import torch

from ..cache import PrefixCache
from .. import profiling
from ..model import Model
from ..ops.fallbacks import fallbacks
from ..replay import ReplayConfig
from .request import Request, RequestOutput, SamplingParams, StreamEvent, TokenLogprob
from .runtime import make_runtime, page_pool_usage
from .sampler import make_generator, sample_rows
from .scheduler import Scheduler
from .sequence import Sequence

__all__ = ["Engine"]

log = logging.getLogger("dsv41.engine")


class Engine:
    def __init__(self, model: Model, cache: PrefixCache | None = None,
                 replay: ReplayConfig | str | None = "bounded", *, max_batch: int = 8,
                 max_prefill_tokens: int = 8192, write_approximate: bool = True,
                 runtime: str = "auto", kv_memory_bytes: int | None = None,
                 graphs: bool = True, clock: Callable[[], float] = time.perf_counter):
        """kv_memory_bytes: the paged runtime's page pool when there is no cache (the
        cache's GPU tier is the pool otherwise); graphs: capture decode steps as CUDA
        graphs (paged runtime on a GPU)."""
        self.model = model
        self.cache = cache
        self.replay = ReplayConfig.parse(replay)
        self.runtime = make_runtime(runtime, model, cache, max_batch=max_batch,
                                    max_prefill_tokens=max_prefill_tokens,
                                    write_approximate=write_approximate,
                                    kv_memory_bytes=kv_memory_bytes, graphs=graphs)
        self.scheduler = Scheduler(max_batch, max_prefill_tokens)
        self.clock = clock
        self._ids = itertools.count()
        self._admissions = itertools.count()
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
        ids = self.model.check_tokens(prompt, "prompt: ").tolist()
        if len(ids) + sampling.max_new_tokens > self.model.config.max_position_embeddings:
            raise ValueError(f"prompt ({len(ids)}) + max_new_tokens ({sampling.max_new_tokens}) "
                             f"exceeds max_position_embeddings")
        self.runtime.check_request(len(ids) + sampling.max_new_tokens)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._seqs:
            raise ValueError(f"request id {rid!r} is already in use")
        seq = Sequence(Request(rid, ids, sampling, namespace, rc), rc, self.clock())
        seq.prefill_tokens = list(ids)
        seq.generator = make_generator(sampling)
        self._seqs[rid] = seq
        self.scheduler.add(seq)
        self.counters["requests"] += 1
        return rid

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def sequence(self, request_id: str) -> Sequence | None:
        """The unfinished request's sequence (its tokens, KV handles and cache match), for
        inspection; None once it finished or if it never existed. Do not mutate it."""
        return self._seqs.get(request_id)

    def request_counts(self) -> dict[str, int]:
        """Unfinished requests by phase, for servers' gauges: {"waiting": queued or
        preempted, holding nothing; "running": holding KV, prefilling or decoding}."""
        return {"waiting": len(self.scheduler.waiting), "running": self.scheduler.active}

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancels an unfinished request: a waiting one just leaves the queue (it holds
        nothing), a running one drops its KV and every cache reference it held; nothing
        more is cached for it. Returns its output so far (finish_reason "abort"), or None
        for an id that is not unfinished here."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        seq.finish_reason = "abort"
        self.scheduler.finish(seq)
        if seq.plan is not None:
            self.runtime.release(seq)
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
        rt = self.runtime
        # admit: estimates only, so a prompt refused now holds no cache reference
        admitted = self.scheduler.admit(rt.estimate, rt.can_admit)
        # plan what was admitted: cache lookup (pins, SSD promotion), path, KV
        for seq in admitted:
            seq.admitted_at = next(self._admissions)
            rt.plan(seq)
        step = self.scheduler.plan(admitted, chunked=rt.chunked)
        done: list[RequestOutput] = []
        step = self._fit_memory(step, done)
        if not step:
            return done
        # run
        self.counters["steps"] += 1
        t0 = self.clock()
        with _step_scope(step):
            prefill_logits, decode_logits = rt.run(step)
        now = self.clock()
        sample: list[tuple[Sequence, torch.Tensor]] = []
        for ch, lg in zip(step.prefills, prefill_logits):
            seq = ch.seq
            rt.advance(ch, seq)
            seq.prefilled += ch.tokens
            if seq.request.sampling.input_logprobs:
                seq.all_logits.append(lg)
            if not ch.last:
                continue
            self.scheduler.prefilled(seq)
            self._prefill_done(seq, t0, now)
            if seq.request.sampling.input_logprobs:
                every = torch.cat(seq.all_logits)
                seq.all_logits = []
                seq.input_logprobs = _input_logprobs(seq.prompt, seq.plan.start, every)
                lg = every[-1]
            rt.after_prefill(seq)
            sample.append((seq, lg))
        for seq, lg in zip(step.decodes, decode_logits):
            rt.advance(None, seq)
            self.counters["decode_tokens"] += 1
            sample.append((seq, lg))
        tokens = sample_rows([lg for _, lg in sample], [s.request.sampling for s, _ in sample],
                             [s.generator for s, _ in sample])
        for (seq, lg), tok in zip(sample, tokens):
            self._emit(seq, lg, tok, now, done)
        return done

    def _fit_memory(self, step, done: list[RequestOutput]):
        """KV memory for every token of the step: while the runtime cannot supply it, the
        newest sequence is preempted (recomputed later from its tokens so far); a sequence
        that cannot fit even alone ends with finish_reason "length"."""
        while step:
            short = self.runtime.prepare(step)
            if short is None:
                return step
            victim = self.scheduler.newest()
            if victim is short and self.scheduler.active == 1:
                log.warning("%s needs more KV memory than there is: stopping it at %d tokens",
                            victim.request_id, len(victim.prefill_tokens) + len(victim.output))
                self._finish(victim, "length", self.clock())
                done.append(victim.to_output())
            else:
                self._preempt(victim)
            step = self.scheduler.plan([], chunked=self.runtime.chunked)
        return step

    def _preempt(self, seq: Sequence) -> None:
        self.runtime.preempt(seq)
        self.scheduler.preempt(seq)
        seq.plan = None
        seq.prefill_tokens = seq.prompt + seq.output   # resumes by recomputing its tokens
        seq.prefilled = 0
        seq.all_logits = []
        seq.preemptions += 1
        self.counters["preemptions"] += 1

    def _prefill_done(self, seq: Sequence, t0: float, now: float) -> None:
        st = seq.stats
        if seq.preemptions:                  # a resumed sequence: its prompt was counted
            return
        st.prefill_s = now - t0
        st.queue_s = t0 - seq.arrival
        self.paths[seq.plan.path] += 1
        self.counters["prefill_tokens"] += seq.plan.computed_tokens
        self.counters["replayed_tokens"] += seq.plan.replayed_tokens
        self.counters["prompt_tokens"] += len(seq.prompt)
        st.ttft_s = now - seq.arrival
        seq.first_token_time = now

    def _emit(self, seq: Sequence, logits: torch.Tensor, tok: int, now: float, done: list) -> None:
        sp = seq.request.sampling
        if seq.output:
            seq.stats.token_latencies_s.append(now - seq.last_token_time)
        seq.last_token_time = now
        seq.output.append(tok)
        if sp.return_logits:
            seq.logits.append(logits.detach().float().cpu().clone())
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
        held = self.runtime.finish(seq)      # the output's blocks and snapshot, then release
        st.bytes.update({f"state_{k}": v for k, v in held.items()})
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
        """The KV memory this engine draws on, pool by pool: {pool: {"used", "free",
        "total", "unit"}}. "global_kv": the page pool's pages (the cache's GPU tier, or
        the paged runtime's own pool; cached pages count as used until evicted);
        "sequence_slots": the paged runtime's per-sequence SWA and compressor slots;
        "swa_snapshots": the host snapshot tier's bytes."""
        out = dict(self.runtime.memory_stats())
        if self.cache is None:
            return out
        stats = self.cache.stats()
        out["global_kv"] = page_pool_usage(stats["gpu"])
        swa = stats.get("swa")
        if swa is not None:
            out["swa_snapshots"] = {"used": swa["used_bytes"],
                                    "free": swa["capacity_bytes"] - swa["used_bytes"],
                                    "total": swa["capacity_bytes"], "unit": "bytes"}
        return out

    def metrics(self) -> dict:
        """Engine counters, paths taken, and the cache's statistics and metrics registry."""
        out = {"counters": dict(self.counters), "paths": dict(self.paths),
               "runtime": self.runtime.name, "kernel_fallbacks": fallbacks.counts(),
               "replay": {"encoder_replay": self.replay.encoder_replay,
                          "decoder_replay": self.replay.decoder_replay, "mode": self.replay.mode}}
        if self.cache is not None:
            out["cache"] = self.cache.stats()
        return out

    def close(self) -> None:
        """Close the cache (commits what is queued for the SSD)."""
        if self.cache is not None:
            self.cache.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _step_scope(step):
    """The NVTX range of a step's model call: engine.encoder_replay when a chunk in it
    replays cached tokens, engine.prefill when it has prefill chunks, else engine.decode;
    its payload counts the step's tokens by what they run (a chunk [a, b) of a plan:
    replayed are those before the plan's cached_until, decoder those from its
    decoder_start)."""
    computed = replayed = decoder = 0
    for ch in step.prefills:
        p, a = ch.seq.plan, ch.start
        b = a + ch.tokens
        computed += ch.tokens
        if p.cached_until is not None:
            replayed += max(0, min(b, p.cached_until) - max(a, p.start))
        decoder += max(0, b - max(a, p.decoder_start))
    name = (("engine.encoder_replay" if replayed else "engine.prefill") if step.prefills
            else "engine.decode")
    return profiling.scope(name, requests=len(step.prefills) + len(step.decodes),
                           prefill_requests=len(step.prefills), prefill_tokens=computed,
                           replayed_tokens=replayed, decoder_tokens=decoder,
                           decode_tokens=len(step.decodes))


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
