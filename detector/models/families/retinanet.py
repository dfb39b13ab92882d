"""The RetinaNet family: dense anchors, a focal loss over anchors matched by IoU, NMS at inference.

The network is `detector.models.retinanet`; this module builds it from the
config and gives the steps its `Objective`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from detector.models import retinanet
from detector.models.families.objective import Objective
from detector.ops import anchors as anchors_lib
from detector.ops import losses, postprocess


def anchors_for_config(config) -> np.ndarray:
    """`[A, 4]` yxyx anchors in network-input pixels for `config.input.image_size` (RetinaNet)."""
    a = config.model.anchors
    height, width = config.input.image_size
    return anchors_lib.generate_anchors(
        height, width, a.min_level, a.max_level, a.num_scales, tuple(a.aspect_ratios), a.anchor_size
    )


def num_anchors_per_location(config) -> int:
    a = config.model.anchors
    return anchors_lib.num_anchors_per_location(a.num_scales, tuple(a.aspect_ratios))


def create(config, num_classes: int, *, data_parallel_devices: int = 1) -> nn.Module:
    """The RetinaNet of `config.model` (see `detector.models.families.create_model`)."""
    return retinanet.create_model(
        config.model, num_classes, num_anchors_per_location(config), data_parallel_devices=data_parallel_devices
    )


def objective(config, model: nn.Module, num_classes: int) -> Objective:
    anchors = anchors_for_config(config)
    loss_config = config.loss
    height, width = config.input.image_size
    box_coder_weights = tuple(loss_config.box_coder_weights)

    def loss(params, batch, rng=None, normalizer=None):
        del rng  # deterministic
        cls_logits, box_deltas = model.apply({"params": params}, batch["image"])
        with jax.named_scope("loss"):
            return losses.retinanet_loss(
                cls_logits,
                box_deltas,
                jnp.asarray(anchors),
                batch["boxes"],
                batch["labels"],
                batch["boxes_mask"],
                num_classes=num_classes,
                positive_iou=loss_config.positive_iou,
                negative_iou=loss_config.negative_iou,
                allow_low_quality_matches=loss_config.allow_low_quality_matches,
                focal_alpha=loss_config.focal_alpha,
                focal_gamma=loss_config.focal_gamma,
                box_loss=loss_config.box_loss,
                huber_delta=loss_config.huber_delta,
                box_loss_weight=loss_config.box_loss_weight,
                box_coder_weights=box_coder_weights,
                example_mask=batch["example_mask"],
                normalizer=normalizer,
            )

    def detect(params, images):
        cls_logits, box_deltas = model.apply({"params": params}, images)
        post = config.postprocess
        return postprocess.detect(
            cls_logits,
            box_deltas,
            jnp.asarray(anchors),
            height,
            width,
            pre_nms_top_k=post.pre_nms_top_k,
            score_threshold=post.score_threshold,
            iou_threshold=post.iou_threshold,
            max_detections=post.max_detections,
            box_coder_weights=box_coder_weights,
        )

    return Objective(loss=loss, detect=detect, outputs_per_image=f"{anchors.shape[0]} anchors")
