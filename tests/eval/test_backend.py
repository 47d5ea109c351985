"""The Engine backend on v41-tiny: the states it builds, concurrency, two turns, the
decoder switch; and loading a checkpoint for `--model`."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("dsv41.engine", reason="needs the engine (dsv41.Engine)")

from dsv41 import Model, ModelConfig  # noqa: E402
from dsv41.eval import load_model  # noqa: E402
from dsv41.eval.backend import EngineBackend  # noqa: E402
from dsv41.eval.runner import BackendRequest  # noqa: E402

SAMPLING = {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 2}


@pytest.fixture(scope="module")
def model():
    return Model.synthetic(ModelConfig.preset("v41-tiny"), seed=0)


def prompt(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(32, 127, (n,), generator=g).tolist()


def test_states_concurrency_and_turns(model):
    b = EngineBackend(model, block_tokens=4, max_batch=2)
    p1, p2 = prompt(1, 30), prompt(2, 34)
    # both hit: the warm-up left blocks and a snapshot at H; two requests at once, two turns
    reqs = [BackendRequest([p1, p1 + [40, 41, 42]], 24, None), BackendRequest([p2, p2 + [43, 44]], 24, None)]
    out = b.run(reqs, "warm", "bounded", SAMPLING)
    for req, turns in zip(reqs, out):
        assert len(turns) == 2
        t1 = turns[0]
        assert t1.stats["path"] == "both_hit" and t1.stats["swa_hit_tokens"] == 24
        assert t1.stats["global_hit_tokens"] == 24 and t1.stats["prefill_tokens"] == len(req.turns[0]) - 24
        assert len(t1.logits) == len(t1.output_tokens) == 2
        assert turns[1].stats["path"] == "both_hit"         # turn 1 wrote its end-of-output snapshot
    # global hit, SWA expired, decoder switch: bounded encoder replay + decoder replay
    out = b.run([BackendRequest([p1], 24, None)], "warm_expired", "decoder", SAMPLING)
    s = out[0][0].stats
    assert s["path"] == "encoder_replay" and s["decoder_replay"] and s["replayed_tokens"] == 16
    assert s["decoder_prefill_tokens"] == 16 and s["swa_hit_tokens"] == 0
    # cold: the same first-token logits as a plain prefill
    out = b.run([BackendRequest([p1], 0, None)], "cold", "off", SAMPLING)
    assert out[0][0].stats["path"] == "cold"
    assert torch.equal(out[0][0].logits[0], model.prefill(p1, model.new_state()))
    with pytest.raises(ValueError, match="unknown backend state"):
        b.run([BackendRequest([p1], 24, None)], "lukewarm", "off", SAMPLING)
    with pytest.raises(ValueError, match="unknown replay switch"):
        b.run([BackendRequest([p1], 24, None)], "warm", "sometimes", SAMPLING)


def test_describe_records_the_frozen_environment(model):
    d = EngineBackend(model, block_tokens=4, write_approximate=False).describe()
    assert d["kv_fingerprint"] == model.kv_fingerprint() and d["config_name"] == "v41-tiny"
    assert d["write_approximate"] is False and d["torch"] == torch.__version__
    assert len(d["weights_sha256"]) == 64 and d["device"] == "cpu"
    other = Model.synthetic(ModelConfig.preset("v41-tiny"), seed=1)
    assert EngineBackend(other).describe()["weights_sha256"] != d["weights_sha256"]


def test_checkpoint_loads_for_model_dir(model, tmp_path):
    model.save_pretrained(tmp_path / "ckpt")
    m, source = load_model({"preset": "v41-small"}, str(tmp_path / "ckpt"))
    assert source == {"checkpoint": str((tmp_path / "ckpt").resolve())}
    assert m.kv_fingerprint() == model.kv_fingerprint()
    assert EngineBackend(m).describe()["weights_sha256"] == EngineBackend(model).describe()["weights_sha256"]
    m, source = load_model({"preset": "v41-tiny", "seed": 3})
    assert source == {"preset": "v41-tiny", "seed": 3, "weights": "synthetic"}


def test_seeded_sampling_pairs_states(model):
    """With temperature > 0 the same seed draws the same tokens in every exact state, so a
    differing token in a replayed state is the state's doing."""
    b = EngineBackend(model, block_tokens=4)
    p = prompt(5, 40)
    samp = {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 4}
    cold = b.run([BackendRequest([p], 0, 7)], "cold", "off", samp)[0][0]
    exact = b.run([BackendRequest([p], 28, 7)], "warm_expired", "exact", samp)[0][0]
    assert exact.stats["path"] == "encoder_replay" and exact.output_tokens == cold.output_tokens
    assert all(torch.equal(a, c) for a, c in zip(exact.logits, cold.logits))
    other = b.run([BackendRequest([p], 0, 8)], "cold", "off", samp)[0][0]
    assert torch.equal(other.logits[0], cold.logits[0])          # same prompt, same first distribution
