"""Mask DINO's mask branch on the DINO decoder: shapes of every segment, gradients into the maps it reads,
parameters only when asked for, and a backbone without stride-4 features refused in one line."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from detector.errors import ConfigError
from detector.models import families, mask_branch
from tests.detector.models.test_dino import BATCH, IMAGE, NUM_CLASSES, NUM_QUERIES, denoising_inputs, tiny_config

MASK_DIM = 8


@pytest.fixture(scope="module")
def masked():
    config = tiny_config()
    config.model.dino.one_to_many_queries = 24
    model = families.create_model(config, NUM_CLASSES).clone(mask_dim=MASK_DIM)
    images = jax.random.normal(jax.random.key(1), (BATCH, IMAGE, IMAGE, 3))
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), images)["params"])
    denoising = denoising_inputs(config.model.dino.denoising_pairs)
    apply = jax.jit(lambda p: model.apply({"params": p}, images, denoising, one_to_many=True))
    return model, params, images, denoising, apply


def test_every_segment_gets_mask_embeddings_and_the_map_is_at_stride_4(masked):
    model, params, _, denoising, apply = masked
    outputs = apply(params)
    layers = model.num_decoder_layers
    num_denoising = denoising["labels"].shape[1]
    assert outputs["pixel_embedding"].shape == (BATCH, IMAGE // 4, IMAGE // 4, MASK_DIM)
    assert outputs["mask_embeddings"].shape == (layers, BATCH, NUM_QUERIES, MASK_DIM)
    assert outputs["denoising_mask_embeddings"].shape == (layers, BATCH, num_denoising, MASK_DIM)
    assert outputs["one_to_many_mask_embeddings"].shape == (layers, BATCH, 24, MASK_DIM)
    assert outputs["encoder_mask_embeddings"].shape == (BATCH, NUM_QUERIES, MASK_DIM)
    for key in ("pixel_embedding", "mask_embeddings", "encoder_mask_embeddings"):
        assert np.isfinite(np.asarray(outputs[key])).all() and np.asarray(outputs[key]).std() > 0, key
    logits = mask_branch.mask_logits(outputs["mask_embeddings"], outputs["pixel_embedding"])
    assert logits.shape == (layers, BATCH, NUM_QUERIES, IMAGE // 4, IMAGE // 4)
    expected = np.einsum(
        "kbnc,bhwc->kbnhw", np.asarray(outputs["mask_embeddings"]), np.asarray(outputs["pixel_embedding"])
    )
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)


def test_mask_logits_train_the_pixel_decoder_the_mask_head_the_encoder_and_the_stride_4_stage(masked):
    model, params, images, denoising, _ = masked

    def loss(p):
        outputs = model.apply({"params": p}, images, denoising, one_to_many=True)
        logits = mask_branch.mask_logits(outputs["mask_embeddings"][-1], outputs["pixel_embedding"])
        return jnp.mean(jax.nn.sigmoid(logits))

    gradients = flatten_dict(jax.jit(jax.grad(loss))(params), sep="/")
    norm = {}
    for name, value in gradients.items():
        for part in ("pixel_embedding", "mask_head", "encoder0", "backbone/stage1", "class_head"):
            if part in name:
                norm[part] = norm.get(part, 0.0) + float(np.square(np.asarray(value)).sum())
    assert norm["pixel_embedding"] > 0 and norm["mask_head"] > 0 and norm["encoder0"] > 0, norm
    assert norm["backbone/stage1"] > 0, norm  # the stride-4 map the pixel embedding reads
    assert norm.get("class_head", 0.0) == 0.0  # the class head is no part of a mask


def test_without_masks_the_model_and_its_parameters_are_dinos():
    config = tiny_config()
    model = families.create_model(config, NUM_CLASSES)
    images = jnp.zeros((1, IMAGE, IMAGE, 3))
    shapes = jax.eval_shape(model.init, jax.random.key(0), images)["params"]
    names = set(flatten_dict(nn.meta.unbox(shapes), sep="/"))
    assert not any("pixel_embedding" in n or "mask_head" in n for n in names)
    outputs = jax.eval_shape(lambda: model.apply(model.init(jax.random.key(0), images), images))
    assert not any("mask" in key or "pixel" in key for key in outputs)


def test_a_backbone_without_stride_4_features_is_one_config_error():
    class Stride8Backbone(nn.Module):
        @nn.compact
        def __call__(self, images):
            x = nn.Conv(8, (3, 3), strides=(8, 8))(images)
            return {3: x, 4: nn.Conv(8, (3, 3), strides=(2, 2))(x), 5: nn.Conv(8, (3, 3), strides=(4, 4))(x)}

    model = families.create_model(tiny_config(), NUM_CLASSES).clone(backbone=Stride8Backbone(), mask_dim=MASK_DIM)
    with pytest.raises(ConfigError, match=r"stride-4 features \(level 2\).*levels \[3, 4, 5\]") as error:
        jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, IMAGE, IMAGE, 3)))
    assert "\n" not in str(error.value)
