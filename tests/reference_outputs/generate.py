"""Reference outputs of timm, transformers and torchvision models, stored for the tests that run without torch.

Each case of `CASES` builds a model of a checkpoint source (timm's registered
model functions, transformers' model classes, torchvision's ResNet code) at a
tiny width and depth but with its real architecture, gives every parameter a
random value of a useful scale (`perturb`: LayerScale, biases and norms
matter), runs it on a random input and writes `tests/reference_outputs/NAME.npz`:

  state/KEY   the state dict under the source's own keys, as its checkpoints
              hold them: float32 (torchvision's BatchNorm counters int64),
              the random values rounded to bfloat16s (`bfloat16_values`)
  input       images `[B, 3, H, W]` float32 (bfloat16 values), as the source
              takes them
  reference   ViTs: the patch tokens `[B, h, w, D]` float32 (prefix tokens
              dropped, the token grid row by row, the final norm if the
              source applies one); ResNet: `reference/L`, the stage outputs
              `[B, C, ceil(H / 2**L), ceil(W / 2**L)]` for levels L = 2..5
  options     JSON: the keyword arguments of this project's module that the
              state dict loads into (`ViT`, `ResNet`)
  metadata    JSON: the source, the library versions, the command

The deformable-attention case holds `value`, `locations`, `weights` and the
`reference` of `torch.nn.functional.grid_sample` instead (see
`deformable_attention_grid_sample`), and the mask-pasting case logits, image
sizes and torch's pasted logits (see `mask_paste_bilinear`). The
tests: `tests/detector/models/test_reference_outputs.py` (ViTs, ResNet),
`tests/detector/ops/test_deformable_attention.py` and
`tests/detector/serving/test_masks.py` compare this project's code with the
files; `--check`, where torch, timm, transformers and
torchvision are installed, builds every case again and exits 1 when a file
no longer holds what the installed libraries compute.

Regenerate on a timm, transformers or torchvision upgrade, or for a new
source (a case here, then the file), where torch can be installed:

    pip install -e ".[bench]"                            # torch, torchvision, timm, transformers
    python -m tests.reference_outputs.generate           # every case
    python -m tests.reference_outputs.generate NAME ...  # some cases
    python -m tests.reference_outputs.generate --check   # compare fresh outputs with the files, write nothing

The files were written with torch 2.14.1 (run on the CPU), torchvision
0.29.1, timm 1.0.31, transformers 5.25.0, numpy 2.4.6 and Python 3.11 (each
file's `metadata` has its own). Seeds are fixed and the archives carry no
timestamps, so regenerating with the same libraries rewrites identical bytes
and git shows only outputs that changed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.metadata
import json
import platform
import sys
import zipfile
from collections.abc import Callable

import numpy as np

from tests.helpers import REPO_ROOT, deformable_attention_inputs
from tests.helpers.foundation_vit import dinov3_options

DIRECTORY = REPO_ROOT / "tests" / "reference_outputs"
COMMAND = "python -m tests.reference_outputs.generate"
LIBRARIES = ("torch", "torchvision", "timm", "transformers", "numpy")

# Every ViT: two blocks of width 32 with 4 heads (head width 8: RoPE needs a multiple of 4), all global.
WIDTH, DEPTH, HEADS = 32, 2, 4
BATCH = 1
# ResNet: torchvision's stem and stage widths divided by 16 (4, then 4 * 2**s inner, 16 * 2**s out).
RESNET_WIDTH = 4


@dataclasses.dataclass
class Case:
    """One reference: `arrays` as the file holds them (`state/KEY`, `input`, `reference`, ...), `options` and
    `source` as JSON and text."""

    source: str
    options: dict
    arrays: dict[str, np.ndarray]

    @property
    def state(self) -> dict[str, np.ndarray]:
        """The state dict under the source's keys."""
        return {name[len("state/") :]: value for name, value in self.arrays.items() if name.startswith("state/")}


# ---- building blocks ----


def perturb(module, seed=0):
    """Random values of a useful scale for every parameter (in place): kernels ~ fan_in^-1/2, norms ~ 1 +- 0.2,
    LayerScale ~ 0.3, biases, tokens and position embeddings ~ 0.2-0.5, each one a bfloat16 (see
    `bfloat16_values`). Buffers keep theirs."""
    import torch

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
            tensor.copy_(bfloat16_values(values))
    return module.eval()


def state_arrays(module) -> dict[str, np.ndarray]:
    """`{'state/KEY': array}`: float tensors as float32, others (counters) as they are."""
    arrays = {}
    for name, tensor in module.state_dict().items():
        value = tensor.detach().numpy()
        arrays[f"state/{name}"] = value.astype(np.float32) if np.issubdtype(value.dtype, np.floating) else value
    return arrays


def bfloat16_values(values):
    """float32 `values` (a torch tensor) rounded to the nearest bfloat16, as float32.

    Stored as float32 (as checkpoints hold them), such values have 16 zero
    bits each, so the deflated files take half the space; the comparisons
    run in float32 all the same.
    """
    import torch

    return values.to(torch.bfloat16).float()


def images(size, seed=1) -> np.ndarray:
    """`[BATCH, 3, H, W]` float32, standard normal (pixels after the usual mean/std normalisation), bfloat16 values."""
    import torch

    pixels = np.random.default_rng(seed).standard_normal((BATCH, 3, *size)).astype(np.float32)
    return bfloat16_values(torch.from_numpy(pixels)).numpy()


def vit_options(**overrides) -> dict:
    return {**dict(embed_dim=WIDTH, depth=DEPTH, num_heads=HEADS, global_attention_every=1, window_size=0), **overrides}


def vit_case(source: str, net, forward, pixels: np.ndarray, num_prefix: int, options: dict) -> Case:
    """`forward(images) -> [B, prefix + h*w, D]` tokens on `pixels` -> the case, patch tokens `[B, h, w, D]`."""
    import torch

    with torch.no_grad():
        tokens = forward(torch.from_numpy(pixels)).float().numpy()[:, num_prefix:]
    patch = options["patch_size"]
    # A grid rounded up: timm's dynamic_img_pad pads the input to whole patches; every other input is a multiple.
    grid = tuple(-(-side // patch) for side in pixels.shape[2:])
    reference = tokens.reshape(tokens.shape[0], *grid, tokens.shape[-1])
    return Case(source, options, {**state_arrays(net), "input": pixels, "reference": reference})


# ---- timm ----


def timm_dinov2(variant: str, registers: int, pad: bool = False) -> Case:
    """DINOv2 (Eva-free `VisionTransformer`): checkpoint grid 4x4 (56 px), run at 70x84 (5x6), position
    embedding resized as timm's dynamic_img_size does. `pad`: an input of 61x73 px, not whole patches, which
    timm's dynamic_img_pad zero-pads at the bottom and right to 70x84 (without it timm refuses such an input)."""
    import timm

    net = perturb(
        timm.create_model(
            variant,
            pretrained=False,
            img_size=56,
            depth=DEPTH,
            embed_dim=WIDTH,
            num_heads=HEADS,
            dynamic_img_size=True,
            dynamic_img_pad=pad,
        )
    )
    options = vit_options(
        patch_size=14, pretrain_image_size=56, class_token=True, register_tokens=registers, layer_scale=1e-5
    )
    pixels = images((61, 73) if pad else (70, 84))
    source = f"timm {variant}" + (" (dynamic_img_pad=True)" if pad else "")
    return vit_case(source, net, net.forward_features, pixels, 1 + registers, options)


def timm_dinov3(variant: str, embed_dim: int, overrides: dict) -> Case:
    """DINOv3 (timm's Eva, RoPE, 4 registers): checkpoint 64 px, run at 80x96 (a 5x6 grid), RoPE for that grid.
    The options are the recipes' (`configs/common.py`'s DINOv3 backbone) at this size, with `overrides`."""
    import timm

    net = perturb(
        timm.create_model(variant, pretrained=False, img_size=64, depth=DEPTH, embed_dim=embed_dim, num_heads=HEADS)
    )
    base = vit_options(embed_dim=embed_dim)
    recipe = {key: value for key, value in dinov3_options(embed_dim, DEPTH, HEADS).items() if key not in base}
    options = {**base, **recipe, **overrides}
    return vit_case(f"timm {variant}", net, net.forward_features, images((80, 96)), 5, options)


def timm_eva02(variant: str) -> Case:
    """EVA-02 as registered (average pooling: `fc_norm` after pooling, no norm in forward_features). B/L keep
    q/k/v apart and norm the MLP's hidden units; Ti/S fuse qkv and pack the SwiGLU fc1. 56 px -> 70x84."""
    import timm

    net = perturb(
        timm.create_model(
            variant, pretrained=False, img_size=56, depth=DEPTH, embed_dim=WIDTH, num_heads=HEADS, dynamic_img_size=True
        )
    )
    options = vit_options(
        patch_size=14,
        pretrain_image_size=56,
        rope="eva02",
        rope_temperature=10000.0,
        rope_reference_grid=16,
        class_token=True,
        mlp="swiglu",
        mlp_hidden=int(WIDTH * 4 * 2 / 3),
        mlp_norm=variant.startswith("eva02_base"),
        qkv_bias="qv",
        final_norm=False,
    )
    return vit_case(f"timm {variant}", net, net.forward_features, images((70, 84)), 1, options)


def timm_vit_windowed() -> Case:
    """A plain pre-norm ViT (MAE, DeiT, AugReg) without class token, as ViTDet uses it: checkpoint 64 px, run at
    96x96 (6x6), where our first block attends in one 6x6 window, the whole grid, as timm's global block does."""
    import timm

    net = perturb(
        timm.models.vision_transformer.VisionTransformer(
            img_size=64,
            patch_size=16,
            embed_dim=WIDTH,
            depth=DEPTH,
            num_heads=HEADS,
            class_token=False,
            global_pool="",
            num_classes=0,
            dynamic_img_size=True,
        )
    )
    options = vit_options(patch_size=16, pretrain_image_size=64, global_attention_every=2, window_size=6)
    return vit_case("timm VisionTransformer", net, net.forward_features, images((96, 96)), 0, options)


# ---- transformers ----


def last_hidden_state(net):
    return lambda pixels: net(pixels).last_hidden_state


def transformers_dinov2(swiglu: bool) -> Case:
    """Dinov2Model at its checkpoint's grid (56 px, 4x4): it resizes position embeddings with another bicubic
    kernel (antialias=False, Keys a = -0.75) than timm and this project."""
    import transformers

    config = transformers.Dinov2Config(
        hidden_size=WIDTH,
        num_hidden_layers=DEPTH,
        num_attention_heads=HEADS,
        image_size=56,
        patch_size=14,
        use_swiglu_ffn=swiglu,
    )
    net = perturb(transformers.Dinov2Model(config))
    options = vit_options(
        patch_size=14,
        pretrain_image_size=56,
        class_token=True,
        layer_scale=1.0,
        mlp="swiglu" if swiglu else "gelu",
        # transformers' SwiGLU: 2/3 of mlp_ratio * width, rounded up to a multiple of 8.
        mlp_hidden=(int(WIDTH * 4 * 2 / 3) + 7) // 8 * 8 if swiglu else 0,
    )
    return vit_case("transformers Dinov2Model", net, last_hidden_state(net), images((56, 56)), 1, options)


def transformers_dinov2_with_registers() -> Case:
    import transformers

    config = transformers.Dinov2WithRegistersConfig(
        hidden_size=WIDTH,
        num_hidden_layers=DEPTH,
        num_attention_heads=HEADS,
        intermediate_size=4 * WIDTH,
        image_size=56,
        patch_size=14,
        num_register_tokens=4,
    )
    net = perturb(transformers.Dinov2WithRegistersModel(config))
    options = vit_options(patch_size=14, pretrain_image_size=56, class_token=True, register_tokens=4, layer_scale=1.0)
    source = "transformers Dinov2WithRegistersModel"
    return vit_case(source, net, last_hidden_state(net), images((70, 84)), 5, options)


def transformers_dinov3(gated: bool) -> Case:
    import transformers

    hidden = 2 * WIDTH if gated else 4 * WIDTH
    config = transformers.DINOv3ViTConfig(
        hidden_size=WIDTH,
        intermediate_size=hidden,
        num_hidden_layers=DEPTH,
        num_attention_heads=HEADS,
        image_size=64,
        patch_size=16,
        num_register_tokens=4,
        use_gated_mlp=gated,
        hidden_act="silu" if gated else "gelu",
    )
    net = perturb(transformers.DINOv3ViTModel(config))
    options = vit_options(
        patch_size=16,
        absolute_position=False,
        rope="dinov3",
        rope_temperature=100.0,
        class_token=True,
        register_tokens=4,
        layer_scale=1.0,
        norm_epsilon=1e-5,
        qkv_bias="qv",
        mlp="swiglu" if gated else "gelu",
        mlp_hidden=hidden if gated else 0,
    )
    return vit_case("transformers DINOv3ViTModel", net, last_hidden_state(net), images((80, 96)), 5, options)


# ---- torchvision ----


def torchvision_resnet() -> Case:
    """torchvision's ResNet (Bottleneck, [1, 1, 1, 1]) with its stem and stages rebuilt by its own `_make_layer`
    at width 4 (torchvision fixes 64), BatchNorm statistics that matter, on odd sizes (57x63 px), where
    symmetric padding must line up with torch's."""
    import torch
    from torchvision.models.resnet import Bottleneck, ResNet

    net = ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10)
    net.inplanes = RESNET_WIDTH
    net.conv1 = torch.nn.Conv2d(3, RESNET_WIDTH, kernel_size=7, stride=2, padding=3, bias=False)
    net.bn1 = torch.nn.BatchNorm2d(RESNET_WIDTH)
    stages = [net._make_layer(Bottleneck, RESNET_WIDTH * 2**s, 1, stride=1 if s == 0 else 2) for s in range(4)]
    net.layer1, net.layer2, net.layer3, net.layer4 = stages
    net.fc = torch.nn.Linear(RESNET_WIDTH * 8 * Bottleneck.expansion, 10)
    generator = torch.Generator().manual_seed(0)

    def uniform(shape, low, high):
        return low + (high - low) * torch.rand(shape, generator=generator)

    with torch.no_grad():
        for module in net.modules():
            if isinstance(module, torch.nn.Conv2d):  # He: activations keep their scale through the stages
                fan_in = module.weight[0].numel()
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * (2 / fan_in) ** 0.5)
            elif isinstance(module, torch.nn.BatchNorm2d):
                module.weight.copy_(uniform(module.weight.shape, 0.5, 1.5))
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=generator))
                module.running_mean.copy_(0.1 * torch.randn(module.running_mean.shape, generator=generator))
                module.running_var.copy_(uniform(module.running_var.shape, 0.5, 2.0))
            elif isinstance(module, torch.nn.Linear):  # the classifier: dropped on loading, seeded all the same
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * module.in_features**-0.5)
                module.bias.copy_(0.2 * torch.randn(module.bias.shape, generator=generator))
        for tensor in net.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(bfloat16_values(tensor))
    net.eval()
    pixels = images((57, 63))
    arrays = {**state_arrays(net), "input": pixels}
    with torch.no_grad():  # torchvision's `_forward_impl` up to its last stage
        x = net.maxpool(net.relu(net.bn1(net.conv1(torch.from_numpy(pixels)))))
        for level, layer in zip(range(2, 6), stages, strict=True):
            x = layer(x)
            arrays[f"reference/{level}"] = x.numpy()
    options = dict(stage_sizes=[1, 1, 1, 1], width=RESNET_WIDTH, block="bottleneck", norm="frozen_bn")
    return Case("torchvision.models.resnet.ResNet(Bottleneck, [1, 1, 1, 1]) at width 4", options, arrays)


# ---- torch.nn.functional.grid_sample ----


def deformable_attention_grid_sample() -> Case:
    """Deformable DETR's `ms_deform_attn_core_pytorch` (grid_sample, bilinear, zero padding, align_corners=False)
    in float64, on non-square levels of different sizes, one a single pixel, with sampling points inside, on the
    border and outside of every level, and at exact edges, corners and pixel centres.

    Arrays: `value [B, S, heads, head_dim]` float32 (S = sum of h * w over the levels, row by row), `locations
    [B, Q, heads, levels, points, 2]` float32 (x, y as fractions of the level's width and height), `weights [B, Q,
    heads, levels, points]` float32, `reference [B, Q, heads * head_dim]` float64; options: `shapes`, the levels'
    (h, w)."""
    import torch
    import torch.nn.functional as F

    shapes = deformable_attention_inputs.SHAPES
    batch, queries, heads, points, head_dim = 2, 6, 3, 3, 5
    value, locations, weights = deformable_attention_inputs.sampling_inputs(
        np.random.default_rng(1), batch, queries, heads, points, head_dim, shapes
    )

    value_t, locations_t, weights_t = (torch.from_numpy(a.astype(np.float64)) for a in (value, locations, weights))
    value_list = value_t.split([h * w for h, w in shapes], dim=1)
    grids = 2 * locations_t - 1
    sampled = []
    for level, (height, width) in enumerate(shapes):
        value_l = value_list[level].flatten(2).transpose(1, 2).reshape(batch * heads, head_dim, height, width)
        grid_l = grids[:, :, :, level].transpose(1, 2).flatten(0, 1)
        sampled.append(F.grid_sample(value_l, grid_l, mode="bilinear", padding_mode="zeros", align_corners=False))
    weights_t = weights_t.transpose(1, 2).reshape(batch * heads, 1, queries, len(shapes) * points)
    out = (torch.stack(sampled, dim=-2).flatten(-2) * weights_t).sum(-1).view(batch, heads * head_dim, queries)
    arrays = {
        "value": value,
        "locations": locations,
        "weights": weights,
        "reference": out.transpose(1, 2).numpy(),
    }
    return Case("torch.nn.functional.grid_sample", {"shapes": [list(s) for s in shapes]}, arrays)


# ---- torch.nn.functional.interpolate: Mask DINO's mask pasting ----

# (logits [N, h, w], mask_stride, image_hw, original_hw): non-square, the image filling part of the padded canvas
# in one or both axes, enlarged and reduced, strides 4 and 8.
MASK_PASTE_SHAPES = (
    ((4, 8, 10), 4, (27, 37), (54, 71)),
    ((4, 12, 16), 4, (48, 45), (33, 30)),
    ((3, 5, 7), 8, (31, 56), (61, 103)),
)


def mask_paste_bilinear() -> Case:
    """Mask DINO's (Mask2Former's, detectron2's `sem_seg_postprocess`) pasting of mask logits, float32 on the CPU:
    `F.interpolate` (bilinear, align_corners=False) to the padded network size, crop to the image, `F.interpolate`
    to the original size. Per shape i of `MASK_PASTE_SHAPES`: masks of smooth logits crossing 0, one all negative
    (an empty mask), one of large logits, some cells exactly 0.

    Arrays: `logits/i [N, h, w]` float32, `reference/i [N, H, W]` float32 the pasted logits (the masks are where
    they are > 0); options: `shapes`, per i the stride, image_hw and original_hw."""
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(2)
    arrays, shapes = {}, []
    for i, ((n, h, w), stride, (image_h, image_w), original_hw) in enumerate(MASK_PASTE_SHAPES):
        logits = rng.normal(0.0, 3.0, size=(n, h, w)) + rng.normal(0.0, 1.0, size=(n, 1, 1))
        logits[1] = -np.abs(logits[1]) - 0.1
        logits[2] *= 20.0
        logits[0, ::3, ::2] = 0.0
        logits = logits.astype(np.float32)
        upsampled = F.interpolate(
            torch.from_numpy(logits)[None], size=(h * stride, w * stride), mode="bilinear", align_corners=False
        )
        cropped = upsampled[:, :, :image_h, :image_w]
        pasted = F.interpolate(cropped, size=tuple(original_hw), mode="bilinear", align_corners=False)[0]
        arrays[f"logits/{i}"] = logits
        arrays[f"reference/{i}"] = pasted.numpy()
        shapes.append({"mask_stride": stride, "image_hw": [image_h, image_w], "original_hw": list(original_hw)})
    return Case("torch.nn.functional.interpolate", {"shapes": shapes}, arrays)


# ---- the cases ----

# Name -> (kind, builder). Kinds: 'vit' (a ViT state dict and its patch tokens), 'resnet', 'deformable_attention',
# 'masks'.
CASES: dict[str, tuple[str, Callable[[], Case]]] = {
    "timm_dinov2": ("vit", functools.partial(timm_dinov2, "vit_small_patch14_dinov2", 0)),
    "timm_dinov2_reg4": ("vit", functools.partial(timm_dinov2, "vit_small_patch14_reg4_dinov2", 4)),
    "timm_dinov2_input_not_whole_patches": (
        "vit",
        functools.partial(timm_dinov2, "vit_small_patch14_dinov2", 0, pad=True),
    ),
    "timm_dinov3_vit_l": ("vit", functools.partial(timm_dinov3, "vit_large_patch16_dinov3", WIDTH, {})),
    "timm_dinov3_qkvb": (
        "vit",
        functools.partial(timm_dinov3, "vit_large_patch16_dinov3_qkvb", WIDTH, dict(qkv_bias="qv")),
    ),
    # The 7B's block: SwiGLU with mlp_ratio 2 and its hidden units aligned to 64 (width 48: 96 -> 128).
    "timm_dinov3_7b_block": (
        "vit",
        functools.partial(timm_dinov3, "vit_7b_patch16_dinov3", 48, dict(mlp="swiglu", mlp_hidden=128)),
    ),
    "timm_eva02_qkv_split": ("vit", functools.partial(timm_eva02, "eva02_base_patch14_224")),
    "timm_eva02_qkv_fused": ("vit", functools.partial(timm_eva02, "eva02_small_patch14_224")),
    "timm_vit_windowed": ("vit", timm_vit_windowed),
    "transformers_dinov2_gelu": ("vit", functools.partial(transformers_dinov2, False)),
    "transformers_dinov2_swiglu": ("vit", functools.partial(transformers_dinov2, True)),
    "transformers_dinov2_with_registers": ("vit", transformers_dinov2_with_registers),
    "transformers_dinov3_gelu": ("vit", functools.partial(transformers_dinov3, False)),
    "transformers_dinov3_gated": ("vit", functools.partial(transformers_dinov3, True)),
    "torchvision_resnet": ("resnet", torchvision_resnet),
    "deformable_attention_grid_sample": ("deformable_attention", deformable_attention_grid_sample),
    "mask_paste_bilinear": ("masks", mask_paste_bilinear),
}


def names(kind: str) -> list[str]:
    """The cases of one kind, in `CASES` order."""
    return [name for name, (case_kind, _) in CASES.items() if case_kind == kind]


def path(name: str):
    return DIRECTORY / f"{name}.npz"


def read(name: str) -> Case:
    """The stored case `name`."""
    with np.load(path(name)) as data:
        arrays = {key: data[key] for key in data.files}
    options = json.loads(str(arrays.pop("options")))
    source = json.loads(str(arrays.pop("metadata")))["source"]
    return Case(source, options, arrays)


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for library in LIBRARIES:
        try:
            found[library] = importlib.metadata.version(library)
        except importlib.metadata.PackageNotFoundError:
            found[library] = "not installed"
    return found


def write(name: str, case: Case) -> int:
    """Writes `name`.npz (deflated, without timestamps: the same arrays give the same bytes); returns its size."""
    metadata = {"source": case.source, "versions": versions(), "command": COMMAND}
    arrays = {
        **case.arrays,
        "options": np.array(json.dumps(case.options, sort_keys=True)),
        "metadata": np.array(json.dumps(metadata, sort_keys=True)),
    }
    with zipfile.ZipFile(path(name), "w", zipfile.ZIP_DEFLATED) as archive:
        for key in sorted(arrays):
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            with archive.open(info, "w") as member:
                np.lib.format.write_array(member, np.asarray(arrays[key]), allow_pickle=False)
    return path(name).stat().st_size


def relative_difference(ours: np.ndarray, reference: np.ndarray) -> float:
    """max |ours - reference| / max |reference| (shapes must agree)."""
    ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
    assert ours.shape == reference.shape, (ours.shape, reference.shape)
    scale = float(np.abs(reference).max()) or 1.0
    return float(np.abs(ours - reference).max() / scale)


def compare(fresh: Case, stored: Case) -> dict:
    """What differs between a freshly built case and the stored one: names, options, and per group of arrays
    (`state`, `input` or the deformable inputs, `reference`) the largest relative difference."""
    names_differ = sorted(set(fresh.arrays) ^ set(stored.arrays))
    groups: dict[str, float] = {}
    for key in sorted(set(fresh.arrays) & set(stored.arrays)):
        group = key.split("/")[0] if key.startswith(("state/", "reference")) else "input"
        a, b = fresh.arrays[key], stored.arrays[key]
        difference = relative_difference(a, b) if a.shape == b.shape else float("inf")
        groups[group] = max(groups.get(group, 0.0), difference)
    return {"names_differ": names_differ, "options_equal": fresh.options == stored.options, **groups}


# --check: of the largest value. Another build or CPU changes the last float32 bits; another algorithm far more.
REFERENCE_TOLERANCE = 1e-5
# Seeded weights and inputs (bfloat16 values) come out the same on any machine.
INPUT_TOLERANCE = 1e-6


def problems(name: str, comparison: dict) -> list[str]:
    """Why a stored case no longer holds what its source computes (empty: it does), each with the fix."""
    regenerate = f"regenerate: {COMMAND} {name}"
    if comparison.get("missing"):
        return [f"no {path(name).relative_to(REPO_ROOT)}; {regenerate}"]
    found = []
    if comparison["names_differ"]:
        found.append(f"arrays added or gone: {comparison['names_differ']}; {regenerate}")
    if not comparison["options_equal"]:
        found.append(f"the case's options changed; {regenerate}")
    for group in ("state", "input"):
        if comparison.get(group, 0.0) > INPUT_TOLERANCE:
            found.append(f"{group} differs by {comparison[group]:.2e}; {regenerate}")
    if comparison.get("reference", 0.0) > REFERENCE_TOLERANCE:
        found.append(
            f"the source now computes otherwise (reference differs by {comparison['reference']:.2e}); {regenerate}, "
            "then the torch-free tests tell whether this project still matches"
        )
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="cases to build (default: all)")
    parser.add_argument("--check", action="store_true", help="compare with the stored files, write nothing")
    parser.add_argument("--report", help="with --check: write the comparison as JSON to this path")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    report, failed = {}, 0
    for name in args.names or list(CASES):
        case = CASES[name][1]()
        if args.check:
            report[name] = compare(case, read(name)) if path(name).exists() else {"missing": True}
            found = problems(name, report[name])
            failed += bool(found)
            print(f"{name}: {'; '.join(found) if found else 'matches'} {json.dumps(report[name])}")
        else:
            print(f"{path(name).relative_to(REPO_ROOT)}: {write(name, case)} bytes ({case.source})")
    if args.report:
        with open(args.report, "w") as file:
            json.dump(report, file)
    if failed:
        print(f"error: {failed} stored reference output(s) differ from what the installed libraries compute")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
