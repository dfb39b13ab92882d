"""COCO-format folders end to end: category ids in and out, crowds, negatives, training and coco_evaluation."""

import json

import numpy as np
import pytest

import input_pipeline
from detector.loop import trainer
from detector.serving import coco_evaluation
from tests.helpers.coco_folders import CATEGORY_IDS, coco_json_overrides, write_folder
from tests.helpers.pipeline_config import make_config as make_pipeline_config
from tests.helpers.tiny_config import make_config as make_train_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compilation_cache_dir")]


@pytest.fixture(scope="module")
def folder_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("coco_folder")
    config = make_pipeline_config(root / "data", **coco_json_overrides(root, num_train=16, num_eval=9))
    return config


def test_categories_and_counts(folder_config):
    info = input_pipeline.get_dataset_info(folder_config)
    assert info.label_to_category_id == CATEGORY_IDS  # contiguous labels <-> the user's gapped ids
    assert info.num_eval_examples == 9
    split = input_pipeline.prepare_split(folder_config, "train")
    assert split.counts["images"] == split.counts["usable_images"] == 16
    assert split.counts["no_annotations"] == 1  # the negative image is kept
    assert split.counts["crowd_box"] == 6  # indices 0, 3, ..., 15
    assert set(split.labels.tolist()) <= {0, 1, 2, 3}
    # Crowd regions are no training targets: the pipeline never emits more boxes than the non-crowd ones.
    batch = next(input_pipeline.create_train_iterator(folder_config))
    assert batch["example_mask"].all()
    ids = sorted(set(batch["image_id"].tolist()))
    assert set(ids) <= {100 + 7 * i for i in range(16)}


def _perfect_outputs(batch):
    """predict_step-shaped outputs that repeat each eval image's ground-truth boxes with score 1."""
    boxes_mask = batch["boxes_mask"]
    return {
        "boxes": batch["boxes"],
        "scores": boxes_mask.astype(np.float32),
        "classes": np.maximum(batch["labels"], 0),
        "valid": boxes_mask,
        "image_id": batch["image_id"],
        "scale": batch["scale"],
        "original_size": batch["original_size"],
        "example_mask": batch["example_mask"],
    }


def test_perfect_predictions_score_one_against_the_users_json(folder_config):
    """Ground truth through the pipeline, mapped back to the user's pixels and ids, scores mAP 1.0."""
    info = input_pipeline.get_dataset_info(folder_config)
    ground_truth = input_pipeline.coco_ground_truth(folder_config)
    with open(folder_config.dataset.eval_json) as f:
        users = json.load(f)
    assert ground_truth["annotations"] == users["annotations"]  # the user's own JSON, unchanged
    results, image_ids = [], []
    for batch in input_pipeline.create_eval_iterator(folder_config).batches:
        outputs = _perfect_outputs(batch)
        image_ids += batch["image_id"][batch["example_mask"]].tolist()
        results += coco_evaluation.detections_to_coco(outputs, info.label_to_category_id)
    assert sorted(image_ids) == sorted(im["id"] for im in users["images"])
    assert {r["category_id"] for r in results} <= set(CATEGORY_IDS)
    metrics = coco_evaluation.coco_metrics(ground_truth, results, image_ids)
    assert metrics["AP"] == pytest.approx(1.0)
    assert metrics["AP50"] == pytest.approx(1.0)
    # The same boxes reported with contiguous labels instead of the user's ids score nothing:
    # the remap is what makes the score right.
    unmapped = coco_evaluation.coco_metrics(
        ground_truth, [dict(r, category_id=CATEGORY_IDS.index(r["category_id"])) for r in results], image_ids
    )
    assert unmapped["AP"] < 0.1


def test_trains_and_evaluates_on_a_coco_folder(tmp_path):
    overrides = coco_json_overrides(tmp_path / "folder", num_train=16, num_eval=8)
    # test_train's reference program (same model, batch and schedule): compiled once per test run.
    config = make_train_config(tmp_path / "data", **overrides)
    metrics = trainer.train_and_evaluate(config, str(tmp_path / "run"))
    assert set(metrics) >= {"AP", "AP50", "AR100"} and all(np.isfinite(list(metrics.values())))
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())
    assert report["dataset"] == "coco_json"
    assert report["train"]["conversion"]["crowd_box"] == 6
    assert report["train"]["conversion"]["no_annotations"] == 1
    assert report["train"]["streaming"]["examples"] == config.total_steps * config.global_batch_size
    assert report["eval"]["streaming"]["examples"] == 8
    eval_lines = [json.loads(line) for line in (tmp_path / "run" / "eval_metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in eval_lines] == [config.total_steps]


def test_images_without_annotations_can_be_left_out(tmp_path):
    train_json, train_images, _ = write_folder(tmp_path, "train", 8, negative_ids=(1, 2))
    config = make_pipeline_config(
        tmp_path / "data",
        **{
            "dataset.name": "coco_json",
            "dataset.train_json": train_json,
            "dataset.train_images": train_images,
            "dataset.eval_json": train_json,
            "dataset.eval_images": train_images,
            "dataset.include_negatives": False,
        },
    )
    seen = set()
    iterator = input_pipeline.create_train_iterator(config)
    for _ in range(4):  # 4 batches of 8 = 5+ epochs of the 6 positive images
        seen.update(next(iterator)["image_id"].tolist())
    assert seen == {100 + 7 * i for i in range(8)} - {107, 114}


def test_conversion_counts_table(folder_config):
    splits = {which: input_pipeline.prepare_split(folder_config, which) for which in ("train", "eval")}
    table = input_pipeline.format_counts(splits)
    assert "| crowd_box | 6 | 3 |" in table  # train: indices 0, 3, .., 15; eval: 0, 3, 6
    assert "| no_annotations | 1 | 1 |" in table
    assert "train: 16 records in" in table and "eval: 9 records in" in table
