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
from detector.models import backbones, mask_branch
from detector.models.dino import Dino, encoder_proposals
from detector.models.families.objective import Objective
from detector.models.necks import ChannelMapper, SimpleFeaturePyramid
from detector.models.query_layout import QueryLayout
from detector.ops import denoising, losses, mask_losses, matching, postprocess

# Folded into each image's key: the mask points' draws (matching, loss), apart from the denoising noise's.
_MASK_MATCH_TAG, _MASK_LOSS_TAG = 0x4D4D00, 0x4D4C00


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
    if dino.mask_dim and config.input.mask_stride != mask_branch.STRIDE:
        raise ConfigError(
            f"model.dino.mask_dim={dino.mask_dim} needs the ground-truth masks on the pixel embedding's grid: set "
            f"input.mask_stride={mask_branch.STRIDE} (it is {config.input.mask_stride})"
        )
    if dino.mask_enhanced_anchors and not dino.mask_dim:
        raise ConfigError(
            "model.dino.mask_enhanced_anchors=True starts the queries from their proposals' masks: set "
            "model.dino.mask_dim > 0 (Mask DINO: 256), or turn it off"
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
        mask_dim=dino.mask_dim,
        mask_enhanced_anchors=dino.mask_enhanced_anchors,
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
    with_masks = bool(dino.mask_dim)
    mask_points = weights.mask_points
    point_ratios = dict(
        oversample_ratio=weights.mask_oversample_ratio, importance_sample_ratio=weights.mask_importance_ratio
    )
    if with_masks:
        if not isinstance(mask_points, int) or isinstance(mask_points, bool) or mask_points < 1:
            raise ConfigError(f"loss.set_prediction.mask_points={mask_points!r}; use a whole number >= 1 (12544)")
        try:
            mask_losses.point_pool_sizes(mask_points, **point_ratios)
        except ValueError as error:
            raise ConfigError(f"loss.set_prediction: {error} (Mask2Former: 3.0 and 0.75)") from error

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

    def mask_cost(embeddings, masks):
        """Mask DINO's mask matching cost `[B, Q, M]` of queries' mask embeddings `[B, Q, C]` (no gradient).

        Every query against every ground-truth mask at the image's mask_points
        uniform matching points; a slot without a mask costs 0 (its box alone matches it).
        """
        logits = mask_losses.logits_at_samples(embeddings, masks["match_embedding"])
        truth = jnp.take_along_axis(masks["match_targets"], masks["gt_source"][..., None], axis=1)
        cost = weights.match_mask_weight * mask_losses.mask_bce_cost(logits, truth)
        cost = cost + weights.match_dice_weight * mask_losses.mask_dice_cost(logits, truth)
        return jnp.where(masks["valid"][:, None, :], cost, 0.0)

    def mask_row_losses(row_embeddings, row_gt, row_weight, masks):
        """Weighted mask BCE and dice `[B, R]` of rows of mask embeddings `[B, R, C]` against the ground-truth
        slot each is trained on (`row_gt` int `[B, R]`, -1 for none), weighted by `row_weight` `[B, R]`. The
        caller sums them over the batch after its loop over sets: one reduction across devices, not one per set.

        Each row's mask_points are the most uncertain of its image's pool of
        candidates plus fresh uniform ones (`mask_losses.uncertain_points`).
        """
        pool_logits = mask_losses.logits_at_samples(row_embeddings, masks["pool_embedding"])
        index = mask_losses.uncertain_points(pool_logits, mask_points, **point_ratios)
        slot = jnp.maximum(row_gt, 0)
        source = jnp.take_along_axis(masks["gt_source"], slot, axis=1)
        truth = mask_losses.pool_targets_of_rows(masks["pool_targets"], source, index)
        logits = jnp.take_along_axis(pool_logits, index, axis=-1)
        row_weight = row_weight * ((row_gt >= 0) & jnp.take_along_axis(masks["valid"], slot, axis=1))
        return {
            "mask_loss": weights.mask_weight * mask_losses.sigmoid_bce_per_mask(logits, truth) * row_weight,
            "dice_loss": weights.dice_weight * mask_losses.dice_per_mask(logits, truth) * row_weight,
        }

    def summed_over_masks(per_row, divisor):
        """`mask_row_losses` of K sets `[K, B, R]` -> each set's terms `[K]`, per counted mask."""
        return {key: mask_losses.total_over_masks(value, divisor, axis=(1, 2)) for key, value in per_row.items()}

    def matched_losses(logits, boxes, targets, mask_embeddings=None, masks=None):
        """Each of the K sets `[K, B, Q, ...]` Hungarian-matched to `targets` on its own; its set loss terms `[K]`.

        With `mask_embeddings` `[K, B, Q, C]` (Mask DINO), the matching cost
        has the mask terms and the terms the mask losses of each set's
        matched queries.
        """
        stopped = jax.lax.stop_gradient
        with jax.named_scope("matching"):
            extra = None
            if mask_embeddings is not None:
                # One set at a time: the [B, Q, P] logits of every set at once would be K times the memory.
                extra = jax.lax.map(lambda embeddings: mask_cost(embeddings, masks), stopped(mask_embeddings))
            gt_to_query, query_to_gt = jax.vmap(
                lambda lg, bx, cost: matching.match_batch(
                    lg, bx, targets["labels"], targets["boxes"], targets["mask"], extra_cost=cost, **match_weights
                )
            )(stopped(logits), stopped(boxes), extra)
        query_mask = jnp.broadcast_to(targets["example_mask"][:, None], query_to_gt.shape[1:])
        with jax.named_scope("loss"):
            terms = jax.vmap(lambda lg, bx, q: set_loss(lg, bx, targets, q, query_mask)[1])(logits, boxes, query_to_gt)
            if mask_embeddings is not None:
                # The rows are the ground-truth slots, each with the query matched to it.
                slots = jnp.arange(gt_to_query.shape[-1])
                weight = jnp.broadcast_to(targets["example_mask"][:, None], gt_to_query.shape[1:]).astype(jnp.float32)

                def one_set(embeddings, matched):
                    rows = jnp.take_along_axis(embeddings, jnp.maximum(matched, 0)[..., None], axis=1)
                    row_gt = jnp.where(matched >= 0, slots[None], -1)
                    return mask_row_losses(rows, row_gt, weight, masks)

                # One set at a time, as the matching: every set's [B, R, K] pool logits and their top-k at once
                # would be K times the memory (GBs at 1024 px).
                per_row = jax.lax.map(lambda a: one_set(*a), (mask_embeddings, gt_to_query))
                terms.update(summed_over_masks(per_row, targets["divisor"]))
            return terms

    def mask_terms(matched, scale=1.0):
        """The summed mask terms of `matched`'s sets, times `scale` (none without masks)."""
        if not with_masks:
            return {}
        return {"mask_loss": scale * jnp.sum(matched["mask_loss"]), "dice_loss": scale * jnp.sum(matched["dice_loss"])}

    def one_to_one_losses(outputs, targets, masks):
        # Every decoder layer and the encoder proposals are matched on their own.
        logits = jnp.concatenate([outputs["logits"], outputs["encoder_logits"][None]])
        boxes = jnp.concatenate([outputs["boxes"], outputs["encoder_boxes"][None]])
        mask_embeddings = None
        if with_masks:
            mask_embeddings = jnp.concatenate([outputs["mask_embeddings"], outputs["encoder_mask_embeddings"][None]])
        matched = matched_losses(logits, boxes, targets, mask_embeddings, masks)
        encoder_loss = matched["cls_loss"][-1] + matched["l1_loss"][-1] + matched["giou_loss"][-1]
        if with_masks:
            encoder_loss = encoder_loss + matched["mask_loss"][-1] + matched["dice_loss"][-1]
        return {
            "cls_loss": jnp.sum(matched["cls_loss"]),
            "box_loss": jnp.sum(matched["l1_loss"]) + jnp.sum(matched["giou_loss"]),
            **mask_terms(matched),
            "encoder_loss": encoder_loss,
        }

    def denoising_losses(outputs, targets, masks):
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
            if with_masks:  # each positive query learns its box's mask, as Mask DINO's mask denoising
                # Only positive queries have masks, and they fill at most half of the slots (each group holds
                # n positive and n negative copies): their rows first, the other half dropped.
                rows = jnp.argsort(dn_to_gt < 0, axis=1, stable=True)[:, : dn_to_gt.shape[1] // 2]
                row_gt = jnp.take_along_axis(dn_to_gt, rows, axis=1)
                row_weight = jnp.take_along_axis(dn_weight, rows, axis=1)
                per_row = jax.lax.map(
                    lambda embeddings: mask_row_losses(
                        jnp.take_along_axis(embeddings, rows[..., None], axis=1), row_gt, row_weight, masks
                    ),
                    outputs["denoising_mask_embeddings"],
                )
                dn.update(summed_over_masks(per_row, targets["divisor"]))
        return {
            "cls_loss": jnp.sum(dn["cls_loss"]),
            "box_loss": jnp.sum(dn["l1_loss"]) + jnp.sum(dn["giou_loss"]),
            **mask_terms(dn),
        }

    def one_to_many_losses(outputs, targets, masks):
        # H-DETR's hybrid branch: the same Hungarian matching and losses
        # against every box repeated K times, divided by the K n copies.
        repeated = {key: jnp.tile(targets[key], (1, repeats) + (1,) * (targets[key].ndim - 2)) for key in GT_KEYS}
        repeated = {**targets, **repeated, "divisor": targets["divisor"] * repeats}
        mask_embeddings = None
        if with_masks:  # the repeated slots point at their masks; no mask is copied
            masks = {
                **masks,
                "gt_source": jnp.tile(masks["gt_source"], (1, repeats)),
                "valid": jnp.tile(masks["valid"], (1, repeats)),
            }
            mask_embeddings = outputs["one_to_many_mask_embeddings"]
        many = matched_losses(
            outputs["one_to_many_logits"], outputs["one_to_many_boxes"], repeated, mask_embeddings, masks
        )
        scale = weights.one_to_many_weight
        return {
            "cls_loss": scale * jnp.sum(many["cls_loss"]),
            "box_loss": scale * (jnp.sum(many["l1_loss"]) + jnp.sum(many["giou_loss"])),
            **mask_terms(many, scale),
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
        masks = None
        if with_masks:
            gt_masks = mask_losses.unpack_masks(batch["masks"], outputs["pixel_embedding"].shape[2])
            # Each image's points from (step key, image id): the same on any device or micro-batch. Every set
            # of queries (decoder layers, encoder proposals, denoising, one-to-many) is matched at one set of
            # uniform points and trained from one importance pool per image: the pixel embedding and the
            # ground truth are sampled there once, not once per set (see mask_losses).
            keys = jax.vmap(lambda image_id: jax.random.fold_in(rng, image_id))(batch["image_id"])
            match_points = mask_losses.uniform_points(mask_losses.fold_in_keys(keys, _MASK_MATCH_TAG), mask_points)
            pool = mask_losses.importance_point_pool(
                mask_losses.fold_in_keys(keys, _MASK_LOSS_TAG), mask_points, **point_ratios
            )
            masks = {
                "valid": batch["masks_valid"] & gt_mask,
                # Which of the image's masks a ground-truth slot is (the one-to-many branch repeats slots).
                "gt_source": jnp.broadcast_to(jnp.arange(gt_mask.shape[1]), gt_mask.shape),
                "match_embedding": jax.lax.stop_gradient(
                    mask_losses.sample_pixel_embedding(outputs["pixel_embedding"], match_points)
                ),
                "match_targets": mask_losses.mask_targets_at_points(gt_masks, match_points),
                "pool_embedding": mask_losses.sample_pixel_embedding(outputs["pixel_embedding"], pool),
                "pool_targets": mask_losses.mask_targets_at_points(gt_masks, pool),
            }
        by_segment = {segment: segment_losses[segment](outputs, targets, masks) for segment in layout.segments}
        terms = {
            "cls_loss": sum(segment["cls_loss"] for segment in by_segment.values()),
            "box_loss": sum(segment["box_loss"] for segment in by_segment.values()),
            "encoder_loss": by_segment["one_to_one"]["encoder_loss"],
            # The training-only segments' own share, as a term of its own.
            **{f"{name}_loss": s["cls_loss"] + s["box_loss"] for name, s in by_segment.items() if name != "one_to_one"},
            "num_positives": num_boxes,
        }
        if with_masks:
            for key in ("mask_loss", "dice_loss"):
                terms[key] = sum(segment[key] for segment in by_segment.values())
            # The training-only segments' own share counts their mask terms too.
            for name, s in by_segment.items():
                if name != "one_to_one":
                    terms[f"{name}_loss"] = terms[f"{name}_loss"] + s["mask_loss"] + s["dice_loss"]
            return terms["cls_loss"] + terms["box_loss"] + terms["mask_loss"] + terms["dice_loss"], terms
        return terms["cls_loss"] + terms["box_loss"], terms

    def detect(params, images):
        outputs = model.apply({"params": params}, images)
        post = config.postprocess
        detections = postprocess.detect_from_queries(
            outputs["logits"][-1],
            outputs["boxes"][-1],
            image_size[0],
            image_size[1],
            max_detections=post.max_detections,
            score_threshold=post.score_threshold,
            nms_iou_threshold=query_nms,
            pre_nms_top_k=post.pre_nms_top_k,
            return_queries=with_masks,
        )
        if with_masks:  # each detection's mask logits at stride 4: pasted and scored on the host
            queries = detections.pop("queries")
            embeddings = jnp.take_along_axis(outputs["mask_embeddings"][-1], queries[..., None], axis=1)
            detections["masks"] = mask_branch.mask_logits(embeddings, outputs["pixel_embedding"])
        return detections

    return Objective(loss=loss, detect=detect, outputs_per_image=f"{dino.num_queries} queries")
