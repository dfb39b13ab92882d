"""timm ViT weights -> the Flax ViT backbone: the mapping, the position-embedding resize, the converter.

The loaded backbone's output is checked against a reference forward pass written
in numpy on the timm tensors (NCHW images, `[out, in]` weights, timm's token
and qkv order), with ViTDet's windowed blocks as `detector.models.vit`
computes them (zero-padded windows, padding tokens attended to).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from configs import vitdet_b_coco, vitdet_tiny
from detector.errors import WeightsFileError
from detector.models import families, weights
from detector.models.retinanet import create_model
from tests.helpers import REPO_ROOT
from tests.helpers.vit_checkpoints import (
    HEADS,
    WIDTH,
    abstract_params,
    random_images,
    timm_vit_state_dict,
    tiny_vit,
    vit_b_mae_shapes,
)

erf = np.vectorize(math.erf)


# ---- the reference: timm's forward_features, with ViTDet's windows, in float64 numpy ----


def keys_cubic(x, a=-0.5):
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def bicubic_matrix(size_in, size_out):
    """`[size_out, size_in]`: Keys cubic (a = -0.5) at half-pixel centres, widened by the shrink factor, renormalised.

    torch's `F.interpolate(mode='bicubic', align_corners=False, antialias=True)` (and PIL's resize).
    """
    step = size_in / size_out
    centres = (np.arange(size_out) + 0.5) * step - 0.5
    weights = keys_cubic((centres[:, None] - np.arange(size_in)[None, :]) / max(step, 1.0))
    return weights / weights.sum(axis=1, keepdims=True)


def resize_grid(grid, size):
    """`[h, w, D]` -> `[size[0], size[1], D]` with `bicubic_matrix` along each axis."""
    if grid.shape[:2] == tuple(size):
        return grid
    return np.einsum(
        "ai,bj,ijd->abd", bicubic_matrix(grid.shape[0], size[0]), bicubic_matrix(grid.shape[1], size[1]), grid
    )


def layer_norm(x, state, name):
    mean = x.mean(-1, keepdims=True)
    y = (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-6)
    return y * state[f"{name}.weight"] + state[f"{name}.bias"]


def linear(x, state, name):
    return x @ state[f"{name}.weight"].T + state[f"{name}.bias"]


def multi_head_attention(tokens, state, name, num_heads):
    """timm's Attention on `[groups, N, D]`: qkv split (q|k|v, head, head_dim), heads concatenated before proj."""
    groups, n, d = tokens.shape
    qkv = linear(tokens, state, f"{name}.qkv").reshape(groups, n, 3, num_heads, d // num_heads).transpose(2, 0, 3, 1, 4)
    q, k, v = qkv  # [groups, heads, N, head_dim]
    logits = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d // num_heads)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = (weights @ v).transpose(0, 2, 1, 3).reshape(groups, n, d)
    return linear(out, state, f"{name}.proj")


def windowed_attention(x, state, name, num_heads, window):
    """ViTDet's: `[B, h, w, D]` zero-padded to whole windows, attention within each, padding cropped."""
    b, h, w, d = x.shape
    if not window:
        return multi_head_attention(x.reshape(b, h * w, d), state, name, num_heads).reshape(b, h, w, d)
    hp, wp = -(-h // window) * window, -(-w // window) * window
    x = np.pad(x, ((0, 0), (0, hp - h), (0, wp - w), (0, 0)))
    windows = x.reshape(b, hp // window, window, wp // window, window, d).transpose(0, 1, 3, 2, 4, 5)
    out = multi_head_attention(windows.reshape(-1, window * window, d), state, name, num_heads)
    out = out.reshape(b, hp // window, wp // window, window, window, d).transpose(0, 1, 3, 2, 4, 5)
    return out.reshape(b, hp, wp, d)[:, :h, :w]


def reference_vit(state, images_nchw, *, num_heads, window_size, global_attention_every, model_grid):
    """`[B, H/16, W/16, D]`: patch embedding, position embedding resized file grid -> model grid -> input grid,
    pre-norm blocks (windowed, every `global_attention_every`-th global), exact GELU, then the final norm if the
    file has one (timm's `forward_features`: a file with `fc_norm` instead applies it to the pooled vector only)."""
    state = {name: np.asarray(value, np.float64) for name, value in state.items()}
    images = np.asarray(images_nchw, np.float64)
    weight = state["patch_embed.proj.weight"]  # [D, 3, P, P]
    d, _, p, _ = weight.shape
    b, c, height, width = images.shape
    h, w = height // p, width // p
    patches = images.reshape(b, c, h, p, w, p).transpose(0, 2, 4, 1, 3, 5).reshape(b, h, w, c * p * p)
    x = patches @ weight.reshape(d, -1).T + state["patch_embed.proj.bias"]

    pos = state["pos_embed"][0]
    side = math.isqrt(pos.shape[0])
    pos = pos[pos.shape[0] - side * side :].reshape(side, side, d)  # without the class token's entry
    x = x + resize_grid(resize_grid(pos, model_grid), (h, w))

    depth = 1 + max(int(name.split(".")[1]) for name in state if name.startswith("blocks."))
    for i in range(depth):
        window = 0 if i % global_attention_every == global_attention_every - 1 else window_size
        x = x + windowed_attention(
            layer_norm(x, state, f"blocks.{i}.norm1"), state, f"blocks.{i}.attn", num_heads, window
        )
        y = linear(layer_norm(x, state, f"blocks.{i}.norm2"), state, f"blocks.{i}.mlp.fc1")
        x = x + linear(0.5 * y * (1 + erf(y / np.sqrt(2))), state, f"blocks.{i}.mlp.fc2")
    return layer_norm(x, state, "norm") if "norm.weight" in state else x


def assert_close(ours, expected):
    expected = np.asarray(expected)
    assert ours.shape == expected.shape
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(expected).max()))


# ---- mapping ----


@pytest.mark.parametrize(
    "file_grid,class_token,final_norm,model,size",
    [
        # The model's grid (128 px / 16) is the file's; the forward pass resizes it to 10x7 (up and down).
        (8, True, True, dict(scan=True, global_attention_every=2), (160, 112)),
        # Loading resizes 6x6 -> 8x8, the forward pass 8x8 -> 6x9; no class token, no final norm (fc_norm).
        (6, False, False, dict(scan=False, global_attention_every=4, final_norm=False), (96, 144)),
    ],
    ids=["scanned_class_token", "unscanned_resized_on_load"],
)
def test_loaded_vit_matches_reference_forward(tmp_path, file_grid, class_token, final_norm, model, size):
    state = timm_vit_state_dict(grid=file_grid, class_token=class_token, final_norm=final_norm)
    np.savez(tmp_path / "timm_vit.npz", **state)
    vit = tiny_vit(**model)
    loaded = weights.load_backbone_params({"backbone": abstract_params(vit)}, tmp_path / "timm_vit.npz")
    images = random_images(size)
    ours = jax.jit(vit.apply)({"params": loaded["backbone"]}, images.transpose(0, 2, 3, 1))[4]
    expected = reference_vit(
        state,
        images,
        num_heads=HEADS,
        window_size=4,
        global_attention_every=model["global_attention_every"],
        model_grid=(8, 8),
    )
    assert ours.shape == (2, size[0] // 16, size[1] // 16, WIDTH)
    assert_close(ours, expected)


def test_a_file_without_a_final_norm_needs_a_model_without_one(tmp_path):
    """timm's average-pooling ViTs (EVA-02 as registered) keep `fc_norm` for the pooled vector and no `norm`:
    their tokens leave the last block unnormalised. A final LayerNorm, even at scale 1 and bias 0, would still
    standardise every token, so such a file loads into `final_norm=False` only, and the converter says so."""
    state = timm_vit_state_dict(final_norm=False)
    np.savez(tmp_path / "fc_norm_vit.npz", **state)
    with pytest.raises(WeightsFileError, match=r"final_norm=False \(the file has no norm\.\*"):
        weights.load_backbone_params({"backbone": abstract_params(tiny_vit())}, tmp_path / "fc_norm_vit.npz")
    # And the other way: a final norm in the file, none in the model.
    np.savez(tmp_path / "norm_vit.npz", **timm_vit_state_dict(final_norm=True))
    with pytest.raises(WeightsFileError, match=r"final_norm=True \(the file has a final norm"):
        weights.load_backbone_params(
            {"backbone": abstract_params(tiny_vit(final_norm=False))}, tmp_path / "norm_vit.npz"
        )
    report = weights.convert_pretrained_file(tmp_path / "fc_norm_vit.npz", tmp_path / "converted.npz")
    assert "final_norm=False" in report and "identity" not in report, report
    assert "norm/scale" not in traverse_util.flatten_dict(abstract_params(tiny_vit(final_norm=False)), sep="/")


@pytest.mark.parametrize("grid,size", [((8, 8), (6, 6)), ((8, 8), (11, 5)), ((14, 14), (64, 64))])
def test_position_embedding_resize_is_the_models_bicubic(grid, size):
    pos = np.random.default_rng(0).standard_normal((1, *grid, 8)).astype(np.float32)
    resized = weights.resize_position_embedding(pos, size)
    assert resized.dtype == np.float32
    np.testing.assert_allclose(resized[0], resize_grid(pos[0].astype(np.float64), size), rtol=1e-5, atol=1e-5)
    # The same as the forward pass's resize (detector.models.vit), so loading and running agree.
    np.testing.assert_allclose(resized, jax.image.resize(pos, (1, *size, 8), method="bicubic"), rtol=1e-6, atol=1e-6)


def test_vit_b_mae_layout_maps_onto_vitdet_b():
    """Names and shapes only, at the real size: each tensor is one distinct constant, which tells where it went."""
    shapes = vit_b_mae_shapes()
    ids = {name: float(k) for k, name in enumerate(sorted(shapes))}
    # Zero strides: the file's 112M values take no memory.
    state = {name: np.broadcast_to(np.float32(ids[name]), shape) for name, shape in shapes.items()}
    config = vitdet_b_coco.get_config()
    model = create_model(config.model, 80, families.num_anchors_per_location(config))
    backbone = abstract_params(model, (224, 224))["backbone"]

    converted = traverse_util.flatten_dict(weights.convert_timm_vit(state, backbone), sep="/")
    model_leaves = traverse_util.flatten_dict(backbone, sep="/")
    assert set(converted) == set(model_leaves)
    for name, leaf in model_leaves.items():
        assert converted[name].shape == leaf.value.shape and converted[name].dtype == np.float32, name
    assert converted["stages/windowed/attn/qkv/kernel"].shape == (4, 2, 768, 3, 12, 64)
    assert converted["pos_embed"].shape == (1, 14, 14, 768)  # 224 px: the file's grid, kept

    def source(name, index=()):
        values = np.unique(converted[name][index])
        assert values.size == 1, name
        return next(key for key, value in ids.items() if value == values[0])

    # Global attention in blocks 2, 5, 8, 11 (every 3rd); the rest windowed, two per stage.
    assert source("stages/windowed/attn/qkv/kernel", (0, 0)) == "blocks.0.attn.qkv.weight"
    assert source("stages/windowed/mlp/fc1/kernel", (1, 1)) == "blocks.4.mlp.fc1.weight"
    assert source("stages/windowed/norm2/bias", (3, 0)) == "blocks.9.norm2.bias"
    assert source("stages/global/attn/out/kernel", (0,)) == "blocks.2.attn.proj.weight"
    assert source("stages/global/mlp/fc2/bias", (3,)) == "blocks.11.mlp.fc2.bias"
    assert source("stages/global/norm1/scale", (2,)) == "blocks.8.norm1.weight"
    assert source("patch_embed/kernel") == "patch_embed.proj.weight"
    assert source("norm/scale") == "norm.weight"
    assert source("pos_embed") == "pos_embed"
    assert weights.ignored_vit_keys(state) == sorted(
        name for name in shapes if name == "mask_token" or name.startswith("decoder")
    )  # the class token is dropped only because ViTDet-B has none (see the foundation-backbone tests)


# ---- the converter and the trainer's path ----


@pytest.mark.slow  # a subprocess and a compile, ~7 s
def test_cli_converts_safetensors_that_the_trainer_path_loads(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    state = timm_vit_state_dict(grid=8, mae_decoder=True)
    safetensors_numpy.save_file(state, str(tmp_path / "vit_tiny_mae.safetensors"))
    output = tmp_path / "vit_tiny.npz"
    # The model is built while the converter spends seconds importing.
    converting = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "detector.convert_pretrained",
            f"--input={tmp_path / 'vit_tiny_mae.safetensors'}",
            f"--output={output}",
        ],
        cwd=REPO_ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    config = vitdet_tiny.get_config()
    config.model.backbone.pretrained = str(output)
    model = create_model(config.model, 3, families.num_anchors_per_location(config))
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 128, 128, 3)))["params"]
    images = random_images((96, 160))
    expected = reference_vit(state, images, num_heads=HEADS, window_size=4, global_attention_every=2, model_grid=(8, 8))

    stdout, stderr = converting.communicate(timeout=120)
    assert converting.returncode == 0, stderr
    assert "timm ViT, depth 4, width 64, MLP 256, patch 16; heads not stored" in stdout
    assert "position embedding: 8x8 grid (128 px), with a class-token entry" in stdout
    assert "its family: model.backbone.patch_size=16, class_token=True, register_tokens=0" in stdout
    assert (
        "ignored: decoder_blocks.* (2), decoder_embed.* (2), decoder_norm.* (2), decoder_pos_embed, "
        "decoder_pred.* (2), head.* (2), mask_token" in stdout
    )
    with np.load(output) as npz:
        kept = set(state) - set(weights.ignored_vit_keys(state))
        assert set(npz.files) == kept | {"class_pos_embed"}
        # The class token's entry split off: the tiny ViTDet has no class token and drops both on loading.
        np.testing.assert_array_equal(npz["pos_embed"], state["pos_embed"][:, 1:])
        np.testing.assert_array_equal(npz["class_pos_embed"], state["pos_embed"][:, :1])

    loaded = weights.load_backbone_params(params, config.model.backbone.pretrained)
    assert loaded["neck"] is params["neck"] and loaded["head"] is params["head"]
    model_leaves = traverse_util.flatten_dict(params["backbone"], sep="/")
    for name, leaf in traverse_util.flatten_dict(loaded["backbone"], sep="/").items():
        assert isinstance(leaf, nn.LogicallyPartitioned) and leaf.names == model_leaves[name].names, name
        assert isinstance(leaf.value, jax.Array) and leaf.value.sharding == model_leaves[name].value.sharding
    features = jax.jit(model.backbone.apply)(
        {"params": nn.meta.unbox(loaded["backbone"])}, images.transpose(0, 2, 3, 1)
    )
    assert_close(features[4], expected)
