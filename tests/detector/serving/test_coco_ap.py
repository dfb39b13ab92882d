"""coco_ap against pycocotools' COCOeval (bbox and segm): the 12 stats, precision and recall on data built for its
corner cases; the RLE mask columns against pycocotools' masks."""

import contextlib
import copy
import dataclasses
import io

import numpy as np
import pytest
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from detector.serving import coco_ap


def _dataset(seed: int, num_images: int = 40, num_categories: int = 7):
    """Ground truth and results with crowds, empty images, an absent class, ties, duplicates, >100 per group."""
    rng = np.random.default_rng(seed)
    category_ids = [1, 3, 4, 8, 9, 20, 31][:num_categories]
    images = [{"id": 100 + i, "height": 480, "width": 640} for i in range(num_images)]
    annotations, results = [], []
    for image in images[:-5]:  # the last five images have no boxes at all
        for _ in range(rng.integers(0, 12)):
            category = int(rng.choice(category_ids[:-1]))  # the last category never has ground truth
            w, h = (float(v) for v in rng.uniform(4, 200, size=2))
            x, y = float(rng.uniform(0, 640 - w)), float(rng.uniform(0, 480 - h))
            crowd = int(rng.random() < 0.1)
            # COCO's area is the mask's, not w * h: some boxes straddle a size range only by it.
            area = w * h * float(rng.uniform(0.5, 1.0))
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image["id"],
                    "category_id": category,
                    "bbox": [round(x, 2), round(y, 2), round(w, 2), round(h, 2)],
                    "area": area,
                    "iscrowd": crowd,
                }
            )
    for ann in annotations:
        for _ in range(rng.integers(0, 4)):
            x, y, w, h = ann["bbox"]
            jitter = rng.normal(0, 0.12, size=4) * [w, h, w, h]
            results.append(
                {
                    "image_id": ann["image_id"],
                    "category_id": ann["category_id"] if rng.random() < 0.85 else int(rng.choice(category_ids)),
                    "bbox": [round(float(v), 2) for v in np.maximum([x, y, w, h] + jitter, [0, 0, 1, 1])],
                    "score": round(float(rng.random()), 2),  # 2 decimals: many equal scores
                }
            )
        if rng.random() < 0.2:  # an exact duplicate of the box: equal IoUs for two detections
            results.append({**results[-1]} if results else {})
    for image in images[:4]:  # background detections, and more than 100 in one image-category
        for _ in range(130):
            w, h = (float(v) for v in rng.uniform(2, 300, size=2))
            results.append(
                {
                    "image_id": image["id"],
                    "category_id": category_ids[0],
                    "bbox": [float(rng.uniform(0, 500)), float(rng.uniform(0, 400)), w, h],
                    "score": round(float(rng.random()), 3),
                }
            )
    # Two ground-truth boxes identical: the tie of IoUs that pycocotools gives to the later one.
    if annotations:
        twin = dict(annotations[0], id=len(annotations) + 1)
        annotations.append(twin)
    categories = [{"id": c, "name": f"c{c}"} for c in category_ids]
    return {"images": images, "annotations": annotations, "categories": categories}, [r for r in results if r]


def _pycocotools(ground_truth, results, image_ids=None, iou_type="bbox"):
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = copy.deepcopy(ground_truth)  # loadRes and COCOeval write into the dicts
        gt.createIndex()
        evaluator = COCOeval(gt, gt.loadRes(copy.deepcopy(results)), iouType=iou_type)
        if image_ids is not None:
            evaluator.params.imgIds = list(image_ids)
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return evaluator


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equals_pycocotools(seed):
    ground_truth, results = _dataset(seed)
    reference = _pycocotools(ground_truth, results)
    ours = coco_ap.evaluate(
        coco_ap.CocoGroundTruth.from_coco(ground_truth), coco_ap.CocoDetections.from_results(results)
    )
    np.testing.assert_allclose([ours.stats[n] for n in coco_ap.STAT_NAMES], reference.stats, rtol=0, atol=1e-12)
    np.testing.assert_allclose(ours.precision, reference.eval["precision"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(ours.recall, reference.eval["recall"], rtol=0, atol=1e-12)
    # The data reaches the cases it was built for.
    assert -1 in reference.eval["precision"][:, :, -1]  # a class without ground truth
    assert 0 < reference.stats[0] < 1


def test_subset_of_images_equals_pycocotools():
    ground_truth, results = _dataset(3)
    evaluated = [image["id"] for image in ground_truth["images"][::3]]
    reference = _pycocotools(ground_truth, results, evaluated)
    ours = coco_ap.evaluate(
        coco_ap.CocoGroundTruth.from_coco(ground_truth), coco_ap.CocoDetections.from_results(results), evaluated
    )
    np.testing.assert_allclose([ours.stats[n] for n in coco_ap.STAT_NAMES], reference.stats, rtol=0, atol=1e-12)


def test_unknown_image_is_an_error():
    ground_truth, results = _dataset(4, num_images=8)
    results.append({"image_id": 99999, "category_id": 1, "bbox": [0, 0, 5, 5], "score": 0.5})
    with pytest.raises(ValueError, match="not in the ground truth"):
        coco_ap.evaluate(coco_ap.CocoGroundTruth.from_coco(ground_truth), coco_ap.CocoDetections.from_results(results))


def test_detections_of_a_category_the_ground_truth_does_not_list_are_not_scored(capfd):
    ground_truth, results = _dataset(5)
    reference = _pycocotools(ground_truth, results)
    foreign = [{**r, "category_id": 777} for r in results[:50]]  # pycocotools scores its params.catIds only
    ours = coco_ap.evaluate(
        coco_ap.CocoGroundTruth.from_coco(ground_truth), coco_ap.CocoDetections.from_results(results + foreign)
    )
    np.testing.assert_allclose([ours.stats[n] for n in coco_ap.STAT_NAMES], reference.stats, rtol=0, atol=1e-12)
    assert capfd.readouterr() == ("", "")  # nothing printed, from a background scoring thread either


def test_no_detections_score_zero_where_there_is_ground_truth():
    ground_truth, _ = _dataset(6)
    ours = coco_ap.evaluate(coco_ap.CocoGroundTruth.from_coco(ground_truth), coco_ap.CocoDetections.concatenate([]))
    assert ours.stats["AP"] == 0.0 and ours.stats["AR100"] == 0.0
    per_class = ours.per_class()
    assert per_class[31] == {"AP": -1.0, "AP50": -1.0, "AP75": -1.0}  # the class without ground truth
    assert all(v["AP"] == 0.0 for c, v in per_class.items() if c != 31)


# ---- segm: masks ----


def _ellipse(shape, center, radii):
    yy, xx = np.mgrid[: shape[0], : shape[1]]
    return ((yy - center[0]) / radii[0]) ** 2 + ((xx - center[1]) / radii[1]) ** 2 <= 1


def _star_polygon(rng, center, radius):
    """A simple polygon (x1, y1, x2, y2, ...) around `center` (y, x): points at sorted angles, random radii."""
    angles = np.sort(rng.uniform(0, 2 * np.pi, size=int(rng.integers(4, 9))))
    radii = radius * rng.uniform(0.5, 1.0, size=angles.size)
    xy = np.stack([center[1] + radii * np.cos(angles), center[0] + radii * np.sin(angles)], axis=1)
    return [round(float(v), 2) for v in xy.reshape(-1)]


def _uncompressed_rle(mask):
    """COCO's uncompressed RLE (run lengths column by column, starting with a run of zeros)."""
    flat = np.asarray(mask, np.uint8).reshape(-1, order="F")
    changes = np.flatnonzero(np.diff(flat)) + 1
    bounds = np.concatenate([[0], changes, [flat.size]])
    runs = np.diff(bounds).tolist()
    return {"size": list(mask.shape), "counts": ([0] if flat[0] else []) + runs}


def _compressed(mask):
    rle = mask_utils.encode(np.asfortranarray(mask, np.uint8))
    return {"size": rle["size"], "counts": rle["counts"].decode("ascii")}


def _segm_dataset(seed):
    """Ground truth in every segmentation form COCO has, and mask results (detectron2's: no `bbox`).

    Images of several sizes, the last without ground truth; multi-part polygons, compressed and uncompressed RLE,
    crowd regions (uncompressed RLE, as COCO's), masks with holes; objects in all three size ranges; results that
    are the objects' masks shifted, grown, shrunk or speckled, tied scores, exact duplicates, wrong classes and
    background masks; the ground truth's `area` not always its mask's pixels.
    """
    rng = np.random.default_rng(seed)
    sizes = [(120, 160), (97, 131), (200, 150), (64, 64), (150, 220), (80, 90), (181, 177), (50, 70)]
    images = [{"id": 10 + i, "height": h, "width": w} for i, (h, w) in enumerate(sizes)]
    categories = [{"id": c, "name": f"c{c}"} for c in (1, 2, 5)]
    annotations, masks = [], []
    forms = ["polygon", "polygons", "rle", "uncompressed", "crowd", "hole"]
    for image in images[:-1]:
        shape = (image["height"], image["width"])
        for _ in range(int(rng.integers(2, 7))):
            form = forms[len(annotations) % len(forms)]
            center = rng.uniform(0.2, 0.8, size=2) * shape
            radius = float(rng.choice([4.0, 12.0, 35.0, 70.0])) * rng.uniform(0.8, 1.3)
            if form in ("polygon", "polygons"):
                parts = [_star_polygon(rng, center, radius)]
                if form == "polygons":
                    parts.append(_star_polygon(rng, shape - center, radius / 2))
                segmentation = parts
                mask = mask_utils.decode(mask_utils.merge(mask_utils.frPyObjects(parts, *shape))).astype(bool)
            else:
                if form == "hole":  # a ring: a pixel of background all around the hole at least
                    mask = _ellipse(shape, center, radius * rng.uniform(1.0, 1.5, size=2))
                    mask &= ~_ellipse(shape, center, [0.4 * radius, 0.5 * radius])
                else:
                    mask = _ellipse(shape, center, radius * rng.uniform(0.5, 1.5, size=2))
                segmentation = _uncompressed_rle(mask) if form in ("uncompressed", "crowd") else _compressed(mask)
            if not mask.any():
                continue
            area = float(mask.sum()) * (float(rng.uniform(0.6, 1.0)) if rng.random() < 0.2 else 1.0)
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image["id"],
                    "category_id": int(rng.choice([1, 2])),  # category 5 never has ground truth
                    "segmentation": segmentation,
                    "area": area,
                    "bbox": [float(v) for v in mask_utils.toBbox(mask_utils.encode(np.asfortranarray(mask, np.uint8)))],
                    "iscrowd": int(form == "crowd"),
                }
            )
            masks.append(mask)
    results = []
    for annotation, mask in zip(annotations, masks):
        for _ in range(int(rng.integers(0, 4))):
            found = np.roll(mask, tuple(rng.integers(-4, 5, size=2)), axis=(0, 1))
            change = rng.integers(0, 3)
            if change == 1:
                found = found | np.roll(found, 2, axis=0) | np.roll(found, 2, axis=1)
            elif change == 2:
                found = found & (rng.random(found.shape) < 0.8)
            category = annotation["category_id"] if rng.random() < 0.85 else int(rng.choice([1, 2, 5]))
            score = round(float(rng.random()), 1)  # one decimal: many equal scores
            results.append(
                {
                    "image_id": annotation["image_id"],
                    "category_id": category,
                    "segmentation": _compressed(found),
                    "score": score,
                }
            )
        if results and rng.random() < 0.2:  # an exact duplicate: equal IoUs for two detections
            results.append(dict(results[-1]))
    for image in images:  # background masks, on the image without ground truth too
        shape = (image["height"], image["width"])
        for _ in range(3):
            mask = _ellipse(shape, rng.uniform(0, 1, size=2) * shape, rng.uniform(2, 50, size=2))
            results.append(
                {
                    "image_id": image["id"],
                    "category_id": int(rng.choice([1, 2, 5])),
                    "segmentation": _compressed(mask),
                    "score": round(float(rng.random()), 1),
                }
            )
    return {"images": images, "annotations": annotations, "categories": categories}, results


def _pycocotools_segm(ground_truth, results, image_ids=None):
    return _pycocotools(ground_truth, results, image_ids, iou_type="segm")


def _detections_with_wrong_boxes(results, ground_truth):
    """The results as columns, each box the whole image: segm scoring must use the masks alone."""
    sizes = {i["id"]: (i["height"], i["width"]) for i in ground_truth["images"]}
    detections = coco_ap.CocoDetections.from_results(results)
    boxes = np.array([[0.0, 0.0, sizes[i][1], sizes[i][0]] for i in detections.image_ids]).reshape(-1, 4)
    return dataclasses.replace(detections, boxes_xywh=boxes)


@pytest.mark.parametrize("seed", [0, 1])
def test_segm_equals_pycocotools(seed):
    ground_truth, results = _segm_dataset(seed)
    reference = _pycocotools_segm(ground_truth, results)
    ours = coco_ap.evaluate(
        coco_ap.CocoGroundTruth.from_coco(ground_truth),
        _detections_with_wrong_boxes(results, ground_truth),
        iou_type="segm",
    )
    np.testing.assert_allclose([ours.stats[n] for n in coco_ap.STAT_NAMES], reference.stats, rtol=0, atol=1e-12)
    np.testing.assert_allclose(ours.precision, reference.eval["precision"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(ours.recall, reference.eval["recall"], rtol=0, atol=1e-12)
    assert ours.metrics() == {"mask_" + n: ours.stats[n] for n in coco_ap.STAT_NAMES}
    # The data reaches the cases it was built for.
    assert 0 < reference.stats[0] < 1 and min(reference.stats[3:6]) > -1  # objects of every size
    assert -1 in reference.eval["precision"][:, :, -1]  # a class without ground truth
    forms = [type(a["segmentation"]) for a in ground_truth["annotations"]]
    crowds = [a for a in ground_truth["annotations"] if a["iscrowd"]]
    assert {list, dict} <= set(forms) and crowds and isinstance(crowds[0]["segmentation"]["counts"], list)
    # pycocotools with each result's box beside its mask tests the box's area against the size ranges: other
    # numbers, so these results tell the two areas apart.
    boxed = [{**r, "bbox": [0.0, 0.0, 1.0, 1.0]} for r in results]
    assert not np.allclose(_pycocotools_segm(ground_truth, boxed).stats, reference.stats)


def test_segm_subset_of_images_equals_pycocotools():
    ground_truth, results = _segm_dataset(2)
    evaluated = [image["id"] for image in ground_truth["images"][1::2]]
    reference = _pycocotools_segm(ground_truth, results, evaluated)
    ours = coco_ap.evaluate(
        coco_ap.CocoGroundTruth.from_coco(ground_truth),
        coco_ap.CocoDetections.from_results(results),
        evaluated,
        iou_type="segm",
    )
    np.testing.assert_allclose([ours.stats[n] for n in coco_ap.STAT_NAMES], reference.stats, rtol=0, atol=1e-12)
    np.testing.assert_allclose(ours.precision, reference.eval["precision"], rtol=0, atol=1e-12)


def test_segm_needs_masks_on_both_sides():
    ground_truth, results = _segm_dataset(3)
    with_masks = coco_ap.CocoGroundTruth.from_coco(ground_truth)
    detections = coco_ap.CocoDetections.from_results(results)
    without = dataclasses.replace(detections, masks=None)
    with pytest.raises(ValueError, match="detections' masks are missing"):
        coco_ap.evaluate(with_masks, without, iou_type="segm")
    with pytest.raises(ValueError, match="ground truth's segmentations are missing"):
        coco_ap.evaluate(dataclasses.replace(with_masks, segmentations=None), detections, iou_type="segm")
    with pytest.raises(ValueError, match="iou_type"):
        coco_ap.evaluate(with_masks, detections, iou_type="keypoints")
    # Boxes of the same data still score as before.
    assert coco_ap.evaluate(with_masks, without).metrics().keys() == set(coco_ap.STAT_NAMES)


def test_ground_truth_masks_are_pycocotools_ann_to_rle():
    ground_truth, _ = _segm_dataset(4)
    ground_truth["annotations"][0]["segmentation"] = []  # an empty polygon list: an empty mask
    columns = coco_ap.CocoGroundTruth.from_coco(ground_truth)
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = copy.deepcopy(ground_truth)
        gt.createIndex()
    for k, (annotation, rle) in enumerate(zip(ground_truth["annotations"], columns.segmentations.to_coco())):
        image = gt.imgs[annotation["image_id"]]
        decoded = mask_utils.decode(rle)
        assert decoded.shape == (image["height"], image["width"])
        if k == 0:
            assert not decoded.any()
        else:
            np.testing.assert_array_equal(decoded, gt.annToMask(annotation))
    assert (
        coco_ap.CocoGroundTruth.from_coco(
            {
                **ground_truth,
                "annotations": [
                    {k: v for k, v in a.items() if k != "segmentation"} for a in ground_truth["annotations"]
                ],
            }
        ).segmentations
        is None
    )


# ---- RleMasks ----


def _random_masks(rng, count):
    masks = []
    for _ in range(count):
        h, w = (int(v) for v in rng.integers(1, 40, size=2))
        masks.append(rng.random((h, w)) < rng.uniform(0, 1))
    return masks


def test_rle_masks_round_trip_and_decode_as_pycocotools():
    rng = np.random.default_rng(0)
    masks = _random_masks(rng, 30) + [np.zeros((5, 7), bool), np.ones((3, 2), bool)]
    rles = [mask_utils.encode(np.asfortranarray(m, np.uint8)) for m in masks]  # counts as bytes
    columns = coco_ap.RleMasks.from_coco(rles)
    assert len(columns) == len(masks) and columns.counts.dtype == np.uint8 and columns.offsets.dtype == np.int64
    as_coco = columns.to_coco()
    assert as_coco == [{"size": list(m.shape), "counts": r["counts"].decode("ascii")} for m, r in zip(masks, rles)]
    for mask, rle in zip(masks, as_coco):
        np.testing.assert_array_equal(mask_utils.decode(rle), mask)
    np.testing.assert_array_equal(columns.areas(), [m.sum() for m in masks])
    # Strings and uncompressed run lengths give the same columns.
    again = coco_ap.RleMasks.from_coco(as_coco)
    uncompressed = coco_ap.RleMasks.from_coco([_uncompressed_rle(m) for m in masks])
    for other in (again, uncompressed):
        for name in ("heights", "widths", "counts", "offsets"):
            np.testing.assert_array_equal(getattr(other, name), getattr(columns, name))


def test_rle_masks_concatenate_and_select():
    rng = np.random.default_rng(1)
    masks = _random_masks(rng, 25)
    rles = [_compressed(m) for m in masks]
    parts = [coco_ap.RleMasks.from_coco(rles[a:b]) for a, b in ((0, 7), (7, 7), (7, 20), (20, 25))]
    whole = coco_ap.RleMasks.concatenate(parts)
    assert whole.to_coco() == rles
    assert len(coco_ap.RleMasks.concatenate([])) == 0 and coco_ap.RleMasks.empty().to_coco() == []
    picked = np.array([24, 3, 3, 0, 17])
    assert whole.select(picked).to_coco() == [rles[i] for i in picked]
    chosen = rng.random(25) < 0.5
    assert whole.select(chosen).to_coco() == [r for r, keep in zip(rles, chosen) if keep]
    assert whole.select(slice(5, 9)).to_coco() == rles[5:9]
    assert whole.select(np.zeros(25, bool)).to_coco() == []
    with pytest.raises(ValueError, match="offsets"):
        coco_ap.RleMasks(whole.heights, whole.widths, whole.counts[:-1], whole.offsets)


def test_detections_with_masks_concatenate_select_and_columns():
    _, results = _segm_dataset(5)
    detections = coco_ap.CocoDetections.from_results(results)
    assert detections.masks.to_coco() == [r["segmentation"] for r in results]
    # Without a `bbox`, a result's box is its mask's bounding box (pycocotools' loadRes).
    np.testing.assert_allclose(detections.boxes_xywh, mask_utils.toBbox([r["segmentation"] for r in results]))
    half = len(results) // 2
    empty_without_masks = coco_ap.CocoDetections.concatenate([])
    joined = coco_ap.CocoDetections.concatenate(
        [detections.select(slice(0, half)), empty_without_masks, detections.select(slice(half, None))]
    )
    assert joined.masks.to_coco() == detections.masks.to_coco()
    np.testing.assert_array_equal(joined.scores, detections.scores)
    restored = coco_ap.CocoDetections.from_columns(detections.to_columns())
    assert restored.masks.to_coco() == detections.masks.to_coco()
    np.testing.assert_array_equal(restored.boxes_xywh, detections.boxes_xywh)
    assert coco_ap.CocoDetections.from_columns(empty_without_masks.to_columns()).masks is None
    with pytest.raises(ValueError, match="with masks and detections without"):
        coco_ap.CocoDetections.concatenate([detections, dataclasses.replace(detections, masks=None)])


def test_ground_truth_from_input_pipeline_columns_scores_its_own_masks_perfectly(tmp_path):
    """A COCO folder's ground-truth columns (masks included) -> CocoGroundTruth.from_columns -> segm AP 1.0."""
    import json

    from input_pipeline.datasets import coco_json

    ground_truth, _ = _segm_dataset(0)
    ground_truth["images"] = [{**i, "file_name": f"{i['id']}.png"} for i in ground_truth["images"]]
    path = tmp_path / "instances.json"
    path.write_text(json.dumps(ground_truth))
    columns = coco_json.load_ground_truth_columns(str(path))
    ours = coco_ap.CocoGroundTruth.from_columns(columns)
    reference = coco_ap.CocoGroundTruth.from_coco(ground_truth)
    for field in dataclasses.fields(coco_ap.CocoGroundTruth):
        if field.name != "segmentations":
            np.testing.assert_array_equal(getattr(ours, field.name), getattr(reference, field.name))
    decoded = [mask_utils.decode(r) for r in ours.segmentations.to_coco()]
    assert len(decoded) == len(ground_truth["annotations"])
    for mask, expected in zip(decoded, (mask_utils.decode(r) for r in reference.segmentations.to_coco())):
        np.testing.assert_array_equal(mask, expected)
    # Box-only columns give no segmentations; a partial set of mask columns is refused.
    box_only = {k: v for k, v in columns.items() if not k.startswith("mask_")}
    assert coco_ap.CocoGroundTruth.from_columns(box_only).segmentations is None
    with pytest.raises(ValueError, match="all of"):
        coco_ap.CocoGroundTruth.from_columns({**box_only, "mask_counts": columns["mask_counts"]})

    # The ground truth's own (non-crowd) masks as detections: every object found exactly.
    keep = ~ours.is_crowd
    rles = [r for r, k in zip(ours.segmentations.to_coco(), keep) if k]
    detections = coco_ap.CocoDetections(
        image_ids=ours.box_image_ids[keep],
        category_ids=ours.box_category_ids[keep],
        boxes_xywh=ours.boxes_xywh[keep],
        scores=np.linspace(1.0, 0.5, int(keep.sum())),
        masks=coco_ap.RleMasks.from_coco(rles),
    )
    scored = coco_ap.evaluate(ours, detections, iou_type="segm")
    assert scored.stats["AP"] == 1.0 and scored.stats["AR100"] == 1.0
    # Any mask moved off its object is no longer a perfect score: the masks, not the boxes, are matched.
    shifted = [mask_utils.encode(np.asfortranarray(np.roll(mask_utils.decode(r), 3, axis=1))) for r in rles]
    moved = dataclasses.replace(detections, masks=coco_ap.RleMasks.from_coco(shifted))
    assert coco_ap.evaluate(ours, moved, iou_type="segm").stats["AP"] < 1.0
