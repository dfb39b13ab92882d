"""DINOv2, DINOv3 and EVA-02 weights -> the one ViT module, against timm's and transformers' own forward passes.

Each reference model is built with random weights at a small width and depth
but its real architecture (timm's registered model functions, transformers'
model classes), with LayerScale, biases and norms moved away from their
initial values so each one matters. Its state dict is converted as
`load_backbone_params` converts a file, and the patch tokens our ViT
computes (`ViT.patch_tokens`: final norm applied, prefix tokens dropped,
before the patch-14 resize) are compared with the reference's at an input
size other than the checkpoint's, so position embeddings are resized and
RoPE is recomputed for the new grid. The measure is max |ours - reference|
over max |reference|, in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from detector.models import weight_import
from detector.models.vit import ViT
from tests.helpers.foundation_vit import dinov3_options

torch = pytest.importorskip("torch")

BATCH = 2
TOLERANCE = 1e-4


def perturb(module, seed=0):
    """Random values of a useful scale for every parameter (in place): kernels ~ fan_in^-1/2, norms ~ 1 +- 0.2,
    LayerScale ~ 0.3, biases, tokens and position embeddings ~ 0.2-0.5."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("gamma", "lambda1", "gamma_1", "gamma_2"):
                values = 0.3 + 0.1 * torch.randn(tensor.shape, generator=generator)
            elif tensor.ndim >= 2 and "token" not in name and "pos" not in name and "embed" != leaf:
                values = torch.randn(tensor.shape, generator=generator) * tensor[0].numel() ** -0.5
            elif "norm" in name and leaf == "weight":
                values = 1.0 + 0.2 * torch.randn(tensor.shape, generator=generator)
            elif tensor.ndim >= 2:  # class / register / mask tokens, position embeddings
                values = 0.5 * torch.randn(tensor.shape, generator=generator)
            else:  # biases
                values = 0.2 * torch.randn(tensor.shape, generator=generator)
            tensor.copy_(values)
    return module.eval()


def state_dict_of(module) -> dict[str, np.ndarray]:
    return {name: tensor.detach().float().numpy() for name, tensor in module.state_dict().items()}


def our_patch_tokens(vit: ViT, state, images_nchw, backbone_config=None) -> np.ndarray:
    """`[B, h, w, D]`: the converted state dict in `vit`, its patch tokens."""
    images = jnp.asarray(images_nchw.transpose(0, 2, 3, 1))
    abstract = jax.eval_shape(vit.init, jax.random.key(0), images)["params"]
    params = weight_import.convert_timm_vit(state, abstract, backbone_config)
    return np.asarray(jax.jit(lambda p, x: vit.apply({"params": p}, x, method=ViT.patch_tokens))(params, images))


def reference_grid(tokens, num_prefix, grid) -> np.ndarray:
    """Reference `[B, prefix + h*w, D]` tokens -> `[B, h, w, D]` patch tokens."""
    tokens = tokens.detach().float().numpy()[:, num_prefix:]
    return tokens.reshape(tokens.shape[0], *grid, tokens.shape[-1])


def relative_difference(ours, expected) -> float:
    assert ours.shape == expected.shape
    return float(np.abs(ours - expected).max() / np.abs(expected).max())


def check(name, ours, expected):
    difference = relative_difference(ours, expected)
    print(f"{name}: max relative difference {difference:.2e}")
    assert difference < TOLERANCE, (name, difference)


def images(size, seed=1):
    return np.random.default_rng(seed).standard_normal((BATCH, 3, *size)).astype(np.float32)


def vit_options(**overrides):
    """Two global blocks of width 64, 4 heads (head width 16: RoPE needs a multiple of 4)."""
    options = dict(embed_dim=64, depth=2, num_heads=4, global_attention_every=1, window_size=0)
    return {**options, **overrides}


# ---- timm ----


@pytest.mark.parametrize(
    "variant,registers", [("vit_small_patch14_dinov2", 0), ("vit_small_patch14_reg4_dinov2", 4)], ids=["plain", "reg4"]
)
def test_timm_dinov2(variant, registers):
    timm = pytest.importorskip("timm")
    # Checkpoint at 56 px (a 4x4 grid); run at 70x84 (5x6), resized as timm's dynamic_img_size does.
    net = perturb(
        timm.create_model(
            variant, pretrained=False, img_size=56, depth=2, embed_dim=64, num_heads=4, dynamic_img_size=True
        )
    )
    pixels = images((70, 84))
    with torch.no_grad():
        expected = reference_grid(net.forward_features(torch.from_numpy(pixels)), 1 + registers, (5, 6))
    vit = ViT(
        **vit_options(),
        patch_size=14,
        pretrain_image_size=56,
        class_token=True,
        register_tokens=registers,
        layer_scale=1e-5,
    )
    check(variant, our_patch_tokens(vit, state_dict_of(net), pixels), expected)


@pytest.mark.parametrize(
    "variant,overrides,options",
    [
        ("vit_large_patch16_dinov3", dict(embed_dim=64), dict(qkv_bias="none")),
        ("vit_large_patch16_dinov3_qkvb", dict(embed_dim=64), dict(qkv_bias="qv")),
        # The 7B's block: SwiGLU with mlp_ratio 2 and hidden units aligned to 64 (160 -> 192).
        (
            "vit_7b_patch16_dinov3",
            dict(embed_dim=80),
            dict(qkv_bias="none", mlp="swiglu", mlp_hidden=192, embed_dim=80),
        ),
    ],
    ids=["vit_l", "qkvb", "7b_block"],
)
def test_timm_dinov3(variant, overrides, options):
    timm = pytest.importorskip("timm")
    net = perturb(timm.create_model(variant, pretrained=False, img_size=64, depth=2, num_heads=4, **overrides))
    pixels = images((80, 96))  # a 5x6 grid; the checkpoint's is 4x4
    with torch.no_grad():
        expected = reference_grid(net.forward_features(torch.from_numpy(pixels)), 5, (5, 6))
    config = {key: value for key, value in dinov3_options(64, 2, 4).items() if key not in vit_options()}
    config.update(options)
    vit = ViT(**{**vit_options(), **config})
    check(variant, our_patch_tokens(vit, state_dict_of(net), pixels, config), expected)


@pytest.mark.parametrize(
    "variant", ["eva02_base_patch14_224", "eva02_small_patch14_224"], ids=["qkv_split", "qkv_fused"]
)
def test_timm_eva02(variant):
    timm = pytest.importorskip("timm")
    # EVA-02 B/L keep q/k/v apart and norm the MLP's hidden units; Ti/S fuse qkv and pack the SwiGLU fc1.
    net = perturb(
        timm.create_model(
            variant,
            pretrained=False,
            img_size=56,
            depth=2,
            embed_dim=64,
            num_heads=4,
            dynamic_img_size=True,
        )
    )
    pixels = images((70, 84))
    with torch.no_grad():
        expected = reference_grid(net.forward_features(torch.from_numpy(pixels)), 1, (5, 6))
    config = dict(
        rope="eva02",
        rope_temperature=10000.0,
        rope_reference_grid=16,
        class_token=True,
        mlp="swiglu",
        mlp_hidden=int(64 * 4 * 2 / 3),
        mlp_norm=variant.startswith("eva02_base"),
        qkv_bias="qv",
        # As registered, EVA-02 pools by averaging: `fc_norm` after pooling, no norm in forward_features.
        final_norm=False,
    )
    vit = ViT(**vit_options(), **config, patch_size=14, pretrain_image_size=56)
    check(variant, our_patch_tokens(vit, state_dict_of(net), pixels, config), expected)


# ---- transformers ----


def test_transformers_dinov2_with_registers():
    transformers = pytest.importorskip("transformers")
    config = transformers.Dinov2WithRegistersConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        image_size=56,
        patch_size=14,
        num_register_tokens=4,
    )
    net = perturb(transformers.Dinov2WithRegistersModel(config))
    pixels = images((70, 84))
    with torch.no_grad():
        expected = reference_grid(net(torch.from_numpy(pixels)).last_hidden_state, 5, (5, 6))
    vit = ViT(
        **vit_options(), patch_size=14, pretrain_image_size=56, class_token=True, register_tokens=4, layer_scale=1.0
    )
    check("Dinov2WithRegistersModel", our_patch_tokens(vit, state_dict_of(net), pixels), expected)


@pytest.mark.parametrize("swiglu", [False, True], ids=["gelu", "swiglu"])
def test_transformers_dinov2(swiglu):
    transformers = pytest.importorskip("transformers")
    config = transformers.Dinov2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=56,
        patch_size=14,
        use_swiglu_ffn=swiglu,
    )
    net = perturb(transformers.Dinov2Model(config))
    # At the checkpoint's grid: Dinov2Model resizes its position embedding with
    # antialias=False (Keys a = -0.75), which neither timm nor this ViT uses.
    pixels = images((56, 56))
    with torch.no_grad():
        expected = reference_grid(net(torch.from_numpy(pixels)).last_hidden_state, 1, (4, 4))
    hidden = (int(64 * 4 * 2 / 3) + 7) // 8 * 8 if swiglu else 0
    vit = ViT(
        **vit_options(),
        patch_size=14,
        pretrain_image_size=56,
        class_token=True,
        layer_scale=1.0,
        mlp="swiglu" if swiglu else "gelu",
        mlp_hidden=hidden,
    )
    check(f"Dinov2Model {'swiglu' if swiglu else 'gelu'}", our_patch_tokens(vit, state_dict_of(net), pixels), expected)


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "gated"])
def test_transformers_dinov3(gated):
    transformers = pytest.importorskip("transformers")
    config = transformers.DINOv3ViTConfig(
        hidden_size=64,
        intermediate_size=128 if gated else 256,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=64,
        patch_size=16,
        num_register_tokens=4,
        use_gated_mlp=gated,
        hidden_act="silu" if gated else "gelu",
    )
    net = perturb(transformers.DINOv3ViTModel(config))
    pixels = images((80, 96))
    with torch.no_grad():
        expected = reference_grid(net(torch.from_numpy(pixels)).last_hidden_state, 5, (5, 6))
    options = dict(
        absolute_position=False,
        rope="dinov3",
        rope_temperature=100.0,
        class_token=True,
        register_tokens=4,
        layer_scale=1.0,
        norm_epsilon=1e-5,
        qkv_bias="qv",
        mlp="swiglu" if gated else "gelu",
        mlp_hidden=128 if gated else 0,
    )
    vit = ViT(**vit_options(), **options, patch_size=16)
    check(
        f"DINOv3ViTModel {'gated' if gated else 'gelu'}",
        our_patch_tokens(vit, state_dict_of(net), pixels, options),
        expected,
    )
