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

Masks travel as `RleMasks`: COCO's compressed RLE strings back to back in
one uint8 column with offsets, so gathering, concatenating or storing them
(Parquet) costs no Python object per mask; dicts are made only for hotcoco.
`evaluate(..., iou_type="segm")` scores them as pycocotools' segm COCOeval
does on detectron2-style results (no `bbox` in a segm result, so a
detection's area, which the size ranges test, is its mask's).
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
# The segm stats beside the box ones in one metrics dict (detectron2 logs them under "segm/AP" and "bbox/AP").
MASK_STAT_NAMES = tuple("mask_" + name for name in STAT_NAMES)
IOU_TYPES = ("bbox", "segm")
# The input pipeline's ground-truth mask columns, in RleMasks' field order (CocoGroundTruth.from_columns).
GROUND_TRUTH_MASK_COLUMNS = ("mask_heights", "mask_widths", "mask_counts", "mask_offsets")


@dataclasses.dataclass(frozen=True)
class RleMasks:
    """Binary masks as COCO compressed RLE, in columns.

    Attributes:
      heights: int32 [N] each mask's height in pixels.
      widths: int32 [N].
      counts: uint8 [total bytes] the masks' compressed RLE strings (COCO's
        `counts`, ASCII) back to back.
      offsets: int64 [N + 1] mask i's string is counts[offsets[i]:offsets[i + 1]];
        offsets[0] is 0 and offsets[N] is len(counts).
    """

    heights: np.ndarray
    widths: np.ndarray
    counts: np.ndarray
    offsets: np.ndarray

    def __post_init__(self):
        if len(self.offsets) != len(self.heights) + 1 or len(self.widths) != len(self.heights):
            raise ValueError(
                f"{len(self.heights)} heights, {len(self.widths)} widths and {len(self.offsets)} offsets: "
                "offsets must have one entry more than there are masks"
            )
        if self.offsets[0] != 0 or self.offsets[-1] != len(self.counts):
            raise ValueError(f"offsets run from {self.offsets[0]} to {self.offsets[-1]}, not 0 to {len(self.counts)}")

    @classmethod
    def empty(cls) -> RleMasks:
        return cls(np.zeros([0], np.int32), np.zeros([0], np.int32), np.zeros([0], np.uint8), np.zeros([1], np.int64))

    @classmethod
    def from_strings(cls, heights: Any, widths: Any, strings: Sequence[bytes]) -> RleMasks:
        """From compressed RLE strings (bytes) and the masks' sizes (int [N] each)."""
        lengths = np.fromiter((len(c) for c in strings), np.int64, count=len(strings))
        return cls(
            heights=np.asarray(heights, np.int32).reshape(-1),
            widths=np.asarray(widths, np.int32).reshape(-1),
            counts=np.frombuffer(b"".join(strings), np.uint8).copy(),
            offsets=np.concatenate([np.zeros([1], np.int64), np.cumsum(lengths)]),
        )

    @classmethod
    def from_coco(cls, rles: Sequence[Mapping[str, Any]]) -> RleMasks:
        """From COCO RLE dicts ({"size": [h, w], "counts": str or bytes, or a list of run lengths})."""
        sizes = np.array([r["size"] for r in rles], np.int64).reshape(-1, 2)
        return cls.from_strings(sizes[:, 0], sizes[:, 1], [_compressed_counts(r) for r in rles])

    def to_coco(self) -> list[dict[str, Any]]:
        """COCO compressed RLE dicts ({"size": [h, w], "counts": str}), as a results JSON holds them."""
        data = self.counts.tobytes()
        offsets = self.offsets.tolist()
        return [
            {"size": [h, w], "counts": data[offsets[i] : offsets[i + 1]].decode("ascii")}
            for i, (h, w) in enumerate(zip(self.heights.tolist(), self.widths.tolist()))
        ]

    @classmethod
    def concatenate(cls, parts: Sequence[RleMasks]) -> RleMasks:
        if not parts:
            return cls.empty()
        starts = np.cumsum([0] + [len(p.counts) for p in parts[:-1]])
        return cls(
            heights=np.concatenate([p.heights for p in parts]).astype(np.int32),
            widths=np.concatenate([p.widths for p in parts]).astype(np.int32),
            counts=np.concatenate([p.counts for p in parts]).astype(np.uint8),
            offsets=np.concatenate(
                [np.zeros([1], np.int64), *(p.offsets[1:] + start for p, start in zip(parts, starts))]
            ),
        )

    def __len__(self) -> int:
        return len(self.heights)

    def select(self, index: Any) -> RleMasks:
        """The masks `index` picks: int array, bool array [N] or slice, as NumPy indexing takes them."""
        picked = np.arange(len(self))[index].reshape(-1)
        starts, ends = self.offsets[picked], self.offsets[picked + 1]
        lengths = ends - starts
        offsets = np.concatenate([np.zeros([1], np.int64), np.cumsum(lengths)])
        # Each picked string's bytes: its start, shifted to where it lands in the new column.
        gather = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
        return RleMasks(self.heights[picked], self.widths[picked], self.counts[gather], offsets)

    def areas(self) -> np.ndarray:
        """int64 [N] foreground pixels of each mask."""
        return np.asarray(hotcoco.mask.area(self.to_coco()), np.int64).reshape(-1)


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
      segmentations: None (box-only data), or the M annotations' masks in
        original pixels, crowd regions included, for `segm` scoring.
    """

    image_ids: np.ndarray
    category_ids: np.ndarray
    box_image_ids: np.ndarray
    box_category_ids: np.ndarray
    boxes_xywh: np.ndarray
    areas: np.ndarray
    is_crowd: np.ndarray
    segmentations: RleMasks | None = None

    @classmethod
    def from_coco(cls, ground_truth: Mapping[str, Any]) -> CocoGroundTruth:
        """From a COCO-format dict ({'images', 'annotations', 'categories'}).

        `segmentations` is set when every annotation has a `segmentation`
        (polygons need their image's `height` and `width`).
        """
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
            segmentations=(
                _segmentations(ground_truth.get("images", []), annotations)
                if all("segmentation" in a for a in annotations)
                else None
            ),
        )

    @classmethod
    def from_columns(cls, columns: Mapping[str, np.ndarray]) -> CocoGroundTruth:
        """From the input pipeline's ground-truth columns (`input_pipeline.coco_ground_truth_columns`).

        The box columns are the fields of the same names; the mask columns
        (mask_heights, mask_widths int32 [M], mask_counts uint8 [bytes],
        mask_offsets int64 [M + 1]: COCO compressed RLE strings back to back)
        become `segmentations`, present only where the source has a mask for
        every box (else None: segm is not scored).
        """
        fields = dict(columns)
        masks = [fields.pop(name, None) for name in GROUND_TRUTH_MASK_COLUMNS]
        if any(m is None for m in masks) and not all(m is None for m in masks):
            raise ValueError(f"ground-truth columns need all of {GROUND_TRUTH_MASK_COLUMNS} or none")
        segmentations = None
        if masks[0] is not None:
            heights, widths, counts, offsets = masks
            segmentations = RleMasks(
                heights=np.asarray(heights, np.int32),
                widths=np.asarray(widths, np.int32),
                counts=np.asarray(counts, np.uint8),
                offsets=np.asarray(offsets, np.int64),
            )
            if len(segmentations.heights) != len(fields["box_image_ids"]):
                raise ValueError(
                    f"{len(segmentations.heights)} ground-truth masks for {len(fields['box_image_ids'])} boxes"
                )
        return cls(**fields, segmentations=segmentations)

    def instances(self, image_ids: np.ndarray) -> dict[int, int]:
        """Category id -> non-crowd boxes among `image_ids` (int [n])."""
        keep = np.isin(self.box_image_ids, image_ids) & ~self.is_crowd
        counts = dict(zip(*np.unique(self.box_category_ids[keep], return_counts=True)))
        return {int(c): int(counts.get(c, 0)) for c in self.category_ids}


def _compressed_counts(rle: Mapping[str, Any]) -> bytes:
    """The compressed RLE string of a COCO RLE dict, compressed or not ("counts" a list of run lengths)."""
    counts = rle["counts"]
    if isinstance(counts, str):
        return counts.encode("ascii")
    if isinstance(counts, bytes):
        return counts
    h, w = rle["size"]  # an uncompressed RLE's own size, as pycocotools takes it (COCO's crowd annotations)
    return hotcoco.mask.frPyObjects({"size": [h, w], "counts": list(counts)}, h, w)["counts"]


def _segmentations(images: Sequence[Mapping[str, Any]], annotations: Sequence[Mapping[str, Any]]) -> RleMasks:
    """The annotations' masks as pycocotools' `annToRLE` makes them (polygon parts merged, run lengths compressed)."""
    sizes = {int(i["id"]): (int(i["height"]), int(i["width"])) for i in images if "height" in i and "width" in i}
    heights, widths, strings = [], [], []
    for annotation in annotations:
        segmentation = annotation["segmentation"]
        if isinstance(segmentation, Mapping):
            h, w = segmentation["size"]
            rle = segmentation
        else:
            image_id = int(annotation["image_id"])
            if image_id not in sizes:
                raise ValueError(f"image {image_id} has polygon segmentations but no height and width")
            h, w = sizes[image_id]
            # An empty polygon list (a few COCO annotations) is an empty mask; pycocotools fails on it.
            parts = hotcoco.mask.frPyObjects([list(p) for p in segmentation], h, w) if segmentation else []
            rle = hotcoco.mask.merge(parts) if parts else hotcoco.mask.encode(np.zeros([h, w], np.uint8))
        strings.append(_compressed_counts(rle))
        heights.append(h)
        widths.append(w)
    return RleMasks.from_strings(heights, widths, strings)


@dataclasses.dataclass(frozen=True)
class CocoDetections:
    """Detections as columns (a COCO results file's content).

    Attributes:
      image_ids: int64 [N].
      category_ids: int64 [N].
      boxes_xywh: float64 [N, 4] x, y, width, height in original pixels.
      scores: float64 [N].
      masks: None (boxes only), or the N detections' masks in original
        pixels, for `segm` scoring.
    """

    image_ids: np.ndarray
    category_ids: np.ndarray
    boxes_xywh: np.ndarray
    scores: np.ndarray
    masks: RleMasks | None = None

    @classmethod
    def from_results(cls, results: Sequence[Mapping[str, Any]]) -> CocoDetections:
        """From a COCO results list ([{image_id, category_id, bbox [x, y, w, h], score}]).

        Results that all carry an RLE `segmentation` (a dict, as detectron2
        writes them) give `masks`; polygons, which need the image's size and
        which pycocotools' loadRes writes into box results, are not read. A
        result with a mask but no `bbox` gets its mask's bounding box.
        """
        with_masks = bool(results) and all(isinstance(r.get("segmentation"), Mapping) for r in results)
        masks = RleMasks.from_coco([r["segmentation"] for r in results]) if with_masks else None
        boxes = np.array([r.get("bbox", [np.nan] * 4) for r in results], np.float64).reshape(-1, 4)
        if masks is not None and np.isnan(boxes).any():
            missing = np.isnan(boxes).any(axis=1)
            boxes[missing] = hotcoco.mask.to_bbox(masks.select(missing).to_coco())
        return cls(
            image_ids=np.array([int(r["image_id"]) for r in results], np.int64),
            category_ids=np.array([int(r["category_id"]) for r in results], np.int64),
            boxes_xywh=boxes,
            scores=np.array([float(r["score"]) for r in results], np.float64),
            masks=masks,
        )

    @classmethod
    def concatenate(cls, parts: Sequence[CocoDetections]) -> CocoDetections:
        """The detections of `parts` in order; masks are kept if every part that has detections has them."""
        if not parts:
            return cls(np.zeros([0], np.int64), np.zeros([0], np.int64), np.zeros([0, 4]), np.zeros([0]))
        columns = [np.concatenate([getattr(p, name) for p in parts]) for name in _DETECTION_COLUMNS]
        # Parts without rows do not decide (a process that found nothing may have made its part without masks).
        with_rows = [p for p in parts if len(p)]
        masked = [p.masks is not None for p in (with_rows or parts)]
        if with_rows and any(masked) and not all(masked):
            raise ValueError("detections with masks and detections without cannot be concatenated")
        masks = RleMasks.concatenate([p.masks for p in parts if p.masks is not None]) if any(masked) else None
        return cls(*columns, masks=masks)

    def __len__(self) -> int:
        return len(self.scores)

    def select(self, index: Any) -> CocoDetections:
        """The detections `index` picks (int array, bool array [N] or slice)."""
        return CocoDetections(
            *(getattr(self, name)[index] for name in _DETECTION_COLUMNS),
            masks=None if self.masks is None else self.masks.select(index),
        )

    def to_columns(self) -> dict[str, np.ndarray]:
        """Flat arrays (for npz or Parquet): the columns, and the masks' as `masks_<column>`."""
        columns = {name: getattr(self, name) for name in _DETECTION_COLUMNS}
        if self.masks is not None:
            columns.update({f"masks_{f.name}": getattr(self.masks, f.name) for f in dataclasses.fields(RleMasks)})
        return columns

    @classmethod
    def from_columns(cls, columns: Mapping[str, np.ndarray]) -> CocoDetections:
        """The inverse of `to_columns`."""
        masks = None
        if "masks_offsets" in columns:
            masks = RleMasks(**{f.name: np.asarray(columns[f"masks_{f.name}"]) for f in dataclasses.fields(RleMasks)})
        return cls(*(np.asarray(columns[name]) for name in _DETECTION_COLUMNS), masks=masks)


_DETECTION_COLUMNS = ("image_ids", "category_ids", "boxes_xywh", "scores")


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
      iou_type: "bbox" or "segm", what was scored.
    """

    precision: np.ndarray
    recall: np.ndarray
    stats: dict[str, float]
    category_ids: np.ndarray
    iou_type: str = "bbox"

    def metrics(self) -> dict[str, float]:
        """`stats` named for a metrics dict holding both scorings: STAT_NAMES for bbox, MASK_STAT_NAMES for segm."""
        names = MASK_STAT_NAMES if self.iou_type == "segm" else STAT_NAMES
        return {name: self.stats[stat] for name, stat in zip(names, STAT_NAMES)}

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


def evaluate(
    ground_truth: CocoGroundTruth,
    detections: CocoDetections,
    image_ids: np.ndarray | None = None,
    *,
    iou_type: str = "bbox",
) -> CocoAp:
    """Scores `detections` against `ground_truth` on `image_ids` (default: all of its images).

    Detections of images outside `image_ids`, or of categories the ground
    truth does not list, are not scored (as pycocotools' params.imgIds /
    catIds do).

    `iou_type`: "bbox", or "segm" to match masks by mask IoU (IoA against
    crowd regions). In segm, as in pycocotools on detectron2's segm results
    (which carry no `bbox`), a detection's area is its mask's and its box
    is not used; a ground-truth annotation's area is its `area` in both.

    Raises:
      ValueError: a detection names an image the ground truth does not have
        (pycocotools: "Results do not correspond to current coco set"), an
        unknown `iou_type`, or "segm" where either side has no masks.
    """
    if iou_type not in IOU_TYPES:
        raise ValueError(f"iou_type={iou_type!r}: use one of {IOU_TYPES}")
    segm = iou_type == "segm"
    if segm and (ground_truth.segmentations is None or detections.masks is None):
        missing = "ground truth's segmentations" if ground_truth.segmentations is None else "detections' masks"
        raise ValueError(f"segm scoring needs masks on both sides; the {missing} are missing (None)")
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
        **({"segmentation": ground_truth.segmentations.to_coco()} if segm else {}),
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
    if segm:
        masks = detections.masks.select(scored).to_coco()
        found = coco_ground_truth.load_res(rows, segmentation=masks)
        # load_res gives each row its box's area; the size ranges must test the mask's (loadRes's segm rule).
        if masks:
            found.update_anns(ids=np.arange(1, len(masks) + 1), area=np.asarray(hotcoco.mask.area(masks), np.float64))
    else:
        found = coco_ground_truth.load_res(rows)
    evaluator = hotcoco.COCOeval(coco_ground_truth, found, iou_type)
    evaluator.params.img_ids = images.tolist()
    evaluator.params.cat_ids = categories.tolist()
    evaluator.evaluate()
    evaluator.accumulate()
    precision = np.asarray(evaluator.eval["precision"], np.float64)
    recall = np.asarray(evaluator.eval["recall"], np.float64)
    return CocoAp(precision, recall, _summarize(precision, recall), categories, iou_type)


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
