import dataclasses
import json

import numpy as np
import pytest
from pycocotools import mask as mask_utils

from detector.serving import coco_evaluation
from detector.serving.coco_ap import RleMasks

GROUND_TRUTH = {
    "images": [{"id": 7, "height": 100, "width": 200}, {"id": 9, "height": 50, "width": 50}],
    "annotations": [
        {"id": 1, "image_id": 7, "category_id": 3, "bbox": [10.0, 20.0, 60.0, 40.0], "area": 2400.0, "iscrowd": 0},
        {"id": 2, "image_id": 7, "category_id": 11, "bbox": [100.0, 5.0, 80.0, 90.0], "area": 7200.0, "iscrowd": 0},
        {"id": 3, "image_id": 9, "category_id": 3, "bbox": [0.0, 0.0, 25.0, 30.0], "area": 750.0, "iscrowd": 0},
    ],
    "categories": [{"id": 3, "name": "a"}, {"id": 11, "name": "b"}],
}
LABEL_TO_CATEGORY = (3, 11)


def _outputs_for(gt, scale, pad_example=True):
    """predict_step-like outputs that reproduce `gt` exactly, in network pixels."""
    by_image = {img["id"]: [a for a in gt["annotations"] if a["image_id"] == img["id"]] for img in gt["images"]}
    num = len(gt["images"]) + int(pad_example)
    d = 4
    out = {
        "boxes": np.zeros((num, d, 4), np.float32),
        "scores": np.zeros((num, d), np.float32),
        "classes": np.zeros((num, d), np.int32),
        "valid": np.zeros((num, d), bool),
        "image_id": np.full((num,), -1, np.int32),
        "scale": np.ones((num,), np.float32),
        "original_size": np.zeros((num, 2), np.int32),
        "example_mask": np.zeros((num,), bool),
    }
    for i, img in enumerate(gt["images"]):
        out["image_id"][i], out["scale"][i], out["example_mask"][i] = img["id"], scale, True
        out["original_size"][i] = (img["height"], img["width"])
        for j, ann in enumerate(by_image[img["id"]]):
            x, y, w, h = ann["bbox"]
            out["boxes"][i, j] = np.array([y, x, y + h, x + w]) * scale
            out["scores"][i, j] = 0.9
            out["classes"][i, j] = LABEL_TO_CATEGORY.index(ann["category_id"])
            out["valid"][i, j] = True
    if pad_example:  # a masked padding example with a confident detection must be ignored
        out["valid"][-1, 0] = True
        out["scores"][-1, 0] = 1.0
        out["boxes"][-1, 0] = [0, 0, 10, 10]
    return out


def test_detections_map_back_to_original_pixels_and_category_ids():
    results = coco_evaluation.detections_to_coco(_outputs_for(GROUND_TRUTH, scale=0.64), LABEL_TO_CATEGORY)
    assert len(results) == 3
    first = [r for r in results if r["image_id"] == 7 and r["category_id"] == 3][0]
    np.testing.assert_allclose(first["bbox"], [10.0, 20.0, 60.0, 40.0], atol=1e-3)
    assert {r["category_id"] for r in results} == {3, 11}


def test_perfect_predictions_score_one():
    results = coco_evaluation.detections_to_coco(_outputs_for(GROUND_TRUTH, scale=1.7), LABEL_TO_CATEGORY)
    metrics = coco_evaluation.coco_metrics(GROUND_TRUTH, results)
    assert metrics["AP"] == pytest.approx(1.0)
    assert metrics["AP50"] == pytest.approx(1.0)


def test_wrong_category_scores_zero_and_no_detections_is_zero():
    results = coco_evaluation.detections_to_coco(_outputs_for(GROUND_TRUTH, scale=1.0), (11, 3))
    assert coco_evaluation.coco_metrics(GROUND_TRUTH, results)["AP"] == pytest.approx(0.0)
    assert coco_evaluation.coco_metrics(GROUND_TRUTH, [])["AP"] == 0.0


def test_boxes_are_clipped_to_the_original_image():
    out = _outputs_for(GROUND_TRUTH, scale=1.0, pad_example=False)
    out["boxes"][1, 0] = [-5.0, -5.0, 80.0, 80.0]  # image 9 is 50x50
    results = coco_evaluation.detections_to_coco(out, LABEL_TO_CATEGORY)
    box = [r for r in results if r["image_id"] == 9][0]["bbox"]
    np.testing.assert_allclose(box, [0.0, 0.0, 50.0, 50.0])


def test_predictions_survive_the_trip_to_process_0():
    """What a process sends (`to_bytes`) is what process 0 scores (`from_bytes`), empty or not."""
    results = coco_evaluation.detections_to_coco(_outputs_for(GROUND_TRUTH, scale=0.64), LABEL_TO_CATEGORY)
    sent = coco_evaluation.Predictions(
        coco_evaluation.CocoDetections.from_results(results), np.array([7, 9, 11], np.int64)
    )
    for predictions in (sent, coco_evaluation.Predictions.concatenate([])):
        received = coco_evaluation.Predictions.from_bytes(predictions.to_bytes())
        np.testing.assert_array_equal(received.image_ids, predictions.image_ids)
        for field in ("image_ids", "category_ids", "boxes_xywh", "scores"):
            np.testing.assert_array_equal(getattr(received.detections, field), getattr(predictions.detections, field))
    assert len(sent.detections) == len(results) > 0


@pytest.mark.parametrize("chunk", [1, 2, 1000])
def test_results_file_is_the_results_list(tmp_path, chunk):
    results = coco_evaluation.detections_to_coco(_outputs_for(GROUND_TRUTH, scale=0.64), LABEL_TO_CATEGORY)
    detections = coco_evaluation.CocoDetections.from_results(results)
    coco_evaluation.write_results(tmp_path / "d.json", detections, chunk=chunk)
    assert json.loads((tmp_path / "d.json").read_text()) == coco_evaluation.to_results(detections) == results
    coco_evaluation.write_results(tmp_path / "empty.json", coco_evaluation.CocoDetections.concatenate([]))
    assert json.loads((tmp_path / "empty.json").read_text()) == []


def test_masks_survive_the_trip_to_process_0_and_the_results_file(tmp_path):
    rng = np.random.default_rng(0)
    results = coco_evaluation.detections_to_coco(_outputs_for(GROUND_TRUTH, scale=0.64), LABEL_TO_CATEGORY)
    masks = [rng.random((13, 17)) < 0.3 for _ in results]
    rles = RleMasks.from_coco([mask_utils.encode(np.asfortranarray(m, np.uint8)) for m in masks])
    detections = dataclasses.replace(coco_evaluation.CocoDetections.from_results(results), masks=rles)
    sent = coco_evaluation.Predictions(detections, np.array([7, 9], np.int64))
    received = coco_evaluation.Predictions.from_bytes(sent.to_bytes())
    assert received.detections.masks.to_coco() == rles.to_coco()
    with_masks = coco_evaluation.to_results(detections)
    assert [r["segmentation"] for r in with_masks] == rles.to_coco()
    for result, mask in zip(with_masks, masks):
        np.testing.assert_array_equal(mask_utils.decode(result["segmentation"]), mask)
    coco_evaluation.write_results(tmp_path / "d.json", detections, chunk=2)
    assert json.loads((tmp_path / "d.json").read_text()) == with_masks


def test_predicted_masks_are_pasted_scored_and_evaluated_beside_the_boxes():
    """Mask logits at stride 4 over the padded network image: each detection's mask in original pixels,
    its score Mask DINO's, and mask AP beside box AP when the ground truth has masks."""
    from detector.serving import masks as mask_pasting

    scale, stride = 0.64, 4
    outputs = _outputs_for(GROUND_TRUTH, scale=scale)
    num, d = outputs["scores"].shape
    grid = (20, 36)  # the padded 80 x 144 network input at stride 4
    outputs["image_hw"] = np.zeros((num, 2), np.int32)
    outputs["masks"] = np.full((num, d, *grid), -8.0, np.float32)
    centres_y, centres_x = (np.arange(grid[0]) + 0.5) * stride, (np.arange(grid[1]) + 0.5) * stride
    for i, (height, width) in enumerate(outputs["original_size"]):
        outputs["image_hw"][i] = np.round(np.array([height, width]) * scale)
        for j in range(d):
            y0, x0, y1, x1 = outputs["boxes"][i, j]
            inside = (centres_y[:, None] >= y0) & (centres_y[:, None] < y1) & (centres_x >= x0) & (centres_x < x1)
            outputs["masks"][i, j] = np.where(inside, 8.0, -8.0) + 0.5 * j  # a mask score below 1
    predictions = coco_evaluation.batch_predictions(outputs, LABEL_TO_CATEGORY)
    detections = predictions.detections
    assert len(detections) == 3 and len(detections.masks) == 3
    for k, (row, rank) in enumerate([(0, 0), (0, 1), (1, 0)]):
        logits = outputs["masks"][row, rank][None]
        pasted = mask_pasting.paste_masks(logits, outputs["image_hw"][row], outputs["original_size"][row], stride)
        assert detections.masks.select([k]).to_coco() == pasted.to_coco()
        expected = mask_pasting.mask_scores(outputs["scores"][row, [rank]], logits, outputs["image_hw"][row], stride)
        np.testing.assert_allclose(detections.scores[k], expected, atol=1e-5)
        assert detections.scores[k] < outputs["scores"][row, rank]

    with_segmentations = {
        **GROUND_TRUTH,
        "annotations": [
            {
                **a,
                "segmentation": [
                    [
                        a["bbox"][0],
                        a["bbox"][1],
                        a["bbox"][0] + a["bbox"][2],
                        a["bbox"][1],
                        a["bbox"][0] + a["bbox"][2],
                        a["bbox"][1] + a["bbox"][3],
                        a["bbox"][0],
                        a["bbox"][1] + a["bbox"][3],
                    ]
                ],
            }
            for a in GROUND_TRUTH["annotations"]
        ],
    }
    metrics = coco_evaluation.coco_metrics(with_segmentations, detections)
    assert metrics["AP"] == pytest.approx(1.0) and metrics["mask_AP50"] == pytest.approx(1.0)
    assert 0.5 < metrics["mask_AP"] <= 1.0  # the cells' edges: each mask covers its box to within a cell
    assert "mask_AP" not in coco_evaluation.coco_metrics(GROUND_TRUTH, detections)  # no masks to score against
