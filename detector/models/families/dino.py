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
from detector.models import backbones
from detector.models.dino import Dino, encoder_proposals
from detector.models.families.objective import Objective
from detector.models.necks import ChannelMapper, SimpleFeaturePyramid
from detector.models.query_layout import QueryLayout
from detector.ops import denoising, losses, matching, postprocess


def create(config, num_classes: int, *, data_parallel_devices: int = 1) -> Dino:
    """DINO from `config.model` (backbone, dtype, remat) and `config.model.dino`; it reduces no gradients of its
    own, so `data_parallel_devices` changes nothing."""
    del data_parallel_devices
    model_config, dino = config.model, config.model.dino
    dtype = backbones.compute_dtype(model_config)
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
    backbone = backbones.create_backbone(model_config, dtype)
    levels = dict(min_level=dino.min_level, max_level=dino.max_level, dtype=dtype)
    if backbones.backbone_kind(model_config.backbone).multi_level:
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


# The targets' ground-truth entries, one per box slot.
GT_KEYS = ("labels", "boxes", "mask")
# What the model takes of the denoising queries (the rest are their targets).
DENOISING_INPUTS = ("labels", "boxes_cxcywh", "group")


def noised_ground_truth(rng, image_ids, boxes, labels, mask, dino_config, num_classes: int) -> dict[str, jax.Array]:
    """`denoising.contrastive_denoising_queries` of every image of the batch: `[B, ...]` entries.

    `image_ids` int `[B]`; `boxes` `[B, M, 4]` normalised cxcywh, `labels`
    int32 `[B, M]` and `mask` bool `[B, M]` of the ground truth.

    Each image's noise is drawn from (rng, its image id): the same whichever
    micro-batch, device or batch position the image has.
    """

    def one_image(image_rng, image_boxes, image_labels, image_mask):
        queries = denoising.contrastive_denoising_queries(
            image_rng,
            image_boxes[None],
            image_labels[None],
            image_mask[None],
            denoising_pairs=dino_config.denoising_pairs,
            num_classes=num_classes,
            label_noise_ratio=dino_config.label_noise_ratio,
            box_noise_scale=dino_config.box_noise_scale,
        )
        return jax.tree.map(lambda x: x[0], queries)

    # Named scopes tell the step's profile (benchmarks.profile_step) these stages apart.
    with jax.named_scope("denoising"):
        image_rngs = jax.vmap(lambda image_id: jax.random.fold_in(rng, image_id))(image_ids)
        return jax.vmap(one_image)(image_rngs, boxes, labels, mask)


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

    # The decoder's queries in training, each segment with its own targets and losses below.
    layout = QueryLayout(
        num_one_to_one=dino.num_queries,
        num_denoising=denoising.num_denoising_queries(pairs, config.input.max_boxes),
        num_one_to_many=one_to_many,
    )

    def set_loss(logits, boxes, targets, query_to_gt, query_weight):
        """`[B, Q, ...]` predictions against `targets` by `query_to_gt` `[B, Q]` -> (loss, its terms)."""
        return losses.set_prediction_loss(
            logits,
            boxes,
            targets["labels"],
            targets["boxes"],
            query_to_gt,
            num_boxes=targets["divisor"],
            query_weight=query_weight,
            **focal,
            **loss_weights,
        )

    def matched_losses(logits, boxes, targets):
        """Each of the K sets `[K, B, Q, ...]` Hungarian-matched to `targets` on its own; its set loss terms `[K]`."""
        stopped = jax.lax.stop_gradient
        with jax.named_scope("matching"):
            _, query_to_gt = jax.vmap(
                lambda lg, bx: matching.match_batch(
                    lg, bx, targets["labels"], targets["boxes"], targets["mask"], **match_weights
                )
            )(stopped(logits), stopped(boxes))
        query_mask = jnp.broadcast_to(targets["example_mask"][:, None], query_to_gt.shape[1:])
        with jax.named_scope("loss"):
            return jax.vmap(lambda lg, bx, q: set_loss(lg, bx, targets, q, query_mask)[1])(logits, boxes, query_to_gt)

    def one_to_one_losses(outputs, targets):
        # Every decoder layer and the encoder proposals are matched on their own.
        logits = jnp.concatenate([outputs["logits"], outputs["encoder_logits"][None]])
        boxes = jnp.concatenate([outputs["boxes"], outputs["encoder_boxes"][None]])
        matched = matched_losses(logits, boxes, targets)
        return {
            "cls_loss": jnp.sum(matched["cls_loss"]),
            "box_loss": jnp.sum(matched["l1_loss"]) + jnp.sum(matched["giou_loss"]),
            "encoder_loss": matched["cls_loss"][-1] + matched["l1_loss"][-1] + matched["giou_loss"][-1],
        }

    def denoising_losses(outputs, targets):
        noised = targets["noised"]
        valid = noised["valid"] & targets["example_mask"][:, None]
        dn_to_gt = jnp.where(noised["positive"] & valid, noised["gt_index"], -1)
        # Each of an image's G groups repeats every box: its queries weigh 1 / G,
        # so each image's denoising counts as much as one group, as in DINO.
        dn_weight = valid / jnp.maximum(noised["num_groups"], 1)[:, None].astype(jnp.float32)
        with jax.named_scope("loss"):
            _, dn = jax.vmap(lambda lg, bx: set_loss(lg, bx, targets, dn_to_gt, dn_weight))(
                outputs["denoising_logits"], outputs["denoising_boxes"]
            )
        return {"cls_loss": jnp.sum(dn["cls_loss"]), "box_loss": jnp.sum(dn["l1_loss"]) + jnp.sum(dn["giou_loss"])}

    def one_to_many_losses(outputs, targets):
        # H-DETR's hybrid branch: the same Hungarian matching and losses
        # against every box repeated K times, divided by the K n copies.
        repeated = {key: jnp.tile(targets[key], (1, repeats) + (1,) * (targets[key].ndim - 2)) for key in GT_KEYS}
        repeated = {**targets, **repeated, "divisor": targets["divisor"] * repeats}
        many = matched_losses(outputs["one_to_many_logits"], outputs["one_to_many_boxes"], repeated)
        return {
            "cls_loss": weights.one_to_many_weight * jnp.sum(many["cls_loss"]),
            "box_loss": weights.one_to_many_weight * (jnp.sum(many["l1_loss"]) + jnp.sum(many["giou_loss"])),
        }

    segment_losses = {"denoising": denoising_losses, "one_to_one": one_to_one_losses, "one_to_many": one_to_many_losses}

    def loss(params, batch, rng, normalizer=None):
        gt_mask = batch["boxes_mask"] & batch["example_mask"][:, None]
        num_boxes = jnp.sum(gt_mask).astype(jnp.float32)
        targets = {
            "labels": jnp.maximum(batch["labels"], 0),
            "boxes": normalized_cxcywh(batch["boxes"], image_size),
            "mask": gt_mask,
            "example_mask": batch["example_mask"],
            "divisor": jnp.maximum(num_boxes, 1.0) if normalizer is None else normalizer,
            "noised": None,
        }
        if layout.num_denoising:
            targets["noised"] = noised_ground_truth(
                rng, batch["image_id"], targets["boxes"], targets["labels"], gt_mask, dino, num_classes
            )
        model_denoising = (
            None if targets["noised"] is None else {key: targets["noised"][key] for key in DENOISING_INPUTS}
        )
        outputs = model.apply(
            {"params": params}, batch["image"], model_denoising, one_to_many=bool(layout.num_one_to_many)
        )
        by_segment = {segment: segment_losses[segment](outputs, targets) for segment in layout.segments}
        terms = {
            "cls_loss": sum(segment["cls_loss"] for segment in by_segment.values()),
            "box_loss": sum(segment["box_loss"] for segment in by_segment.values()),
            "encoder_loss": by_segment["one_to_one"]["encoder_loss"],
            # The training-only segments' own share, as a term of its own.
            **{f"{name}_loss": s["cls_loss"] + s["box_loss"] for name, s in by_segment.items() if name != "one_to_one"},
            "num_positives": num_boxes,
        }
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
