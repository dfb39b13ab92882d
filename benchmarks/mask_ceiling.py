"""The best mask AP a mask stride allows on a dataset: its ground truth taken down to the stride and pasted back.

  python -m benchmarks.mask_ceiling                                   # configs/mask_dino_tiny.py's eval data
  python -m benchmarks.mask_ceiling --config=configs/mask_dino_r50_coco.py --max_images=500

A model's masks are logits on a grid of `mask_stride` network pixels per
cell, pasted to the original image (`serving.masks.paste_masks`). Even a
perfect model is limited by that grid: a shape narrower than a cell, or a
boundary between cell centres, cannot be drawn. This script predicts every
ground-truth instance as well as the grid allows: its box, its class, score
1, and as mask logits the fraction of each cell the ground-truth mask covers
in the evaluation geometry, less one half, pasted as the predictor pastes
(bilinear, threshold 0). The segm AP of those detections is the ceiling a
trained model's mask AP is measured against; box AP is 1 by construction.
Rows: the ceiling at the config's mask stride and, for comparison, at the
other strides given.
"""

from __future__ import annotations

from collections.abc import Sequence

import hotcoco
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from benchmarks import report

_CONFIG = config_flags.DEFINE_config_file("config", "configs/mask_dino_tiny.py", "A config with instance masks.")
_STRIDES = flags.DEFINE_list("strides", ["1", "2", "4", "8"], "Mask strides (network pixels per cell) to score.")
_MAX_IMAGES = flags.DEFINE_integer("max_images", 0, "Score the first this many evaluation images (0: all).")


def grid_masks(ground_truth, image_size: tuple[int, int], stride: int) -> tuple[list, np.ndarray]:
    """Each non-crowd instance's mask as logits on the stride grid of its image's evaluation geometry.

    A cell's logit is the fraction of its network pixels the mask covers,
    minus one half (each network pixel the original pixel under its centre,
    as the training batches rasterise masks at stride 1): what a model that
    predicts each cell's coverage exactly would give.

    Returns:
      per image (float32 [n, Ho, Wo] logits, image_hw, original_hw), and the
      instances' indices into the ground truth, in that order.
    """
    import tensorflow as tf

    from input_pipeline import masks as input_masks

    out_h, out_w = image_size
    grid_hw = (-(-out_h // stride), -(-out_w // stride))
    segmentations = ground_truth.segmentations
    images = []
    order = []
    for image_id in np.unique(ground_truth.box_image_ids):
        chosen = np.flatnonzero((ground_truth.box_image_ids == image_id) & ~ground_truth.is_crowd)
        if chosen.size == 0:
            continue
        original_hw = (int(segmentations.heights[chosen[0]]), int(segmentations.widths[chosen[0]]))
        # eval_transform's geometry: the longer side (relative to the target) fills it, rounded to whole pixels.
        scale = min(out_h / original_hw[0], out_w / original_hw[1])
        image_hw = tuple(min(max(round(v * scale), 1), m) for v, m in zip(original_hw, image_size))
        rows, columns = input_masks.network_sample_grid(
            tf.constant(original_hw, tf.int32),
            tf.constant(image_hw, tf.float32) / tf.constant(original_hw, tf.float32),
            tf.zeros([2], tf.int32),
            tf.constant(image_hw, tf.int32),
            tf.constant(False),
            (grid_hw[0] * stride, grid_hw[1] * stride),
            1,
        )
        rows, columns = rows.numpy(), columns.numpy()
        full = np.asarray(hotcoco.mask.decode(segmentations.select(chosen).to_coco()), bool).reshape(
            original_hw[0], original_hw[1], -1
        )
        pixels = full[np.maximum(rows, 0)][:, np.maximum(columns, 0)]
        pixels &= ((rows >= 0)[:, None] & (columns >= 0)[None, :])[..., None]
        pixels = np.moveaxis(pixels, -1, 0).reshape(-1, grid_hw[0], stride, grid_hw[1], stride)
        coverage = pixels.mean(axis=(2, 4), dtype=np.float32)
        images.append((coverage - 0.5, image_hw, original_hw))
        order.append(chosen)
    return images, np.concatenate(order) if order else np.zeros([0], np.int64)


def ceiling(ground_truth, image_size: tuple[int, int], stride: int) -> dict[str, float]:
    """COCO segm stats of the ground truth predicted perfectly at `stride` (see the module doc)."""
    from detector.serving import masks as serving_masks
    from detector.serving.coco_ap import CocoDetections, RleMasks, evaluate

    images, order = grid_masks(ground_truth, image_size, stride)
    pasted = RleMasks.concatenate(
        [serving_masks.paste_masks(logits, image_hw, original_hw, stride) for logits, image_hw, original_hw in images]
    )
    detections = CocoDetections(
        image_ids=ground_truth.box_image_ids[order],
        category_ids=ground_truth.box_category_ids[order],
        boxes_xywh=ground_truth.boxes_xywh[order],
        scores=np.ones([order.size]),
        masks=pasted,
    )
    return evaluate(ground_truth, detections, iou_type="segm").stats


def main(argv: Sequence[str]) -> None:
    del argv
    import input_pipeline
    from detector.serving.coco_ap import CocoGroundTruth

    config = _CONFIG.value
    ground_truth = CocoGroundTruth.from_columns(input_pipeline.coco_ground_truth_columns(config))
    if ground_truth.segmentations is None:
        raise app.UsageError(f"the evaluation data of {flags.FLAGS['config'].value} has no masks to score")
    if _MAX_IMAGES.value:
        keep = np.isin(ground_truth.box_image_ids, ground_truth.image_ids[: _MAX_IMAGES.value])
        ground_truth = CocoGroundTruth(
            image_ids=ground_truth.image_ids[: _MAX_IMAGES.value],
            category_ids=ground_truth.category_ids,
            box_image_ids=ground_truth.box_image_ids[keep],
            box_category_ids=ground_truth.box_category_ids[keep],
            boxes_xywh=ground_truth.boxes_xywh[keep],
            areas=ground_truth.areas[keep],
            is_crowd=ground_truth.is_crowd[keep],
            segmentations=ground_truth.segmentations.select(np.flatnonzero(keep)),
        )
    image_size = tuple(config.input.image_size)
    rows = []
    for stride in sorted({int(s) for s in _STRIDES.value} | {int(config.input.mask_stride)}):
        stats = ceiling(ground_truth, image_size, stride)
        rows.append(
            [
                stride,
                "config" if stride == config.input.mask_stride else "",
                stats["AP"],
                stats["AP50"],
                stats["AP75"],
                stats["APs"],
                stats["APm"],
            ]
        )
    report.emit(
        "mask_ceiling",
        f"Mask AP of the ground truth taken down to each mask stride and pasted back ({len(ground_truth.image_ids)} "
        f"images of {flags.FLAGS['config'].value}'s evaluation data, {tuple(image_size)} network pixels)",
        ["mask stride", "", "mask AP", "AP50", "AP75", "APs", "APm"],
        rows,
    )


if __name__ == "__main__":
    app.run(main)
