"""COCO mask evaluation at validation-set scale: paste, encode and score, the project's path against pycocotools'.

  python -m benchmarks.mask_scoring --pycocotools_max_images=1000     # 5000 images x 100 detections, 640 x 480
  python -m benchmarks.mask_scoring --images=1000 --pycocotools_max_images=1000

What a training run's evaluation of a mask model does after predicting: each
detection's mask logits (stride 4 over the padded 640 x 640 network input)
pasted to the 640 x 480 original, thresholded, RLE-encoded, rescored, and
the whole set scored (`bbox` and `segm`). Each path runs in a fresh child
process that builds the same inputs from one seed: ground truth of ~7
ellipse masks per image (`coco_scoring`'s boxes, 10% crowds), and 100
detections per image whose logits are ellipses in their boxes (jittered
copies of the ground truth and background). Times are the paste + encode
and the scoring alone; the peak RSS is the whole child's.

- project: `serving.masks.instance_masks` (banded bilinear products, hotcoco's
  encoder, Mask DINO's score) per image, then `coco_ap.evaluate` (hotcoco) on
  the columns.
- pycocotools: the same resizes as dense products (torch's `F.interpolate`
  twice, as Mask DINO pastes), `pycocotools.mask.encode`, the same score,
  then pycocotools' COCOeval for bbox and segm on the dicts.
`max |diff|` is the largest difference of the 12 segm stats between the two.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import resource
import time
from collections.abc import Sequence

import numpy as np
from absl import app, flags

from benchmarks import coco_scoring, report
from benchmarks.coco_scoring import synthetic_columns

_IMAGES = flags.DEFINE_integer("images", 5000, "Images (640 x 480 each).")
# coco_scoring's flags (imported with its input generator): --pycocotools_max_images, --detections_per_image.
_PYCOCOTOOLS_MAX = coco_scoring.PYCOCOTOOLS_MAX_IMAGES
_DETECTIONS = coco_scoring._DETECTIONS

HEIGHT, WIDTH, STRIDE = 480, 640, 4
NETWORK = 640  # the padded square network input the logits cover
CLASSES = 80


def ellipse_polygon(box_xywh: np.ndarray, points: int = 24) -> list[float]:
    x, y, w, h = box_xywh
    angles = np.linspace(0, 2 * np.pi, points, endpoint=False)
    xs, ys = x + w / 2 * (1 + np.cos(angles)), y + h / 2 * (1 + np.sin(angles))
    return np.stack([xs.clip(0, WIDTH), ys.clip(0, HEIGHT)], 1).reshape(-1).tolist()


def inputs(num_images: int, detections_per_image: int):
    """(columns as `synthetic_columns`, ground-truth RLE dicts, per-image detection rows)."""
    import hotcoco

    columns = synthetic_columns(num_images, CLASSES, detections_per_image)
    rles = [hotcoco.mask.frPyObjects([ellipse_polygon(box)], HEIGHT, WIDTH)[0] for box in columns["gt_xywh"]]
    order = np.argsort(columns["dt_image_ids"], kind="stable")
    starts = np.searchsorted(columns["dt_image_ids"][order], columns["image_ids"])
    ends = np.searchsorted(columns["dt_image_ids"][order], columns["image_ids"], side="right")
    return columns, rles, [order[a:b] for a, b in zip(starts, ends)]


def ellipse_logits(boxes_xywh: np.ndarray) -> np.ndarray:
    """float32 [N, 160, 160]: 1 - the ellipse distance of each cell centre in the box's ellipse (> 0 inside)."""
    cells = (np.arange(NETWORK // STRIDE) + 0.5) * STRIDE
    x, y, w, h = (boxes_xywh[:, i, None, None] for i in range(4))
    dx = (cells[None, None, :] - (x + w / 2)) / np.maximum(w / 2, 1.0)
    dy = (cells[None, :, None] - (y + h / 2)) / np.maximum(h / 2, 1.0)
    return (1.0 - np.sqrt(dx * dx + dy * dy)).astype(np.float32)


def project_path(num_images: int, detections_per_image: int) -> dict:
    from detector.serving import masks
    from detector.serving.coco_ap import CocoDetections, RleMasks, evaluate

    columns, rles, rows = inputs(num_images, detections_per_image)
    paste_s, parts, scores = 0.0, [], np.zeros(len(columns["dt_scores"]))
    for image_rows in rows:
        logits = ellipse_logits(columns["dt_xywh"][image_rows])
        start = time.perf_counter()
        pasted, scores[image_rows] = masks.instance_masks(
            columns["dt_scores"][image_rows], logits, (HEIGHT, WIDTH), (HEIGHT, WIDTH), STRIDE
        )
        paste_s += time.perf_counter() - start
        parts.append(pasted)
    order = np.concatenate(rows)
    boxes_only, _ = coco_scoring.coco_ap_inputs(columns)
    ground_truth = dataclasses.replace(boxes_only, segmentations=RleMasks.from_coco(rles))
    detections = CocoDetections(
        columns["dt_image_ids"][order],
        columns["dt_category_ids"][order],
        columns["dt_xywh"][order],
        np.round(scores[order], 5),
        masks=RleMasks.concatenate(parts),
    )
    start = time.perf_counter()
    box = evaluate(ground_truth, detections).stats
    segm = evaluate(ground_truth, detections, iou_type="segm").stats
    score_s = time.perf_counter() - start
    return {"paste_s": paste_s, "score_s": score_s, "box": list(box.values()), "segm": list(segm.values())}


def pycocotools_path(num_images: int, detections_per_image: int) -> dict:
    import contextlib
    import io

    from pycocotools import mask as mask_utils
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    from detector.serving import masks

    columns, rles, rows = inputs(num_images, detections_per_image)
    upsample = masks.bilinear_resize_matrix(NETWORK // STRIDE, NETWORK).astype(np.float32)  # [640, 160]
    to_rows = masks.bilinear_resize_matrix(HEIGHT, HEIGHT).astype(np.float32)[:, :HEIGHT] @ upsample[:HEIGHT]
    to_columns = masks.bilinear_resize_matrix(WIDTH, WIDTH).astype(np.float32) @ upsample[:WIDTH]
    paste_s, results = 0.0, []
    for image_rows in rows:
        logits = ellipse_logits(columns["dt_xywh"][image_rows])
        start = time.perf_counter()
        full = np.transpose(to_rows @ logits @ to_columns.T, (1, 2, 0)) > 0  # [H, W, N], dense
        encoded = mask_utils.encode(np.asfortranarray(full, dtype=np.uint8))
        scores = masks.mask_scores(columns["dt_scores"][image_rows], logits, (HEIGHT, WIDTH), STRIDE)
        paste_s += time.perf_counter() - start
        for row, rle, score in zip(image_rows, encoded, scores):
            results.append(
                {
                    "image_id": int(columns["dt_image_ids"][row]),
                    "category_id": int(columns["dt_category_ids"][row]),
                    "bbox": [float(v) for v in columns["dt_xywh"][row]],
                    "score": float(np.round(score, 5)),
                    "segmentation": {"size": rle["size"], "counts": rle["counts"].decode("ascii")},
                }
            )
    dataset, _ = coco_scoring._as_coco(columns)  # 640 x 480 images, the boxes; the masks added here
    for annotation, rle in zip(dataset["annotations"], rles):
        annotation["segmentation"] = {"size": rle["size"], "counts": rle["counts"]}
    start = time.perf_counter()
    stats = {}
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO()
        coco.dataset = dataset
        coco.createIndex()
        for iou_type in ("bbox", "segm"):
            # segm as detectron2 scores it: results without their box, so the size ranges test the mask's area.
            typed = results if iou_type == "bbox" else [{k: v for k, v in r.items() if k != "bbox"} for r in results]
            evaluation = COCOeval(coco, coco.loadRes(typed), iou_type)
            evaluation.evaluate()
            evaluation.accumulate()
            evaluation.summarize()
            stats[iou_type] = evaluation.stats.tolist()
    return {"paste_s": paste_s, "score_s": time.perf_counter() - start, "box": stats["bbox"], "segm": stats["segm"]}


def _child(path: str, num_images: int, detections_per_image: int, queue) -> None:
    result = {"project": project_path, "pycocotools": pycocotools_path}[path](num_images, detections_per_image)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    queue.put(result)


def run_child(path: str, num_images: int, detections_per_image: int) -> dict:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_child, args=(path, num_images, detections_per_image, queue))
    process.start()
    result = queue.get()
    process.join()
    return result


def main(argv: Sequence[str]) -> None:
    del argv
    sizes = [_IMAGES.value]
    if _PYCOCOTOOLS_MAX.value and _PYCOCOTOOLS_MAX.value != _IMAGES.value:
        sizes.insert(0, min(_PYCOCOTOOLS_MAX.value, _IMAGES.value))
    rows = []
    for num_images in sizes:
        project = run_child("project", num_images, _DETECTIONS.value)
        reference = None
        if _PYCOCOTOOLS_MAX.value and num_images <= _PYCOCOTOOLS_MAX.value:
            reference = run_child("pycocotools", num_images, _DETECTIONS.value)
        for name, result in (("project (hotcoco)", project), ("pycocotools", reference)):
            if result is None:
                continue
            diff = float(np.max(np.abs(np.subtract(result["segm"], reference["segm"])))) if reference else float("nan")
            rows.append(
                [
                    f"{num_images} x {_DETECTIONS.value}",
                    name,
                    result["paste_s"],
                    result["score_s"],
                    result["paste_s"] + result["score_s"],
                    result["peak_rss_mb"],
                    result["segm"][0],
                    diff,
                ]
            )
    report.emit(
        "mask_scoring",
        "COCO mask evaluation (640 x 480, stride-4 logits): paste + encode + score, fresh process each",
        [
            "images x detections",
            "path",
            "paste + encode s",
            "score s",
            "total s",
            "peak RSS MB",
            "mask AP",
            "max |diff|",
        ],
        rows,
    )


if __name__ == "__main__":
    app.run(main)
