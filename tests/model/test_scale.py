"""Synthetic weights keep activations in a realistic range through every layer."""
from __future__ import annotations

import pytest
import torch

from dsv41 import Model, ModelConfig

from .conftest import token_ids


@pytest.mark.parametrize("preset", ["v41-tiny", "v41-small"])
def test_hidden_rms_stays_in_a_band_through_depth(preset):
    c = ModelConfig.preset(preset)
    model = Model.synthetic(c, seed=0)
    ids = token_ids(48, seed=51, vocab=c.vocab_size)
    trace = {}
    logits = model.prefill(ids, model.new_state(), trace=trace, return_all_logits=True)
    hidden = [model.embed(ids)] + [trace[i]["hidden"] for i in range(c.num_layers)]
    rms = [float(h.square().mean(-1).sqrt().mean()) for h in hidden]
    assert all(0.8 < r < 2.0 for r in rms), rms
    # Every layer changes the residual stream by a visible but bounded amount.
    for i in range(c.num_layers):
        step = float((hidden[i + 1] - hidden[i]).square().mean().sqrt())
        assert 0.01 < step < 0.5, (i, step)
    assert torch.isfinite(logits).all() and 0.2 < float(logits.std()) < 5.0
