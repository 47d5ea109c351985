"""Issue 17's greedy bar on a model with real answers: the shipped trained model decoded
greedily by the bf16 production path agrees with the float64 reference on at least 99% of
steps (every step, not only decisive ones: a trained model's answers are decisive), and
both answer the held-out tasks. Teacher-forced on the reference's own greedy outputs, so a
single early disagreement cannot cascade."""
from __future__ import annotations

import pytest
import torch

from dsv41.checkpoints import shipped_path
from dsv41.eval.tasks import TASKS
from dsv41.eval.tokenizer import EOS, CharTokenizer
from dsv41.model import Model
from dsv41.train.accuracy import greedy
from dsv41.train.data import held_out


@pytest.fixture(scope="module")
def pair():
    torch.set_num_threads(2)
    path = shipped_path("v41-tiny-tasks")
    return Model.from_pretrained(path), Model.from_pretrained(path, precision="bf16")


def test_production_path_greedy_agreement(pair):
    ref, prod = pair
    assert prod.precision == "bf16" and ref.precision == "reference"
    tok = CharTokenizer(ref.config.vocab_size)
    steps = agree = solved = 0
    examples = [ex for task in ("passkey", "multihop", "extraction", "tool_loop")
                for ex in held_out(tok, task, 5, context_len=96, window=16, seed=9 << 20)]
    for ex in examples:
        prompt = ex.tokens[:ex.prompt_len]
        out = greedy(ref, prompt, 48)
        solved += TASKS[ex.task].score(ex.answer, [tok.decode(out)])["success"]
        logits = prod.prefill(prompt + out[:-1], prod.new_state(),
                              return_all_logits=True)[len(prompt) - 1:]
        picks = logits.argmax(-1).tolist()
        steps += len(out)
        agree += sum(int(a == b) for a, b in zip(picks, out))
        assert out[-1] == EOS
    assert steps >= 200
    assert agree / steps >= 0.99, (agree, steps)
    assert solved == len(examples)


def test_paged_bf16_chooses_the_reference_tokens(pair):
    """Issue 27.6: the paged runtime in bf16, all held-out prompts batched together, chooses
    the tokens the per-sequence reference runtime chooses in float64, every one."""
    from dsv41.engine import Engine, SamplingParams
    ref, prod = pair
    tok = CharTokenizer(ref.config.vocab_size)
    prompts = [ex.tokens[:ex.prompt_len]
               for task in ("passkey", "multihop", "extraction", "tool_loop")
               for ex in held_out(tok, task, 4, context_len=96, window=16, seed=9 << 21)]
    sp = SamplingParams(max_new_tokens=48, stop_token_ids=(EOS,))
    paged = Engine(prod, max_batch=len(prompts), max_prefill_tokens=512)
    assert paged.runtime.name == "paged"
    got = [o.output_tokens for o in paged.generate(prompts, sp)]
    want = [o.output_tokens for o in Engine(ref, runtime="reference").generate(prompts, sp)]
    assert sum(len(w) for w in want) >= 150
    assert got == want
