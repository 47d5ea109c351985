"""Training examples: laid out as the eval harness lays out its prompts, with exactly the
answers the scorers accept as targets."""
from __future__ import annotations

import random

import pytest

from dsv41.eval.tasks import TASKS
from dsv41.eval.tokenizer import EOS, CharTokenizer
from dsv41.train.data import collate, held_out, make_example, random_example

TOK = CharTokenizer(256)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_reference_outputs_are_what_the_scorer_accepts(task):
    t = TASKS[task]
    for seed in range(20):
        inst = t.make(TOK, seed, context_len=128, suffix="short", hit=96, window=16,
                      placement="before_boundary")
        outs = t.reference_outputs(inst.answer)
        assert len(outs) == 2
        assert t.score(inst.answer, outs)["success"] is True
        assert t.score(inst.answer, outs[:1])["success"] is True
        assert t.score(inst.answer, ["", ""])["success"] is False


def test_example_is_the_eval_prompt_then_both_answers():
    t = TASKS["passkey"]
    ex = make_example(TOK, task="passkey", seed=5, context_len=80, suffix="short", hit=64,
                      window=16, placement="far_behind")
    inst = t.make(TOK, 5, context_len=80, suffix="short", hit=64, window=16, placement="far_behind")
    key = inst.answer["key"]
    want = inst.prompt + TOK.encode(key) + [EOS] + inst.followup + TOK.encode(key) + [EOS]
    assert ex.tokens == want
    targets = [tok for tok, m in zip(ex.tokens, ex.target) if m]
    assert targets == TOK.encode(key) + [EOS] + TOK.encode(key) + [EOS]
    assert not any(ex.target[:len(inst.prompt)])


def test_random_examples_cover_the_harness_and_collate_pads():
    rng = random.Random(0)
    exs = [random_example(rng, TOK, window=16, block=4, contexts=(48, 144)) for _ in range(200)]
    assert {e.task for e in exs} == set(TASKS)
    assert {e.placement for e in exs} == {"before_boundary", "across_boundary", "far_behind",
                                          "in_window"}
    assert all(48 <= e.context_len <= 144 for e in exs)
    toks, mask = collate(exs[:5])
    assert toks.shape == mask.shape and toks.shape[1] == max(len(e.tokens) for e in exs[:5])
    for b, e in enumerate(exs[:5]):
        assert toks[b, :len(e.tokens)].tolist() == e.tokens
        assert (toks[b, len(e.tokens):] == EOS).all() and not mask[b, len(e.tokens):].any()


def test_held_out_seeds_are_disjoint_from_training_and_the_matrix():
    a = held_out(TOK, "passkey", 3, context_len=96, window=16)
    assert len({tuple(e.tokens) for e in a}) == 3
    rng = random.Random(1)
    train_prompts = {tuple(random_example(rng, TOK, window=16, block=4, contexts=(96, 96)).tokens)
                     for _ in range(50)}
    assert not train_prompts & {tuple(e.tokens) for e in a}
