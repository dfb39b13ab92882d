"""Mask DINO's mask branch: one per-pixel embedding map at stride 4, and each query's mask embedding.

A query's mask logits are the dot product of its mask embedding with the
pixel embedding at every cell (Li et al. 2023, as Mask2Former), so the
branch adds no per-query map to the model's outputs: the losses sample the
pixel embedding at points (`detector.ops.mask_losses`) and prediction forms
the maps of its top queries only. Shapes stay static and the map's rows may
shard over `model` as the conv activations do (`layers.ACTIVATION_AXES`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from detector.models.layers import constrain_activation, conv, group_norm, relu

# Network pixels per cell of the pixel embedding (the backbone's level 2): the grid of the ground-truth
# masks the losses compare with and of the mask logits prediction returns.
STRIDE = 4


class PixelEmbedding(nn.Module):
    """The pixel embedding map from the backbone's stride-4 features and the encoder's finest level.

    Mask DINO's pixel decoder: a 1x1 convolution and GroupNorm of the
    stride-4 backbone map, plus the deformable encoder's output at its finest
    level resized bilinearly to it, then a 3x3 convolution, GroupNorm and
    ReLU, and a 1x1 convolution to `mask_dim` channels.

    `__call__(stride4 [B, H4, W4, C], finest [B, h, w, E]) -> [B, H4, W4, mask_dim]` in `dtype`.
    """

    hidden_dim: int
    mask_dim: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, stride4: jax.Array, finest: jax.Array) -> jax.Array:
        batch, height, width, _ = stride4.shape
        xavier = nn.initializers.xavier_uniform()
        lateral = conv(self.hidden_dim, 1, dtype=self.dtype, kernel_init=xavier, name="lateral")(stride4)
        lateral = group_norm(self.hidden_dim, num_groups=32, dtype=self.dtype, name="lateral_norm")(lateral)
        upsampled = jax.image.resize(
            finest.astype(self.dtype), (batch, height, width, finest.shape[-1]), method="bilinear"
        )
        x = constrain_activation(lateral + upsampled)
        x = conv(self.hidden_dim, 3, use_bias=False, dtype=self.dtype, kernel_init=xavier, name="output")(x)
        x = relu(group_norm(self.hidden_dim, num_groups=32, dtype=self.dtype, name="output_norm")(x))
        x = conv(self.mask_dim, 1, dtype=self.dtype, kernel_init=xavier, name="mask_features")(constrain_activation(x))
        return constrain_activation(x)


def mask_logits(mask_embeddings: jax.Array, pixel_embedding: jax.Array) -> jax.Array:
    """Queries' mask logits on the whole map: `[..., B, N, C]` x `[B, H4, W4, C]` -> `[..., B, N, H4, W4]` float32.

    For prediction and tests; training samples the map at points instead.
    """
    return jnp.einsum("...bnc,bhwc->...bnhw", mask_embeddings.astype(jnp.float32), pixel_embedding.astype(jnp.float32))
