"""The training run end to end at toy size: every artefact is written, the checkpoint
loads through Model.from_pretrained, and the same seed gives the same weights."""
from __future__ import annotations

import json

import torch

from dsv41.model import Model
from dsv41.train.loop import Recipe, train


def _run(tmp_path, name):
    recipe = Recipe(steps=3, batch=4, dense_steps=1, warmup_steps=1, eval_every=2,
                    held_out_per_task=2, contexts=(48, 64), threads=1)
    final = train(recipe, tmp_path / name, progress=False)
    return final, tmp_path / name


def test_a_toy_run_writes_a_loadable_reproducible_checkpoint(tmp_path):
    final, out = _run(tmp_path, "a")
    for name in ("config.json", "recipe.json", "train_log.jsonl", "training.png",
                 "weights_digest.json"):
        assert (out / name).is_file(), name
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3]
    assert [r["dense"] for r in log] == [True, False, False]
    assert "held_out" in log[1] and "held_out" in log[2] and "held_out" not in log[0]
    assert set(final) == {"passkey", "multihop", "extraction"}
    assert json.loads((out / "recipe.json").read_text())["steps"] == 3
    a = Model.from_pretrained(out)
    assert a.weights_id          # the digest save_pretrained recorded
    _, out_b = _run(tmp_path, "b")
    b = Model.from_pretrained(out_b)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    init = Model.synthetic(a.config, seed=0)
    assert not torch.equal(init.state_dict()["head.weight"], sa["head.weight"])   # it trained
