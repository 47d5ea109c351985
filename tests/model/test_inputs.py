"""Bad input gets a clear error and leaves the state untouched."""
from __future__ import annotations

import pytest
import torch

from dsv41 import Model, ModelConfig
from dsv41.model import state_bytes_equal

from .conftest import token_ids


@pytest.fixture
def started(tiny):
    state = tiny.new_state()
    tiny.prefill(token_ids(21, seed=21), state)
    return state, state.clone()


def _untouched(state, before):
    assert state.position == before.position == 21
    assert state_bytes_equal(state, before)
    assert all(s.rows()[0].shape[0] == s.n for s in state.main_kv.values())  # nothing staged


@pytest.mark.parametrize("tokens,exc,msg", [
    ([1, 2, 256], ValueError, r"token id 256 at index 2 is outside the vocabulary \[0, 256\)"),
    ([-1], ValueError, "token id -1 at index 0 is outside the vocabulary"),
    (torch.tensor([3, 999]), ValueError, "token id 999 at index 1"),
    ([], ValueError, "empty prompt"),
    (torch.zeros(0, dtype=torch.long), ValueError, "empty prompt"),
    ([1, 2.0], TypeError, r"token 1 is 2.0 \(float\), not an int"),
    ([True], TypeError, "not an int"),
    (torch.tensor([1.0, 2.0]), TypeError, "integer tensor"),
    (torch.tensor([[1, 2]]), ValueError, "1-d tensor"),
    ("hello", TypeError, "list of ints or a 1-d integer tensor"),
])
def test_bad_tokens(tiny, started, tokens, exc, msg):
    state, before = started
    with pytest.raises(exc, match=msg):
        tiny.prefill(tokens, state)
    _untouched(state, before)


def test_bad_decode_tokens(tiny, started):
    state, before = started
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny.decode_step(300, state)
    with pytest.raises(TypeError, match="must be an int"):
        tiny.decode_step("7", state)
    with pytest.raises(ValueError, match="exactly one token"):
        tiny.decode_step(torch.tensor([1, 2]), state)
    _untouched(state, before)


def test_prompt_past_the_maximum_length(tiny_config, started):
    state, before = started
    short = tiny_config.replace(max_position_embeddings=30)
    model = Model.synthetic(short, seed=0)
    s = model.new_state()
    model.prefill(list(range(25)), s)
    snap = s.clone()
    with pytest.raises(ValueError, match=r"would reach position 31, past the maximum length 30"):
        model.prefill(list(range(6)), s)
    assert state_bytes_equal(s, snap)
    model.prefill(list(range(5)), s)  # exactly at the limit is fine
    assert s.position == 30


def test_state_from_another_config(tiny, tiny_config, started):
    state, before = started
    small = Model.synthetic(tiny_config.replace(sliding_window=8), seed=0)
    with pytest.raises(ValueError, match="the state belongs to model config"):
        small.prefill([1, 2], state)
    with pytest.raises(TypeError, match="state must be a SequenceState"):
        tiny.prefill([1, 2], {"tokens": []})
    _untouched(state, before)


def test_a_bad_sequence_in_a_batch_leaves_every_state_untouched(tiny, started):
    state, before = started
    other = tiny.new_state()
    with pytest.raises(ValueError, match="sequence 1: token id 1000"):
        tiny.prefill_batch([[1, 2], [1000]], [state, other])
    with pytest.raises(ValueError, match="the same state appears twice"):
        tiny.prefill_batch([[1], [2]], [state, state])
    with pytest.raises(ValueError, match="2 token lists for 1 states"):
        tiny.prefill_batch([[1], [2]], [state])
    _untouched(state, before)
    assert other.position == 0


def test_a_failure_inside_the_forward_rolls_back(tiny, started):
    state, before = started

    def boom(module, args, out):
        raise RuntimeError("injected failure")

    handle = tiny.layers[5].attn.register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            tiny.prefill(token_ids(9, seed=22), state)
    finally:
        handle.remove()
    _untouched(state, before)
    # The state still continues exactly like its untouched copy.
    assert torch.equal(tiny.prefill([4, 5], state), tiny.prefill([4, 5], before))


def test_meta_model_cannot_run(tiny_config):
    with torch.device("meta"):
        model = Model(tiny_config)
    with pytest.raises(RuntimeError, match="meta device"):
        model.prefill([1], model.new_state())


def test_unsupported_configs_are_refused():
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        Model(ModelConfig.preset("v4-tiny"), kv_dtype="bfloat16")
    with pytest.raises(TypeError, match="config must be a ModelConfig"):
        Model({"name": "v41-tiny"})
