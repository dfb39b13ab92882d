"""Mask DINO's mask branch on the DINO decoder: shapes of every segment, gradients into the maps it reads,
parameters only when asked for, and a ViT's one map brought to stride 4 by ViTDet's transposed convolutions."""

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


def test_a_vit_backbone_gets_its_stride_4_map_from_transposed_convolutions():
    from configs import dino_dinov3_tiny

    config = dino_dinov3_tiny.get_config()
    config.model.dino.mask_dim = MASK_DIM
    config.input.mask_stride = mask_branch.STRIDE
    model = families.create_model(config, NUM_CLASSES)
    images = jnp.zeros((1, 128, 128, 3))
    variables = jax.eval_shape(model.init, jax.random.key(0), images)
    names = flatten_dict(nn.meta.unbox(variables["params"]), sep="/")
    # The ViT's stride-16 map, 64 wide, up twice: 32 then 16 channels, as ViTDet's P2.
    assert names["mask_stride4_up0/kernel"].shape == (2, 2, 64, 32)
    assert names["mask_stride4_up1/kernel"].shape == (2, 2, 32, 16)
    assert "mask_stride4_up_norm1/scale" in names
    outputs = jax.eval_shape(model.apply, variables, images)
    assert outputs["pixel_embedding"].shape == (1, 32, 32, MASK_DIM)


def test_mask_enhanced_anchors_start_the_queries_from_their_proposals_masks(masked):
    model, params, images, _, _ = masked
    enhanced = model.clone(mask_enhanced_anchors=True)

    def outputs_of(network):
        return jax.jit(lambda p: {k: network.apply({"params": p}, images)[k] for k in ("boxes", "encoder_boxes")})

    plain, with_masks = outputs_of(model), outputs_of(enhanced)  # the same parameters: the option adds none
    assert not np.allclose(with_masks(params)["boxes"], plain(params)["boxes"], atol=1e-4)
    np.testing.assert_array_equal(with_masks(params)["encoder_boxes"], plain(params)["encoder_boxes"])
    # Where every proposal's mask is empty (a zero pixel embedding), each query keeps its proposal's box.
    silent = jax.tree.map(lambda x: x, params)
    features = params["pixel_embedding"]["mask_features"]
    silent["pixel_embedding"]["mask_features"] = jax.tree.map(jnp.zeros_like, features)
    np.testing.assert_allclose(with_masks(silent)["boxes"], plain(silent)["boxes"], atol=1e-6)


def test_mask_enhanced_anchors_need_the_mask_branch():
    config = tiny_config()
    config.model.dino.mask_enhanced_anchors = True
    with pytest.raises(
        ConfigError, match=r"mask_enhanced_anchors=True starts the queries .* set model\.dino\.mask_dim"
    ):
        families.create_model(config, NUM_CLASSES)
