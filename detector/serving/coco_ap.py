"""COCO AP/AR from columns, scored by hotcoco: pycocotools' COCOeval numbers at validation-set scale.

Ground truth and detections stay columns (`CocoGroundTruth`,
`CocoDetections`) from the input pipeline and the predictor to the scorer:
no Python dict per box. hotcoco (Rust; pycocotools' matching and
accumulation rule for rule: equal `precision`, `recall` and stats on crowds,
ties, duplicates, empty images, classes without ground truth and more than
100 detections per image and class, `tests/detector/serving/test_coco_ap.py`)
takes them through `COCO.from_arrays` and `load_res(ndarray)` and releases
the GIL while it matches: COCO val's 5,000 images x 100 detections in about
half a second, 20,000 images x 365 classes in about 2 s and 1.2 GB, where
pycocotools takes 80 s and 417 s / 9.9 GB (`benchmarks.coco_scoring`).
hotcoco also scores `segm` (mask IoU on RLE) and LVIS's federated AP.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import hotcoco
import numpy as np

# pycocotools' (and hotcoco's) Params for iouType="bbox" and "segm": the axes of the tables below.
IOU_THRESHOLDS = np.linspace(0.5, 0.95, int(np.round((0.95 - 0.5) / 0.05)) + 1, endpoint=True)
MAX_DETECTIONS = (1, 10, 100)

# pycocotools' `stats` vector, in its order: (name, precision or recall, IoU threshold, area range, max detections).
_STATS = (
    ("AP", "precision", None, 0, 100),
    ("AP50", "precision", 0.5, 0, 100),
    ("AP75", "precision", 0.75, 0, 100),
    ("APs", "precision", None, 1, 100),
    ("APm", "precision", None, 2, 100),
    ("APl", "precision", None, 3, 100),
    ("AR1", "recall", None, 0, 1),
    ("AR10", "recall", None, 0, 10),
    ("AR100", "recall", None, 0, 100),
    ("ARs", "recall", None, 1, 100),
    ("ARm", "recall", None, 2, 100),
    ("ARl", "recall", None, 3, 100),
)
STAT_NAMES = tuple(name for name, *_ in _STATS)


@dataclasses.dataclass(frozen=True)
class CocoGroundTruth:
    """COCO ground truth as columns.

    Attributes:
      image_ids: int64 [I] the dataset's images (those detections may name).
      category_ids: int64 [K] the categories scored, ascending.
      box_image_ids: int64 [M] image of each box.
      box_category_ids: int64 [M].
      boxes_xywh: float64 [M, 4] x, y, width, height in original pixels.
      areas: float64 [M] the annotation's `area` (what the size ranges test).
      is_crowd: bool [M].
    """

    image_ids: np.ndarray
    category_ids: np.ndarray
    box_image_ids: np.ndarray
    box_category_ids: np.ndarray
    boxes_xywh: np.ndarray
    areas: np.ndarray
    is_crowd: np.ndarray

    @classmethod
    def from_coco(cls, ground_truth: Mapping[str, Any]) -> CocoGroundTruth:
        """From a COCO-format dict ({'images', 'annotations', 'categories'})."""
        annotations = ground_truth.get("annotations", [])
        boxes = np.array([a["bbox"] for a in annotations], np.float64).reshape(-1, 4)
        return cls(
            image_ids=np.array([int(i["id"]) for i in ground_truth.get("images", [])], np.int64),
            category_ids=np.array(sorted(int(c["id"]) for c in ground_truth.get("categories", [])), np.int64),
            box_image_ids=np.array([int(a["image_id"]) for a in annotations], np.int64),
            box_category_ids=np.array([int(a["category_id"]) for a in annotations], np.int64),
            boxes_xywh=boxes,
            areas=np.array([float(a.get("area", 0.0)) for a in annotations], np.float64),
            is_crowd=np.array([bool(a.get("iscrowd", 0)) for a in annotations], bool),
        )

    def instances(self, image_ids: np.ndarray) -> dict[int, int]:
        """Category id -> non-crowd boxes among `image_ids` (int [n])."""
        keep = np.isin(self.box_image_ids, image_ids) & ~self.is_crowd
        counts = dict(zip(*np.unique(self.box_category_ids[keep], return_counts=True)))
        return {int(c): int(counts.get(c, 0)) for c in self.category_ids}


@dataclasses.dataclass(frozen=True)
class CocoDetections:
    """Detections as columns (a COCO results file's content).

    Attributes:
      image_ids: int64 [N].
      category_ids: int64 [N].
      boxes_xywh: float64 [N, 4] x, y, width, height in original pixels.
      scores: float64 [N].
    """

    image_ids: np.ndarray
    category_ids: np.ndarray
    boxes_xywh: np.ndarray
    scores: np.ndarray

    @classmethod
    def from_results(cls, results: Sequence[Mapping[str, Any]]) -> CocoDetections:
        """From a COCO results list ([{image_id, category_id, bbox [x, y, w, h], score}])."""
        return cls(
            image_ids=np.array([int(r["image_id"]) for r in results], np.int64),
            category_ids=np.array([int(r["category_id"]) for r in results], np.int64),
            boxes_xywh=np.array([r["bbox"] for r in results], np.float64).reshape(-1, 4),
            scores=np.array([float(r["score"]) for r in results], np.float64),
        )

    @classmethod
    def concatenate(cls, parts: Sequence[CocoDetections]) -> CocoDetections:
        if not parts:
            return cls(np.zeros([0], np.int64), np.zeros([0], np.int64), np.zeros([0, 4]), np.zeros([0]))
        return cls(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(cls)))

    def __len__(self) -> int:
        return len(self.scores)


@dataclasses.dataclass(frozen=True)
class CocoAp:
    """The evaluation's tables (pycocotools' `eval` dict) and summary.

    Attributes:
      precision: float64 [T, R, K, A, 3]: IoU thresholds, recall thresholds,
        categories, area ranges, max detections (1, 10, 100); -1 where the
        category has no ground truth in that area range.
      recall: float64 [T, K, A, 3], -1 likewise.
      stats: STAT_NAMES -> value (pycocotools' `stats`; -1 where nothing to score).
      category_ids: int64 [K], the K axis.
    """

    precision: np.ndarray
    recall: np.ndarray
    stats: dict[str, float]
    category_ids: np.ndarray

    def per_class(self) -> dict[int, dict[str, float]]:
        """Category id -> {'AP', 'AP50', 'AP75'} over all sizes at 100 detections (-1: no ground truth)."""

        def mean(values: np.ndarray) -> float:
            values = values[values > -1]
            return float(values.mean()) if values.size else -1.0

        p = self.precision[:, :, :, 0, -1]
        return {
            int(c): {"AP": mean(p[:, :, k]), "AP50": mean(p[0, :, k]), "AP75": mean(p[5, :, k])}
            for k, c in enumerate(self.category_ids)
        }


def evaluate(ground_truth: CocoGroundTruth, detections: CocoDetections, image_ids: np.ndarray | None = None) -> CocoAp:
    """Scores `detections` against `ground_truth` on `image_ids` (default: all of its images).

    Detections of images outside `image_ids`, or of categories the ground
    truth does not list, are not scored (as pycocotools' params.imgIds /
    catIds do).

    Raises:
      ValueError: a detection names an image the ground truth does not have
        (pycocotools: "Results do not correspond to current coco set").
    """
    all_images = np.unique(ground_truth.image_ids)
    known = np.isin(detections.image_ids, all_images)
    if not known.all():
        unknown = np.unique(detections.image_ids[~known])
        raise ValueError(
            f"{unknown.size} detected image ids are not in the ground truth (e.g. {unknown[:5].tolist()}); "
            "score detections against the ground truth of the images they were predicted on"
        )
    images = all_images if image_ids is None else np.unique(np.asarray(image_ids, np.int64))
    categories = np.asarray(ground_truth.category_ids, np.int64)
    coco_ground_truth = hotcoco.COCO.from_arrays(
        images=[{"id": int(i)} for i in all_images],
        categories=[{"id": int(c), "name": str(int(c))} for c in categories],
        image_ids=np.asarray(ground_truth.box_image_ids, np.int64),
        category_ids=np.asarray(ground_truth.box_category_ids, np.int64),
        boxes=np.asarray(ground_truth.boxes_xywh, np.float64).reshape(-1, 4),
        area=np.asarray(ground_truth.areas, np.float64),
        iscrowd=np.asarray(ground_truth.is_crowd, bool),
    )
    # Unscored detections are left out here, not handed to hotcoco, which warns on stderr about
    # categories the ground truth does not list.
    scored = (known if image_ids is None else np.isin(detections.image_ids, images)) & np.isin(
        detections.category_ids, categories
    )
    scored = slice(None) if scored.all() else scored  # no copy of every column in the usual case
    rows = np.empty([len(detections.scores[scored]), 7], np.float64)  # [image_id, x, y, w, h, score, category_id]
    rows[:, 0] = detections.image_ids[scored]
    rows[:, 1:5] = np.reshape(detections.boxes_xywh, (-1, 4))[scored]
    rows[:, 5] = detections.scores[scored]
    rows[:, 6] = detections.category_ids[scored]
    evaluator = hotcoco.COCOeval(coco_ground_truth, coco_ground_truth.load_res(rows), "bbox")
    evaluator.params.img_ids = images.tolist()
    evaluator.params.cat_ids = categories.tolist()
    evaluator.evaluate()
    evaluator.accumulate()
    precision = np.asarray(evaluator.eval["precision"], np.float64)
    recall = np.asarray(evaluator.eval["recall"], np.float64)
    return CocoAp(precision, recall, _summarize(precision, recall), categories)


def _summarize(precision: np.ndarray, recall: np.ndarray) -> dict[str, float]:
    """pycocotools' `summarize()` stats as a dict."""
    stats = {}
    for name, which, iou, area, max_detections in _STATS:
        m = MAX_DETECTIONS.index(max_detections)
        if which == "precision":
            values = precision[:, :, :, area, m]
        else:
            values = recall[:, :, area, m]
        if iou is not None:
            values = values[np.flatnonzero(iou == IOU_THRESHOLDS)]
        values = values[values > -1]
        stats[name] = float(values.mean()) if values.size else -1.0
    return stats
