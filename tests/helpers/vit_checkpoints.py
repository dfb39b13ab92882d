"""ViT checkpoints as timm names them, with random values and no torch: state dicts, shapes, a tiny model.

A small ViT (width 64, depth 4, 4 heads, patch 16) for the numbers, the full
ViT-B (an MAE pretraining checkpoint's names and shapes) for the layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from detector.models.vit import ViT

WIDTH, DEPTH, HEADS, PATCH = 64, 4, 4, 16


def timm_vit_state_dict(
    width=WIDTH, depth=DEPTH, grid=8, class_token=True, final_norm=True, patch=PATCH, mae_decoder=False, seed=0
):
    """A timm `VisionTransformer` state dict (qkv_bias=True, mlp_ratio 4) with random values of a useful scale."""
    rng = np.random.default_rng(seed)
    hidden = 4 * width
    state = {}

    def array(shape, std, mean=0.0):
        return (mean + std * rng.standard_normal(shape)).astype(np.float32)

    def linear(name, out_features, in_features):
        state[f"{name}.weight"] = array((out_features, in_features), 1 / np.sqrt(in_features))
        state[f"{name}.bias"] = array(out_features, 0.5)

    def norm(name, features=width):
        state[f"{name}.weight"] = array(features, 0.25, mean=1.0)
        state[f"{name}.bias"] = array(features, 0.5)

    state["patch_embed.proj.weight"] = array((width, 3, patch, patch), 1 / np.sqrt(3 * patch * patch))
    state["patch_embed.proj.bias"] = array(width, 0.5)
    state["pos_embed"] = array((1, int(class_token) + grid * grid, width), 0.5)
    if class_token:
        state["cls_token"] = array((1, 1, width), 0.02)
    for i in range(depth):
        norm(f"blocks.{i}.norm1")
        linear(f"blocks.{i}.attn.qkv", 3 * width, width)
        linear(f"blocks.{i}.attn.proj", width, width)
        norm(f"blocks.{i}.norm2")
        linear(f"blocks.{i}.mlp.fc1", hidden, width)
        linear(f"blocks.{i}.mlp.fc2", width, hidden)
    if final_norm:
        norm("norm")
    else:  # timm's global-average-pooling variant: fc_norm instead of norm
        norm("fc_norm")
    linear("head", 10, width)
    if mae_decoder:
        state["mask_token"] = array((1, 1, 32), 0.02)
        linear("decoder_embed", 32, width)
        state["decoder_pos_embed"] = array((1, int(class_token) + grid * grid, 32), 0.02)
        linear("decoder_blocks.0.attn.qkv", 96, 32)
        norm("decoder_norm", 32)
        linear("decoder_pred", 3 * patch * patch, 32)
    return state


def timm_vit_shapes(width, depth, grid):
    """The names and shapes of a timm ViT/16 with a class token and a final norm (no classifier)."""
    shapes = {
        "cls_token": (1, 1, width),
        "pos_embed": (1, 1 + grid * grid, width),
        "patch_embed.proj.weight": (width, 3, 16, 16),
        "patch_embed.proj.bias": (width,),
        "norm.weight": (width,),
        "norm.bias": (width,),
    }
    for i in range(depth):
        block = {
            "norm1.weight": (width,),
            "norm1.bias": (width,),
            "attn.qkv.weight": (3 * width, width),
            "attn.qkv.bias": (3 * width,),
            "attn.proj.weight": (width, width),
            "attn.proj.bias": (width,),
            "norm2.weight": (width,),
            "norm2.bias": (width,),
            "mlp.fc1.weight": (4 * width, width),
            "mlp.fc1.bias": (4 * width,),
            "mlp.fc2.weight": (width, 4 * width),
            "mlp.fc2.bias": (width,),
        }
        shapes.update({f"blocks.{i}.{name}": shape for name, shape in block.items()})
    return shapes


def vit_b_mae_shapes():
    """The names and shapes of MAE's ViT-B/16 pretraining checkpoint (224 px, with its decoder)."""
    shapes = timm_vit_shapes(768, 12, 14)
    shapes.update(
        {
            "mask_token": (1, 1, 512),
            "decoder_embed.weight": (512, 768),
            "decoder_embed.bias": (512,),
            "decoder_pos_embed": (1, 197, 512),
            "decoder_norm.weight": (512,),
            "decoder_norm.bias": (512,),
            "decoder_pred.weight": (768, 512),
            "decoder_pred.bias": (768,),
        }
    )
    for k in range(8):
        shapes.update({f"decoder_blocks.{k}.attn.qkv.weight": (1536, 512), f"decoder_blocks.{k}.norm1.weight": (512,)})
    return shapes


def zeros_without_memory(shapes):
    return {name: np.broadcast_to(np.float32(0), shape) for name, shape in shapes.items()}


def random_images(size, batch=2, seed=1):
    return np.random.default_rng(seed).standard_normal((batch, 3, *size)).astype(np.float32)


def tiny_vit(**overrides):
    kwargs = dict(
        embed_dim=WIDTH, depth=DEPTH, num_heads=HEADS, window_size=4, global_attention_every=2, pretrain_image_size=128
    )
    return ViT(**{**kwargs, **overrides})


def abstract_params(model, size=(128, 128)):
    return jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, *size, 3)))["params"]
