"""COCO evaluation: run the eval split once, gather detections, score with pycocotools.

Every process runs the same number of eval batches (the pipeline pads with
masked examples); detections are gathered to every host, and process 0 maps
them back to original image pixels and scores them against the ground truth.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from input_pipeline import box_geometry
from sharding.tables import aligned_table

# pycocotools' `stats` vector, in its order.
COCO_METRIC_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")


def detections_to_coco(outputs: Mapping[str, np.ndarray], label_to_category_id: Sequence[int]) -> list[dict[str, Any]]:
    """COCO results (`[{image_id, category_id, bbox [x,y,w,h], score}]`) in original pixels.

    Args:
      outputs: numpy arrays from `predict_step` for a batch: boxes `[B,D,4]` in
        network pixels, scores/classes/valid `[B,D]`, image_id/scale/example_mask
        `[B]`, original_size `[B,2]` (h, w).
      label_to_category_id: contiguous label -> the dataset's category id.
    """
    results = []
    for i in np.flatnonzero(outputs["example_mask"]):
        keep = outputs["valid"][i]
        if not keep.any():
            continue
        height, width = outputs["original_size"][i]
        # Host-side numpy: a few hundred boxes per image are not worth a device dispatch.
        boxes_yxyx = np.asarray(outputs["boxes"][i][keep], np.float64) / float(outputs["scale"][i])
        boxes_xywh = box_geometry.yxyx_to_xywh(box_geometry.clip(boxes_yxyx, float(height), float(width)))
        for box, score, label in zip(boxes_xywh, outputs["scores"][i][keep], outputs["classes"][i][keep]):
            results.append(
                {
                    "image_id": int(outputs["image_id"][i]),
                    "category_id": int(label_to_category_id[int(label)]),
                    "bbox": [round(float(v), 3) for v in box],
                    "score": round(float(score), 5),
                }
            )
    return results


@dataclasses.dataclass(frozen=True)
class CocoEvaluation:
    """pycocotools' bbox evaluation of one set of detections.

    Attributes:
      metrics: COCO_METRIC_NAMES -> value in 0-1 (-1 where a size range has no ground truth).
      per_class: category id -> {"AP", "AP50", "AP75"} over all sizes at 100
        detections (-1 for a class without ground truth among the evaluated
        images), plus "instances", its ground-truth boxes there (crowds excluded).
    """

    metrics: dict[str, float]
    per_class: dict[int, dict[str, float]]


def coco_evaluation(
    ground_truth: dict[str, Any], results: list[dict[str, Any]], image_ids: Sequence[int] | None = None
) -> CocoEvaluation:
    """Scores COCO `results` (`detections_to_coco`) against a COCO-format `ground_truth` dict.

    `image_ids`: the images that were evaluated (default: all of the ground
    truth's); images the pipeline could not read are left out this way
    instead of counting their objects as missed.
    """
    evaluated = sorted(
        {
            int(i)
            for i in (image_ids if image_ids is not None else (image["id"] for image in ground_truth.get("images", [])))
        }
    )
    instances = collections.Counter(
        int(a["category_id"])
        for a in ground_truth.get("annotations", [])
        if int(a["image_id"]) in set(evaluated) and not a.get("iscrowd", 0)
    )
    category_ids = [int(c["id"]) for c in ground_truth.get("categories", [])]
    if not results:
        return CocoEvaluation(
            {name: 0.0 for name in COCO_METRIC_NAMES},
            {c: {"AP": 0.0, "AP50": 0.0, "AP75": 0.0, "instances": instances[c]} for c in category_ids},
        )
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress
        gt = COCO()
        gt.dataset = ground_truth
        gt.createIndex()
        dt = gt.loadRes(results)
        evaluator = COCOeval(gt, dt, iouType="bbox")
        evaluator.params.imgIds = evaluated
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    # precision: [IoU thresholds 0.5:0.95, recall points, classes, area ranges, max detections];
    # area range 0 is "all", max detections -1 is 100; -1 marks "no ground truth".
    precision = evaluator.eval["precision"]

    def mean_precision(values: np.ndarray) -> float:
        values = values[values > -1]
        return float(values.mean()) if values.size else -1.0

    per_class = {}
    for k, category_id in enumerate(evaluator.params.catIds):
        per_class[int(category_id)] = {
            "AP": mean_precision(precision[:, :, k, 0, -1]),
            "AP50": mean_precision(precision[0, :, k, 0, -1]),
            "AP75": mean_precision(precision[5, :, k, 0, -1]),
            "instances": instances[int(category_id)],
        }
    return CocoEvaluation({name: float(v) for name, v in zip(COCO_METRIC_NAMES, evaluator.stats)}, per_class)


def coco_metrics(
    ground_truth: dict[str, Any], results: list[dict[str, Any]], image_ids: Sequence[int] | None = None
) -> dict[str, float]:
    """pycocotools bbox metrics (0-1; -1 where a size range has no ground truth); see `coco_evaluation`."""
    return coco_evaluation(ground_truth, results, image_ids).metrics


def predict_all(
    predict: Callable[[Any, dict[str, jax.Array]], dict[str, jax.Array]],
    params: Any,
    global_batches: Iterable[dict[str, jax.Array]],
    *,
    label_to_category_id: Sequence[int],
) -> tuple[list[dict[str, Any]], list[int]] | None:
    """Runs `predict` over every batch; on process 0 returns (COCO results, evaluated image ids), elsewhere None.

    Args:
      predict: compiled `(params, global_batch) -> outputs` (see `steps.predict_step`).
      global_batches: sharded global batches, the same count on every process.
    """
    results: list[dict[str, Any]] = []
    image_ids: list[int] = []
    for batch in global_batches:
        outputs = predict(params, batch)
        # Every process takes part in the gather; only process 0 needs the result.
        outputs = multihost_utils.process_allgather(outputs, tiled=True)
        if jax.process_index() == 0:
            image_ids.extend(int(i) for i in outputs["image_id"][outputs["example_mask"]])
            results.extend(detections_to_coco(outputs, label_to_category_id))
    return (results, image_ids) if jax.process_index() == 0 else None


def evaluate(
    predict: Callable[[Any, dict[str, jax.Array]], dict[str, jax.Array]],
    params: Any,
    global_batches: Iterable[dict[str, jax.Array]],
    *,
    ground_truth: dict[str, Any] | None,
    label_to_category_id: Sequence[int],
) -> dict[str, float] | None:
    """Runs `predict` over every eval batch and scores on process 0.

    Args:
      predict: compiled `(params, global_batch) -> outputs` (see `steps.predict_step`).
      global_batches: the eval split as sharded global batches, same count on every process.
      ground_truth: COCO ground-truth dict (needed on process 0 only).
    Returns:
      COCO metrics on process 0, None elsewhere.
    """
    start = time.perf_counter()
    predicted = predict_all(predict, params, global_batches, label_to_category_id=label_to_category_id)
    if predicted is None:
        return None
    results, image_ids = predicted
    metrics = coco_metrics(ground_truth, results, image_ids)
    logging.info("eval: %d images, %d detections, %.1fs", len(image_ids), len(results), time.perf_counter() - start)
    return metrics


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table with aligned columns (floats to 3 decimals, -1 shown as "-")."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return "-" if value < 0 else f"{value:.3f}"
        return str(value)

    return aligned_table(header, [[cell(v) for v in row] for row in rows])
