"""transformers' `DINOv3ViTModel` checkpoints: Dinov2's blocks in transformers 5's names, RoPE, no position embedding.

  embeddings.cls_token / .register_tokens  -> cls_token / reg_token
  embeddings.patch_embeddings.*            -> patch_embed.proj.*
  (model.)layer.i.                         -> blocks.i. (then the blocks as in `transformers_dinov2`)
  rope_embeddings.inv_freq                 -> rope.periods (1 / inv_freq; checked, then dropped)
  norm.*                                   -> kept

Dropped: `embeddings.mask_token`. transformers does not save the RoPE
buffer, and no tensor holds the LayerNorm epsilon: the config sets
`rope='dinov3'`, `rope_temperature=100`, `norm_epsilon=1e-5`.
"""

from __future__ import annotations

from detector.models.weights import transformers_dinov2
from detector.models.weights.canonical import Source

SOURCE = Source(
    name="transformers DINOv3ViT",
    checkpoints="transformers' DINOv3ViTModel",
    patch_embedding="embeddings.patch_embeddings.weight",
    trunk_renames=(
        (r"^embeddings\.cls_token$", "cls_token"),
        (r"^embeddings\.register_tokens$", "reg_token"),
        (r"^embeddings\.patch_embeddings\.", "patch_embed.proj."),
        (r"^(?:model\.)?layer\.(\d+)\.", r"blocks.\1."),
        (r"^rope_embeddings\.inv_freq$", "rope.inv_freq"),
    ),
    block_renames=transformers_dinov2.BLOCK_RENAMES,
    ignored=("embeddings.mask_token",),
)
