"""Mask DINO end to end in the training loop: two steps on the embedded shapes with their masks, an evaluation
whose background scoring gives mask AP beside box AP, recorded with its step."""

from __future__ import annotations

import json

import pytest

from detector.loop import trainer
from detector.training import checkpointing
from tests.helpers.runs import read_jsonl
from tests.helpers.tiny_config import make_dino_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compilation_cache_dir")]

MASKS = {
    "model.dino.mask_dim": 8,
    "input.mask_stride": 4,
    "loss.set_prediction.mask_points": 64,
    "postprocess.score_threshold": 0.0,  # every detection kept: after 2 steps all scores are low
}
STEPS = {"total_steps": 2, "checkpoint_every_steps": 2, "eval_every_steps": 2, "log_every_steps": 1}


def test_mask_dino_trains_and_scores_mask_ap_in_the_loop(data_dir, tmp_path):
    # The best checkpoint by mask AP: the one evaluation's.
    config = make_dino_config(data_dir, **MASKS, **STEPS, best_metric="mask_AP")
    metrics = trainer.train_and_evaluate(config, str(tmp_path))
    for key in ("AP", "mask_AP", "mask_AP50", "mask_AR100"):
        assert 0.0 <= metrics[key] <= 1.0, (key, metrics)
    train_rows = [row for row in read_jsonl(tmp_path / "train_metrics.jsonl") if "loss" in row]
    assert [row["step"] for row in train_rows] == [1, 2]
    assert all(row["mask_loss"] > 0 and row["dice_loss"] > 0 for row in train_rows)
    [evaluation] = read_jsonl(tmp_path / "eval_metrics.jsonl")
    assert evaluation["step"] == 2 and evaluation["mask_AP"] == pytest.approx(metrics["mask_AP"])
    assert json.dumps(evaluation)  # plain numbers, as every other metric
    assert checkpointing.restore_best(str(tmp_path))[0] == 2


def test_the_best_checkpoint_metric_is_checked_before_training(data_dir, tmp_path):
    from detector.errors import ConfigError
    from detector.loop.evaluator import best_metric

    assert best_metric(make_dino_config(data_dir, **MASKS, best_metric="mask_AP")) == "mask_AP"
    with pytest.raises(ConfigError, match=r"best_metric='mask_AP' needs a model that predicts masks"):
        best_metric(make_dino_config(data_dir, best_metric="mask_AP"))
    with pytest.raises(ConfigError, match=r"best_metric='segm_AP'; use a COCO stat name"):
        best_metric(make_dino_config(data_dir, best_metric="segm_AP"))
