"""COCO evaluation: run the eval split once, gather detections, score with pycocotools.

Every process runs the same number of eval batches (the pipeline pads with
masked examples); detections are gathered to every host, and process 0 maps
them back to original image pixels and scores them against the ground truth.
"""

from __future__ import annotations

import contextlib
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

# pycocotools' `stats` vector, in its order.
COCO_METRIC_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")


def detections_to_coco(outputs: Mapping[str, np.ndarray],
                       label_to_category_id: Sequence[int]) -> list[dict[str, Any]]:
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
        y0, x0, y1, x1 = (np.clip(boxes_yxyx[:, k], 0.0, limit)
                          for k, limit in enumerate((height, width, height, width)))
        boxes_xywh = np.stack([x0, y0, x1 - x0, y1 - y0], axis=1)
        for box, score, label in zip(boxes_xywh, outputs["scores"][i][keep], outputs["classes"][i][keep]):
            results.append({
                "image_id": int(outputs["image_id"][i]),
                "category_id": int(label_to_category_id[int(label)]),
                "bbox": [round(float(v), 3) for v in box],
                "score": round(float(score), 5),
            })
    return results


def coco_metrics(ground_truth: dict[str, Any], results: list[dict[str, Any]],
                 image_ids: Sequence[int] | None = None) -> dict[str, float]:
    """pycocotools bbox metrics (0-1; -1 where a size range has no ground truth).

    Args:
      ground_truth: COCO-format dict.
      results: COCO detections (`detections_to_coco`).
      image_ids: the images that were evaluated (default: all of the ground
        truth's); images the pipeline could not read are left out this way
        instead of counting their objects as missed.
    """
    if not results:
        return {name: 0.0 for name in COCO_METRIC_NAMES}
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress
        gt = COCO()
        gt.dataset = ground_truth
        gt.createIndex()
        dt = gt.loadRes(results)
        evaluator = COCOeval(gt, dt, iouType="bbox")
        if image_ids is not None:
            evaluator.params.imgIds = sorted({int(i) for i in image_ids})
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return {name: float(v) for name, v in zip(COCO_METRIC_NAMES, evaluator.stats)}


def evaluate(predict: Callable[[Any, dict[str, jax.Array]], dict[str, jax.Array]], params: Any,
             global_batches: Iterable[dict[str, jax.Array]], *, ground_truth: dict[str, Any] | None,
             label_to_category_id: Sequence[int]) -> dict[str, float] | None:
    """Runs `predict` over every eval batch and scores on process 0.

    Args:
      predict: compiled `(params, global_batch) -> outputs` (see `steps.predict_step`).
      global_batches: the eval split as sharded global batches, same count on every process.
      ground_truth: COCO ground-truth dict (needed on process 0 only).
    Returns:
      COCO metrics on process 0, None elsewhere.
    """
    start = time.perf_counter()
    results: list[dict[str, Any]] = []
    image_ids: list[int] = []
    for batch in global_batches:
        outputs = predict(params, batch)
        # Every process takes part in the gather; only process 0 needs the result.
        outputs = multihost_utils.process_allgather(outputs, tiled=True)
        if jax.process_index() == 0:
            image_ids.extend(int(i) for i in outputs["image_id"][outputs["example_mask"]])
            results.extend(detections_to_coco(outputs, label_to_category_id))
    if jax.process_index() != 0:
        return None
    metrics = coco_metrics(ground_truth, results, image_ids)
    logging.info("eval: %d images, %d detections, %.1fs", len(image_ids), len(results), time.perf_counter() - start)
    return metrics
