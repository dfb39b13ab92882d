"""COCO bbox scoring at validation-set scale: the project's (`coco_ap`) against pycocotools and others, one sitting.

  python -m benchmarks.coco_scoring                                  # 5k x 80 and 20k x 365 classes
  python -m benchmarks.coco_scoring --sizes=5000:80 --pycocotools_max_images=5000
  python -m benchmarks.coco_scoring --overlap_config=configs/default.py   # + training during a scoring

Each scorer runs in a fresh child process that builds its own inputs from
the same seed: ground truth of ~7 boxes per image (COCO's mean; 10% crowds)
and 100 detections per image (jittered copies of the ground truth, some with
the wrong class, plus background boxes), as a training run's evaluation
produces. The time is the scoring alone, from the scorer's own input form
(columns for coco_ap, which hands them to hotcoco, and for hotcoco called
directly; COCO dicts for pycocotools, faster-coco-eval and hotcoco fed
dicts); the
peak RSS is the whole child's, inputs included. `max |diff|` is the largest
difference of the 12 stats from pycocotools' where it ran.

With --overlap_config, a second table shows what a background scoring costs
the training loop: that config's compiled train step (random inputs, no
input pipeline) timed alone, then while a thread of the same process scores
the largest size at nice 10, as the trainer's scoring thread does; and the
scoring's time alone and under training.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import resource
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from benchmarks import report

_SIZES = flags.DEFINE_list(
    "sizes", ["5000:80", "20000:365"], "IMAGES:CLASSES pairs to score (COCO val: 5000:80; Objects365 val: 80000:365)."
)
PYCOCOTOOLS_MAX_IMAGES = flags.DEFINE_integer(
    "pycocotools_max_images",
    5000,
    "Run pycocotools and faster-coco-eval only up to this many images (0: never); hotcoco runs at every size.",
)
_DETECTIONS = flags.DEFINE_integer("detections_per_image", 100, "Detections per image (COCO's maxDets).")
_OVERLAP_CONFIG = config_flags.DEFINE_config_file(
    "overlap_config", None, "A config whose train step is timed alone and during a background scoring."
)


def synthetic_columns(num_images: int, num_classes: int, detections_per_image: int, seed: int = 0) -> dict:
    """Ground truth and detections as numpy columns (xywh pixels); see the module doc."""
    rng = np.random.default_rng(seed)
    boxes_per_image = rng.poisson(7.0, size=num_images)
    num_boxes = int(boxes_per_image.sum())
    gt_image = np.repeat(np.arange(num_images), boxes_per_image)
    size = np.exp(rng.uniform(np.log(4), np.log(400), size=(num_boxes, 2)))  # small to large, as COCO
    xy = rng.uniform(0, 1, size=(num_boxes, 2)) * (np.array([640.0, 480.0]) - size).clip(1)
    gt_xywh = np.round(np.concatenate([xy, size], axis=1), 2)
    gt_class = rng.integers(0, num_classes, size=num_boxes)
    # Detections: up to 3 noisy copies of each box, then background boxes up to the per-image count.
    copies = rng.integers(0, 4, size=num_boxes)
    source = np.repeat(np.arange(num_boxes), copies)
    noisy = gt_xywh[source] + rng.normal(0, 0.1, size=(len(source), 4)) * gt_xywh[source][:, [2, 3, 2, 3]]
    noisy[:, 2:] = noisy[:, 2:].clip(1)
    wrong = rng.random(len(source)) < 0.15
    noisy_class = np.where(wrong, rng.integers(0, num_classes, size=len(source)), gt_class[source])
    noisy_image = gt_image[source]
    per_image = np.bincount(noisy_image, minlength=num_images).clip(max=detections_per_image)
    background = detections_per_image - per_image
    bg_image = np.repeat(np.arange(num_images), background)
    bg_size = np.exp(rng.uniform(np.log(4), np.log(300), size=(len(bg_image), 2)))
    bg_xywh = np.concatenate([rng.uniform(0, 1, size=(len(bg_image), 2)) * [600.0, 440.0], bg_size], axis=1)
    dt_image = np.concatenate([noisy_image, bg_image])
    dt_xywh = np.round(np.concatenate([noisy, bg_xywh]), 2)
    dt_class = np.concatenate([noisy_class, rng.integers(0, num_classes, size=len(bg_image))])
    dt_score = np.round(np.concatenate([rng.uniform(0.3, 1.0, len(source)), rng.uniform(0, 0.6, len(bg_image))]), 5)
    category_ids = np.arange(1, num_classes + 1) * 2  # ids with gaps, as COCO's
    return {
        "image_ids": np.arange(num_images, dtype=np.int64) + 1,
        "category_ids": category_ids.astype(np.int64),
        "gt_image_ids": gt_image.astype(np.int64) + 1,
        "gt_category_ids": category_ids[gt_class].astype(np.int64),
        "gt_xywh": gt_xywh,
        "gt_crowd": rng.random(num_boxes) < 0.1,
        "dt_image_ids": dt_image.astype(np.int64) + 1,
        "dt_category_ids": category_ids[dt_class].astype(np.int64),
        "dt_xywh": dt_xywh,
        "dt_scores": dt_score,
    }


def coco_ap_inputs(columns: dict):
    """The same data as coco_ap's (CocoGroundTruth, CocoDetections)."""
    from detector.serving import coco_ap

    ground_truth = coco_ap.CocoGroundTruth(
        image_ids=columns["image_ids"],
        category_ids=columns["category_ids"],
        box_image_ids=columns["gt_image_ids"],
        box_category_ids=columns["gt_category_ids"],
        boxes_xywh=columns["gt_xywh"],
        areas=columns["gt_xywh"][:, 2] * columns["gt_xywh"][:, 3],
        is_crowd=columns["gt_crowd"],
    )
    found = coco_ap.CocoDetections(
        columns["dt_image_ids"], columns["dt_category_ids"], columns["dt_xywh"], columns["dt_scores"]
    )
    return ground_truth, found


def _as_coco(columns: dict) -> tuple[dict, list[dict]]:
    """The same data as a COCO ground-truth dict and a results list."""
    images = [{"id": int(i), "height": 480, "width": 640} for i in columns["image_ids"]]
    annotations = [
        {
            "id": n + 1,
            "image_id": int(i),
            "category_id": int(c),
            "bbox": [float(v) for v in box],
            "area": float(box[2] * box[3]),
            "iscrowd": int(crowd),
        }
        for n, (i, c, box, crowd) in enumerate(
            zip(columns["gt_image_ids"], columns["gt_category_ids"], columns["gt_xywh"], columns["gt_crowd"])
        )
    ]
    categories = [{"id": int(c), "name": str(c)} for c in columns["category_ids"]]
    results = [
        {"image_id": int(i), "category_id": int(c), "bbox": [float(v) for v in box], "score": float(s)}
        for i, c, box, s in zip(
            columns["dt_image_ids"], columns["dt_category_ids"], columns["dt_xywh"], columns["dt_scores"]
        )
    ]
    return {"images": images, "annotations": annotations, "categories": categories}, results


def _score_in_child(scorer: str, num_images: int, num_classes: int, detections: int, queue) -> None:
    columns = synthetic_columns(num_images, num_classes, detections)
    if scorer == "coco_ap":
        from detector.serving import coco_ap

        start = time.perf_counter()
        ground_truth, found = coco_ap_inputs(columns)
        evaluated = coco_ap.evaluate(ground_truth, found)
        stats = [evaluated.stats[name] for name in coco_ap.STAT_NAMES]
    elif scorer == "hotcoco (columns)":
        import hotcoco

        start = time.perf_counter()
        gt = hotcoco.COCO.from_arrays(
            images=[{"id": int(i)} for i in columns["image_ids"]],
            categories=[{"id": int(c), "name": str(c)} for c in columns["category_ids"]],
            image_ids=columns["gt_image_ids"],
            category_ids=columns["gt_category_ids"],
            boxes=columns["gt_xywh"],
            area=columns["gt_xywh"][:, 2] * columns["gt_xywh"][:, 3],
            iscrowd=columns["gt_crowd"],
        )
        rows = np.column_stack(
            [columns["dt_image_ids"], columns["dt_xywh"], columns["dt_scores"], columns["dt_category_ids"]]
        )
        with contextlib.redirect_stdout(io.StringIO()):
            evaluator = hotcoco.COCOeval(gt, gt.load_res(rows.astype(np.float64)), "bbox")
            evaluator.evaluate()
            evaluator.accumulate()
            evaluator.summarize()
        stats = [float(v) for v in evaluator.stats]
    else:
        ground_truth, results = _as_coco(columns)
        del columns
        if scorer == "pycocotools":
            from pycocotools.coco import COCO
            from pycocotools.cocoeval import COCOeval
        elif scorer == "hotcoco (dicts)":
            import hotcoco

            start = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                gt = hotcoco.COCO(ground_truth)
                evaluator = hotcoco.COCOeval(gt, gt.load_res(results), "bbox")
                evaluator.evaluate()
                evaluator.accumulate()
                evaluator.summarize()
            stats = [float(v) for v in evaluator.stats]
            queue.put((time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, stats))
            return
        else:
            from faster_coco_eval import COCO
            from faster_coco_eval import COCOeval_faster as COCOeval
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            gt = COCO()
            gt.dataset = ground_truth
            gt.createIndex()
            evaluator = COCOeval(gt, gt.loadRes(results), iouType="bbox")
            evaluator.evaluate()
            evaluator.accumulate()
            evaluator.summarize()
        stats = [float(v) for v in evaluator.stats]
    seconds = time.perf_counter() - start
    queue.put((seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, stats))


def measure(scorer: str, num_images: int, num_classes: int, detections_per_image: int) -> dict[str, Any]:
    """Seconds, peak RSS bytes and the 12 stats of one scorer in a fresh process."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_score_in_child, args=(scorer, num_images, num_classes, detections_per_image, queue))
    child.start()
    seconds, peak_bytes, stats = queue.get()
    child.join()
    return {"seconds": seconds, "peak_bytes": peak_bytes, "stats": stats}


def scoring_rows(
    sizes: Sequence[tuple[int, int]], *, pycocotools_max_images: int, detections_per_image: int = 100
) -> list[dict[str, Any]]:
    """One row per (size, scorer): the columns of the module doc."""
    try:
        import faster_coco_eval  # noqa: F401

        peers = ["pycocotools", "hotcoco (columns)", "hotcoco (dicts)", "faster-coco-eval"]
    except ImportError:
        peers = ["pycocotools", "hotcoco (columns)", "hotcoco (dicts)"]
    rows = []
    for num_images, num_classes in sizes:
        measured = {"coco_ap": measure("coco_ap", num_images, num_classes, detections_per_image)}
        for peer in peers:
            # hotcoco is fast enough for every size; the others only up to --pycocotools_max_images.
            if peer.startswith("hotcoco") or num_images <= pycocotools_max_images:
                measured[peer] = measure(peer, num_images, num_classes, detections_per_image)
        reference = measured.get("pycocotools")
        for scorer, result in measured.items():
            rows.append(
                {
                    "images": num_images,
                    "classes": num_classes,
                    "detections": num_images * detections_per_image,
                    "scorer": scorer,
                    "seconds": float(f"{result['seconds']:.3g}"),  # 3 digits: a small set scores in milliseconds
                    "speed-up vs pycocotools": (
                        round(reference["seconds"] / result["seconds"], 1) if reference else None
                    ),
                    "peak RSS GB": round(result["peak_bytes"] / 1e9, 2),
                    "AP": round(result["stats"][0], 4),
                    "max |diff| vs pycocotools": (
                        float(np.max(np.abs(np.subtract(result["stats"], reference["stats"])))) if reference else None
                    ),
                }
            )
    return rows


def overlap_rows(config, config_name: str, num_images: int, num_classes: int, detections_per_image: int) -> list[list]:
    """Train steps/s alone and while a thread scores; scoring seconds alone and under training."""
    import threading

    from benchmarks import jax_step
    from detector.loop.evaluator import lower_thread_priority
    from detector.serving import coco_ap

    step = jax_step.build(config, num_classes=4)
    step.run(3)  # warm-up
    columns = synthetic_columns(num_images, num_classes, detections_per_image)
    ground_truth, found = coco_ap_inputs(columns)
    start = time.perf_counter()
    coco_ap.evaluate(ground_truth, found)
    scoring_alone = time.perf_counter() - start

    def steps_per_second(seconds: float) -> float:
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            step.run(1)
            done += 1
        return done / (time.perf_counter() - start)

    alone = steps_per_second(scoring_alone)
    timing = {}

    def score() -> None:
        lower_thread_priority()  # as the trainer's scoring thread
        start = time.perf_counter()
        coco_ap.evaluate(ground_truth, found)
        timing["seconds"] = time.perf_counter() - start

    thread = threading.Thread(target=score)
    thread.start()
    done, start = 0, time.perf_counter()
    while thread.is_alive():
        step.run(1)
        done += 1
    during = done / (time.perf_counter() - start)
    thread.join()
    return [
        [config_name, "train steps/s", alone, during, during / alone],
        [
            f"{num_images} x {num_classes} scoring",
            "seconds",
            scoring_alone,
            timing["seconds"],
            None,
        ],
    ]


def main(argv: Sequence[str]) -> None:
    del argv
    sizes = [tuple(int(v) for v in pair.split(":")) for pair in _SIZES.value]
    rows = scoring_rows(
        sizes, pycocotools_max_images=PYCOCOTOOLS_MAX_IMAGES.value, detections_per_image=_DETECTIONS.value
    )
    columns = list(rows[0]) if rows else []
    report.emit(
        "coco_scoring",
        "COCO bbox scoring: coco_ap (hotcoco fed columns) against pycocotools and others on the same detections "
        "(fresh process each)",
        columns,
        [[row[c] for c in columns] for row in rows],
    )
    if _OVERLAP_CONFIG.value:
        num_images, num_classes = max(sizes)
        report.emit(
            "coco_scoring_overlap",
            "Training during a background scoring (one process: the train step on the main thread, coco_ap on another)",
            ["what", "unit", "alone", "together", "together / alone"],
            overlap_rows(
                _OVERLAP_CONFIG.value,
                config_flags.get_config_filename(flags.FLAGS["overlap_config"]),
                num_images,
                num_classes,
                _DETECTIONS.value,
            ),
        )


if __name__ == "__main__":
    app.run(main)
