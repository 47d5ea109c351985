"""DeepSeek-V4.1-Flash as a torch module with an explicit, stored-format KV state.

    model = Model.synthetic(ModelConfig.preset("v41-tiny"), seed=0)
    state = model.new_state()
    logits = model.prefill(prompt_ids, state)                  # [vocab], last token
    logits = model.decode_step(next_id, state)                 # [vocab]
    all_lp = model.prefill(more_ids, state, return_all_logits=True)   # [T, vocab]
    outs = model.prefill_batch([ids_a, ids_b], [state_a, state_b])     # list of [vocab]
    model.save_pretrained(path); Model.from_pretrained(path)
    outs = model.extend_batch([Extend(ids, state, swa_start=s, cached_until=H,
                                      decoder_start=d)])   # replay (docs/replay.md)

The network: embedding; pre-norm blocks (attention + MoE), for V4.1 the first
num_encoder_layers forming the causal encoder, the rest the decoder; final RMSNorm; head.
With mHC (hc_mult > 1) the residual is hc_mult streams (the embedding copied into each),
mixed around every block (`mhc.py`) and collapsed by `hc_head` before the final norm.
The decoder's global KV is projected from the encoder's final hidden state H_enc (the
residual stream(s) after the last encoder layer) by the decoder's Full layer only:
C = compressor(attn_norm(X_enc)), where X_enc is H_enc itself with hc_mult = 1 and, with
several streams, their collapse by that layer's own attention-site mHC `pre` weights
computed from H_enc - exactly the block input the layer computes in a plain forward.
Engram, the draft (MTP) layers, DSpark and vision are not modelled (docs/model.md).

Every call validates its inputs before touching a state; a call that fails mid-way rolls
its staged writes back, so a state is only ever advanced by a whole call.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..config import MODE_FULL, PART_DECODER, ModelConfig
from . import gemm, production
from .attention import Attention
from .context import ForwardContext, Segment
from .kv_codec import KV_DTYPES, codec_for
from .layers import Embedding, Linear, RMSNorm
from .mhc import HyperConnection, add_site, hc_head
from .moe import MoE
from .state import SequenceState

__all__ = ["Block", "Extend", "Model"]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


@dataclass
class Extend:
    """One sequence of an `extend_batch` call: the general form of a prefill, for replay.

    tokens run from state.position on. swa_start: the first position any query's SWA window
    may reach (docs/design.md#replay: query i sees [max(swa_start, i - W + 1), i]); it must lie in
    [0, state.position]. cached_until: the state already holds the global KV (and indexer
    keys) of tokens [0, cached_until), a multiple of every ratio at or after the position;
    tokens before it rebuild SWA state only and read that KV as cached, never recomputing
    or overwriting it. decoder_start: decoder replay - the decoder layers run only on
    tokens from this position on (their SWA windows start there too), while the decoder's
    global KV is still projected from the encoder output of every token. all_logits: every
    new token's logits (impossible with decoder_start past the position).
    """

    tokens: object
    state: SequenceState
    swa_start: int = 0
    cached_until: int | None = None
    decoder_start: int | None = None
    all_logits: bool = False


class Block(nn.Module):
    """One pre-norm residual layer: h += attn(attn_norm(h)); h += ffn(ffn_norm(h)); with
    mHC, each `+=` is the hyper-connection (hc_attn_*, hc_ffn_* weights)."""

    def __init__(self, config: ModelConfig, layer: int, *, indexer_rotation: bool, codec):
        super().__init__()
        c = config
        plan = c.layer_plan()[layer]
        self.layer = layer
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attn = Attention(c, plan, indexer_rotation=indexer_rotation, codec=codec)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ffn = MoE(c, layer)
        self.hc: dict[str, HyperConnection] = {}
        if c.hc_mult > 1:
            n = c.hc_mult
            for site in ("hc_attn", "hc_ffn"):
                add_site(self, site, n, (2 + n) * n, c.hidden_size)
                self.hc[site] = HyperConnection(self, site, n=n, iters=c.hc_sinkhorn_iters,
                                                eps=c.hc_eps, norm_eps=c.rms_norm_eps)

    def attn_input(self, h: torch.Tensor):
        """The attention's input attn_norm(x) from the residual h, and the mHC weights
        (None without mHC). On the production path x is bf16: every reader of it is a
        GEMM."""
        dtype = torch.bfloat16 if gemm.is_production(self) else None
        if not self.hc:
            return self.attn_norm(h, dtype), None
        pre, post, comb = self.hc["hc_attn"].weights(h)
        return self.attn_norm(HyperConnection.collapse(h, pre), dtype), (post, comb)

    @staticmethod
    def residual(h: torch.Tensor, out: torch.Tensor, mix) -> torch.Tensor:
        if mix is None:
            return h + out
        return HyperConnection.expand(h, out, *mix)

    def ffn_step(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        if not self.hc:
            return h + self.ffn(self.ffn_norm(h), tokens)
        pre, post, comb = self.hc["hc_ffn"].weights(h)
        out = self.ffn(self.ffn_norm(HyperConnection.collapse(h, pre)), tokens)
        return HyperConnection.expand(h, out, post, comb)


class Model(nn.Module):
    """The V4.1 model. Parameter names follow the public checkpoint layout (docs/model.md).

    Options (part of the state's identity because they change stored bytes):
    indexer_rotation - Hadamard-rotate indexer queries and keys before MXFP4 quantization
    (default True, as in V4; saved with the checkpoint); kv_dtype - "stored" (default: the
    formats a server stores) or "float32" (the unquantized reference mode, never cached;
    not saved: choose it at load time).
    Runtime switch: `dense_attention = True` makes every compressing layer attend to all of
    its visible global entries instead of the top-k (the benchmark's dense baseline).

    `weights_id` names the weights (model/weights_id.py): set by `synthetic`, by
    `from_pretrained` from the checkpoint's recorded digest, or by the operator; None when
    unknown. Whoever changes the weights in place must set it again (or to None).
    precision - "reference" (default: float32 weights, float64 math, batch invariant,
    bit-exact chunking) or "bf16" (the production path, production.py: weights as the
    checkpoint ships them, bf16 GEMMs, grouped MoE). Not part of the state's identity:
    both read and write the same stored KV formats. `to_production()` switches in place.
    """

    def __init__(self, config: ModelConfig, *, indexer_rotation: bool = True,
                 kv_dtype: str = "stored", precision: str = "reference"):
        super().__init__()
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
        _check_supported(config, indexer_rotation, kv_dtype)
        if precision not in production.PRECISIONS:
            raise ValueError(f"precision must be one of {production.PRECISIONS}, "
                             f"got {precision!r}")
        self.precision = "reference"
        self.config = config
        self.options = {"indexer_rotation": bool(indexer_rotation)}
        self.weights_id: str | None = None
        if kv_dtype != "stored":
            self.options["kv_dtype"] = kv_dtype
        self.codec = codec_for(config, kv_dtype)
        self.dense_attention = False
        self.embed = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Block(config, i, indexer_rotation=indexer_rotation, codec=self.codec)
            for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = Linear(config.hidden_size, config.vocab_size)
        if config.hc_mult > 1:
            add_site(self, "hc_head", config.hc_mult, config.hc_mult, config.hidden_size)
        self._decoder_full = next(
            (p.layer for p in config.layer_plan()
             if p.part == PART_DECODER and p.mode == MODE_FULL), None)
        if precision != "reference":
            self.to_production()

    def to_production(self, *, fp8: bool = False) -> Model:
        """Switch to the bf16 production path in place (production.to_production): float32
        weights become bf16 (fp8=True: FP8 E4M3 with 128x128 block scales)."""
        production.to_production(self, fp8=fp8)
        return self

    # ---- construction -----------------------------------------------------------------

    @classmethod
    def synthetic(cls, config: ModelConfig, seed: int = 0, *, device: str | torch.device = "cpu",
                  **options) -> Model:
        """A model with deterministic synthetic weights (see `init_synthetic`)."""
        with torch.device("meta"):
            model = cls(config, **options)
        model = model.to_empty(device=device)
        model.init_synthetic(seed)
        return model

    def init_synthetic(self, seed: int) -> Model:
        from .synthetic import init_synthetic
        from .weights_id import synthetic_weights_id
        init_synthetic(self, seed)
        self.weights_id = synthetic_weights_id(self.config.fingerprint(), seed)
        return self

    def save_pretrained(self, directory: str | Path, *, max_shard_bytes: int = 2 << 30) -> None:
        if self.precision != "reference":
            raise ValueError("save_pretrained: this model holds production weights (bf16/FP8/"
                             "FP4); save the reference-precision model they came from")
        from .checkpoint import save_pretrained
        save_pretrained(self, directory, max_shard_bytes=max_shard_bytes)

    @classmethod
    def from_pretrained(cls, directory: str | Path, *, device: str | torch.device = "cpu",
                        kv_dtype: str = "stored", weights_id: str | None = None,
                        precision: str = "reference") -> Model:
        """Load dsv41's own checkpoints, directories written by transformers'
        DeepseekV4ForCausalLM.save_pretrained, and DeepSeek's naming with FP8/FP4 weights
        (docs/model.md, "Checkpoints")."""
        from .checkpoint import load_pretrained
        return load_pretrained(cls, directory, device=device, kv_dtype=kv_dtype,
                               weights_id=weights_id, precision=precision)

    @property
    def decoder_full_layer(self) -> int | None:
        """The decoder's Full layer, whose global KV is projected from the encoder's final
        hidden state (None without an encoder-decoder split)."""
        return self._decoder_full

    def new_state(self) -> SequenceState:
        return SequenceState(self.config, device=self.device, options=self.options)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def kv_fingerprint(self) -> str:
        """The config fingerprint, extended by the options that change stored bytes. With
        `weights_id` it makes the prefix cache's model fingerprint
        (dsv41.cache.hashing.model_fingerprint)."""
        import hashlib
        import json
        if self.options.get("kv_dtype", "stored") != "stored":
            raise ValueError(f"kv_dtype={self.options['kv_dtype']!r} is a reference mode: its "
                             f"states are never cached or shared")
        blob = json.dumps({"config": self.config.fingerprint(), "options": self.options},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    # ---- public forward API -----------------------------------------------------------

    def prefill(self, tokens, state: SequenceState, *, return_all_logits: bool = False,
                trace: dict | None = None) -> torch.Tensor:
        """Run new tokens (one or more) through the model, extending `state`.

        Returns the last token's logits [vocab] (float32), or every new token's logits
        [T, vocab] with return_all_logits=True. `trace`, if a dict, receives per-layer
        records (index lists, queries, attention outputs, hidden states) for tests/tools.
        """
        segs = self._segments([tokens], [state])
        return self._run(segs, [return_all_logits], trace=trace)[0]

    def decode_step(self, token, state: SequenceState) -> torch.Tensor:
        """One token (an int or a 0-d/1-element tensor) -> its logits [vocab]."""
        return self.prefill(_one_token(token), state)

    def prefill_batch(self, tokens: Sequence, states: Sequence[SequenceState], *,
                      return_all_logits: bool = False) -> list[torch.Tensor]:
        """prefill over several sequences (any lengths and positions) in one pass; the
        result for each equals running it alone."""
        if len(tokens) != len(states):
            raise ValueError(f"prefill_batch: {len(tokens)} token lists for {len(states)} states")
        segs = self._segments(list(tokens), list(states))
        return self._run(segs, [return_all_logits] * len(segs))

    def decode_batch(self, tokens, states: Sequence[SequenceState]) -> torch.Tensor:
        """One token per sequence -> logits [B, vocab]."""
        if isinstance(tokens, torch.Tensor):
            tokens = list(tokens.reshape(-1))
        if len(tokens) != len(states):
            raise ValueError(f"decode_batch: {len(tokens)} tokens for {len(states)} states")
        return torch.stack(self.prefill_batch([_one_token(t) for t in tokens], states))

    def extend_batch(self, items: Sequence[Extend], *, trace: dict | None = None
                     ) -> list[torch.Tensor]:
        """Run several `Extend`s in one pass (any mix of plain prefills, decodes, encoder
        replays and decoder replays); each result equals running it alone. Returns per
        item the last token's logits [vocab], or [T, vocab] with all_logits."""
        items = list(items)
        for b, it in enumerate(items):
            if not isinstance(it, Extend):
                raise TypeError(f"extend_batch: item {b} is {type(it).__name__}, not an Extend")
        segs = self._segments([it.tokens for it in items], [it.state for it in items])
        dec_from = []
        for b, (it, seg) in enumerate(zip(items, segs)):
            where = f"sequence {b}: " if len(items) > 1 else ""
            self._check_replay(it, seg, where)
            seg.swa_start = int(it.swa_start)
            seg.cached_until = None if it.cached_until is None else int(it.cached_until)
            dec_from.append(0 if it.decoder_start is None else int(it.decoder_start) - seg.start)
        return self._run(segs, [bool(it.all_logits) for it in items], trace=trace,
                         dec_from=dec_from)

    def _check_replay(self, it: Extend, seg: Segment, where: str) -> None:
        st, pos, n = it.state, seg.start, seg.length
        if not 0 <= int(it.swa_start) <= pos:
            raise ValueError(f"{where}swa_start={it.swa_start} must lie in [0, {pos}] "
                             f"(the state's position)")
        if it.cached_until is not None:
            H = int(it.cached_until)
            if H > pos and self.config.overlap_compress_ratios:
                raise ValueError(f"{where}cached_until={H}: replay over cached global KV is "
                                 f"not supported with overlapping compressor windows (V4): "
                                 f"the carried window is not part of the cached entries")
            m = st._block_multiple()
            if H < pos or H % m:
                raise ValueError(f"{where}cached_until={H} must be a multiple of {m} (every "
                                 f"ratio) at or after the position {pos}")
            for layer, store in (*st.main_kv.items(), *st.index_keys.items()):
                want = H // self.config.compress_ratios[layer]
                if store.n != want:
                    raise ValueError(f"{where}cached_until={H}: layer {layer} holds {store.n} "
                                     f"global entries, not the {want} of tokens [0, {H})")
            if H > pos and any(kv.shape[0] for kv, _ in st.pending.values()):
                raise ValueError(f"{where}cached_until={H} > position {pos} needs an empty "
                                 f"compressor state (replay starts at a block boundary)")
        if it.decoder_start is not None:
            d = int(it.decoder_start)
            if not pos <= d < pos + n:
                raise ValueError(f"{where}decoder_start={d} must lie in [{pos}, {pos + n - 1}]")
            if d > pos and it.all_logits:
                raise ValueError(f"{where}decoder replay (decoder_start={d} > position {pos}) "
                                 f"cannot return every token's logits: the decoder does not "
                                 f"run on tokens before {d}")

    # ---- validation -------------------------------------------------------------------

    def _segments(self, token_lists: list, states: list) -> list[Segment]:
        if not states:
            raise ValueError("no sequences given")
        if self.embed.weight.is_meta:
            raise RuntimeError("the model's weights are on the meta device: load them "
                               "(from_pretrained) or initialise them (init_synthetic) first")
        if len({id(s) for s in states}) != len(states):
            raise ValueError("the same state appears twice in one batch")
        segs, offset = [], 0
        for b, (tokens, state) in enumerate(zip(token_lists, states)):
            where = f"sequence {b}: " if len(states) > 1 else ""
            ids = self.check_tokens(tokens, where)
            self._check_state(state, ids.shape[0], where)
            segs.append(Segment(state, ids.to(self.device), offset))
            offset += ids.shape[0]
        return segs

    def check_tokens(self, tokens, where: str = "") -> torch.Tensor:
        """Token ids as an int64 CPU tensor, or a clear error (type, shape, empty, a token
        outside the vocabulary); `where` prefixes the message."""
        if isinstance(tokens, torch.Tensor):
            if tokens.dtype not in _INT_DTYPES:
                raise TypeError(f"{where}token ids must be an integer tensor, got {tokens.dtype}")
            if tokens.dim() != 1:
                raise ValueError(f"{where}token ids must be a 1-d tensor, got shape "
                                 f"{tuple(tokens.shape)}")
            ids = tokens.detach().to("cpu", torch.int64)
        elif isinstance(tokens, (list, tuple)):
            for i, t in enumerate(tokens):
                if isinstance(t, bool) or not isinstance(t, int):
                    raise TypeError(f"{where}token {i} is {t!r} ({type(t).__name__}), not an int")
            ids = torch.tensor(list(tokens), dtype=torch.int64)
        else:
            raise TypeError(f"{where}tokens must be a list of ints or a 1-d integer tensor, "
                            f"got {type(tokens).__name__}")
        if ids.numel() == 0:
            raise ValueError(f"{where}empty prompt: at least one token is needed")
        bad = ((ids < 0) | (ids >= self.config.vocab_size)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise ValueError(f"{where}token id {int(ids[i])} at index {i} is outside the "
                             f"vocabulary [0, {self.config.vocab_size})")
        return ids

    def _check_state(self, state, n_new: int, where: str) -> None:
        if not isinstance(state, SequenceState):
            raise TypeError(f"{where}state must be a SequenceState (model.new_state()), "
                            f"got {type(state).__name__}")
        if state.config_fingerprint != self.config.fingerprint():
            raise ValueError(f"{where}the state belongs to model config {state.config.name!r} "
                             f"(fingerprint {state.config_fingerprint[:12]}), not to this "
                             f"model's {self.config.name!r} "
                             f"({self.config.fingerprint()[:12]})")
        if state.options != self.options:
            raise ValueError(f"{where}the state was built with model options {state.options}, "
                             f"this model uses {self.options}")
        if state.device != self.device:
            raise ValueError(f"{where}the state is on {state.device}, the model on {self.device}")
        limit = self.config.max_position_embeddings
        if state.position + n_new > limit:
            raise ValueError(f"{where}{n_new} new tokens after {state.position} would reach "
                             f"position {state.position + n_new}, past the maximum length "
                             f"{limit} (max_position_embeddings)")

    # ---- the forward pass -------------------------------------------------------------

    @torch.no_grad()
    def _run(self, segs: list[Segment], all_logits: list[bool], *, trace: dict | None = None,
             dec_from: list[int] | None = None) -> list[torch.Tensor]:
        if trace is not None and len(segs) != 1:
            raise ValueError("trace is supported for one sequence at a time")
        ctx = ForwardContext.build(segs, dense=self.dense_attention, trace=trace)
        enc_ctx, h_enc, dsegs = None, None, []
        first_decoder = self.config.num_encoder_layers
        try:
            tok = torch.cat([s.tokens for s in segs])
            h = self.embed(tok)
            if self.config.hc_mult > 1:
                h = h[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()
            for block in self.layers:
                if block.layer == first_decoder and dec_from and any(dec_from):
                    # Decoder replay: the decoder layers run on each segment's tokens from
                    # its decoder_start on, with their SWA windows starting there.
                    enc_ctx, h_enc = ctx, h
                    keep, offset = [], 0
                    for s, k in zip(segs, dec_from):
                        d = Segment(s.state, s.tokens[k:], offset,
                                    swa_start=s.start + k if k else s.swa_start,
                                    cached_until=s.cached_until, base=k)
                        dsegs.append(d)
                        keep.append(torch.arange(s.rows.start + k, s.rows.stop))
                        offset += d.length
                    ctx = ForwardContext.build(dsegs, dense=self.dense_attention, trace=trace)
                    keep_rows = torch.cat(keep).to(h.device)
                    h, tok = h.index_select(0, keep_rows), tok.index_select(0, keep_rows)
                x, mix = block.attn_input(h)
                kv_input, kv_ctx = None, None
                if block.layer == self._decoder_full:
                    # The decoder's global KV is a function of the encoder's final hidden
                    # state H_enc only: its compressor reads attn_norm(X_enc), X_enc being
                    # this layer's block input computed from H_enc (module docstring). In a
                    # plain forward that is x itself; decoder replay passes the longer H_enc
                    # of every token of the call (and its segments).
                    if h_enc is None:
                        ctx.record(block.layer, h_enc=h)
                        kv_input = x
                    else:
                        ctx.record(block.layer, h_enc=h_enc)
                        kv_input, kv_ctx = block.attn_input(h_enc)[0], enc_ctx
                h = block.residual(h, block.attn(x, ctx, kv_input, kv_ctx), mix)
                h = block.ffn_step(h, tok)
                ctx.record(block.layer, hidden=h)
            if self.config.hc_mult > 1:
                h = hc_head(h, self.hc_head_fn, self.hc_head_base, self.hc_head_scale,
                            self.config.hc_eps, self.config.rms_norm_eps,
                            fp32=gemm.is_production(self))
            out_segs = ctx.segments
            rows = torch.cat([
                torch.arange(s.rows.start, s.rows.stop) if want
                else torch.tensor([s.rows.stop - 1])
                for s, want in zip(out_segs, all_logits)]).to(h.device)
            logits = self.head(self.norm(h.index_select(0, rows)))
        except BaseException:
            for s in segs:
                s.state._rollback()
            raise
        for d in dsegs:
            d.commit(advance=False)
        out, at = [], 0
        for s, want in zip(segs, all_logits):
            s.commit()
            n = s.length if want else 1
            out.append(logits[at:at + n] if want else logits[at])
            at += n
        return out

    def extra_repr(self) -> str:
        return (f"config={self.config.name!r}, options={self.options}, "
                f"precision={self.precision!r}")


def _one_token(token) -> list[int]:
    if isinstance(token, torch.Tensor):
        if token.numel() != 1:
            raise ValueError(f"decode needs exactly one token, got shape {tuple(token.shape)}")
        if token.dtype not in _INT_DTYPES:
            raise TypeError(f"token ids must be integers, got {token.dtype}")
        return [int(token.reshape(()))]
    if isinstance(token, bool) or not isinstance(token, int):
        raise TypeError(f"a token id must be an int, got {token!r} ({type(token).__name__})")
    return [token]


def _check_supported(config: ModelConfig, indexer_rotation: bool, kv_dtype: str) -> None:
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    if config.rope_head_dim > config.index_head_dim:
        raise ValueError(f"config {config.name!r}: rope_head_dim={config.rope_head_dim} must not "
                         f"exceed index_head_dim={config.index_head_dim} (the indexer rotates "
                         f"the last rope_head_dim dims of its heads)")
    if kv_dtype != "stored":
        return   # float32 KV: nothing is quantized or rotated, any dims work
    config.check_stored_formats()
    n = config.index_head_dim
    if indexer_rotation and n & (n - 1):
        raise ValueError(f"indexer_rotation needs a power-of-two index_head_dim, got {n}")
