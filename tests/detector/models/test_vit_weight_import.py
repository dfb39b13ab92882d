"""timm ViT weights -> the Flax ViT backbone: mapping, position-embedding resize, errors, converter, loading.

State dicts are built here with timm's names and shapes and random values:
a small ViT (width 64, depth 4, 4 heads, patch 16) for the numbers, the full
ViT-B (an MAE pretraining checkpoint's names and shapes) for the layout. The
loaded backbone's output is checked against a reference forward pass written
in numpy on the timm tensors (NCHW images, `[out, in]` weights, timm's token
and qkv order), with ViTDet's windowed blocks as `detector.models.vit`
computes them (zero-padded windows, padding tokens attended to).
"""

from __future__ import annotations

import importlib.util
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

from configs import default, vitdet_b_coco, vitdet_tiny
from detector.errors import WeightsFileError
from detector.models import families, weight_import
from detector.models.retinanet import create_model
from detector.models.vit import ViT
from tests.helpers import REPO_ROOT
from tests.helpers.foundation_vit import dinov3_options

WIDTH, DEPTH, HEADS, PATCH = 64, 4, 4, 16
erf = np.vectorize(math.erf)


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


def random_images(size, batch=2, seed=1):
    return np.random.default_rng(seed).standard_normal((batch, 3, *size)).astype(np.float32)


def tiny_vit(**overrides):
    kwargs = dict(
        embed_dim=WIDTH, depth=DEPTH, num_heads=HEADS, window_size=4, global_attention_every=2, pretrain_image_size=128
    )
    return ViT(**{**kwargs, **overrides})


def abstract_params(model, size=(128, 128)):
    return jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, *size, 3)))["params"]


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
    loaded = weight_import.load_backbone_params({"backbone": abstract_params(vit)}, tmp_path / "timm_vit.npz")
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
        weight_import.load_backbone_params({"backbone": abstract_params(tiny_vit())}, tmp_path / "fc_norm_vit.npz")
    # And the other way: a final norm in the file, none in the model.
    np.savez(tmp_path / "norm_vit.npz", **timm_vit_state_dict(final_norm=True))
    with pytest.raises(WeightsFileError, match=r"final_norm=True \(the file has a final norm"):
        weight_import.load_backbone_params(
            {"backbone": abstract_params(tiny_vit(final_norm=False))}, tmp_path / "norm_vit.npz"
        )
    report = weight_import.convert_pretrained_file(tmp_path / "fc_norm_vit.npz", tmp_path / "converted.npz")
    assert "final_norm=False" in report and "identity" not in report, report
    assert "norm/scale" not in traverse_util.flatten_dict(abstract_params(tiny_vit(final_norm=False)), sep="/")


@pytest.mark.parametrize("grid,size", [((8, 8), (6, 6)), ((8, 8), (11, 5)), ((14, 14), (64, 64))])
def test_position_embedding_resize_is_the_models_bicubic(grid, size):
    pos = np.random.default_rng(0).standard_normal((1, *grid, 8)).astype(np.float32)
    resized = weight_import.resize_position_embedding(pos, size)
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

    converted = traverse_util.flatten_dict(weight_import.convert_timm_vit(state, backbone), sep="/")
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
    assert weight_import.ignored_timm_vit_keys(state) == sorted(
        name for name in shapes if name == "mask_token" or name.startswith("decoder")
    )  # the class token is dropped only because ViTDet-B has none (see the foundation-backbone tests)


# Runs in its own process: torch can crash on import next to TensorFlow, which this test process has loaded.
_TIMM_FEATURES = r"""
import sys
import numpy as np
import timm
import torch

torch.manual_seed(0)
# No class token (our backbone has none to attend to) and one 8x8 window over the whole 128 px grid.
net = timm.models.vision_transformer.VisionTransformer(
    img_size=128, patch_size=16, embed_dim=64, depth=4, num_heads=4, mlp_ratio=4.0, qkv_bias=True,
    class_token=False, global_pool="", num_classes=0,
).eval()
with torch.no_grad():
    for name, tensor in net.named_parameters():
        if tensor.ndim >= 2:
            tensor.normal_(0, tensor[0].numel() ** -0.5)
        elif "norm" in name and name.endswith("weight"):
            tensor.normal_(1, 0.25)
        else:
            tensor.normal_(0, 0.5)
    features = net.forward_features(torch.from_numpy(np.load(sys.argv[1])))
arrays = {"state." + name: tensor.numpy() for name, tensor in net.state_dict().items()}
np.savez(sys.argv[2], features=features.numpy(), **arrays)
"""


def test_matches_timm_vision_transformer(tmp_path):
    if importlib.util.find_spec("timm") is None or importlib.util.find_spec("torch") is None:
        pytest.skip("timm and torch are not installed")
    images = random_images((128, 128))
    np.save(tmp_path / "images.npy", images)
    subprocess.run(
        [sys.executable, "-c", _TIMM_FEATURES, str(tmp_path / "images.npy"), str(tmp_path / "timm.npz")],
        check=True,
        timeout=300,
    )
    arrays = np.load(tmp_path / "timm.npz")
    state = {name[len("state.") :]: arrays[name] for name in arrays.files if name.startswith("state.")}
    vit = tiny_vit(window_size=8)  # windows of the whole grid: global attention, as timm's blocks
    params = weight_import.convert_timm_vit(state, abstract_params(vit))
    ours = vit.apply({"params": params}, images.transpose(0, 2, 3, 1))[4]
    assert_close(ours, arrays["features"].reshape(2, 8, 8, WIDTH))


# ---- errors: one line each, naming the tensors and the fix ----


def load_error(tmp_path, state, model=None) -> str:
    np.savez(tmp_path / "vit.npz", **state)
    params = {"backbone": abstract_params(model or tiny_vit())}
    with pytest.raises(WeightsFileError) as error:
        weight_import.load_backbone_params(params, tmp_path / "vit.npz")
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'vit.npz'}: ")
    return message


def test_missing_tensor_is_named(tmp_path):
    state = timm_vit_state_dict()
    del state["blocks.2.attn.qkv.bias"]
    message = load_error(tmp_path, state)
    assert (
        "the model's ViT (depth 4, width 64, MLP 256, patch 16): 1 missing (blocks.2.attn.qkv.bias) tensors" in message
    )
    assert "model.backbone.qkv_bias ('all', 'qv', 'none')" in message
    assert "unexpected" not in message and "misshapen" not in message

    state = timm_vit_state_dict()
    del state["norm.bias"]  # a final norm is optional, but not half of one
    assert "1 missing (norm.bias) tensors" in load_error(tmp_path, state)


def test_unexpected_tensor_is_named(tmp_path):
    state = timm_vit_state_dict()
    state["blocks.1.ls1.gamma"] = np.ones(WIDTH, np.float32)  # DINOv2's LayerScale
    message = load_error(tmp_path, state)
    assert (
        "1 unexpected (blocks.1.ls1.gamma) tensors; LayerScale (ls1/ls2.gamma) needs model.backbone.layer_scale"
        in message
    )
    # Skipped tensors are not reported.
    assert "cls_token" not in message and "head." not in message and "missing" not in message


@pytest.mark.parametrize(
    "file,expected",
    [
        (
            dict(depth=6),
            "24 unexpected (blocks.4.attn.proj.bias, blocks.4.attn.proj.weight, blocks.4.attn.qkv.bias, "
            "blocks.4.attn.qkv.weight, blocks.4.mlp.fc1.bias and 19 more) tensors; "
            "the file is a ViT of depth 6, width 64, MLP 256, patch 16: set model.backbone.depth",
        ),
        (
            dict(width=96),
            # All of it: 2 patch embedding + pos_embed + 4 x 12 block tensors + 2 norm.
            "53 misshapen (blocks.0.attn.proj.bias (96,) for (64,), blocks.0.attn.proj.weight (96, 96) for "
            "(64, 64), blocks.0.attn.qkv.bias (288,) for (192,), ",
        ),
        (
            dict(patch=14),
            "1 misshapen (patch_embed.proj.weight (64, 3, 14, 14) for (64, 3, 16, 16)) tensors; the file is a ViT "
            "of depth 4, width 64, MLP 256, patch 14",
        ),
    ],
    ids=["deeper", "wider", "patch14"],
)
def test_misshapen_file_is_named_with_the_fix(tmp_path, file, expected):
    message = load_error(tmp_path, timm_vit_state_dict(**file))
    assert expected in message
    assert "model.backbone.depth/embed_dim/num_heads/mlp_ratio" in message
    if "patch" in file:
        assert message.endswith("set model.backbone.patch_size=14")


def test_vit_l_file_into_vit_b_model_names_the_config(tmp_path):
    state = zeros_without_memory(timm_vit_shapes(1024, 24, 14))
    config = vitdet_b_coco.get_config()
    model = create_model(config.model, 80, families.num_anchors_per_location(config))
    with pytest.raises(WeightsFileError) as error:
        weight_import.convert_timm_vit(state, abstract_params(model, (224, 224))["backbone"])
    message = str(error.value)
    assert message.startswith("the state dict does not fit the model's ViT (depth 12, width 768, MLP 3072, patch 16)")
    assert "144 unexpected (blocks.12." in message and "misshapen" in message
    assert "the file is a ViT of depth 24, width 1024, MLP 4096, patch 16" in message
    assert "(configs/vitdet_l_coco.py is ViT-L)" in message


def test_not_a_vit_file(tmp_path):
    resnet_like = {"conv1.weight": np.zeros((8, 3, 7, 7), np.float32), "bn1.weight": np.ones(8, np.float32)}
    message = load_error(tmp_path, resnet_like)
    assert (
        "not a ViT state dict (no patch_embed.proj.weight, embeddings.patch_embeddings.projection.weight or " in message
    )
    assert "names: bn1.weight, conv1.weight)" in message

    np.savez(tmp_path / "vit.npz", **timm_vit_state_dict())
    config = default.get_config()  # a ResNet
    model = create_model(config.model, 3, families.num_anchors_per_location(config))
    with pytest.raises(WeightsFileError, match=r"holds a ViT \(timm layout\) but the model's backbone is a ResNet"):
        weight_import.load_backbone_params(abstract_params(model, (64, 64)), tmp_path / "vit.npz")

    state = timm_vit_state_dict()
    state["pos_embed"] = state["pos_embed"][:, :51]  # neither 7 x 7 + 1 nor a square
    assert "pos_embed has shape (1, 51, 64); timm's is [1, G*G, width] or [1, 1 + G*G, width]" in load_error(
        tmp_path, state
    )


def test_converter_checks_the_file_on_its_own(tmp_path):
    state = timm_vit_state_dict()
    state["blocks.3.attn.rope.freqs"] = np.ones(8, np.float32)  # EVA-02-like
    del state["blocks.0.mlp.fc2.bias"]
    np.savez(tmp_path / "eva.npz", **state)
    with pytest.raises(WeightsFileError) as error:
        weight_import.convert_pretrained_file(tmp_path / "eva.npz", tmp_path / "out.npz")
    assert str(error.value).startswith(
        f"{tmp_path / 'eva.npz'}: the state dict does not fit a ViT of depth 4, width 64, MLP 256, patch 16 "
        "(read from patch_embed.proj.weight and blocks.*): 1 missing (blocks.0.mlp.fc2.bias); "
        "1 unexpected (blocks.3.attn.rope.freqs) tensors"
    )
    assert not (tmp_path / "out.npz").exists()


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
        kept = {name for name in state if not weight_import.is_ignored_timm_vit_key(name)}
        assert set(npz.files) == kept | {"class_pos_embed"}
        # The class token's entry split off: the tiny ViTDet has no class token and drops both on loading.
        np.testing.assert_array_equal(npz["pos_embed"], state["pos_embed"][:, 1:])
        np.testing.assert_array_equal(npz["class_pos_embed"], state["pos_embed"][:, :1])

    loaded = weight_import.load_backbone_params(params, config.model.backbone.pretrained)
    assert loaded["neck"] is params["neck"] and loaded["head"] is params["head"]
    model_leaves = traverse_util.flatten_dict(params["backbone"], sep="/")
    for name, leaf in traverse_util.flatten_dict(loaded["backbone"], sep="/").items():
        assert isinstance(leaf, nn.LogicallyPartitioned) and leaf.names == model_leaves[name].names, name
        assert isinstance(leaf.value, jax.Array) and leaf.value.sharding == model_leaves[name].value.sharding
    features = jax.jit(model.backbone.apply)(
        {"params": nn.meta.unbox(loaded["backbone"])}, images.transpose(0, 2, 3, 1)
    )
    assert_close(features[4], expected)


# ---- foundation-backbone files (numpy state dicts: no torch needed) ----


def dinov3_like_state_dict(width=WIDTH, depth=2, head_dim=16, temperature=100.0, seed=0):
    """timm's DINOv3 layout (Eva: gamma_1/2, cls/reg tokens, no pos_embed, no qkv bias) plus Meta's RoPE periods."""
    state = timm_vit_state_dict(width=width, depth=depth, seed=seed)
    del state["pos_embed"]
    for i in range(depth):
        del state[f"blocks.{i}.attn.qkv.bias"]
        state[f"blocks.{i}.gamma_1"] = np.full(width, 0.3, np.float32)
        state[f"blocks.{i}.gamma_2"] = np.full(width, 0.3, np.float32)
    state["reg_token"] = np.zeros((1, 4, width), np.float32)
    state["rope_embed.periods"] = (temperature ** (np.arange(head_dim // 4) / (head_dim // 4))).astype(np.float32)
    return state


def dinov3_vit(**overrides):
    return ViT(**dinov3_options(WIDTH, 2, HEADS, **overrides))


def dinov3_config(vit):
    return {key: getattr(vit, key) for key in ("rope", "rope_temperature", "qkv_bias")}


def convert_error(state, vit, config=None) -> str:
    with pytest.raises(WeightsFileError) as error:
        weight_import.convert_timm_vit(state, abstract_params(vit), config)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_dinov3_file_loads_and_drops_prefix_tokens_only_when_the_model_has_none():
    state = dinov3_like_state_dict()
    vit = dinov3_vit()
    params = traverse_util.flatten_dict(
        weight_import.convert_timm_vit(state, abstract_params(vit), dinov3_config(vit)), sep="/"
    )
    np.testing.assert_array_equal(params["stages/global/ls1"][1], state["blocks.1.gamma_1"])
    assert params["reg_token"].shape == (1, 4, WIDTH)
    # Windowed: no prefix tokens; the file's cls_token and reg_token are dropped, not an error.
    windowed = dinov3_vit(global_attention_every=2, window_size=4, class_token=False, register_tokens=0)
    params = weight_import.convert_timm_vit(state, abstract_params(windowed), dinov3_config(windowed))
    assert "cls_token" not in params and "reg_token" not in params


def test_unused_layer_scale_names_the_tensor_and_the_config_key():
    message = convert_error(dinov3_like_state_dict(), dinov3_vit(layer_scale=0.0))
    assert "4 unexpected (blocks.0.ls1.gamma, blocks.0.ls2.gamma, blocks.1.ls1.gamma, blocks.1.ls2.gamma)" in message
    assert "set model.backbone.layer_scale=1e-05" in message


@pytest.mark.parametrize(
    "vit_overrides,file_overrides,expected",
    [
        (dict(register_tokens=2), {}, "misshapen (reg_token (1, 4, 64) for (1, 2, 64))"),
        (dict(register_tokens=2), {}, "set model.backbone.register_tokens=4"),
        (dict(qkv_bias="all"), {}, "set model.backbone.qkv_bias='none'"),
        (dict(absolute_position=True, rope="", pretrain_image_size=128), {}, "absolute_position=False (no pos_embed"),
        (dict(mlp="swiglu"), {}, "set model.backbone.mlp='gelu'"),
        (dict(rope_temperature=10000.0), {}, "temperature 100, the model's model.backbone.rope_temperature=10000.0"),
        (dict(), dict(temperature=100.0, head_dim=32), "RoPE periods) has 8 values; a ViT with head width 16"),
    ],
    ids=["registers_shape", "registers_key", "qkv_bias", "absolute", "mlp", "rope_temperature", "rope_width"],
)
def test_family_mismatch_is_one_line_naming_the_config_keys(vit_overrides, file_overrides, expected):
    vit = dinov3_vit(**vit_overrides)
    assert expected in convert_error(dinov3_like_state_dict(**file_overrides), vit, dinov3_config(vit))


def test_rope_periods_of_another_formula_are_refused():
    state = dinov3_like_state_dict()
    state["rope_embed.periods"] = np.linspace(1.0, 50.0, 4).astype(np.float32)
    assert "are not temperature ** (i / 4) for any temperature" in convert_error(state, dinov3_vit())
    vit = dinov3_vit(rope="")
    message = convert_error(dinov3_like_state_dict(), vit, dinov3_config(vit))
    assert "holds DINOv3 RoPE periods (rope.periods, temperature 100) but model.backbone.rope=''" in message


def test_transformers_dinov2_names_as_published_map_to_the_canonical_ones():
    """transformers' Dinov2 checkpoints on the hub (attention.attention.query, weights_in/out for ViT-g)."""
    rng = np.random.default_rng(0)
    d, h = 8, 12
    state = {
        "embeddings.cls_token": rng.standard_normal((1, 1, d)),
        "embeddings.mask_token": rng.standard_normal((1, d)),
        "embeddings.position_embeddings": rng.standard_normal((1, 5, d)),
        "embeddings.patch_embeddings.projection.weight": rng.standard_normal((d, 3, 14, 14)),
        "layernorm.weight": rng.standard_normal(d),
    }
    for part in ("query", "key", "value"):
        state[f"encoder.layer.0.attention.attention.{part}.weight"] = rng.standard_normal((d, d))
        state[f"encoder.layer.0.attention.attention.{part}.bias"] = rng.standard_normal(d)
    state["encoder.layer.0.attention.output.dense.weight"] = rng.standard_normal((d, d))
    state["encoder.layer.0.layer_scale1.lambda1"] = rng.standard_normal(d)
    state["encoder.layer.0.mlp.weights_in.weight"] = rng.standard_normal((2 * h, d))
    state["encoder.layer.0.mlp.weights_out.weight"] = rng.standard_normal((d, h))
    state = {name: value.astype(np.float32) for name, value in state.items()}
    canonical = weight_import.canonical_vit_state_dict(state)
    assert sorted(canonical) == sorted(
        [
            "cls_token",
            "pos_embed",
            "class_pos_embed",
            "patch_embed.proj.weight",
            "norm.weight",
            "blocks.0.attn.qkv.weight",
            "blocks.0.attn.qkv.bias",
            "blocks.0.attn.proj.weight",
            "blocks.0.ls1.gamma",
            "blocks.0.mlp.fc1_g.weight",
            "blocks.0.mlp.fc1_x.weight",
            "blocks.0.mlp.fc2.weight",
        ]
    )
    np.testing.assert_array_equal(
        canonical["blocks.0.attn.qkv.weight"][d : 2 * d], state["encoder.layer.0.attention.attention.key.weight"]
    )
    np.testing.assert_array_equal(
        canonical["blocks.0.mlp.fc1_x.weight"], state["encoder.layer.0.mlp.weights_in.weight"][h:]
    )
    np.testing.assert_array_equal(canonical["class_pos_embed"], state["embeddings.position_embeddings"][:, :1])
    assert weight_import.canonical_vit_state_dict(canonical).keys() == canonical.keys()  # canonical maps onto itself
