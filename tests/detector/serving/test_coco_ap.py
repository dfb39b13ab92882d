"""coco_ap against pycocotools' COCOeval: the 12 stats, precision and recall on data built for its corner cases."""

import contextlib
import io

import numpy as np
import pytest
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


def _pycocotools(ground_truth, results, image_ids=None):
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = ground_truth
        gt.createIndex()
        evaluator = COCOeval(gt, gt.loadRes(results), iouType="bbox")
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
