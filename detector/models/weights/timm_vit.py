"""timm's ViT checkpoints: `VisionTransformer` and `Eva`, whose names are the canonical ones but inside Eva's blocks.

  VisionTransformer: MAE, DeiT, AugReg, `vit_*_patch14_dinov2`, `vit_*_patch14_reg4_dinov2`
  Eva: `vit_*_patch16_dinov3` (+ `_qkvb`), `eva02_*_patch14_*`
      blocks.i.gamma_{1,2}               -> blocks.i.ls{1,2}.gamma
      blocks.i.attn.{q,k,v}_proj.*       -> blocks.i.attn.qkv.* (unfused: EVA-02 B/L)
      blocks.i.attn.{q,v}_bias (no k's)  -> kept as they are

Always dropped: the classifier (`head.*`), the pooled vector's norm
(`fc_norm.*`; a file with it has no `norm.*`, so it loads into
`final_norm=False`), MAE's `mask_token` and decoder (`decoder*`), and a
masked-image-modelling head (`lm_head.*`). A converted `.npz` (the
canonical names) is read as this layout too.
"""

from __future__ import annotations

from detector.models.weights.canonical import PATCH_EMBEDDING, Source

BLOCK_RENAMES = (
    (r"\.gamma_([12])$", r".ls\1.gamma"),
    (r"\.attn\.([qkv])_proj\.", r".attn.\1."),
)

SOURCE = Source(
    name="timm",
    checkpoints="timm's VisionTransformer/Eva (MAE, DeiT, DINOv2, DINOv3, EVA-02)",
    patch_embedding=PATCH_EMBEDDING,
    block_renames=BLOCK_RENAMES,
    ignored=("mask_token",),
    ignored_prefixes=("head.", "fc_norm.", "decoder", "lm_head."),
)
