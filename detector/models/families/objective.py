"""What the train and predict steps need of a detector family: `Objective`, pure functions of (params, batch)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class Objective:
    """What the steps need of a family, as pure functions.

    loss: `(params, batch, rng, normalizer=None) -> (loss, terms)`. Terms
      hold float32 scalars `cls_loss`, `box_loss` (parts of the loss) and
      `num_positives` (the count the loss is divided by), and maybe more
      parts. With `normalizer` the sums are divided by it instead (1: plain
      sums, for gradient accumulation over micro-batches).
    detect: `(params, images, image_hw) -> dict` of boxes float32
      `[B, D, 4]` yxyx in network-input pixels, scores `[B, D]`, classes
      int32 `[B, D]` and valid bool `[B, D]`; D = `postprocess.max_detections`.
      Images are the batch's uint8 `[B, H, W, 3]`, image_hw its int32
      `[B, 2]` (see input_pipeline.batch): both functions normalise on the device.
    outputs_per_image: anchors or queries, for logs.
    network: `(params, images, image_hw) -> outputs` of the network `detect`
      runs, before any post-processing (a pytree of arrays: RetinaNet's class
      logits and box deltas, DINO's per-layer logits and boxes), for checking
      an exported program's network against this one; None where a family's
      own objective is not wrapped by `families.objective`.
    """

    loss: Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
    detect: Callable[[Any, jax.Array, jax.Array], dict[str, jax.Array]]
    outputs_per_image: str
    network: Callable[[Any, jax.Array, jax.Array], Any] | None = None
