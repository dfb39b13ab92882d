"""Mask DINO's objective: mask terms in the matching and the set loss of every set of queries, boxes without
masks trained as before, points that follow the image and not its batch position, and config errors."""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import input_pipeline
from detector.errors import ConfigError
from detector.models import families
from tests.helpers.runs import once_per_run
from tests.helpers.tiny_config import make_dino_config

NUM_CLASSES = 4
MASKS = {"model.dino.mask_dim": 8, "input.mask_stride": 4, "loss.set_prediction.mask_points": 64}


def _config(data_dir, **overrides):
    return make_dino_config(data_dir, **{**MASKS, **overrides})  # mosaics too: the 32 px tiles hold 8 x 8 cells


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    data_dir = once_per_run(
        tmp_path_factory, "data", lambda path: input_pipeline.get_dataset_info(make_dino_config(path))
    )
    config = _config(data_dir)
    batch = next(input_pipeline.create_train_iterator(config))
    model = families.create_model(config, NUM_CLASSES)
    objective = families.objective(config, model, NUM_CLASSES)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, *config.input.image_size, 3)))["params"]
    params = flax.linen.meta.unbox(params)
    loss = jax.jit(jax.value_and_grad(objective.loss, has_aux=True))
    return data_dir, config, batch, params, loss


@pytest.mark.slow  # compiles DINO's loss and gradient with the mask branch (about 20 s)
def test_every_set_of_queries_gets_mask_terms_that_train_the_mask_branch(setup):
    _, _, batch, params, loss = setup
    (total, terms), gradients = loss(params, batch, jax.random.key(1))
    assert batch["masks_valid"].sum() > 0
    for key in ("mask_loss", "dice_loss"):
        assert np.isfinite(terms[key]) and terms[key] > 0, terms
    np.testing.assert_allclose(
        total, terms["cls_loss"] + terms["box_loss"] + terms["mask_loss"] + terms["dice_loss"], rtol=1e-6
    )
    flat = flax.traverse_util.flatten_dict(gradients, sep="/")
    for part in ("pixel_embedding", "mask_head", "backbone/stage1"):
        assert sum(float(np.square(v).sum()) for k, v in flat.items() if part in k) > 0, part

    # A batch whose images come in another order: the same images, points and noise, so the same loss.
    order = np.array([3, 1, 0, 2, 7, 6, 5, 4])
    shuffled = {key: value[order] for key, value in batch.items()}
    (shuffled_total, shuffled_terms), _ = loss(params, shuffled, jax.random.key(1))
    for key in ("mask_loss", "dice_loss", "cls_loss", "box_loss"):
        np.testing.assert_allclose(shuffled_terms[key], terms[key], rtol=2e-5, err_msg=key)


@pytest.mark.slow  # compiles the mask-free DINO's loss too (about 20 s)
def test_boxes_without_masks_train_as_a_box_only_dino(setup):
    data_dir, config, batch, params, loss = setup
    box_only = {**batch, "masks_valid": np.zeros_like(batch["masks_valid"])}
    (_, terms), _ = loss(params, box_only, jax.random.key(1))
    assert terms["mask_loss"] == 0 and terms["dice_loss"] == 0

    plain_config = make_dino_config(data_dir)
    plain_model = families.create_model(plain_config, NUM_CLASSES)
    plain = families.objective(plain_config, plain_model, NUM_CLASSES)
    shared = {k: v for k, v in params.items() if k not in ("pixel_embedding", "mask_head")}
    plain_batch = {k: v for k, v in batch.items() if k not in ("masks", "masks_valid")}
    _, plain_terms = jax.jit(plain.loss)(shared, plain_batch, jax.random.key(1))
    # The same matches and losses: a slot without a mask adds nothing to the cost or the loss.
    for key in ("cls_loss", "box_loss", "encoder_loss", "denoising_loss", "one_to_many_loss"):
        np.testing.assert_allclose(terms[key], plain_terms[key], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"input.mask_stride": 8}, r"input\.mask_stride=4 \(it is 8\)"),
        ({"loss.set_prediction.mask_points": 0}, r"mask_points=0; use a whole number >= 1"),
        ({"loss.set_prediction.mask_importance_ratio": 1.5}, r"importance_sample_ratio=1\.5 must be in \[0, 1\]"),
    ],
    ids=["stride", "points", "importance"],
)
def test_bad_mask_settings_are_one_config_error(tmp_path, overrides, message):
    config = _config(tmp_path, **overrides)
    with pytest.raises(ConfigError, match=message) as error:
        model = families.create_model(config, NUM_CLASSES)
        families.objective(config, model, NUM_CLASSES)
    assert "\n" not in str(error.value)
