"""Detector families through `Objective`: DINO's loss (masking, normalisation, rng), config errors, and
RetinaNet's objective behind the same interface."""

from __future__ import annotations

import re
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default, dino_tiny
from detector.errors import ConfigError
from detector.models import families
from detector.models.families import dino as dino_family
from detector.ops import images as images_lib
from detector.ops import losses, matching, postprocess
from input_pipeline import batch as batch_lib

NUM_CLASSES = 4
IMAGE = 64
MAX_BOXES = 4
BOXES = np.array(  # yxyx pixels of a 64x64 input
    [
        [[8, 10, 30, 40], [20, 30, 50, 60], [5, 5, 20, 25], [0, 0, 0, 0]],
        [[30, 2, 60, 20], [10, 40, 25, 62], [0] * 4, [0] * 4],
    ],
    np.float32,
)
BOXES_MASK = np.array([[True, True, True, False], [True, True, False, False]])
LABELS = np.where(BOXES_MASK, np.array([[0, 3, 1, 0], [2, 2, 0, 0]]), -1).astype(np.int32)


def make_batch(seed=0, boxes=BOXES, boxes_mask=BOXES_MASK, labels=LABELS, example_mask=(True, True)):
    """A batch as the input pipeline makes it (input_pipeline/batch.py), random images."""
    examples = [batch_lib.empty_example((IMAGE, IMAGE), MAX_BOXES) for _ in range(2)]
    batch = {key: np.stack([e[key] for e in examples]) for key in batch_lib.KEYS}
    batch["image"] = np.random.default_rng(seed).integers(0, 256, batch["image"].shape, np.uint8)
    batch["image_hw"][:] = IMAGE
    batch["boxes"] = np.where(boxes_mask[..., None], boxes, 0.0).astype(np.float32)
    batch["labels"] = np.where(boxes_mask, labels, -1).astype(np.int32)
    batch["boxes_mask"] = np.asarray(boxes_mask)
    batch["example_mask"] = np.asarray(example_mask)
    for key, spec in batch_lib.batch_spec(2, (IMAGE, IMAGE), MAX_BOXES).items():
        assert batch[key].shape == spec.shape and batch[key].dtype == spec.dtype, key
    return batch


def dino_config():
    config = dino_tiny.get_config()
    config.input.image_size = (IMAGE, IMAGE)
    config.input.max_boxes = MAX_BOXES
    config.model.dino.num_queries = 32
    config.postprocess.max_detections = 20
    return config


@pytest.fixture(scope="module")
def dino():
    config = dino_config()
    model = families.create_model(config, NUM_CLASSES)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, IMAGE, IMAGE, 3)))["params"])
    objective = families.objective(config, model, NUM_CLASSES)
    assert objective.outputs_per_image == "32 queries"
    return types.SimpleNamespace(
        config=config,
        params=params,
        objective=objective,
        loss=jax.jit(objective.loss),
        loss_with=jax.jit(lambda p, b, r, n: objective.loss(p, b, r, normalizer=n)),
    )


DINO_TERMS = {"cls_loss", "box_loss", "encoder_loss", "denoising_loss", "num_positives"}


def scalars(loss, terms):
    return float(loss), {k: float(v) for k, v in terms.items()}


def test_dino_loss_is_finite_positive_and_the_sum_of_its_terms(dino):
    loss, terms = scalars(*dino.loss(dino.params, make_batch(), jax.random.key(1)))
    assert set(terms) == DINO_TERMS
    assert np.isfinite(loss) and loss > 0
    assert all(np.isfinite(v) for v in terms.values())
    assert terms["num_positives"] == BOXES_MASK.sum() == 5
    np.testing.assert_allclose(loss, terms["cls_loss"] + terms["box_loss"], rtol=1e-6)
    assert terms["box_loss"] > 0 and terms["encoder_loss"] > 0 and terms["denoising_loss"] > 0
    # The encoder and denoising parts are inside cls_loss + box_loss, and do not make all of it.
    assert terms["encoder_loss"] + terms["denoising_loss"] < loss


@pytest.mark.slow  # 10-20 s of compiling or real processes
def test_images_without_boxes_and_padded_examples_give_a_finite_loss(dino):
    """Image 0 has no boxes, image 1 is padding (example_mask False): every term is finite, no box is
    counted, and the only loss left is "no object" on image 0's queries."""
    batch = make_batch(boxes_mask=np.zeros_like(BOXES_MASK), example_mask=(True, False))
    loss, terms = scalars(*dino.loss(dino.params, batch, jax.random.key(1)))
    assert np.isfinite(loss) and all(np.isfinite(v) for v in terms.values())
    assert terms["num_positives"] == 0 and terms["box_loss"] == 0 and terms["denoising_loss"] == 0
    assert loss > 0
    # Padding boxes are all-zero: their GIoU and L1 terms must not put NaNs into the gradient either.
    grads = jax.jit(jax.grad(lambda p: dino.objective.loss(p, batch, jax.random.key(1))[0]))(dino.params)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))

    # All examples padded: nothing to learn from, and still finite (no 0 / 0).
    loss, terms = scalars(*dino.loss(dino.params, make_batch(example_mask=(False, False)), jax.random.key(1)))
    assert loss == 0.0 and terms["num_positives"] == 0
    assert all(np.isfinite(v) for v in terms.values())


def test_a_padded_example_does_not_change_the_loss(dino):
    """Example 1 masked out: its image, boxes and labels may be anything."""
    rng = jax.random.key(1)
    first = scalars(*dino.loss(dino.params, make_batch(seed=0, example_mask=(True, False)), rng))
    other_boxes = BOXES.copy()
    other_boxes[1] = [[1, 1, 60, 60], [3, 30, 9, 40], [40, 40, 50, 55], [20, 0, 30, 10]]
    other_labels = LABELS.copy()
    other_labels[1] = [3, 1, 0, 2]
    other_mask = BOXES_MASK.copy()
    other_mask[1] = True
    batch = make_batch(
        seed=7, boxes=other_boxes, boxes_mask=other_mask, labels=other_labels, example_mask=(True, False)
    )
    batch["image"][0] = make_batch(seed=0)["image"][0]  # example 0 unchanged
    second = scalars(*dino.loss(dino.params, batch, rng))
    assert first[1]["num_positives"] == 3
    np.testing.assert_allclose(second[0], first[0], rtol=1e-6)
    for key in DINO_TERMS:
        np.testing.assert_allclose(second[1][key], first[1][key], rtol=1e-6, atol=1e-7, err_msg=key)
    # ... whereas the same change in a real example does change it.
    batch["example_mask"][:] = True
    assert abs(float(dino.loss(dino.params, batch, rng)[0]) - first[0]) > 1e-3


@pytest.mark.slow  # several loss compiles: ~15-20 s
def test_normalizer_one_gives_plain_sums(dino):
    """normalizer=1: every term is the normalised term times the number of boxes (same rng)."""
    batch, rng = make_batch(), jax.random.key(2)
    loss, terms = scalars(*dino.loss(dino.params, batch, rng))
    loss_sum, terms_sum = scalars(*dino.loss_with(dino.params, batch, rng, jnp.float32(1.0)))
    num_boxes = terms["num_positives"]
    assert num_boxes == terms_sum["num_positives"] == 5
    np.testing.assert_allclose(loss_sum, loss * num_boxes, rtol=1e-5)
    for key in ("cls_loss", "box_loss", "encoder_loss", "denoising_loss"):
        np.testing.assert_allclose(terms_sum[key], terms[key] * num_boxes, rtol=1e-5, err_msg=key)
    # Any other normaliser divides the same sums.
    loss_other, _ = scalars(*dino.loss_with(dino.params, batch, rng, jnp.float32(8.0)))
    np.testing.assert_allclose(loss_other, loss_sum / 8.0, rtol=1e-5)


def test_loss_is_deterministic_for_an_rng_and_only_its_denoising_part_depends_on_it(dino):
    batch = make_batch()
    a = scalars(*dino.loss(dino.params, batch, jax.random.key(3)))
    b = scalars(*dino.loss(dino.params, batch, jax.random.key(3)))
    assert a == b
    c = scalars(*dino.loss(dino.params, batch, jax.random.key(4)))
    assert abs(c[1]["denoising_loss"] - a[1]["denoising_loss"]) > 1e-4
    # The matching queries never see the denoising ones, so the rest of the loss is the same.
    np.testing.assert_allclose(c[0] - c[1]["denoising_loss"], a[0] - a[1]["denoising_loss"], rtol=1e-5)
    np.testing.assert_allclose(c[1]["encoder_loss"], a[1]["encoder_loss"], rtol=1e-5)


def test_dino_detect_shapes_and_boxes_in_the_image(dino):
    batch = make_batch()
    out = jax.jit(dino.objective.detect)(dino.params, batch["image"], batch["image_hw"])
    d = dino.config.postprocess.max_detections
    want = {"boxes": ((2, d, 4), jnp.float32), "scores": ((2, d), jnp.float32)}
    want |= {"classes": ((2, d), jnp.int32), "valid": ((2, d), jnp.bool_)}
    assert {k: (v.shape, v.dtype) for k, v in out.items()} == want
    boxes = np.asarray(out["boxes"])
    assert boxes.min() >= 0 and boxes.max() <= IMAGE
    assert np.all(boxes[..., 2:] >= boxes[..., :2])
    assert np.all(np.diff(np.asarray(out["scores"]), axis=-1) <= 0)
    classes = np.asarray(out["classes"])
    assert classes.min() >= 0 and classes.max() < NUM_CLASSES


def test_dino_detect_applies_the_configured_query_nms_and_distinct_selection(dino):
    """postprocess.query_nms_iou_threshold reaches detect as `detect_from_queries`' NMS over pre_nms_top_k
    pairs; model.dino.distinct_query_iou reaches the model (the same parameters serve it)."""
    config = dino_config()
    config.postprocess.query_nms_iou_threshold = 0.3
    config.postprocess.pre_nms_top_k = 50
    config.postprocess.score_threshold = 0.0
    config.model.dino.distinct_query_iou = 0.8
    model = families.create_model(config, NUM_CLASSES)
    assert model.distinct_query_iou == 0.8
    objective = families.objective(config, model, NUM_CLASSES)
    batch = make_batch()
    # Every query's box grown to most of the image, so that queries overlap and NMS has work.
    params = jax.tree.map(lambda x: x, dino.params)
    params["box_head"]["layer2"]["bias"] = jnp.asarray([0.0, 0.0, 6.0, 6.0])
    got = jax.jit(objective.detect)(params, batch["image"], batch["image_hw"])

    @jax.jit  # one program, not hundreds of operations dispatched (and compiled) one by one
    def expected_detections(params, image, image_hw):
        images = images_lib.normalize_images(image, image_hw, config.input.mean_rgb, config.input.std_rgb)
        outputs = model.apply({"params": params}, images)
        return postprocess.detect_from_queries(
            outputs["logits"][-1],
            outputs["boxes"][-1],
            IMAGE,
            IMAGE,
            max_detections=config.postprocess.max_detections,
            score_threshold=0.0,
            nms_iou_threshold=0.3,
            pre_nms_top_k=50,
        )

    want = expected_detections(params, batch["image"], batch["image_hw"])
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-4, err_msg=key)
    plain = jax.jit(dino.objective.detect)(params, batch["image"], batch["image_hw"])
    assert np.asarray(plain["valid"]).all()
    # Overlapping boxes of one class suppress each other: fewer valid detections than the plain top-20.
    assert 0 < np.asarray(got["valid"]).sum() < np.asarray(plain["valid"]).sum()


def test_out_of_range_query_nms_and_distinct_iou_are_config_errors():
    config = dino_config()
    config.postprocess.query_nms_iou_threshold = 1.0
    with pytest.raises(ConfigError, match=r"postprocess\.query_nms_iou_threshold=1\.0; use 0"):
        families.objective(config, families.create_model(config, NUM_CLASSES), NUM_CLASSES)
    config = dino_config()
    config.model.dino.distinct_query_iou = -0.5
    with pytest.raises(ConfigError, match=r"model\.dino\.distinct_query_iou=-0\.5; use 0"):
        families.create_model(config, NUM_CLASSES)


def test_normalized_cxcywh():
    """yxyx pixels of a 64 (high) x 128 (wide) input -> fractions (cx, cy, w, h)."""
    got = dino_family.normalized_cxcywh(jnp.array([[10.0, 20.0, 30.0, 100.0]]), (64, 128))
    np.testing.assert_allclose(got, [[60 / 128, 20 / 64, 80 / 128, 20 / 64]], rtol=1e-6)


def test_unknown_model_name_is_a_config_error():
    config = dino_config()
    config.model.name = "detr"
    with pytest.raises(ConfigError, match=r"model\.name"):
        families.create_model(config, NUM_CLASSES)
    with pytest.raises(ConfigError, match=r"model\.name"):
        families.objective(config, None, NUM_CLASSES)


def test_more_queries_than_proposals_is_a_config_error():
    # 64 px on levels 3..6: 8x8 + 4x4 + 2x2 + 1x1 = 85 positions, all of whose proposals are valid.
    config = dino_config()
    config.model.dino.num_queries = 85
    families.create_model(config, NUM_CLASSES)
    config.model.dino.num_queries = 86
    with pytest.raises(ConfigError, match=r"model\.dino\.num_queries"):
        families.create_model(config, NUM_CLASSES)


@pytest.mark.slow  # compiles the RetinaNet's loss (about 10 s); its parts are tested in the fast tier
def test_retinanet_objective_still_works():
    config = default.get_config()
    assert config.model.name == "retinanet"
    config.input.image_size = (IMAGE, IMAGE)
    config.input.max_boxes = MAX_BOXES
    config.postprocess.max_detections = 10
    config.postprocess.pre_nms_top_k = 50
    model = families.create_model(config, NUM_CLASSES)
    objective = families.objective(config, model, NUM_CLASSES)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, IMAGE, IMAGE, 3)))["params"])
    batch = make_batch()
    loss, terms = jax.jit(objective.loss)(params, batch, jax.random.key(0))
    assert np.isfinite(float(loss)) and float(loss) > 0
    assert {"cls_loss", "box_loss", "num_positives"} <= set(terms)
    assert all(np.isfinite(np.asarray(v)).all() for v in terms.values())
    assert float(terms["num_positives"]) > 0
    out = jax.jit(objective.detect)(params, batch["image"], batch["image_hw"])
    want = {"boxes": ((2, 10, 4), jnp.float32), "scores": ((2, 10), jnp.float32)}
    want |= {"classes": ((2, 10), jnp.int32), "valid": ((2, 10), jnp.bool_)}
    assert {k: (v.shape, v.dtype) for k, v in out.items()} == want
    assert objective.outputs_per_image.endswith("anchors")


def test_loss_and_detect_normalise_on_the_device_and_ignore_the_padding(dino):
    """Both see `normalize_images` of the uint8 batch: padding bytes change nothing, image bytes do."""
    batch = make_batch()
    batch["image_hw"][1] = (40, 50)  # image 1 is padded below and to the right
    rng = jax.random.key(5)
    detect = jax.jit(dino.objective.detect)
    loss = scalars(*dino.loss(dino.params, batch, rng))
    detections = detect(dino.params, batch["image"], batch["image_hw"])

    noisy_padding = {**batch, "image": batch["image"].copy()}
    noisy_padding["image"][1, 40:] = 255 - noisy_padding["image"][1, 40:]
    noisy_padding["image"][1, :, 50:] = 0
    assert scalars(*dino.loss(dino.params, noisy_padding, rng)) == loss
    same = detect(dino.params, noisy_padding["image"], noisy_padding["image_hw"])
    for key in detections:
        np.testing.assert_array_equal(same[key], detections[key], err_msg=key)

    # The same bytes inside the image change both.
    changed = {**batch, "image": batch["image"].copy()}
    changed["image"][1, :40, :50] = 255 - changed["image"][1, :40, :50]
    assert abs(scalars(*dino.loss(dino.params, changed, rng))[0] - loss[0]) > 1e-6
    assert not np.array_equal(
        detect(dino.params, changed["image"], changed["image_hw"])["scores"], detections["scores"]
    )


@pytest.mark.slow  # 10-20 s of compiling or real processes
def test_with_resize_on_device_the_loss_sees_the_resampled_source_pixels(dino):
    """The train step resamples the shipped source (here shifted and mirrored: whole pixels, so exactly) first."""
    from detector.ops.images import resample_images

    config = dino_config()
    config.input.resize_on_device = True
    model = families.create_model(config, NUM_CLASSES)
    loss_on_device = jax.jit(families.objective(config, model, NUM_CLASSES).loss)
    rng = jax.random.key(3)
    shipped = make_batch(seed=4)
    shipped["image"][:, 50:] = 255  # beyond the source: must not leak in
    shipped["image"][:, :, 40:] = 255
    shipped["source_hw"][:] = (50, 40)
    shipped["source_to_image"][:] = (1.0, 1.0, -3.0, -5.0)
    shipped["source_flipped"][:] = (True, False)
    resampled = np.asarray(
        resample_images(shipped["image"], shipped["source_hw"], shipped["source_to_image"], shipped["source_flipped"])
    )
    assert np.abs(resampled[0] - resampled[0, :, ::-1]).max() > 1  # not symmetric: the flip matters
    np.testing.assert_array_equal(resampled[1, :47, :35], shipped["image"][1, 3:50, 5:40])
    on_host = {**shipped, "image": resampled.astype(np.uint8)}  # what the host would have shipped
    got = scalars(*loss_on_device(dino.params, shipped, rng))
    want = scalars(*dino.loss(dino.params, on_host, rng))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    # Without the resample, the same bytes are a different image.
    assert abs(scalars(*dino.loss(dino.params, shipped, rng))[0] - want[0]) > 1e-3


@pytest.mark.slow  # several loss compiles: ~15-20 s
def test_dino_class_loss_option_reaches_every_set_loss(dino):
    """A quality-aware class loss replaces the focal one in the decoder, encoder and denoising terms alike.

    (One of them: both take the same path to `set_prediction_loss`, whose tests check each.)
    """
    batch, rng = make_batch(), jax.random.key(1)

    def terms_with(class_loss):
        config = dino_config()
        config.loss.set_prediction.class_loss = class_loss
        objective = families.objective(config, families.create_model(config, NUM_CLASSES), NUM_CLASSES)
        return scalars(*jax.jit(objective.loss)(dino.params, batch, rng))

    _, focal_terms = terms_with("focal")
    assert dino.config.loss.set_prediction.class_loss == "mal"  # the module's loss, compiled once
    loss, terms = scalars(*dino.loss(dino.params, batch, rng))
    assert np.isfinite(loss) and loss > 0
    # Box terms are the same; every part's class term moved.
    np.testing.assert_allclose(terms["box_loss"], focal_terms["box_loss"], rtol=1e-5)
    assert terms["cls_loss"] != pytest.approx(focal_terms["cls_loss"], rel=1e-3)
    for part in ("encoder_loss", "denoising_loss"):
        assert terms[part] != pytest.approx(focal_terms[part], rel=1e-3), part


@pytest.mark.slow  # several loss compiles: ~15-20 s
def test_one_to_many_loss_is_every_layers_set_loss_against_the_boxes_repeated(dino):
    """H-DETR's branch adds one term and changes no other: per decoder layer, the set loss of the M
    one-to-many queries under an optimal assignment (scipy's) to each box repeated K times, over K n."""
    scipy_optimize = pytest.importorskip("scipy.optimize")
    repeats, count = 3, 24
    config = dino_config()
    config.model.dino.one_to_many_queries, config.model.dino.one_to_many_repeats = count, repeats
    model = families.create_model(config, NUM_CLASSES)
    content = np.random.default_rng(5).standard_normal((count, config.model.dino.hidden_dim), np.float32)
    params = {**dino.params, "one_to_many_content": content}
    batch, rng = make_batch(), jax.random.key(1)
    loss, terms = scalars(*jax.jit(families.objective(config, model, NUM_CLASSES).loss)(params, batch, rng))
    _, plain = scalars(*dino.loss(dino.params, batch, rng))
    assert set(terms) == set(plain) | {"one_to_many_loss"}
    for key in ("encoder_loss", "denoising_loss", "num_positives"):  # what the branch leaves alone
        assert terms[key] == pytest.approx(plain[key], rel=1e-5), key
    branch = terms["cls_loss"] + terms["box_loss"] - (plain["cls_loss"] + plain["box_loss"])
    assert branch == pytest.approx(terms["one_to_many_loss"], rel=1e-4)
    assert loss == pytest.approx(terms["cls_loss"] + terms["box_loss"], rel=1e-6)

    images = images_lib.normalize_images(batch["image"], batch["image_hw"], config.input.mean_rgb, config.input.std_rgb)
    outputs = jax.jit(lambda p, x: model.apply({"params": p}, x, one_to_many=True))(params, images)
    gt_boxes = np.asarray(dino_family.normalized_cxcywh(batch["boxes"], (IMAGE, IMAGE)))
    weights, want = config.loss.set_prediction, 0.0
    num_boxes = repeats * int(BOXES_MASK.sum())
    for logits, boxes in zip(np.asarray(outputs["one_to_many_logits"]), np.asarray(outputs["one_to_many_boxes"])):
        query_to_gt = np.full((2, count), -1, np.int32)
        repeated_boxes = np.zeros((2, repeats * MAX_BOXES, 4), np.float32)
        repeated_labels = np.zeros((2, repeats * MAX_BOXES), np.int32)
        for image in range(2):
            # Copies side by side (the objective tiles them): any optimal assignment gives the same loss.
            real = np.flatnonzero(BOXES_MASK[image]).repeat(repeats)
            repeated_boxes[image, : len(real)] = gt_boxes[image, real]
            repeated_labels[image, : len(real)] = LABELS[image, real]
            cost = matching.dino_matching_cost(
                logits[image],
                boxes[image],
                repeated_labels[image, : len(real)],
                repeated_boxes[image, : len(real)],
                class_weight=weights.match_class_weight,
                l1_weight=weights.match_l1_weight,
                giou_weight=weights.match_giou_weight,
                focal_alpha=config.loss.focal_alpha,
                focal_gamma=config.loss.focal_gamma,
            )
            rows, columns = scipy_optimize.linear_sum_assignment(np.asarray(cost))
            query_to_gt[image, rows] = columns
        total, _ = losses.set_prediction_loss(
            logits,
            boxes,
            repeated_labels,
            repeated_boxes,
            query_to_gt,
            num_boxes=num_boxes,
            class_weight=weights.class_weight,
            l1_weight=weights.l1_weight,
            giou_weight=weights.giou_weight,
            class_loss=weights.class_loss,
            mal_gamma=weights.mal_gamma,
        )
        want += float(total)
    assert terms["one_to_many_loss"] == pytest.approx(weights.one_to_many_weight * want, rel=1e-4)


def test_one_to_many_queries_that_cannot_hold_the_repeated_boxes_are_a_config_error():
    config = dino_config()
    config.model.dino.one_to_many_queries, config.model.dino.one_to_many_repeats = 23, 6  # 6 x 4 boxes = 24
    with pytest.raises(ConfigError, match=r"one_to_many_queries=23.*at least 24"):
        families.create_model(config, NUM_CLASSES)
    config.model.dino.one_to_many_queries = 54  # 32 + 54 > 85 proposals of a 64 px input
    with pytest.raises(ConfigError, match=r"one_to_many_queries=54.*85 encoder proposals"):
        families.create_model(config, NUM_CLASSES)
    config.model.dino.one_to_many_queries, config.model.dino.one_to_many_repeats = 24, 0
    with pytest.raises(ConfigError, match=r"one_to_many_repeats=0"):
        families.create_model(config, NUM_CLASSES)


@pytest.mark.slow  # 10-20 s of compiling or real processes
def test_the_one_to_many_branch_leaves_the_exported_detection_program_unchanged(dino):
    """Training-only: with the branch on, the same parameters export the same program, byte for byte."""
    config = dino_config()
    config.model.dino.one_to_many_queries, config.model.dino.one_to_many_repeats = 24, 6
    content = np.ones((24, config.model.dino.hidden_dim), np.float32)
    inputs = (jax.ShapeDtypeStruct((2, IMAGE, IMAGE, 3), jnp.uint8), jax.ShapeDtypeStruct((2, 2), jnp.int32))

    def exported(config, params):
        objective = families.objective(config, families.create_model(config, NUM_CLASSES), NUM_CLASSES)
        return jax.export.export(jax.jit(lambda images, image_hw: objective.detect(params, images, image_hw)))(*inputs)

    off = exported(dino_config(), dino.params)
    on = exported(config, {**dino.params, "one_to_many_content": content})
    assert (on.in_avals, on.out_avals) == (off.in_avals, off.out_avals)

    def program(exported):  # source locations aside
        text = re.sub(r"\s*loc\((#loc\d*|unknown)\)", "", exported.mlir_module())
        return [line for line in text.splitlines() if not line.startswith("#loc")]

    assert len(program(off)) > 100 and program(on) == program(off)
    batch = make_batch()
    detections = on.call(batch["image"], batch["image_hw"])
    for key, value in off.call(batch["image"], batch["image_hw"]).items():
        np.testing.assert_array_equal(np.asarray(detections[key]), np.asarray(value), err_msg=key)
