"""transformers' `Dinov2Model` and `Dinov2WithRegistersModel` checkpoints, as published and in transformers 5.

  embeddings.cls_token / .register_tokens      -> cls_token / reg_token
  embeddings.position_embeddings               -> pos_embed
  embeddings.patch_embeddings.projection.*     -> patch_embed.proj.*
  encoder.layer.i.                             -> blocks.i.
      attention.attention.{query,key,value}    -> attn.qkv (5: attention.{q,k,v}_proj)
      attention.output.dense                   -> attn.proj (5: attention.o_proj)
      layer_scale{1,2}.lambda1                 -> ls{1,2}.gamma
      mlp.weights_in / mlp.weights_out         -> mlp.fc1_g + fc1_x (halves, gate first) / mlp.fc2 (SwiGLU, ViT-g)
      mlp.gate_proj / up_proj / down_proj      -> mlp.fc1_g / fc1_x / fc2 (5: SwiGLU)
      norm1, norm2, mlp.fc1, mlp.fc2           -> kept (GELU)
  layernorm.*                                  -> norm.*

Dropped: `embeddings.mask_token`.
"""

from __future__ import annotations

from detector.models.weights.canonical import Source

# transformers' self-attention, shared by its ViT-like models: first as published, then transformers 5's names.
ATTENTION_RENAMES = (
    (r"\.attention\.attention\.query\.", ".attn.q."),
    (r"\.attention\.attention\.key\.", ".attn.k."),
    (r"\.attention\.attention\.value\.", ".attn.v."),
    (r"\.attention\.output\.dense\.", ".attn.proj."),
    (r"\.attention\.([qkv])_proj\.", r".attn.\1."),
    (r"\.attention\.o_proj\.", ".attn.proj."),
)
BLOCK_RENAMES = (
    *ATTENTION_RENAMES,
    (r"\.layer_scale([12])\.lambda1$", r".ls\1.gamma"),
    (r"\.mlp\.weights_in\.", ".mlp.fc1_packed."),
    (r"\.mlp\.weights_out\.", ".mlp.fc2."),
    (r"\.mlp\.gate_proj\.", ".mlp.fc1_g."),
    (r"\.mlp\.up_proj\.", ".mlp.fc1_up."),
    (r"\.mlp\.down_proj\.", ".mlp.fc2."),
)

SOURCE = Source(
    name="transformers Dinov2",
    checkpoints="transformers' Dinov2Model/Dinov2WithRegistersModel",
    patch_embedding="embeddings.patch_embeddings.projection.weight",
    trunk_renames=(
        (r"^embeddings\.cls_token$", "cls_token"),
        (r"^embeddings\.register_tokens$", "reg_token"),
        (r"^embeddings\.position_embeddings$", "pos_embed"),
        (r"^embeddings\.patch_embeddings\.projection\.", "patch_embed.proj."),
        (r"^encoder\.layer\.(\d+)\.", r"blocks.\1."),
        (r"^layernorm\.", "norm."),
    ),
    block_renames=BLOCK_RENAMES,
    ignored=("embeddings.mask_token",),
)
