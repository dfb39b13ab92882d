"""The DINO family: queries matched one-to-one (Hungarian) with set losses on every decoder layer, the
encoder proposals, contrastive denoising groups and the hybrid one-to-many branch; top-k without NMS.

The network is `detector.models.dino`; this module builds it from the
config and gives the steps its `Objective`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from detector.errors import ConfigError
from detector.models import retinanet
from detector.models.dino import Dino, encoder_proposals
from detector.models.families.objective import Objective
from detector.models.necks import ChannelMapper, SimpleFeaturePyramid
from detector.ops import denoising, losses, matching, postprocess


def create(config, num_classes: int, *, data_parallel_devices: int = 1) -> Dino:
    """DINO from `config.model` (backbone, dtype, remat) and `config.model.dino`; it reduces no gradients of its
    own, so `data_parallel_devices` changes nothing."""
    del data_parallel_devices
    model_config, dino = config.model, config.model.dino
    dtype = retinanet.compute_dtype(model_config)
    if dino.hidden_dim % dino.num_heads or (dino.hidden_dim // dino.num_heads) % 2:
        raise ConfigError(
            f"model.dino.hidden_dim={dino.hidden_dim} must split into num_heads={dino.num_heads} heads of an even width"
        )
    num_levels = dino.max_level - dino.min_level + 1
    if dino.min_level < 2 or num_levels < 1:
        raise ConfigError(f"model.dino levels {dino.min_level}..{dino.max_level}; use e.g. 3..6 (4 scales)")
    height, width = config.input.image_size
    shapes = [(-(-height // 2**level), -(-width // 2**level)) for level in range(dino.min_level, dino.max_level + 1)]
    one_to_many, repeats = dino.one_to_many_queries, dino.one_to_many_repeats
    for key, value in (("one_to_many_queries", one_to_many), ("one_to_many_repeats", repeats)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"model.dino.{key}={value!r}; use a whole number >= 0")
    if one_to_many and one_to_many < repeats * config.input.max_boxes:
        raise ConfigError(
            f"model.dino.one_to_many_queries={one_to_many} cannot take one_to_many_repeats={repeats} copies of "
            f"input.max_boxes={config.input.max_boxes} boxes; use at least {repeats * config.input.max_boxes} "
            "queries or fewer repeats"
        )
    if one_to_many and repeats < 1:
        raise ConfigError("model.dino.one_to_many_repeats=0 with one_to_many_queries > 0; use at least 1 (H-DETR: 6)")
    selectable = int(encoder_proposals(shapes)[1].sum())
    if dino.num_queries + one_to_many > selectable:
        raise ConfigError(
            f"model.dino.num_queries={dino.num_queries} + one_to_many_queries={one_to_many}, but {height}x{width} "
            f"inputs give only {selectable} encoder proposals on levels {dino.min_level}..{dino.max_level}; "
            "use fewer queries or larger images"
        )
    if not 0.0 <= dino.distinct_query_iou < 1.0:
        raise ConfigError(
            f"model.dino.distinct_query_iou={dino.distinct_query_iou!r}; use 0 (off) or an IoU in (0, 1) (DDQ: 0.8)"
        )
    backbone = retinanet.create_backbone(model_config, dtype)
    levels = dict(min_level=dino.min_level, max_level=dino.max_level, dtype=dtype)
    if model_config.backbone.name == "resnet":
        neck = ChannelMapper(dino.hidden_dim, **levels)
    else:
        neck = SimpleFeaturePyramid(dino.hidden_dim, **levels)
    return Dino(
        backbone=backbone,
        neck=neck,
        num_classes=num_classes,
        hidden_dim=dino.hidden_dim,
        num_heads=dino.num_heads,
        ffn_dim=dino.ffn_dim,
        num_encoder_layers=dino.encoder_layers,
        num_decoder_layers=dino.decoder_layers,
        num_points=dino.num_points,
        num_queries=dino.num_queries,
        num_one_to_many_queries=one_to_many,
        distinct_query_iou=dino.distinct_query_iou,
        remat=model_config.remat,
        dtype=dtype,
    )


def normalized_cxcywh(boxes_yxyx: jax.Array, image_size: tuple[int, int]) -> jax.Array:
    """`[..., 4]` yxyx pixels -> (cx, cy, w, h) as fractions of the `(height, width)` network input."""
    height, width = image_size
    y0, x0, y1, x1 = (boxes_yxyx[..., i].astype(jnp.float32) for i in range(4))
    return jnp.stack([(x0 + x1) / (2 * width), (y0 + y1) / (2 * height), (x1 - x0) / width, (y1 - y0) / height], -1)


def objective(config, model: nn.Module, num_classes: int) -> Objective:
    dino, loss_config = config.model.dino, config.loss
    weights = loss_config.set_prediction
    image_size = tuple(config.input.image_size)
    pairs = dino.denoising_pairs
    one_to_many, repeats = dino.one_to_many_queries, dino.one_to_many_repeats
    focal = dict(focal_alpha=loss_config.focal_alpha, focal_gamma=loss_config.focal_gamma)
    if weights.class_loss not in losses.CLASS_LOSSES:
        raise ConfigError(
            f"loss.set_prediction.class_loss={weights.class_loss!r}; use one of {', '.join(losses.CLASS_LOSSES)}"
        )
    loss_weights = dict(
        class_weight=weights.class_weight,
        l1_weight=weights.l1_weight,
        giou_weight=weights.giou_weight,
        class_loss=weights.class_loss,
        varifocal_alpha=weights.varifocal_alpha,
        varifocal_gamma=weights.varifocal_gamma,
        mal_gamma=weights.mal_gamma,
    )
    match_weights = dict(
        class_weight=weights.match_class_weight,
        l1_weight=weights.match_l1_weight,
        giou_weight=weights.match_giou_weight,
        **focal,
    )
    max_detections = config.postprocess.max_detections
    if max_detections > dino.num_queries * num_classes:
        raise ConfigError(
            f"postprocess.max_detections={max_detections} exceeds model.dino.num_queries x classes = "
            f"{dino.num_queries} x {num_classes}; lower it or use more queries"
        )
    query_nms = config.postprocess.query_nms_iou_threshold
    if not 0.0 <= query_nms < 1.0:
        raise ConfigError(
            f"postprocess.query_nms_iou_threshold={query_nms!r}; use 0 (no NMS, DINO's own output) or an IoU in "
            "(0, 1), e.g. 0.7"
        )
    if not isinstance(pairs, int) or isinstance(pairs, bool) or pairs < 0:
        raise ConfigError(f"model.dino.denoising_pairs={pairs!r}; use a whole number >= 0 (0: no denoising)")

    def set_loss(logits, boxes, labels, gt_boxes, query_to_gt, num_boxes, query_weight):
        return losses.set_prediction_loss(
            logits,
            boxes,
            labels,
            gt_boxes,
            query_to_gt,
            num_boxes=num_boxes,
            query_weight=query_weight,
            **focal,
            **loss_weights,
        )

    def loss(params, batch, rng, normalizer=None):
        gt_mask = batch["boxes_mask"] & batch["example_mask"][:, None]
        gt_boxes = normalized_cxcywh(batch["boxes"], image_size)
        labels = jnp.maximum(batch["labels"], 0)
        num_boxes = jnp.sum(gt_mask).astype(jnp.float32)
        divisor = jnp.maximum(num_boxes, 1.0) if normalizer is None else normalizer
        denoising_inputs = None
        if pairs:
            # Each image's noise is drawn from (rng, its image id): the same
            # whichever micro-batch, device or batch position the image has.
            def noised_copies(image_rng, boxes, image_labels, mask):
                one = denoising.contrastive_denoising_queries(
                    image_rng,
                    boxes[None],
                    image_labels[None],
                    mask[None],
                    denoising_pairs=pairs,
                    num_classes=num_classes,
                    label_noise_ratio=dino.label_noise_ratio,
                    box_noise_scale=dino.box_noise_scale,
                )
                return jax.tree.map(lambda x: x[0], one)

            # Named scopes tell the step's profile (benchmarks.profile_step) these stages apart.
            with jax.named_scope("denoising"):
                image_rngs = jax.vmap(lambda image_id: jax.random.fold_in(rng, image_id))(batch["image_id"])
                queries = jax.vmap(noised_copies)(image_rngs, gt_boxes, labels, gt_mask)
                denoising_inputs = {
                    "labels": queries["labels"],
                    "boxes_cxcywh": queries["boxes_cxcywh"],
                    "attention_mask": denoising.denoising_attention_mask(queries["group"], dino.num_queries),
                }
        outputs = model.apply({"params": params}, batch["image"], denoising_inputs, one_to_many=bool(one_to_many))

        def matched_losses(logits, boxes, gt_labels, gt_boxes, gt_mask, num_boxes):
            """Each of the K sets `[K, B, N, ...]` Hungarian-matched on its own, then its set loss terms `[K]`."""
            stopped = jax.lax.stop_gradient
            with jax.named_scope("matching"):
                _, query_to_gt = jax.vmap(
                    lambda lg, bx: matching.match_batch(lg, bx, gt_labels, gt_boxes, gt_mask, **match_weights)
                )(stopped(logits), stopped(boxes))
            query_mask = jnp.broadcast_to(batch["example_mask"][:, None], query_to_gt.shape[1:])
            with jax.named_scope("loss"):
                return jax.vmap(lambda lg, bx, q: set_loss(lg, bx, gt_labels, gt_boxes, q, num_boxes, query_mask)[1])(
                    logits, boxes, query_to_gt
                )

        # Every decoder layer and the encoder proposals are matched on their own.
        all_logits = jnp.concatenate([outputs["logits"], outputs["encoder_logits"][None]])
        all_boxes = jnp.concatenate([outputs["boxes"], outputs["encoder_boxes"][None]])
        matched = matched_losses(all_logits, all_boxes, labels, gt_boxes, gt_mask, divisor)
        terms = {
            "cls_loss": jnp.sum(matched["cls_loss"]),
            "box_loss": jnp.sum(matched["l1_loss"]) + jnp.sum(matched["giou_loss"]),
            "encoder_loss": matched["cls_loss"][-1] + matched["l1_loss"][-1] + matched["giou_loss"][-1],
        }
        if pairs:
            valid = queries["valid"] & batch["example_mask"][:, None]
            dn_to_gt = jnp.where(queries["positive"] & valid, queries["gt_index"], -1)
            # Each of an image's G groups repeats every box: its queries weigh 1 / G,
            # so each image's denoising counts as much as one group, as in DINO.
            dn_weight = valid / jnp.maximum(queries["num_groups"], 1)[:, None].astype(jnp.float32)
            with jax.named_scope("loss"):
                _, dn = jax.vmap(lambda lg, bx: set_loss(lg, bx, labels, gt_boxes, dn_to_gt, divisor, dn_weight))(
                    outputs["denoising_logits"], outputs["denoising_boxes"]
                )
            dn_cls, dn_box = jnp.sum(dn["cls_loss"]), jnp.sum(dn["l1_loss"]) + jnp.sum(dn["giou_loss"])
            terms["cls_loss"] += dn_cls
            terms["box_loss"] += dn_box
            terms["denoising_loss"] = dn_cls + dn_box
        if one_to_many:
            # H-DETR's hybrid branch: the same Hungarian matching and losses
            # against every box repeated K times, divided by the K n copies.
            def repeated(x):
                return jnp.tile(x, (1, repeats) + (1,) * (x.ndim - 2))

            many = matched_losses(
                outputs["one_to_many_logits"],
                outputs["one_to_many_boxes"],
                repeated(labels),
                repeated(gt_boxes),
                repeated(gt_mask),
                divisor * repeats,
            )
            many_cls = weights.one_to_many_weight * jnp.sum(many["cls_loss"])
            many_box = weights.one_to_many_weight * (jnp.sum(many["l1_loss"]) + jnp.sum(many["giou_loss"]))
            terms["cls_loss"] += many_cls
            terms["box_loss"] += many_box
            terms["one_to_many_loss"] = many_cls + many_box
        terms["num_positives"] = num_boxes
        return terms["cls_loss"] + terms["box_loss"], terms

    def detect(params, images):
        outputs = model.apply({"params": params}, images)
        post = config.postprocess
        return postprocess.detect_from_queries(
            outputs["logits"][-1],
            outputs["boxes"][-1],
            image_size[0],
            image_size[1],
            max_detections=post.max_detections,
            score_threshold=post.score_threshold,
            nms_iou_threshold=query_nms,
            pre_nms_top_k=post.pre_nms_top_k,
        )

    return Objective(loss=loss, detect=detect, outputs_per_image=f"{dino.num_queries} queries")
