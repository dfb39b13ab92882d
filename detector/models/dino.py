"""DINO (Zhang et al. 2022): a deformable DETR with two-stage query selection and contrastive denoising.

backbone -> 4-level pyramid (`necks.ChannelMapper` on a ResNet, the simple
feature pyramid on a ViT) -> deformable encoder over every pyramid position
-> top-k encoder proposals -> deformable decoder with iterative box
refinement -> per-layer class logits and boxes. There are no anchors and no
NMS: each of the N queries predicts one box and C sigmoid scores.

Differences from the reference implementation, all for static shapes:
  * images are not masked: the zero padding the input pipeline adds to
    reach `input.image_size` is part of the map (valid ratios are 1), as
    for the project's RetinaNet;
  * the denoising groups are `dn_number // n` for each image's own n boxes,
    not for the batch's most crowded image, in a fixed number of query
    slots (see `detector.ops.denoising`);
  * encoder proposals outside (0.01, 0.99) are excluded from the top-k by
    their score rather than by infinite coordinates;
  * the decoder's output LayerNorm feeds both the box refinement and the
    predictions (DINO refines from the un-normed output and predicts from
    the normed one); the boxes a layer predicts and the references the next
    layer uses are therefore the same numbers.

Logical axis names (mapped to mesh axes by `config.sharding.rules`):
  parameters  'embed' (model width, FSDP), 'heads' and 'mlp' (tensor
              parallel), 'kv' (head width), 'norm' (width-sized vectors);
  activations ('batch', 'tokens', 'act_embed') for tokens and queries,
              ('batch', 'tokens', 'act_heads', 'kv') inside attention and
              ('batch', 'tokens', 'act_mlp') inside the FFN.
Every attention (deformable or not) splits its value/query/key projections
by head and its output projection by input, and the FFN splits its hidden
units: with heads and mlp on `model` (Megatron) an encoder layer's forward
pass needs two all-reduces and a decoder layer's three. The small prediction
heads are replicated over `model`.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from detector.models.layers import constrain_activation, relu, rematerialized
from detector.models.mask_branch import PixelEmbedding, mask_logits
from detector.models.necks import deconvolution_upsample
from detector.models.query_layout import QueryLayout
from detector.models.transformer import HEAD_AXES, TOKEN_AXES, Mlp, Projection, attention, layer_norm
from detector.ops.box_ops import cxcywh_to_yxyx, mask_boxes_cxcywh
from detector.ops.deformable_attention import multi_scale_deformable_attention
from detector.ops.postprocess import non_max_suppression


def inverse_sigmoid(x: jax.Array, eps: float = 1e-5) -> jax.Array:
    """logit(x) for x in [0, 1], clipped to stay finite at 0 and 1."""
    x = jnp.clip(x, 0.0, 1.0)
    return jnp.log(jnp.maximum(x, eps) / jnp.maximum(1.0 - x, eps))


def _sine(positions: np.ndarray | jax.Array, dim: int, temperature: float, xp) -> Any:
    """`[...]` positions (already scaled to radians) -> `[..., dim]`: sin/cos interleaved at geometric frequencies."""
    frequencies = temperature ** (2 * (np.arange(dim) // 2) / dim)
    angles = positions[..., None] / frequencies
    return xp.stack([xp.sin(angles[..., 0::2]), xp.cos(angles[..., 1::2])], axis=-1).reshape(*angles.shape[:-1], dim)


def map_position_embedding(height: int, width: int, dim: int, temperature: float = 10000.0) -> np.ndarray:
    """DETR's normalised sine embedding of a `height x width` map: float32 `[height * width, dim]` (y half, x half).

    Pixel centres are at (i + 0.5) / size, times 2 pi.
    """
    ys = (np.arange(height) + 0.5) / height * 2 * math.pi
    xs = (np.arange(width) + 0.5) / width * 2 * math.pi
    pos_y = _sine(ys, dim // 2, temperature, np)[:, None, :].repeat(width, axis=1)
    pos_x = _sine(xs, dim // 2, temperature, np)[None, :, :].repeat(height, axis=0)
    return np.concatenate([pos_y, pos_x], axis=-1).reshape(height * width, dim).astype(np.float32)


def box_position_embedding(boxes_cxcywh: jax.Array, dim_per_coordinate: int) -> jax.Array:
    """DINO's sine embedding of reference boxes: `[..., 4]` in [0, 1] -> `[..., 4 * dim_per_coordinate]`, y x w h."""
    scaled = boxes_cxcywh.astype(jnp.float32) * (2 * math.pi)
    cx, cy, w, h = (scaled[..., i] for i in range(4))
    return jnp.concatenate([_sine(v, dim_per_coordinate, 10000.0, jnp) for v in (cy, cx, w, h)], axis=-1)


def encoder_reference_points(spatial_shapes: list[tuple[int, int]]) -> np.ndarray:
    """float32 `[S, 2]` normalised (x, y) pixel centres of every position of every level, in token order."""
    points = []
    for height, width in spatial_shapes:
        ys, xs = np.meshgrid((np.arange(height) + 0.5) / height, (np.arange(width) + 0.5) / width, indexing="ij")
        points.append(np.stack([xs.ravel(), ys.ravel()], axis=-1))
    return np.concatenate(points).astype(np.float32)


def encoder_proposals(spatial_shapes: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Two-stage proposals: a box of side 0.05 * 2**level centred on every position.

    Returns (float32 `[S, 4]` proposals as logits of normalised cxcywh,
    bool `[S]` whether every coordinate lies in (0.01, 0.99), the positions
    the top-k may choose).
    """
    boxes = []
    for level, (height, width) in enumerate(spatial_shapes):
        centres = encoder_reference_points([(height, width)])
        sizes = np.full_like(centres, 0.05 * 2.0**level)
        boxes.append(np.concatenate([centres, sizes], axis=-1))
    boxes = np.concatenate(boxes)
    valid = np.all((boxes > 0.01) & (boxes < 0.99), axis=-1)
    clipped = np.clip(boxes, 0.01, 0.99)  # invalid proposals (sides of 1 and more) get 0 below
    logits = np.log(clipped / (1.0 - clipped))
    return np.where(valid[:, None], logits, 0.0).astype(np.float32), valid


def _grid_offsets_init(num_heads: int, num_levels: int, num_points: int):
    """Deformable DETR's initial sampling offsets: head h points along angle 2 pi h / H, point p at p + 1 pixels."""

    def init(key, shape, dtype=jnp.float32):
        del key
        angles = np.arange(num_heads) * (2.0 * math.pi / num_heads)
        grid = np.stack([np.cos(angles), np.sin(angles)], -1)
        grid = grid / np.abs(grid).max(-1, keepdims=True)
        grid = np.tile(grid[:, None, None, :], (1, num_levels, num_points, 1))
        grid = grid * np.arange(1, num_points + 1)[None, None, :, None]
        return jnp.asarray(grid.reshape(shape), dtype)

    return init


def _merge_heads(heads_output: jax.Array, embed: int, dtype: Any) -> jax.Array:
    """`[B, Q, H, Dh]` -> `[B, Q, E]` by the attention's output projection (a submodule named "output").

    The kernel is split by input heads, so with heads on `model` this is the
    attention's one all-reduce.
    """
    heads_output = nn.with_logical_constraint(heads_output, HEAD_AXES)
    out = Projection((embed,), ("heads", "kv", "embed"), ("norm",), contract=2, dtype=dtype, name="output")(
        heads_output
    )
    return nn.with_logical_constraint(out, TOKEN_AXES)


class MultiScaleDeformableAttention(nn.Module):
    """Deformable attention of queries over the flattened pyramid (Zhu et al. 2020).

    `__call__(query [B, Q, E], reference [B or 1, Q, 2 or 4], values [B, S, E], spatial_shapes) -> [B, Q, E]`.
    A 2-d reference is a point (x, y): offsets are in pixels of each level;
    a 4-d one a box (cx, cy, w, h): offsets are in units of the box's half
    size divided by the number of points.
    """

    num_heads: int
    num_levels: int
    num_points: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, query, reference, values, spatial_shapes: tuple[tuple[int, int], ...]) -> jax.Array:
        batch, num_queries, embed = query.shape
        heads, levels, points = self.num_heads, self.num_levels, self.num_points
        head_dim = embed // heads
        value = Projection(
            (heads, head_dim), ("embed", "heads", "kv"), ("heads", "kv"), dtype=self.dtype, name="value"
        )(values)
        value = nn.with_logical_constraint(value, HEAD_AXES)
        offsets = Projection(
            (heads, levels, points, 2),
            ("embed", "heads", None, None, None),
            ("heads", None, None, None),
            dtype=self.dtype,
            kernel_init=nn.initializers.zeros,
            bias_init=_grid_offsets_init(heads, levels, points),
            name="sampling_offsets",
        )(query).astype(jnp.float32)
        logits = Projection(
            (heads, levels * points),
            ("embed", "heads", None),
            ("heads", None),
            dtype=self.dtype,
            kernel_init=nn.initializers.zeros,
            name="attention_weights",
        )(query).astype(jnp.float32)
        weights = jax.nn.softmax(logits, axis=-1).reshape(batch, num_queries, heads, levels, points)

        reference = reference.astype(jnp.float32)[:, :, None, None, None, :]
        if reference.shape[-1] == 2:
            level_sizes = jnp.asarray([(w, h) for h, w in spatial_shapes], jnp.float32)  # [L, 2] as (x, y)
            locations = reference + offsets / level_sizes[None, None, None, :, None, :]
        else:
            locations = reference[..., :2] + offsets / points * reference[..., 2:] * 0.5
        sampled = multi_scale_deformable_attention(value, spatial_shapes, locations, weights)
        return _merge_heads(sampled.reshape(batch, num_queries, heads, head_dim), embed, self.dtype)


class MultiHeadAttention(nn.Module):
    """Dot-product attention `(query, key, value [B, T, E], mask [B, T, T] bool or None) -> [B, T, E]`."""

    num_heads: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, query, key, value, mask=None) -> jax.Array:
        embed = query.shape[-1]
        head_dim = embed // self.num_heads

        def project(x, name):
            y = Projection(
                (self.num_heads, head_dim), ("embed", "heads", "kv"), ("heads", "kv"), dtype=self.dtype, name=name
            )(x)
            return nn.with_logical_constraint(y, HEAD_AXES)

        q, k, v = project(query, "query"), project(key, "key"), project(value, "value")
        return _merge_heads(attention(q, k, v, mask), embed, self.dtype)


class PredictionMlp(nn.Module):
    """A small MLP `[..., E_in] -> [..., out]` (ReLU between layers), replicated over `model`."""

    hidden: int
    out: int
    num_layers: int
    zero_last: bool = False  # start at a zero output (the box refinement's delta)
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(self.num_layers):
            last = i == self.num_layers - 1
            features = self.out if last else self.hidden
            x = Projection(
                (features,),
                ("embed", None),
                (None,),
                dtype=self.dtype,
                kernel_init=nn.initializers.zeros if last and self.zero_last else None,
                name=f"layer{i}",
            )(x)
            x = x if last else relu(x)
        return x


def _feed_forward(hidden: int, dtype: Any):
    """DETR's FFN `[B, T, E] -> [B, T, E]` (submodule "ffn"): E -> hidden (ReLU) -> E, hidden units on `mlp`."""
    mlp = Mlp(hidden, dtype, kind="relu", name="ffn")
    return lambda x: nn.with_logical_constraint(mlp(x), TOKEN_AXES)


class _TransformerLayer(nn.Module):
    """What encoder and decoder layers are built of: attention shapes, FFN width, the pyramid's level sizes."""

    num_heads: int
    num_levels: int
    num_points: int
    ffn_dim: int
    spatial_shapes: tuple[tuple[int, int], ...]
    dtype: Any = jnp.float32


class EncoderLayer(_TransformerLayer):
    """Post-norm deformable self-attention over all pyramid positions, then the FFN."""

    @nn.compact
    def __call__(self, x: jax.Array, position: jax.Array, reference: jax.Array) -> jax.Array:
        attention = MultiScaleDeformableAttention(
            self.num_heads, self.num_levels, self.num_points, self.dtype, name="self_attention"
        )
        x = layer_norm(self.dtype, "norm1", 1e-5)(x + attention(x + position, reference, x, self.spatial_shapes))
        x = layer_norm(self.dtype, "norm2", 1e-5)(x + _feed_forward(self.ffn_dim, self.dtype)(x))
        return nn.with_logical_constraint(x, TOKEN_AXES)


class DecoderLayer(_TransformerLayer):
    """Post-norm query self-attention (masked), deformable cross-attention into the encoder memory, FFN."""

    @nn.compact
    def __call__(self, queries, query_position, reference_boxes, memory, mask) -> jax.Array:
        q = queries + query_position
        y = MultiHeadAttention(self.num_heads, self.dtype, name="self_attention")(q, q, queries, mask)
        queries = layer_norm(self.dtype, "norm1", 1e-5)(queries + y)
        cross = MultiScaleDeformableAttention(
            self.num_heads, self.num_levels, self.num_points, self.dtype, name="cross_attention"
        )
        y = cross(queries + query_position, reference_boxes, memory, self.spatial_shapes)
        queries = layer_norm(self.dtype, "norm2", 1e-5)(queries + y)
        y = _feed_forward(self.ffn_dim, self.dtype)(queries)
        queries = layer_norm(self.dtype, "norm3", 1e-5)(queries + y)
        return nn.with_logical_constraint(queries, TOKEN_AXES)


def _class_head(num_classes: int, dtype: Any, name: str) -> Projection:
    """Per-class sigmoid logits; the prior bias starts every query at p = 0.01, as in RetinaNet."""
    prior_bias = -math.log((1.0 - 0.01) / 0.01)
    return Projection(
        (num_classes,), ("embed", None), (None,), dtype=dtype, bias_init=nn.initializers.constant(prior_bias), name=name
    )


# Distinct selection runs its NMS over this many times `count` of the best
# proposals (all of them on small inputs): a fixed cost however large the
# pyramid, where DDQ's NMS over every position grows with its square.
DISTINCT_CANDIDATES_PER_QUERY = 4


def select_proposals(
    scores: jax.Array, count: int, boxes_cxcywh: jax.Array | None = None, distinct_iou: float = 0.0
) -> jax.Array:
    """Indices int32 `[B, count]` of each image's `count` highest-scoring proposals, best first.

    `scores` `[B, T]` (-inf for invalid proposals) carry no gradient through
    the choice. With `distinct_iou` > 0 (DDQ's distinct query selection,
    Zhang et al. 2023), proposals whose boxes `boxes_cxcywh` `[B, T, 4]`
    overlap a better one by more than that IoU (class-agnostic greedy NMS
    over the `DISTINCT_CANDIDATES_PER_QUERY * count` best) come after every
    distinct one, so the queries start on different objects rather than
    on neighbouring positions of one. The one discontinuous step of the
    forward pass besides the matching, named so that equivalence tests can
    hold it fixed.
    """
    scores = jax.lax.stop_gradient(scores)
    if distinct_iou <= 0:
        return jax.lax.top_k(scores, count)[1]
    candidates = min(scores.shape[-1], DISTINCT_CANDIDATES_PER_QUERY * count)

    def one_image(image_scores, image_boxes):
        top_scores, top = jax.lax.top_k(image_scores, candidates)
        kept, valid = non_max_suppression(cxcywh_to_yxyx(image_boxes[top]), top_scores, distinct_iou, candidates)
        is_kept = jnp.zeros((candidates,), bool).at[kept].max(valid)
        # Distinct proposals first, then the suppressed ones, each in score order.
        rank = jnp.arange(candidates) + candidates * (~is_kept).astype(jnp.int32)
        return top[jnp.argsort(rank)[:count]]

    return jax.vmap(one_image)(scores, jax.lax.stop_gradient(boxes_cxcywh).astype(jnp.float32))


def _gather_queries(x: jax.Array, index: jax.Array) -> jax.Array:
    """`x [B, S, ...]`, `index [B, K]` -> `[B, K, ...]`."""
    return jnp.take_along_axis(x, index.reshape(*index.shape, *([1] * (x.ndim - 2))), axis=1)


class Dino(nn.Module):
    """The DINO detector.

    `__call__(images [B, H, W, 3], denoising=None, one_to_many=False)` returns float32 arrays:
      logits `[K, B, N, C]` and boxes `[K, B, N, 4]` (normalised cxcywh) of the
        N matching queries after each of the K decoder layers;
      encoder_logits `[B, N, C]`, encoder_boxes `[B, N, 4]`: the selected
        encoder proposals (two-stage), trained like a decoder layer;
      with `denoising` (a dict of labels int32 `[B, D]`, boxes_cxcywh
      `[B, D, 4]` and group int32 `[B, D]`, each slot's denoising group or
      -1, from `detector.ops.denoising.contrastive_denoising_queries`):
      denoising_logits `[K, B, D, C]` and denoising_boxes `[K, B, D, 4]` too;
      with `one_to_many` (training only, `num_one_to_many_queries` M > 0):
        one_to_many_logits `[K, B, M, C]` and one_to_many_boxes `[K, B, M, 4]`
        of H-DETR's hybrid branch: M more queries with their own learned
        content, the encoder proposals ranked N+1 to N+M as references, the
        same decoder and heads, seen by no other query.
        Their parameters exist whether or not a call uses them, so prediction
        and training share one parameter tree;
      with `mask_dim` > 0 (Mask DINO): pixel_embedding `[B, H/4, W/4,
        mask_dim]` (in `dtype`, from the backbone's stride-4 map, or a ViT's
        map upsampled to stride 4 by ViTDet's transposed convolutions, and the
        encoder's finest level, `mask_branch.PixelEmbedding`), mask_embeddings
        `[K, B, N, mask_dim]` of every decoder layer's queries (and
        `{segment}_mask_embeddings` for the denoising and one-to-many ones),
        encoder_mask_embeddings `[B, N, mask_dim]`: a query's mask logits are
        its embedding dotted with the map's cells (`mask_branch.mask_logits`).
    The decoder runs the queries side by side as `QueryLayout` orders them,
    with the attention mask it gives.
    """

    backbone: nn.Module  # images -> {level: features}
    neck: nn.Module  # {level: features} -> {level: [B, h, w, hidden_dim]}, 4 levels
    num_classes: int
    hidden_dim: int = 256
    num_heads: int = 8
    ffn_dim: int = 2048
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    num_points: int = 4
    num_queries: int = 900
    num_one_to_many_queries: int = 0
    distinct_query_iou: float = 0.0
    mask_dim: int = 0  # > 0: Mask DINO's mask branch, with embeddings of this width
    mask_enhanced_anchors: bool = False  # the one-to-one queries start from their proposals' mask boxes
    remat: str = "none"
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self, images: jax.Array, denoising: dict[str, jax.Array] | None = None, one_to_many: bool = False
    ) -> dict[str, jax.Array]:
        if one_to_many and not self.num_one_to_many_queries:
            raise ValueError("one_to_many=True needs num_one_to_many_queries > 0")
        layout = QueryLayout(
            num_one_to_one=self.num_queries,
            num_denoising=0 if denoising is None else denoising["labels"].shape[1],
            num_one_to_many=self.num_one_to_many_queries if one_to_many else 0,
        )
        features = self.backbone(images)
        pyramid = self.neck(features)
        levels = sorted(pyramid)
        spatial_shapes = tuple((int(pyramid[level].shape[1]), int(pyramid[level].shape[2])) for level in levels)
        batch, embed = images.shape[0], self.hidden_dim
        queries = self.num_queries

        level_embed = self.param(
            "level_embed",
            nn.with_logical_partitioning(nn.initializers.normal(1.0), (None, "norm")),
            (len(levels), embed),
        )
        tokens = jnp.concatenate([pyramid[level].reshape(batch, -1, embed) for level in levels], axis=1)
        tokens = nn.with_logical_constraint(tokens.astype(self.dtype), TOKEN_AXES)
        position = jnp.concatenate(
            [
                jnp.asarray(map_position_embedding(h, w, embed)) + level_embed[i]
                for i, (h, w) in enumerate(spatial_shapes)
            ]
        )[None].astype(self.dtype)

        encoder_reference = jnp.asarray(encoder_reference_points(list(spatial_shapes)))[None]
        layer_shape = dict(
            num_heads=self.num_heads,
            num_levels=len(levels),
            num_points=self.num_points,
            ffn_dim=self.ffn_dim,
            spatial_shapes=spatial_shapes,
            dtype=self.dtype,
        )
        encoder_layer = rematerialized(EncoderLayer, self.remat)
        memory = tokens
        for i in range(self.num_encoder_layers):
            memory = encoder_layer(**layer_shape, name=f"encoder{i}")(memory, position, encoder_reference)

        mask_outputs = {}
        if self.mask_dim:
            if 2 in features:
                stride4 = features[2]
            else:
                # A plain ViT's one map (stride 16): ViTDet's transposed convolutions up to stride 4, as its
                # simple pyramid builds P2.
                top_level = max(features)
                stride4 = constrain_activation(
                    deconvolution_upsample(features[top_level], top_level - 2, self.dtype, "mask_stride4_up")
                )
            height, width = spatial_shapes[0]  # the finest level leads the encoder's tokens
            finest = memory[:, : height * width].reshape(batch, height, width, embed)
            pixel_embedding = PixelEmbedding(embed, self.mask_dim, dtype=self.dtype, name="pixel_embedding")(
                stride4, finest
            )
            mask_outputs["pixel_embedding"] = pixel_embedding
            mask_head = PredictionMlp(embed, self.mask_dim, 3, dtype=self.dtype, name="mask_head")

        # Two-stage query selection: every position proposes a box; the N best
        # give the decoder its reference boxes (the content queries are learned).
        proposals, proposal_valid = encoder_proposals(list(spatial_shapes))
        selection_memory = jnp.where(jnp.asarray(proposal_valid)[None, :, None], memory, 0)
        selection_memory = Projection((embed,), ("embed", None), (None,), dtype=self.dtype, name="proposal_proj")(
            selection_memory
        )
        selection_memory = layer_norm(self.dtype, "proposal_norm", 1e-5)(selection_memory)
        proposal_logits = _class_head(self.num_classes, self.dtype, "encoder_class_head")(selection_memory).astype(
            jnp.float32
        )
        proposal_boxes = (
            PredictionMlp(embed, 4, 3, zero_last=True, dtype=self.dtype, name="encoder_box_head")(
                selection_memory
            ).astype(jnp.float32)
            + jnp.asarray(proposals)[None]
        )
        scores = jnp.where(jnp.asarray(proposal_valid)[None], jnp.max(proposal_logits, axis=-1), -jnp.inf)
        # The queries that start from encoder proposals, best first: the one-to-one
        # queries take the N best whether or not one-to-many ones follow.
        proposed = layout.without("denoising")
        selected = select_proposals(scores, proposed.total, jax.nn.sigmoid(proposal_boxes), self.distinct_query_iou)
        selected_boxes_logit = _gather_queries(proposal_boxes, selected)
        one_to_one_selected = proposed.split(selected, axis=1)["one_to_one"]
        encoder_logits = _gather_queries(proposal_logits, one_to_one_selected)
        encoder_boxes_logit = proposed.split(selected_boxes_logit, axis=1)["one_to_one"]
        reference = proposed.split(jax.lax.stop_gradient(jax.nn.sigmoid(selected_boxes_logit)), axis=1)
        output_norm = layer_norm(self.dtype, "decoder_norm", 1e-5)
        if self.mask_dim:  # the selected proposals' masks: Mask DINO trains them like a decoder layer's
            selected_features = output_norm(_gather_queries(selection_memory, one_to_one_selected))
            mask_outputs["encoder_mask_embeddings"] = mask_head(selected_features).astype(jnp.float32)
        if self.mask_enhanced_anchors:
            # Mask DINO's mask-enhanced box initialisation: a mask outlines its object better than the
            # proposal's box predicted from one position's features; no gradient through the start.
            proposal_masks = mask_logits(mask_outputs["encoder_mask_embeddings"], pixel_embedding) > 0
            mask_boxes, nonempty = mask_boxes_cxcywh(jax.lax.stop_gradient(proposal_masks))
            reference["one_to_one"] = jnp.where(nonempty[..., None], mask_boxes, reference["one_to_one"])

        content = self.param(
            "query_content", nn.with_logical_partitioning(nn.initializers.normal(1.0), (None, "norm")), (queries, embed)
        )
        content = {"one_to_one": content}
        if self.num_one_to_many_queries:
            one_to_many_content = self.param(
                "one_to_many_content",
                nn.with_logical_partitioning(nn.initializers.normal(1.0), (None, "norm")),
                (self.num_one_to_many_queries, embed),
            )
            if layout.num_one_to_many:
                content["one_to_many"] = one_to_many_content
        content = {
            segment: jnp.broadcast_to(learned.astype(self.dtype)[None], (batch, *learned.shape))
            for segment, learned in content.items()
        }
        label_embedding = nn.Embed(
            self.num_classes,
            embed,
            dtype=self.dtype,
            param_dtype=jnp.float32,
            # Replicated (C x E is small): an embed-split table would make the
            # lookup's gradient reshard every noised query's row.
            embedding_init=nn.with_logical_partitioning(nn.initializers.normal(1.0), (None, None)),
            name="denoising_label_embedding",
        )
        if denoising is not None:
            labels = jnp.clip(denoising["labels"], 0, self.num_classes - 1)
            content["denoising"] = nn.with_logical_constraint(label_embedding(labels), TOKEN_AXES)
            reference["denoising"] = denoising["boxes_cxcywh"].astype(jnp.float32)
        elif self.is_initializing():
            label_embedding(jnp.zeros((1, 1), jnp.int32))  # its parameters exist whether or not training denoises
        content = layout.concatenate(content, axis=1)
        reference = layout.concatenate(reference, axis=1)
        mask = layout.attention_mask(batch, None if denoising is None else denoising["group"])

        reference_head = PredictionMlp(embed, embed, 2, dtype=self.dtype, name="query_position_head")
        class_head = _class_head(self.num_classes, self.dtype, "class_head")
        box_head = PredictionMlp(embed, 4, 3, zero_last=True, dtype=self.dtype, name="box_head")
        decoder_layer = rematerialized(DecoderLayer, self.remat)
        x = nn.with_logical_constraint(content, TOKEN_AXES)
        previous_boxes = reference  # the previous layer's prediction, with its gradient
        all_logits, all_boxes, all_mask_embeddings = [], [], []
        for i in range(self.num_decoder_layers):
            reference = jax.lax.stop_gradient(previous_boxes)
            query_position = reference_head(box_position_embedding(reference, embed // 2).astype(self.dtype))
            x = decoder_layer(**layer_shape, name=f"decoder{i}")(x, query_position, reference, memory, mask)
            normed = output_norm(x)
            delta = box_head(normed).astype(jnp.float32)
            # Look forward twice: this layer's boxes refine the previous layer's
            # prediction with its gradient (so layer i's loss also trains layer
            # i - 1's box head), while the next layer samples around them
            # without it (reference above).
            boxes = jax.nn.sigmoid(delta + inverse_sigmoid(previous_boxes))
            all_logits.append(class_head(normed).astype(jnp.float32))
            all_boxes.append(boxes)
            if self.mask_dim:
                all_mask_embeddings.append(mask_head(normed).astype(jnp.float32))
            previous_boxes = boxes

        logits = layout.split(jnp.stack(all_logits), axis=2)
        boxes = layout.split(jnp.stack(all_boxes), axis=2)
        outputs = {
            "logits": logits["one_to_one"],
            "boxes": boxes["one_to_one"],
            "encoder_logits": encoder_logits,
            "encoder_boxes": jax.nn.sigmoid(encoder_boxes_logit),
        }
        for segment in layout.segments:
            if segment != "one_to_one":  # the training-only segments' outputs carry the segment's name
                outputs[f"{segment}_logits"], outputs[f"{segment}_boxes"] = logits[segment], boxes[segment]
        if self.mask_dim:
            mask_embeddings = layout.split(jnp.stack(all_mask_embeddings), axis=2)
            outputs.update(mask_outputs, mask_embeddings=mask_embeddings["one_to_one"])
            for segment in layout.segments:
                if segment != "one_to_one":
                    outputs[f"{segment}_mask_embeddings"] = mask_embeddings[segment]
        return outputs
