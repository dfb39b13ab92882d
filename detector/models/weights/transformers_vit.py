"""transformers' `ViTModel` and `ViTMAEModel` checkpoints, as published and as transformers 5 names them.

  embeddings.cls_token                      -> cls_token
  embeddings.position_embeddings            -> pos_embed
  embeddings.patch_embeddings.projection.*  -> patch_embed.proj.*
  encoder.layer.i. (5: layers.i.)           -> blocks.i.
      layernorm_before / layernorm_after    -> norm1 / norm2
      attention.attention.{query,key,value} -> attn.qkv (5: attention.{q,k,v}_proj)
      attention.output.dense                -> attn.proj (5: attention.o_proj)
      intermediate.dense / output.dense     -> mlp.fc1 / mlp.fc2 (5: the same names)
  layernorm.*                               -> norm.*

Dropped: the pooler (`pooler.*`) and `embeddings.mask_token`. Told from
Dinov2's layout, whose patch embedding it shares, by `layernorm_before`
(Dinov2's blocks have `norm1`). No tensor holds the LayerNorm epsilon:
transformers' ViTConfig has 1e-12 (`layer_norm_eps`), the model's
`norm_epsilon` 1e-6 unless set.
"""

from __future__ import annotations

from detector.models.weights import transformers_dinov2
from detector.models.weights.canonical import Source

SOURCE = Source(
    name="transformers ViTModel",
    checkpoints="transformers' ViTModel/ViTMAEModel",
    patch_embedding="embeddings.patch_embeddings.projection.weight",
    also_has=r"\.layernorm_before\.",
    trunk_renames=(
        (r"^embeddings\.cls_token$", "cls_token"),
        (r"^embeddings\.position_embeddings$", "pos_embed"),
        (r"^embeddings\.patch_embeddings\.projection\.", "patch_embed.proj."),
        (r"^(?:encoder\.layer|layers)\.(\d+)\.", r"blocks.\1."),
        (r"^layernorm\.", "norm."),
    ),
    block_renames=(
        *transformers_dinov2.ATTENTION_RENAMES,  # before output.dense, which attention.output.dense ends with
        (r"\.layernorm_before\.", ".norm1."),
        (r"\.layernorm_after\.", ".norm2."),
        (r"\.intermediate\.dense\.", ".mlp.fc1."),
        (r"\.output\.dense\.", ".mlp.fc2."),
    ),
    ignored=("embeddings.mask_token",),
    ignored_prefixes=("pooler.",),
)
