"""Random training batches laid out as input_pipeline.batch defines, for benchmarks (numpy only: no JAX, no TF)."""

from __future__ import annotations

import numpy as np

from input_pipeline import batch as batch_layout

BOXES_PER_IMAGE = 7  # COCO's average


def random_batch(
    config, num_classes: int, seed: int = 0, boxes_per_image: int = BOXES_PER_IMAGE
) -> dict[str, np.ndarray]:
    """One global batch of `config`: random uint8 images `[B, H, W, 3]` filling the frame, yxyx pixel boxes,
    labels, masks."""
    rng = np.random.default_rng(seed)
    b = config.global_batch_size
    height, width = config.input.image_size
    max_boxes = config.input.max_boxes
    mask_grid_hw = batch_layout.training_mask_grid(config.input)
    spec = batch_layout.batch_spec(b, batch_layout.training_image_size(config.input), max_boxes, mask_grid_hw)
    k = min(boxes_per_image, max_boxes)
    corners = rng.uniform(0.0, 1.0, size=(b, k, 2, 2)) * np.array([height, width])
    boxes = np.zeros(spec["boxes"].shape, spec["boxes"].dtype)
    boxes[:, :k, :2] = corners.min(axis=2)
    # At least 8 px on each side: every box gets positive anchors.
    boxes[:, :k, 2:] = np.minimum(np.maximum(corners.max(axis=2), corners.min(axis=2) + 8.0), [height, width])
    mask = np.arange(max_boxes)[None].repeat(b, 0) < k
    labels = np.where(mask, rng.integers(0, num_classes, size=(b, max_boxes)), -1)
    values = {
        "image": rng.integers(0, 256, size=spec["image"].shape),
        "image_hw": np.broadcast_to((height, width), spec["image_hw"].shape),
        # The identity: the pixels are the network image (with input.resize_on_device the step still resamples them).
        "source_hw": np.broadcast_to((height, width), spec["source_hw"].shape),
        "source_to_image": np.broadcast_to(batch_layout.IDENTITY_GEOMETRY, spec["source_to_image"].shape),
        "source_flipped": np.zeros(b, bool),
        "boxes": boxes,
        "labels": labels,
        "boxes_mask": mask,
        "image_id": np.arange(b),
        "scale": np.ones(b),
        "original_size": np.broadcast_to((height, width), spec["original_size"].shape),
        "example_mask": np.ones(b, bool),
    }
    if mask_grid_hw is not None:  # each box's mask: the cells whose centres its box holds
        stride = config.input.mask_stride
        rows = (np.arange(mask_grid_hw[0]) + 0.5) * stride
        columns = (np.arange(mask_grid_hw[1]) + 0.5) * stride
        inside_rows = (rows >= boxes[..., 0, None]) & (rows < boxes[..., 2, None])
        inside_columns = (columns >= boxes[..., 1, None]) & (columns < boxes[..., 3, None])
        cells = inside_rows[..., :, None] & inside_columns[..., None, :] & mask[..., None, None]
        values["masks"] = np.packbits(cells, axis=-1)
        values["masks_valid"] = mask
    return {key: np.array(values[key], dtype=dtype) for key, (_, dtype) in spec.items()}
