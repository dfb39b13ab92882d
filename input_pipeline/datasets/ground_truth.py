"""COCO-format ground truth of a dataset's eval split, what COCO evaluation scores against."""

from __future__ import annotations

from input_pipeline.datasets import cache, coco_json
from input_pipeline.datasets.locations import coco_json_paths
from input_pipeline.datasets.registry import EVAL, check_name
from input_pipeline.datasets.splits import prepare_split


def eval_ground_truth(config) -> dict:
    """COCO-format ground truth of the eval split, in original image pixels.

    A COCO-format folder is evaluated against the user's own JSON (annotations
    that conversion dropped as unusable left out, missing `area` / `iscrowd`
    filled in as COCO defines them); other sources against their prepared
    split, with crowd / difficult regions as iscrowd=1 so COCO evaluation
    ignores detections on them. Runs on one process and never waits for
    others: call it after the splits are prepared.
    """
    if check_name(config) == "coco_json":
        return coco_json.load_ground_truth(coco_json_paths(config, EVAL)[0])
    return cache.ground_truth(prepare_split(config, EVAL, sync=False))


def eval_ground_truth_columns(config) -> dict:
    """`eval_ground_truth` as columns (see `coco_json.load_ground_truth_columns`): no dict per box."""
    if check_name(config) == "coco_json":
        return coco_json.load_ground_truth_columns(coco_json_paths(config, EVAL)[0])
    return cache.ground_truth_columns(prepare_split(config, EVAL, sync=False))
