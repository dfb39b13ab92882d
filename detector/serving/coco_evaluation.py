"""COCO evaluation: predict the eval split, keep the detections as arrays, score them with `coco_ap` (hotcoco).

Every process runs the same number of eval batches (the pipeline pads with
masked examples) and keeps the detections of the rows its devices hold,
mapped back to original image pixels; process 0 alone collects them
(`sharding.distributed.send_to_primary`: no device collective, the other
processes go on at once) and scores them against the ground truth.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from detector.models import mask_branch
from detector.serving import coco_ap, masks
from detector.serving.coco_ap import CocoDetections, CocoGroundTruth, RleMasks
from input_pipeline import box_geometry
from sharding import distributed
from sharding.tables import aligned_table

COCO_METRIC_NAMES = coco_ap.STAT_NAMES


def _host_rows(x: Any) -> np.ndarray:
    """The rows of a batch-sharded output that this process's devices hold (all rows in one process)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    by_first_row = {}
    for shard in x.addressable_shards:  # devices holding the same rows (model axes) hold copies
        by_first_row.setdefault(shard.index[0].start or 0, shard)
    return np.concatenate([np.asarray(by_first_row[row].data) for row in sorted(by_first_row)])


@dataclasses.dataclass(frozen=True)
class Predictions:
    """Detections of a set of images, and which images were evaluated.

    Attributes:
      detections: in original image pixels (a COCO results file's content).
      image_ids: int64 [n] every evaluated image, detections or not.
    """

    detections: CocoDetections
    image_ids: np.ndarray

    @classmethod
    def concatenate(cls, parts: Sequence[Predictions]) -> Predictions:
        return cls(
            CocoDetections.concatenate([p.detections for p in parts]),
            np.concatenate([np.zeros([0], np.int64), *(p.image_ids for p in parts)]),
        )

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        detections = {f"detections_{k}": v for k, v in self.detections.to_columns().items()}
        np.savez(buffer, image_ids=self.image_ids, **detections)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, payload: bytes) -> Predictions:
        with np.load(io.BytesIO(payload)) as arrays:
            prefix = "detections_"
            columns = {k[len(prefix) :]: arrays[k] for k in arrays.files if k.startswith(prefix)}
            return cls(CocoDetections.from_columns(columns), arrays["image_ids"])


def batch_predictions(outputs: Mapping[str, Any], label_to_category_id: Sequence[int]) -> Predictions:
    """The detections of a batch's real examples in original pixels, COCO style.

    Args:
      outputs: `predict_step` outputs for a batch (numpy, or global arrays of
        which this process's rows are taken): boxes `[B,D,4]` yxyx in network
        pixels, scores/classes/valid `[B,D]`, image_id/scale/example_mask
        `[B]`, original_size and image_hw `[B,2]` (h, w); a mask family's
        masks `[B,D,Hm,Wm]`, logits at `mask_branch.STRIDE`.
      label_to_category_id: contiguous label -> the dataset's category id.
    Returns:
      Boxes clipped to the image and rounded to 1/1000 pixel, scores to 1e-5
      (what a COCO results file holds), in row-then-rank order. With masks,
      each detection's mask pasted to original pixels as RLE and its score
      Mask DINO's (class score x mean mask probability, `masks.mask_scores`),
      for its box too, as Mask DINO reports them.
    """
    rows = {k: _host_rows(outputs[k]) for k in ("boxes", "scores", "classes", "valid", "image_id", "scale")}
    rows["example_mask"] = _host_rows(outputs["example_mask"]).astype(bool)
    rows["original_size"] = _host_rows(outputs["original_size"])
    image, rank = np.nonzero(rows["valid"].astype(bool) & rows["example_mask"][:, None])
    boxes_yxyx = rows["boxes"][image, rank].astype(np.float64) / rows["scale"][image].astype(np.float64)[:, None]
    size = rows["original_size"][image].astype(np.float64)
    boxes_xywh = box_geometry.yxyx_to_xywh(box_geometry.clip(boxes_yxyx, size[:, 0], size[:, 1]))
    category_ids = np.asarray(label_to_category_id, np.int64)
    scores = rows["scores"][image, rank].astype(np.float64)
    pasted = None
    if "masks" in outputs:
        logits, image_hw = _host_rows(outputs["masks"]), _host_rows(outputs["image_hw"])
        parts = []
        for row in np.unique(image).tolist():  # image ascends in np.nonzero's order: the parts line up
            chosen = image == row
            row_logits = logits[row, rank[chosen]]
            pasted_row, scores[chosen] = masks.instance_masks(
                scores[chosen], row_logits, image_hw[row], rows["original_size"][row], mask_branch.STRIDE
            )
            parts.append(pasted_row)
        pasted = RleMasks.concatenate(parts)
    detections = CocoDetections(
        image_ids=rows["image_id"][image].astype(np.int64),
        category_ids=category_ids[rows["classes"][image, rank].astype(np.int64)],
        boxes_xywh=np.round(boxes_xywh, 3),
        scores=np.round(scores, 5),
        masks=pasted,
    )
    return Predictions(detections, rows["image_id"][rows["example_mask"]].astype(np.int64))


def to_results(detections: CocoDetections) -> list[dict[str, Any]]:
    """A COCO results list (`[{image_id, category_id, bbox [x,y,w,h], score}]`) of `detections`.

    With masks, each result also has its `segmentation` (compressed RLE), as detectron2 writes them.
    """
    results = [
        {"image_id": int(i), "category_id": int(c), "bbox": [float(v) for v in box], "score": float(s)}
        for i, c, box, s in zip(detections.image_ids, detections.category_ids, detections.boxes_xywh, detections.scores)
    ]
    if detections.masks is not None:
        for result, rle in zip(results, detections.masks.to_coco()):
            result["segmentation"] = rle
    return results


def write_results(path: Any, detections: CocoDetections, *, chunk: int = 100_000) -> None:
    """Writes `detections` as a COCO results JSON file, `chunk` detections' dicts at a time.

    `path`: a local path or an `etils.epath.Path`. The file is the list
    `to_results` gives, without holding a dict per detection for all of them.
    """
    with epath.Path(path).open("w") as f:
        f.write("[")
        for first in range(0, len(detections), chunk):
            part = detections.select(slice(first, first + chunk))
            f.write(("," if first else "") + json.dumps(to_results(part))[1:-1])
        f.write("]")


def detections_to_coco(outputs: Mapping[str, Any], label_to_category_id: Sequence[int]) -> list[dict[str, Any]]:
    """COCO results of a batch's outputs in original pixels (see `batch_predictions`)."""
    return to_results(batch_predictions(outputs, label_to_category_id).detections)


@dataclasses.dataclass(frozen=True)
class CocoEvaluation:
    """The COCO bbox evaluation of one set of detections.

    Attributes:
      metrics: COCO_METRIC_NAMES -> value in 0-1 (-1 where a size range has no ground truth); with masks on
        both sides the segm ones too (`coco_ap.MASK_STAT_NAMES`: mask_AP, ...).
      per_class: category id -> {"AP", "AP50", "AP75"} over all sizes at 100
        detections (-1 for a class without ground truth among the evaluated
        images), plus "instances", its ground-truth boxes there (crowds excluded).
    """

    metrics: dict[str, float]
    per_class: dict[int, dict[str, float]]


def score(
    ground_truth: CocoGroundTruth, detections: CocoDetections, image_ids: np.ndarray | Sequence[int] | None = None
) -> CocoEvaluation:
    """Scores `detections` on `image_ids` (default: every ground-truth image); see `coco_ap.evaluate`.

    `image_ids`: the images that were evaluated; images the pipeline could not
    read are left out this way instead of counting their objects as missed.
    """
    evaluated = np.unique(np.asarray(ground_truth.image_ids if image_ids is None else image_ids, np.int64).reshape(-1))
    instances = ground_truth.instances(evaluated)
    if not len(detections):
        return CocoEvaluation(
            {name: 0.0 for name in COCO_METRIC_NAMES},
            {c: {"AP": 0.0, "AP50": 0.0, "AP75": 0.0, "instances": n} for c, n in instances.items()},
        )
    result = coco_ap.evaluate(ground_truth, detections, evaluated)
    per_class = {c: {**values, "instances": instances[c]} for c, values in result.per_class().items()}
    metrics = dict(result.stats)
    if detections.masks is not None and ground_truth.segmentations is not None:
        metrics.update(coco_ap.evaluate(ground_truth, detections, evaluated, iou_type="segm").metrics())
    return CocoEvaluation(metrics, per_class)


def coco_evaluation(
    ground_truth: Mapping[str, Any] | CocoGroundTruth,
    results: Sequence[Mapping[str, Any]] | CocoDetections,
    image_ids: Sequence[int] | None = None,
) -> CocoEvaluation:
    """Scores COCO `results` (a results list or `CocoDetections`) against COCO-format `ground_truth`.

    The numbers are pycocotools' COCOeval bbox numbers (see `coco_ap`).
    `image_ids`: the images that were evaluated (default: all of the ground truth's).
    """
    if not isinstance(ground_truth, CocoGroundTruth):
        ground_truth = CocoGroundTruth.from_coco(ground_truth)
    if not isinstance(results, CocoDetections):
        results = CocoDetections.from_results(results)
    return score(ground_truth, results, image_ids)


def coco_metrics(
    ground_truth: Mapping[str, Any] | CocoGroundTruth,
    results: Sequence[Mapping[str, Any]] | CocoDetections,
    image_ids: Sequence[int] | None = None,
) -> dict[str, float]:
    """COCO bbox metrics (0-1; -1 where a size range has no ground truth); see `coco_evaluation`."""
    return coco_evaluation(ground_truth, results, image_ids).metrics


def predict_local(
    predict: Callable[[Any, dict[str, jax.Array]], dict[str, jax.Array]],
    params: Any,
    global_batches: Iterable[dict[str, jax.Array]],
    *,
    label_to_category_id: Sequence[int],
) -> Predictions:
    """Runs `predict` over every batch; returns the predictions of this process's rows.

    Args:
      predict: compiled `(params, global_batch) -> outputs` (see `steps.predict_step`).
      global_batches: sharded global batches, the same count on every process.
    """
    parts = [batch_predictions(predict(params, batch), label_to_category_id) for batch in global_batches]
    return Predictions.concatenate(parts)


def gather_predictions(local: Predictions, key: str) -> Predictions | None:
    """Every process's `local` predictions on process 0 (None elsewhere); see `distributed.send_to_primary`.

    `key`: unique per evaluation and the same on every process.
    """
    received = distributed.send_to_primary(key, local.to_bytes() if jax.process_count() > 1 else b"")
    if received is None:
        return None
    if jax.process_count() == 1:
        return local
    return Predictions.concatenate([Predictions.from_bytes(payload) for payload in received])


def predict_all(
    predict: Callable[[Any, dict[str, jax.Array]], dict[str, jax.Array]],
    params: Any,
    global_batches: Iterable[dict[str, jax.Array]],
    *,
    label_to_category_id: Sequence[int],
    key: str = "predict_all",
) -> Predictions | None:
    """`predict_local` on every process, gathered to process 0 (None elsewhere)."""
    start = time.perf_counter()
    local = predict_local(predict, params, global_batches, label_to_category_id=label_to_category_id)
    gathered = gather_predictions(local, key)
    if gathered is not None:
        logging.info(
            "predicted %d images, %d detections in %.1fs",
            len(gathered.image_ids),
            len(gathered.detections),
            time.perf_counter() - start,
        )
    return gathered


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table with aligned columns (floats to 3 decimals, -1 shown as "-")."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return "-" if value < 0 else f"{value:.3f}"
        return str(value)

    return aligned_table(header, [[cell(v) for v in row] for row in rows])
