"""The engine's side of the prefix cache: look a prompt up, plan its path, build its
state from the cached global KV (and SWA snapshot), and write exact results back.

Write-back rule. Blocks are inserted when the state's global KV is exact (cold, recompute,
both hit, exact replay, decoder replay: the encoder ran on every token); SWA snapshots when
its SWA state is exact too. A state after decoder replay never gives a snapshot
(docs/design.md#decoder-replay: decode only, never cached). A state after bounded encoder
replay is the session's own state from then on: with write_approximate=True (the engine's
default, as production runtimes do) its blocks and snapshots are cached, so the
conversation's next turn resumes from them; with False (strict) only states equal to a full
prefill are ever cached, so approximate KV can never reach another request.
"""
from __future__ import annotations

from .. import profiling
from ..cache import PrefixCache
from ..model import Model
from ..replay import plan_prompt
from .cache_adapter import export_blocks, import_blocks, snapshot_boundary, snapshot_from_cache, snapshot_to_cache
from .sequence import Sequence

__all__ = ["PrefixIO"]


class PrefixIO:
    def __init__(self, model: Model, cache: PrefixCache | None, write_approximate: bool = True):
        self.model, self.cache = model, cache
        self.write_approximate = write_approximate
        if cache is not None:
            cache.bind(model)    # refuses a cache whose keys name another model (or weights)

    @property
    def align(self) -> int | None:
        return self.cache.block_tokens if self.cache is not None else None

    def estimate(self, seq: Sequence) -> int:
        """The prefill tokens a waiting sequence would compute if admitted now: its plan
        against the GPU pool's current hit, taking no reference and reading nothing (the
        scheduler's admission cost). It can be off both ways - plan() may find SSD blocks
        or an SWA snapshot (fewer tokens), or blocks may be evicted first (more) - which
        only moves the step's prefill budget, never correctness."""
        tokens = seq.prefill_tokens
        N = len(tokens)
        H = 0
        if self.cache is not None and N > 1:
            H = self.cache.peek(tokens, namespace=seq.request.namespace, max_tokens=N - 1)
        return plan_prompt(self.model.config, N, global_hit=H, replay=seq.replay,
                           align=self.align).computed_tokens

    def lookup(self, seq: Sequence):
        """The cache lookup (pins the matched blocks in seq.match, promotes SSD hits), the
        replay plan (seq.plan) and the statistics of both; returns the SWA snapshot the
        plan resumes from (None unless the path is both_hit)."""
        if seq.plan is not None:
            raise RuntimeError(f"{seq.request_id} is already planned")
        req, model, cache = seq.request, self.model, self.cache
        tokens = seq.prefill_tokens
        N = len(tokens)
        st = seq.stats
        H = P = 0
        snap = None
        if cache is not None and N > 1:
            m = seq.match = cache.match(tokens, namespace=req.namespace, max_tokens=N - 1)
            H = m.cached_tokens
            st.gpu_hit_tokens, st.ssd_hit_tokens = m.gpu_blocks * m.block_tokens, m.ssd_blocks * m.block_tokens
            if m.snapshot is not None:
                snap = m.snapshot
                P = m.snapshot_tokens
        plan = seq.plan = plan_prompt(model.config, N, global_hit=H, snapshot_tokens=P,
                                      replay=seq.replay, align=self.align)
        st.path = plan.path
        st.prompt_tokens = len(req.prompt)
        st.global_hit_tokens = plan.global_hit
        st.swa_hit_tokens = plan.snapshot_tokens
        st.replayed_tokens = plan.replayed_tokens
        st.prefill_tokens = plan.computed_tokens
        st.decoder_prefill_tokens = plan.decoder_tokens
        st.replay_start = plan.start
        st.decoder_start = plan.decoder_start
        st.encoder_replay = seq.replay.encoder_replay
        st.decoder_replay = seq.replay.decoder_replay
        st.replay_mode = seq.replay.mode
        st.global_exact, st.swa_exact = plan.global_exact, plan.swa_exact
        return snap if plan.path == "both_hit" else None

    @profiling.traced("engine.plan",
                      lambda self, seq: {"requests": 1, "tokens": len(seq.prefill_tokens)})
    def plan(self, seq: Sequence) -> None:
        """lookup(), then the state to prefill from: once per sequence, when the scheduler
        has admitted it."""
        snap = self.lookup(seq)
        plan, model, cache, st = seq.plan, self.model, self.cache, seq.stats
        state = model.new_state()
        read = 0
        if plan.import_tokens:
            nb = plan.import_tokens // cache.block_tokens
            import_blocks(cache.layout, state, cache.read_blocks(seq.match.block_ids[:nb], device=model.device))
            read = nb * cache.layout.block_bytes
        if plan.path == "both_hit":
            state.restore_swa(snapshot_from_cache(snap, device=model.device))
            st.bytes["swa_read"] = snap.nbytes
        elif plan.path == "encoder_replay":
            state.seek_for_replay(seq.prefill_tokens[:plan.start])
        seq.state = state
        seq.prefilled = state.position
        st.bytes["global_read"] = read

    @profiling.traced("engine.write_back",
                      lambda self, seq: {"requests": 1, "tokens": seq.state.position})
    def write_back(self, seq: Sequence) -> None:
        """Insert the state's new full blocks and its SWA snapshot (if exact)."""
        cache, plan, state = self.cache, seq.plan, seq.state
        if cache is None or not (plan.global_exact or self.write_approximate):
            return
        B = cache.block_tokens
        nb = state.position // B
        m = seq.match
        have = m.num_blocks if m is not None else 0
        if m is not None and nb > have:
            # the match may hold more blocks than this request's tokens extend; only extend it
            payloads = export_blocks(cache.layout, state, have, nb - have)
            cache.insert(state.tokens, payloads, namespace=seq.request.namespace, match=m)
        elif m is None and nb:
            seq.match = cache.insert(state.tokens, export_blocks(cache.layout, state, 0, nb),
                                     namespace=seq.request.namespace)
        written = (nb - have) * cache.layout.block_bytes if nb > have else 0
        seq.stats.bytes["global_written"] = seq.stats.bytes.get("global_written", 0) + written
        swa_ok = self.swa_ok(seq)
        if swa_ok and cache.checkpoints is not None:
            self.checkpoint(seq)     # end of prompt / end of output
        if swa_ok and cache.swa is not None:
            snap = snapshot_to_cache(state.snapshot_swa(snapshot_boundary(cache.layout, state.position)))
            if cache.put_snapshot(state.tokens, snap, namespace=seq.request.namespace):
                seq.stats.bytes["swa_written"] = seq.stats.bytes.get("swa_written", 0) + snap.nbytes

    def swa_ok(self, seq: Sequence) -> bool:
        """The sequence's SWA state may be cached (see the write-back rule above)."""
        plan = seq.plan
        return plan.swa_exact or (self.write_approximate and not plan.decoder_replay)

    # ---- V4's SWA checkpoints on the SSD (cache/swa_checkpoints.py) ---------------------

    @property
    def checkpoint_tokens(self) -> int | None:
        """The checkpoint cadence, or None when the cache writes no SWA checkpoints."""
        c = self.cache
        return c.checkpoint_tokens if c is not None and c.checkpoints is not None else None

    def prefill_checkpoints(self, seq: Sequence) -> list[int]:
        """Positions strictly inside this prefill, multiples of the cadence, where the
        state is exact (at or past the imported global KV) and a checkpoint is due."""
        N, plan = self.checkpoint_tokens, seq.plan
        if not N or plan.decoder_replay or seq.request.sampling.input_logprobs \
                or not (plan.global_exact or self.write_approximate) or not self.swa_ok(seq):
            return []
        lo = max(plan.start, plan.cached_until or 0, seq.state.position)
        return [b for b in range((lo // N + 1) * N, len(seq.prefill_tokens), N)]

    def decode_checkpoint_due(self, seq: Sequence) -> bool:
        N = self.checkpoint_tokens
        return bool(N) and seq.state.position % N == 0 and self.swa_ok(seq)

    def checkpoint(self, seq: Sequence) -> None:
        """Writes the SWA checkpoint of the sequence's state after its tokens so far."""
        cache, state = self.cache, seq.state
        if seq.checkpointed_at == state.position:   # e.g. a cadence point at the end of output
            return
        seq.checkpointed_at = state.position
        snap = snapshot_to_cache(state.snapshot_swa(snapshot_boundary(cache.layout, state.position)))
        n = cache.put_checkpoint(state.tokens, snap, namespace=seq.request.namespace)
        seq.stats.bytes["swa_checkpoint_written"] = seq.stats.bytes.get("swa_checkpoint_written", 0) + n

    def release(self, seq: Sequence) -> None:
        """Drops the sequence's references on cached blocks (its match)."""
        if self.cache is not None and seq.match is not None:
            self.cache.release(seq.match)
