"""The shipped trained model (dsv41/checkpoints/v41-tiny-tasks) loads and still retrieves:
greedy passkey accuracy on held-out prompts through the serving forward with the stored KV
formats. Fails when the checkpoint or the model code regresses."""
from __future__ import annotations

import json

import pytest
import torch

from dsv41.checkpoints import SHIPPED, resolve, shipped_path
from dsv41.eval import default_matrix, load_model
from dsv41.model import Model
from dsv41.train.accuracy import task_accuracy

NAME = "v41-tiny-tasks"


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(2)
    return Model.from_pretrained(shipped_path(NAME))


def test_it_ships_with_its_recipe_log_and_plot():
    d = shipped_path(NAME)
    for f in ("config.json", "recipe.json", "train_log.jsonl", "training.png", "README.md",
              "weights_digest.json"):
        assert (d / f).is_file(), f
    assert sum(p.stat().st_size for p in d.iterdir()) < 8 << 20        # "a few MB"
    assert json.loads((d / "config.json").read_text())["text_config"]["sliding_window"] == 16
    assert resolve(NAME) == d and NAME in SHIPPED


def test_it_is_the_eval_default(model):
    spec = default_matrix().model
    assert spec == {"shipped": NAME}
    loaded, source = load_model(spec)
    assert source == {"shipped": NAME} and loaded.weights_id == model.weights_id


def test_passkey_retrieval_on_held_out_prompts(model):
    # 16 prompts, 4 and 8 windows of context, the key outside the last window
    hits = 0
    for ctx, placement in ((64, "far_behind"), (128, "before_boundary")):
        r = task_accuracy(model, "passkey", 8, context_len=ctx, placement=placement, seed=7 << 20)
        hits += r["success"]
    assert hits >= 13, hits
