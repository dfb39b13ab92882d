"""Every public box function on zero boxes: empty results of the right shape, never an exception.

Images without objects are common (COCO has ~1%, negatives are trained on by
default), and a user's post-processing may see no candidates at all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detector.ops import anchors as anchors_lib
from detector.ops import box_ops, matching, postprocess
from input_pipeline import box_geometry

NONE = np.zeros((0, 4), np.float32)
SOME = np.array([[0, 0, 10, 10], [5, 5, 20, 30]], np.float32)


def test_areas_and_ious_of_no_boxes_are_empty():
    assert box_ops.area(NONE).shape == (0,)
    assert box_ops.pairwise_iou(NONE, SOME).shape == (0, 2)
    assert box_ops.pairwise_iou(SOME, NONE).shape == (2, 0)
    assert box_ops.elementwise_iou(NONE, NONE).shape == (0,)
    assert box_ops.generalized_iou(NONE, NONE).shape == (0,)
    assert box_ops.generalized_iou(NONE[:, None], SOME[None]).shape == (0, 2)


def test_coding_clipping_and_conversions_of_no_boxes_are_empty():
    assert box_ops.encode_boxes(NONE, NONE).shape == (0, 4)
    assert box_ops.decode_boxes(NONE, NONE).shape == (0, 4)
    assert box_ops.clip_boxes(NONE, 10, 10).shape == (0, 4)
    for convert in (box_ops.yxyx_to_xywh, box_ops.xywh_to_yxyx, box_ops.cxcywh_to_yxyx):
        assert convert(NONE).shape == (0, 4)


@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jax"])
def test_box_geometry_of_no_boxes_is_empty(xp):
    boxes = xp.zeros((0, 4), xp.float32)
    assert box_geometry.area(boxes, xp=xp).shape == (0,)
    assert box_geometry.intersection_area(boxes, boxes, xp=xp).shape == (0,)
    assert box_geometry.clip(boxes, 10, 10, xp=xp).shape == (0, 4)
    assert box_geometry.yxyx_to_xywh(boxes, xp=xp).shape == (0, 4)
    assert box_geometry.xywh_to_yxyx(boxes, xp=xp).shape == (0, 4)


@pytest.mark.parametrize("class_aware", [False, True])
def test_nms_of_no_boxes_keeps_nothing(class_aware):
    classes = np.zeros((0,), np.int32) if class_aware else None
    for run in (postprocess.non_max_suppression, jax.jit(postprocess.non_max_suppression, static_argnums=(2, 3))):
        indices, valid = run(NONE, np.zeros((0,), np.float32), 0.5, 5, classes)
        assert indices.shape == (5,) and indices.dtype == jnp.int32
        assert valid.shape == (5,) and not np.any(valid)
    # Boxes that all score -inf are no candidates either.
    some_classes = np.zeros((2,), np.int32) if class_aware else None
    indices, valid = postprocess.non_max_suppression(SOME, np.full((2,), -np.inf, np.float32), 0.5, 3, some_classes)
    assert not np.any(valid)


def test_anchor_assignment_with_no_ground_truth_is_all_background():
    anchors = anchors_lib.generate_anchors(32, 32, 3, 4, 1, (1.0,), 4.0)
    targets = anchors_lib.assign_targets(anchors, NONE, np.zeros((0,), np.int32), np.zeros((0,), bool))
    assert not np.any(targets["positive"]) and not np.any(targets["ignore"])
    assert np.all(targets["labels"] == -1)


def test_matching_with_no_ground_truth_slots_assigns_no_query():
    query_for_gt, gt_for_query = matching.hungarian_assignment(np.zeros((6, 0), np.float32))
    assert query_for_gt.shape == (0,)
    assert gt_for_query.shape == (6,) and np.all(np.asarray(gt_for_query) == -1)
