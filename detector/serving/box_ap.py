"""COCO bounding-box AP/AR, computed on arrays: pycocotools' COCOeval semantics, vectorised.

pycocotools scores one (image, category, area range) at a time in Python:
about 50 s for COCO val2017's 5,000 images and minutes to hours at
Objects365 scale, with every box held as a dict. Here ground truth and
detections are columns (`CocoGroundTruth`, `CocoDetections`), and the
greedy matching runs for all image-category groups, IoU thresholds and area
ranges at once, one detection rank at a time (at most 100 ranks), so the time
and memory grow with the number of boxes, not with images x categories.

The result is pycocotools' to float rounding (tests compare all 12 stats and
the per-class AP on crowds, empty images and categories without ground
truth), including its order-dependent rules:
- per image and category only the 100 highest-scoring detections count,
  ties kept in input order (pycocotools' stable mergesort);
- a detection takes, among the ground-truth boxes still free at IoU >= t
  (crowd boxes are never used up), the one of highest IoU, preferring boxes
  that are not ignored (crowd, or outside the area range); equal IoUs go to
  the later box, as pycocotools' `<` comparison does;
- IoU with a crowd box is intersection over the detection's area;
- the area range tests use the ground truth's `area` field (COCO's mask
  area, not w * h) and the detection's w * h, both ends inclusive.

faster-coco-eval (C++) was measured as the alternative: it scores COCO val
in a few seconds but keeps pycocotools' per-box dicts and a dict entry per
(image, category) pair, which is what makes 20,000 images x 365 classes take
10 GB; these columns take a few hundred MB there (`benchmarks.data_scale`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# pycocotools' Params for iouType="bbox".
IOU_THRESHOLDS = np.linspace(0.5, 0.95, int(np.round((0.95 - 0.5) / 0.05)) + 1, endpoint=True)
RECALL_THRESHOLDS = np.linspace(0.0, 1.00, int(np.round((1.00 - 0.0) / 0.01)) + 1, endpoint=True)
MAX_DETECTIONS = (1, 10, 100)
AREA_RANGES = ((0.0, 1e5**2), (0.0, 32.0**2), (32.0**2, 96.0**2), (96.0**2, 1e5**2))  # all, small, medium, large

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
class BoxAp:
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


def _box_iou(dt_xywh: np.ndarray, gt_xywh: np.ndarray, gt_crowd: np.ndarray) -> np.ndarray:
    """float64 [P]: IoU of paired boxes as pycocotools' C `bbIou` computes it (same operations, same order)."""
    width = np.minimum(dt_xywh[:, 0] + dt_xywh[:, 2], gt_xywh[:, 0] + gt_xywh[:, 2]) - np.maximum(
        dt_xywh[:, 0], gt_xywh[:, 0]
    )
    height = np.minimum(dt_xywh[:, 1] + dt_xywh[:, 3], gt_xywh[:, 1] + gt_xywh[:, 3]) - np.maximum(
        dt_xywh[:, 1], gt_xywh[:, 1]
    )
    overlap = (width > 0) & (height > 0)
    intersection = np.where(overlap, width * height, 0.0)
    dt_area = dt_xywh[:, 2] * dt_xywh[:, 3]
    union = np.where(gt_crowd, dt_area, dt_area + gt_xywh[:, 2] * gt_xywh[:, 3] - intersection)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(overlap, intersection / union, 0.0)


def _segment_max(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Max over the last axis within segments beginning at `starts` (int [S], ascending, first 0)."""
    return np.maximum.reduceat(values, starts, axis=-1)


def evaluate(ground_truth: CocoGroundTruth, detections: CocoDetections, image_ids: np.ndarray | None = None) -> BoxAp:
    """Scores `detections` against `ground_truth` on `image_ids` (default: all of its images).

    Detections of images outside `image_ids`, or of categories the ground
    truth does not list, are not scored (as pycocotools' params.imgIds /
    catIds do).

    Raises:
      ValueError: a detection names an image the ground truth does not have
        (pycocotools: "Results do not correspond to current coco set").
    """
    all_images = np.unique(ground_truth.image_ids)
    unknown = np.setdiff1d(np.unique(detections.image_ids), all_images)
    if unknown.size:
        raise ValueError(
            f"{unknown.size} detected image ids are not in the ground truth (e.g. {unknown[:5].tolist()}); "
            "score detections against the ground truth of the images they were predicted on"
        )
    images = all_images if image_ids is None else np.unique(np.asarray(image_ids, np.int64))
    categories = np.asarray(ground_truth.category_ids, np.int64)
    num_categories = len(categories)
    num_thresholds, num_areas = len(IOU_THRESHOLDS), len(AREA_RANGES)

    def group_of(box_images: np.ndarray, box_categories: np.ndarray) -> np.ndarray:
        """int64 [n]: image index * K + category index, -1 where not scored."""
        image_index = np.searchsorted(images, box_images)
        category_index = np.searchsorted(categories, box_categories)
        known = (image_index < len(images)) & (category_index < num_categories)
        known[known] &= (images[image_index[known]] == box_images[known]) & (
            categories[category_index[known]] == box_categories[known]
        )
        return np.where(known, image_index * num_categories + category_index, -1)

    # Ground truth, grouped; within a group in input order (pycocotools' gt order).
    gt_group = group_of(ground_truth.box_image_ids, ground_truth.box_category_ids)
    gt_keep = np.flatnonzero(gt_group >= 0)
    gt_keep = gt_keep[np.argsort(gt_group[gt_keep], kind="stable")]
    gt_group = gt_group[gt_keep]
    gt_boxes = np.asarray(ground_truth.boxes_xywh, np.float64)[gt_keep]
    gt_areas = np.asarray(ground_truth.areas, np.float64)[gt_keep]
    gt_crowd = np.asarray(ground_truth.is_crowd, bool)[gt_keep]
    num_gt = len(gt_keep)
    # [A, M]: ignored in each area range: crowds, and boxes outside the range.
    gt_ignored = np.stack([gt_crowd | (gt_areas < lo) | (gt_areas > hi) for lo, hi in AREA_RANGES])

    # Detections: per group by descending score (stable), the best MAX_DETECTIONS[-1] kept.
    dt_group = group_of(detections.image_ids, detections.category_ids)
    scores = np.asarray(detections.scores, np.float64)
    dt_keep = np.flatnonzero(dt_group >= 0)
    dt_keep = dt_keep[np.lexsort((-scores[dt_keep], dt_group[dt_keep]))]
    dt_group = dt_group[dt_keep]
    group_start = np.searchsorted(dt_group, dt_group, side="left")
    dt_rank = np.arange(len(dt_keep)) - group_start
    within = dt_rank < MAX_DETECTIONS[-1]
    dt_keep, dt_group, dt_rank = dt_keep[within], dt_group[within], dt_rank[within]
    dt_boxes = np.asarray(detections.boxes_xywh, np.float64)[dt_keep]
    dt_scores = scores[dt_keep]
    dt_areas = dt_boxes[:, 2] * dt_boxes[:, 3]
    num_dt = len(dt_keep)

    # Every (detection, ground-truth box) pair of a group, ordered by detection rank, then detection, then box.
    by_rank = np.lexsort((dt_group, dt_rank))
    gt_first = np.searchsorted(gt_group, dt_group[by_rank], side="left")
    gt_count = np.searchsorted(gt_group, dt_group[by_rank], side="right") - gt_first
    pair_dt = np.repeat(by_rank, gt_count)
    pair_offset = np.arange(len(pair_dt)) - np.repeat(np.cumsum(gt_count) - gt_count, gt_count)
    pair_gt = np.repeat(gt_first, gt_count) + pair_offset
    pair_iou = _box_iou(dt_boxes[pair_dt], gt_boxes[pair_gt], gt_crowd[pair_gt])
    del pair_offset

    # Greedy matching, all groups at once, one rank at a time: a rank's detections are
    # in distinct groups, so they never compete; earlier ranks have taken their boxes.
    thresholds = np.minimum(IOU_THRESHOLDS, 1 - 1e-10)[None, :, None]
    gt_taken = np.zeros([num_areas, num_thresholds, num_gt], bool)
    dt_matched = np.zeros([num_areas, num_thresholds, num_dt], bool)
    dt_on_ignored = np.zeros([num_areas, num_thresholds, num_dt], bool)
    pair_rank = dt_rank[pair_dt]
    rank_bounds = np.searchsorted(pair_rank, np.arange(MAX_DETECTIONS[-1] + 1), side="left")
    for rank in range(MAX_DETECTIONS[-1]):
        lo, hi = rank_bounds[rank], rank_bounds[rank + 1]
        if lo == hi:
            continue
        dts, gts, ious = pair_dt[lo:hi], pair_gt[lo:hi], pair_iou[lo:hi]
        starts = np.flatnonzero(np.r_[True, dts[1:] != dts[:-1]])
        segment = np.cumsum(np.r_[False, dts[1:] != dts[:-1]])
        free = ~gt_taken[:, :, gts] | gt_crowd[gts]
        candidate = free & (ious >= thresholds)  # [A, T, P]
        kept = ~gt_ignored[:, gts][:, None, :]
        # Boxes that are not ignored first: ignored ones only where no such box qualifies.
        prefers_kept = _segment_max(candidate & kept, starts)[..., segment]
        candidate &= kept == prefers_kept
        best_iou = _segment_max(np.where(candidate, ious, -1.0), starts)
        candidate &= ious == best_iou[..., segment]
        # Equal IoUs: the later box, as pycocotools' strict `<` lets it replace the earlier.
        position = np.where(candidate, np.arange(hi - lo), -1)
        chosen = _segment_max(position, starts)  # [A, T, S], -1: no match
        a_index, t_index, s_index = np.nonzero(chosen >= 0)
        pick = chosen[a_index, t_index, s_index]
        gt_taken[a_index, t_index, gts[pick]] = True
        dt_matched[a_index, t_index, dts[starts[s_index]]] = True
        dt_on_ignored[a_index, t_index, dts[starts[s_index]]] = gt_ignored[a_index, gts[pick]]
    del pair_dt, pair_gt, pair_iou, pair_rank

    # Unmatched detections outside the area range are ignored; matched ones follow their box.
    dt_outside = np.stack([(dt_areas < lo) | (dt_areas > hi) for lo, hi in AREA_RANGES])[:, None, :]
    dt_ignored = np.where(dt_matched, dt_on_ignored, dt_outside)
    true_positive = dt_matched & ~dt_ignored
    false_positive = ~dt_matched & ~dt_ignored
    del dt_on_ignored, dt_outside, dt_ignored

    # Accumulation (pycocotools' accumulate): per category, detections of all images by
    # descending score; ties in image order, then rank (its concatenation + stable sort).
    dt_category = dt_group % num_categories if num_dt else dt_group
    dt_image = dt_group // num_categories if num_dt else dt_group
    gt_category = gt_group % num_categories
    not_ignored_count = np.stack(
        [np.bincount(gt_category[~gt_ignored[a]], minlength=num_categories) for a in range(num_areas)]
    )  # [A, K]
    precision = -np.ones([num_thresholds, len(RECALL_THRESHOLDS), num_categories, num_areas, len(MAX_DETECTIONS)])
    recall = -np.ones([num_thresholds, num_categories, num_areas, len(MAX_DETECTIONS)])
    for m, max_detections in enumerate(MAX_DETECTIONS):
        counted = np.flatnonzero(dt_rank < max_detections)
        counted = counted[np.lexsort((dt_rank[counted], dt_image[counted], -dt_scores[counted], dt_category[counted]))]
        bounds = np.searchsorted(dt_category[counted], np.arange(num_categories + 1), side="left")
        for k in range(num_categories):
            members = counted[bounds[k] : bounds[k + 1]]
            for a in range(num_areas):
                positives = not_ignored_count[a, k]
                if positives == 0:
                    continue
                tp = np.cumsum(true_positive[a][:, members], axis=1, dtype=np.float64)  # [T, n]
                fp = np.cumsum(false_positive[a][:, members], axis=1, dtype=np.float64)
                if not members.size or not tp.shape[1]:
                    recall[:, k, a, m] = 0.0
                    precision[:, :, k, a, m] = 0.0
                    continue
                rc = tp / positives
                pr = tp / (fp + tp + np.spacing(1))
                # Interpolated precision: the best at this recall or beyond.
                pr = np.maximum.accumulate(pr[:, ::-1], axis=1)[:, ::-1]
                recall[:, k, a, m] = rc[:, -1]
                for t in range(num_thresholds):
                    at = np.searchsorted(rc[t], RECALL_THRESHOLDS, side="left")
                    q = np.zeros(len(RECALL_THRESHOLDS))
                    reached = at < rc.shape[1]
                    q[reached] = pr[t, at[reached]]
                    precision[t, :, k, a, m] = q
    return BoxAp(precision, recall, _summarize(precision, recall), categories)


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
