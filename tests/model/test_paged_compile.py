"""The paged decode step compiles as one graph: `torch.compile(fullgraph=True)` refuses any
graph break, and a host sync (`.item()`, `.tolist()`, `nonzero`, boolean-mask indexing, a
data-dependent shape) is a graph break. So this is the CPU's evidence that the step holds
none and can be captured as a CUDA graph (issue 27.3). The aot_eager backend traces the
whole step through AOTAutograd, as inductor does, without generating code, so it fits CI;
the compiled step must give the eager step's logits."""
from __future__ import annotations

import torch

from dsv41.config import ModelConfig
from dsv41.model import Model
from dsv41.model.paged import forward

from .paged_helpers import Driver


def test_the_decode_step_compiles_with_no_graph_break():
    torch._dynamo.reset()
    m = Model.synthetic(ModelConfig.preset("v41-tiny"), seed=0, precision="bf16")
    drv = Driver(m, pages=24, slots=3, page_tokens=16, max_step=256)
    seqs = [drv.new() for _ in range(3)]
    drv.step([(s, list(range(1, 30 + 7 * i))) for i, s in enumerate(seqs)])
    batch = drv.decode_batch(seqs, 5, pad_to=4, context_cap=64, pad_logits=True)
    eager = forward(m, batch, drv.kv)
    step = torch.compile(lambda b: forward(m, b, drv.kv), fullgraph=True, dynamic=False,
                         backend="aot_eager")
    compiled = step(batch)
    assert compiled.shape == eager.shape == (4, m.config.vocab_size)
    assert torch.equal(compiled[:3], eager[:3])


def test_a_decode_step_with_attention_plans_gives_the_same_logits():
    """A captured step passes its attention plans (model.paged.AttentionPlans): one plan per
    distinct attention shape of the step, made on first use and reused after. On the CPU the
    plans are the reference's, and the step's logits are those of unplanned calls."""
    from dsv41.model.paged import AttentionPlans
    m = Model.synthetic(ModelConfig.preset("v41-tiny"), seed=0)
    drv = Driver(m, pages=24, slots=3, page_tokens=16, max_step=256)
    seqs = [drv.new() for _ in range(3)]
    drv.step([(s, list(range(1, 30 + 7 * i))) for i, s in enumerate(seqs)])
    batch = drv.decode_batch(seqs, 5, pad_to=4, context_cap=64, pad_logits=True)
    plain = forward(m, batch, drv.kv)
    plans = AttentionPlans(m.device)
    planned = forward(m, batch, drv.kv, plans)
    assert torch.equal(planned, plain)
    assert plans.made and all(k[0] == 4 for k in plans.made)       # the padded bucket's rows
    assert all(p.kernel == "reference" for p in plans.made.values())
    made = dict(plans.made)
    forward(m, batch, drv.kv, plans)
    assert all(plans.made[k] is made[k] for k in made) and plans.made.keys() == made.keys()
