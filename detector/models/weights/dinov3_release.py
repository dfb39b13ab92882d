"""DINOv3's own checkpoints (Meta's release, e.g. `dinov3_vitl16_pretrain_*.pth`): timm's names but for two tensors.

  storage_tokens      -> reg_token
  rope_embed.periods  -> rope.periods (checked against the model's RoPE, then dropped)

Told from timm's layout, whose patch embedding it shares, by these two
names. Dropped as in timm's layout, `mask_token` among them. The periods
give `rope_temperature` (with `rope='dinov3'`); no tensor holds the
LayerNorm epsilon, DINOv3's `norm_epsilon=1e-5`.
"""

from __future__ import annotations

from detector.models.weights import timm_vit
from detector.models.weights.canonical import PATCH_EMBEDDING, Source

SOURCE = Source(
    name="DINOv3 release",
    checkpoints="DINOv3's own release",
    patch_embedding=PATCH_EMBEDDING,
    also_has=r"^(storage_tokens|rope_embed\.periods)$",
    trunk_renames=(
        (r"^storage_tokens$", "reg_token"),
        (r"^rope_embed\.periods$", "rope.periods"),
    ),
    # Its blocks are timm's (ls1.gamma, attn.qkv); with Eva's renames too, timm's DINOv3 blocks (gamma_1)
    # under DINOv3's own trunk names load as well.
    block_renames=timm_vit.BLOCK_RENAMES,
    ignored=timm_vit.SOURCE.ignored,
    ignored_prefixes=timm_vit.SOURCE.ignored_prefixes,
)
