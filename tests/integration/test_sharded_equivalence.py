"""Sharding changes placement, never results: ViT, DINO and spatially partitioned detectors.

Three SGD steps from the same parameters on the same batches, on one device
and on a mesh, through the trainer's compiled step.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import dino_tiny, vitdet_tiny
from detector.models import families
from tests.helpers.sharded_training import NUM_CLASSES, assert_same_training, spatial_config, train_on_mesh

pytestmark = pytest.mark.slow


def random_batch(config, seed: int) -> dict[str, np.ndarray]:
    """A global batch shaped like the pipeline's: a few random boxes per image."""
    rng = np.random.default_rng(seed)
    b, (h, w), m = config.global_batch_size, config.input.image_size, config.input.max_boxes
    corners = rng.uniform(0, h * 0.6, size=(b, m, 2))
    sizes = rng.uniform(h * 0.1, h * 0.4, size=(b, m, 2))
    boxes = np.concatenate([corners, corners + sizes], axis=-1).astype(np.float32)
    boxes_mask = np.arange(m)[None, :] < rng.integers(1, 4, size=(b, 1))
    image_hw = np.stack([rng.integers(h // 2, h + 1, size=b), np.full(b, w)], -1).astype(np.int32)
    return {
        "image": rng.integers(0, 256, size=(b, h, w, 3), dtype=np.uint8),
        "image_hw": image_hw,
        # Resized on the host: the identity geometry.
        "source_hw": image_hw,
        "source_to_image": np.tile(np.float32([1, 1, 0, 0]), (b, 1)),
        "source_flipped": np.zeros((b,), bool),
        "boxes": np.where(boxes_mask[..., None], boxes, 0).astype(np.float32),
        "labels": np.where(boxes_mask, rng.integers(0, NUM_CLASSES, size=(b, m)), -1).astype(np.int32),
        "boxes_mask": boxes_mask,
        "image_id": np.arange(b, dtype=np.int32),
        "scale": np.ones((b,), np.float32),
        "original_size": np.full((b, 2), h, np.int32),
        "example_mask": np.ones((b,), bool),
    }


def check_sharded_training(config, mesh_shape, expected_axes):
    """Three SGD steps on one device and on `mesh_shape` give the same losses and parameters.

    SGD: Adam's first updates are +-lr whatever the gradient's size, which
    would turn rounding-level gradient differences into lr-sized ones.
    """
    config.optimizer.name = "sgd"
    config.optimizer.learning_rate = 0.05
    config.optimizer.warmup_steps = 0
    config.total_steps = 3
    # Both runs pack the head's levels, as training on a data-parallel mesh does
    # ("auto"), so they differ only in how the work is split.
    config.model.head_level_packing = "always"
    model = families.create_model(config, NUM_CLASSES)
    initial = jax.device_get(
        flax.linen.meta.unbox(
            jax.jit(lambda r: model.init(r, jnp.zeros((1, *config.input.image_size, 3))))(jax.random.key(0))["params"]
        )
    )
    batches = [random_batch(config, seed) for seed in range(3)]
    reference = train_on_mesh(config, (1, 1, 1), initial, batches, NUM_CLASSES)
    sharded = train_on_mesh(config, mesh_shape, initial, batches, NUM_CLASSES)
    for axis in expected_axes:  # the parameters really are split over these axes
        assert any(f"'{axis}'" in spec for spec in sharded.param_specs.values()), sharded.param_specs
    assert_same_training(reference, sharded, flax.traverse_util.flatten_dict(initial, sep="/"))


def test_vit_detector_trains_identically_on_a_2x2x2_mesh():
    config = vitdet_tiny.get_config()
    config.global_batch_size = 4
    check_sharded_training(config, (2, 2, 2), expected_axes=("fsdp", "model"))


def test_spatial_partitioning_trains_identically():
    config = spatial_config(128)
    config.global_batch_size = 4
    check_sharded_training(config, (2, 1, 2), expected_axes=())


def test_dino_trains_identically_on_a_2x2x2_mesh():
    """Matching, denoising and deformable attention with heads, FFN and widths split: same as one device."""
    config = dino_tiny.get_config()
    config.global_batch_size = 4
    check_sharded_training(config, (2, 2, 2), expected_axes=("fsdp", "model"))
