"""Pretrained backbone weights: torchvision ResNet and timm ViT state dicts -> this project's backbone parameters.

ResNet. torchvision's `resnet50()` state dict (`conv1.weight`, `bn1.*`,
`layer{1-4}.{i}.conv{1,2,3}.weight`, `.bn{1,2,3}.*`, `.downsample.{0,1}.*`)
maps onto `detector.models.resnet.ResNet(norm='frozen_bn')`:

  conv1 -> stem_conv            bn1 -> stem_norm
  layerS.I.convK -> stageS_block{I+1}/Conv_{K-1}
  layerS.I.bnK -> stageS_block{I+1}/FrozenBatchNorm_{K-1}
  layerS.I.downsample.0 / .1 -> .../Conv_{last} / .../FrozenBatchNorm_{last}

Convolution weights `[out, in, kh, kw]` become kernels `[kh, kw, in, out]`;
each BatchNorm folds into the per-channel `scale`, `bias` of
`detector.models.layers.FrozenBatchNorm`. The classifier (`fc.*`) and the
`num_batches_tracked` counters are not part of a backbone and are skipped.

ViT. timm's `VisionTransformer` state dict (MAE, DeiT, AugReg: a plain
pre-norm ViT at patch 16; D = width, H = heads, i = block) maps onto
`detector.models.vit.ViT` (blocks are pre-norm in both, LayerNorm eps 1e-6):

  patch_embed.proj.weight [D, 3, 16, 16]  -> patch_embed/kernel [16, 16, 3, D]  (.bias -> /bias)
  pos_embed [1, (1 +) G*G, D]             -> pos_embed [1, g, g, D]: the class token's entry
      dropped, the rest read as the G x G grid row by row, resized (see
      `resize_position_embedding`) to the model's g = pretrain_image_size / 16 if G != g
  blocks.i.norm{1,2}.{weight,bias}        -> norm{1,2}/{scale,bias}
  blocks.i.attn.qkv.weight [3D, D]        -> attn/qkv/kernel [D, 3, H, D/H]  (.bias [3D] -> [3, H, D/H])
  blocks.i.attn.proj.weight [D, D]        -> attn/out/kernel [H, D/H, D]     (.bias -> /bias)
  blocks.i.mlp.fc{1,2}.weight [out, in]   -> mlp/fc{1,2}/kernel [in, out]    (.bias -> /bias)
  norm.{weight,bias}                      -> norm/{scale,bias}

With k = global_attention_every, block i = s*k + l is slice [s, l] of the
scanned `stages/windowed/...` stacks for l < k - 1 and slice [s] of
`stages/global/...` for l = k - 1 (`stage{s}/windowed{l}/...` and
`stage{s}/global/...` when not scanned). The head count, the stacking and the
grid are config values no tensor of the file holds, so a ViT is mapped when it
is loaded into a model's parameters, not when it is converted. Skipped:
`cls_token`, `mask_token`, `head.*`, `fc_norm.*`, `decoder*` (MAE's decoder).
The one parameter that may get nothing is the final norm, for files without
`norm.*` (timm keeps `fc_norm` instead when it pools by averaging): it starts
as the identity (scale 1, bias 0), as the model initialises it.

Files: torchvision or timm layout in `.pth`/`.pt` (needs torch),
`.safetensors` (needs safetensors) or `.npz`; or this project's layout as a
flat `.npz` with `stem_conv/kernel`-style keys, as `save_backbone_params`
and, for ResNets, `python -m detector.convert_pretrained` write it. Nothing
is downloaded.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import traverse_util

from detector.errors import WeightsFileError
from detector.models.layers import FrozenBatchNorm
from detector.models.resnet import STEM_NORM_NAME

# torch.nn.BatchNorm2d's default, which torchvision's ResNets keep.
BATCH_NORM_EPS = 1e-5
BATCH_NORM_TENSORS = ("weight", "bias", "running_mean", "running_var")
SUFFIXES = (".npz", ".safetensors", ".pth", ".pt")
_LAYER_KEY = re.compile(r"^layer(\d+)\.(\d+)\.")
_SHOWN_NAMES = 5


def _describe(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_SHOWN_NAMES])
    return f"{shown} and {len(names) - _SHOWN_NAMES} more" if len(names) > _SHOWN_NAMES else shown


def _torch_tensors_as_numpy(path: str) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise WeightsFileError(
            f"{path}: reading a PyTorch checkpoint needs torch (pip install torch), or "
            "convert it elsewhere to .npz or .safetensors"
        ) from None
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    # Training checkpoints wrap the weights: {"model": ...} or {"state_dict": ...}.
    for wrapper in ("state_dict", "model"):
        if isinstance(loaded, Mapping) and isinstance(loaded.get(wrapper), Mapping):
            loaded = loaded[wrapper]
    if not isinstance(loaded, Mapping) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise WeightsFileError(f"{path}: not a state dict (a mapping of names to tensors)")
    return {
        name: (t.detach().float() if t.is_floating_point() else t.detach()).cpu().numpy() for name, t in loaded.items()
    }


def read_state_dict(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor in a weights file, by name, as host numpy arrays.

    Reads `.npz`, `.safetensors` (with the `safetensors` package) and
    `.pth`/`.pt` PyTorch state dicts (with `torch`, tensors only: no pickled
    code runs). Floating-point torch tensors come back as float32. A
    `module.` prefix on every name (DistributedDataParallel) is dropped.
    Raises FileNotFoundError for a missing file and WeightsFileError for an
    unknown suffix, a missing reader package or a damaged (e.g. truncated) file.
    """
    path = os.fspath(path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SUFFIXES:
        raise WeightsFileError(
            f"{path}: unknown weights file type {suffix or '(no suffix)'!r}; use one of {', '.join(SUFFIXES)}"
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(f"pretrained weights file not found: {path}")
    try:
        tensors = _read_tensors(path, suffix)
    except WeightsFileError:
        raise
    except Exception as e:  # each reader has its own error types for a damaged file
        cause = " ".join(str(e).split()) or type(e).__name__
        raise WeightsFileError(
            f"{path}: cannot read it as {suffix} ({cause}); the file is damaged or truncated, copy or convert it again"
        ) from e
    if tensors and all(name.startswith("module.") for name in tensors):
        tensors = {name[len("module.") :]: value for name, value in tensors.items()}
    return tensors


def _read_tensors(path: str, suffix: str) -> dict[str, np.ndarray]:
    if suffix == ".npz":
        with np.load(path, allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    if suffix == ".safetensors":
        try:
            from safetensors.numpy import load_file
        except ImportError:
            raise WeightsFileError(
                f"{path}: reading .safetensors needs the safetensors package "
                "(pip install safetensors, or pip install '.[pretrained]')"
            ) from None
        return load_file(path)
    return _torch_tensors_as_numpy(path)


def is_ignored_torchvision_key(name: str) -> bool:
    """The classifier and BatchNorm's step counters: in a torchvision ResNet, not in a backbone."""
    return name.startswith("fc.") or name.split(".")[-1] == "num_batches_tracked"


def ignored_torchvision_keys(state_dict: Mapping[str, Any]) -> list[str]:
    """The names `convert_torchvision_resnet` skips, sorted."""
    return sorted(name for name in state_dict if is_ignored_torchvision_key(name))


def torchvision_stage_sizes(state_dict: Mapping[str, Any]) -> tuple[int, ...]:
    """Blocks per stage from `layer{S}.{I}.` names, e.g. (3, 4, 6, 3) for ResNet-50."""
    blocks: dict[int, int] = {}
    for name in state_dict:
        match = _LAYER_KEY.match(name)
        if match:
            stage, index = int(match[1]), int(match[2])
            blocks[stage] = max(blocks.get(stage, 0), index + 1)
    if not blocks or sorted(blocks) != list(range(1, len(blocks) + 1)):
        raise WeightsFileError(
            f"not a torchvision ResNet state dict: residual stages {sorted(blocks)} "
            "(names layer1.0.conv1.weight, ...) where layer1..layerN are expected"
        )
    return tuple(blocks[stage] for stage in sorted(blocks))


def _torchvision_layout(stage_sizes: tuple[int, ...], bottleneck: bool, width: int):
    """Per conv: (torch conv prefix, torch bn prefix, our conv path, our norm path, torch weight shape)."""
    yield "conv1", "bn1", ("stem_conv",), (STEM_NORM_NAME,), (width, 3, 7, 7)
    expansion = 4 if bottleneck else 1
    in_channels = width
    for stage, num_blocks in enumerate(stage_sizes):
        features = width * 2**stage
        for index in range(num_blocks):
            torch_block = f"layer{stage + 1}.{index}"
            block = f"stage{stage + 1}_block{index + 1}"
            if bottleneck:
                shapes = [(features, in_channels, 1, 1), (features, features, 3, 3), (features * 4, features, 1, 1)]
            else:
                shapes = [(features, in_channels, 3, 3), (features, features, 3, 3)]
            for k, shape in enumerate(shapes):
                yield (
                    f"{torch_block}.conv{k + 1}",
                    f"{torch_block}.bn{k + 1}",
                    (block, f"Conv_{k}"),
                    (block, f"{FrozenBatchNorm.__name__}_{k}"),
                    shape,
                )
            strides = 2 if stage > 0 and index == 0 else 1
            if strides != 1 or in_channels != features * expansion:
                k = len(shapes)
                yield (
                    f"{torch_block}.downsample.0",
                    f"{torch_block}.downsample.1",
                    (block, f"Conv_{k}"),
                    (block, f"{FrozenBatchNorm.__name__}_{k}"),
                    (features * expansion, in_channels, 1, 1),
                )
            in_channels = features * expansion


def _fold_batch_norm(weight, bias, mean, var) -> tuple[np.ndarray, np.ndarray]:
    # In float64: var + eps loses digits in float32 for small variances.
    scale = np.asarray(weight, np.float64) / np.sqrt(np.asarray(var, np.float64) + BATCH_NORM_EPS)
    shift = np.asarray(bias, np.float64) - np.asarray(mean, np.float64) * scale
    return scale.astype(np.float32), shift.astype(np.float32)


def convert_torchvision_resnet(state_dict: Mapping[str, Any], stage_sizes=(3, 4, 6, 3)) -> dict:
    """A torchvision ResNet state dict -> params of `ResNet(stage_sizes, width, block, norm='frozen_bn')`.

    The block type (bottleneck when `layer1.0.conv3.weight` is present, else
    basic) and the width (output channels of `conv1.weight`) come from the
    state dict. Returns a nested dict of float32 numpy arrays: kernels
    `[kh, kw, in, out]`, FrozenBatchNorm `scale`/`bias` `[channels]`.
    Raises WeightsFileError naming missing or unexpected tensors (other than
    `ignored_torchvision_keys`) or a tensor whose shape does not fit.
    """
    stage_sizes = tuple(int(n) for n in stage_sizes)
    bottleneck = "layer1.0.conv3.weight" in state_dict
    width = int(np.shape(state_dict["conv1.weight"])[0]) if "conv1.weight" in state_dict else 64
    layout = list(_torchvision_layout(stage_sizes, bottleneck, width))
    expected = {}
    for conv_name, bn_name, _, _, conv_shape in layout:
        expected[f"{conv_name}.weight"] = conv_shape
        expected.update({f"{bn_name}.{tensor}": conv_shape[:1] for tensor in BATCH_NORM_TENSORS})
    present = {name for name in state_dict if not is_ignored_torchvision_key(name)}
    missing, unexpected = sorted(set(expected) - present), sorted(present - set(expected))
    if missing or unexpected:
        kind = "bottleneck" if bottleneck else "basic"
        problems = [
            f"{len(missing)} missing ({_describe(missing)})" if missing else "",
            f"{len(unexpected)} unexpected ({_describe(unexpected)})" if unexpected else "",
        ]
        raise WeightsFileError(
            f"the state dict does not fit a torchvision ResNet with {kind} blocks, "
            f"stage sizes {stage_sizes}, width {width}: "
            f"{'; '.join(p for p in problems if p)} tensors"
        )
    for name, shape in expected.items():
        if tuple(np.shape(state_dict[name])) != tuple(shape):
            raise WeightsFileError(
                f"tensor {name} has shape {tuple(np.shape(state_dict[name]))}; this ResNet needs {tuple(shape)}"
            )
    params: dict[tuple[str, ...], np.ndarray] = {}
    for conv_name, bn_name, conv_path, norm_path, _ in layout:
        weight = np.asarray(state_dict[f"{conv_name}.weight"], np.float32)
        params[(*conv_path, "kernel")] = np.ascontiguousarray(weight.transpose(2, 3, 1, 0))
        scale, bias = _fold_batch_norm(*(state_dict[f"{bn_name}.{tensor}"] for tensor in BATCH_NORM_TENSORS))
        params[(*norm_path, "scale")] = scale
        params[(*norm_path, "bias")] = bias
    return traverse_util.unflatten_dict(params)


TIMM_VIT_MARKER = "patch_embed.proj.weight"
# What a timm ViT checkpoint holds beyond a detection backbone: the class
# token and the classifier, MAE's mask token and decoder.
_TIMM_VIT_IGNORED = ("cls_token", "mask_token")
_TIMM_VIT_IGNORED_PREFIXES = ("head.", "fc_norm.", "decoder")
_TIMM_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.")
# The head count shapes no tensor (qkv is [3D, D] however it is split), so
# the converter can only name it for timm's standard sizes: (width, depth) -> (name, heads).
_STANDARD_VITS = {
    (192, 12): ("ViT-Ti", 3),
    (384, 12): ("ViT-S", 6),
    (768, 12): ("ViT-B", 12),
    (1024, 24): ("ViT-L", 16),
    (1280, 32): ("ViT-H", 16),
}
_VITDET_CONFIGS = {
    "ViT-B": "configs/vitdet_b_coco.py",
    "ViT-L": "configs/vitdet_l_coco.py",
    "ViT-H": "configs/vitdet_h_coco.py",
}


def _same(tensor: np.ndarray, num_heads: int) -> np.ndarray:
    return tensor


def _transposed(tensor: np.ndarray, num_heads: int) -> np.ndarray:
    return tensor.T


def _qkv_kernel(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # torch's Linear weight is [out, in]; timm orders qkv's outputs (q|k|v, head, head_dim).
    return weight.T.reshape(weight.shape[1], 3, num_heads, -1)


def _qkv_bias(bias: np.ndarray, num_heads: int) -> np.ndarray:
    return bias.reshape(3, num_heads, -1)


def _out_kernel(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # timm concatenates the heads' outputs head by head before `proj`.
    return weight.T.reshape(num_heads, -1, weight.shape[0])


# Inside a block: our parameter -> (timm's tensor under `blocks.{i}.`, its conversion given the head count).
_VIT_BLOCK_TENSORS = {
    "norm1/scale": ("norm1.weight", _same),
    "norm1/bias": ("norm1.bias", _same),
    "attn/qkv/kernel": ("attn.qkv.weight", _qkv_kernel),
    "attn/qkv/bias": ("attn.qkv.bias", _qkv_bias),
    "attn/out/kernel": ("attn.proj.weight", _out_kernel),
    "attn/out/bias": ("attn.proj.bias", _same),
    "norm2/scale": ("norm2.weight", _same),
    "norm2/bias": ("norm2.bias", _same),
    "mlp/fc1/kernel": ("mlp.fc1.weight", _transposed),
    "mlp/fc1/bias": ("mlp.fc1.bias", _same),
    "mlp/fc2/kernel": ("mlp.fc2.weight", _transposed),
    "mlp/fc2/bias": ("mlp.fc2.bias", _same),
}
# The ViT's parameters outside its blocks.
_VIT_TRUNK_PARAMS = ("patch_embed/kernel", "patch_embed/bias", "pos_embed", "norm/scale", "norm/bias")
_SCANNED_BLOCK_PARAM = re.compile(r"^stages/(windowed|global)/(.+)$")
_UNSCANNED_BLOCK_PARAM = re.compile(r"^stage(\d+)/(?:windowed(\d+)|global)/(.+)$")


@dataclasses.dataclass(frozen=True)
class VitSize:
    """What fixes a plain ViT's tensor shapes: blocks, model width, MLP hidden units, patch side in pixels."""

    depth: int
    width: int
    mlp_hidden: int
    patch_size: int

    def __str__(self) -> str:
        return f"depth {self.depth}, width {self.width}, MLP {self.mlp_hidden}, patch {self.patch_size}"

    def timm_shapes(self) -> dict[str, tuple[int, ...]]:
        """timm's tensor shapes at this size, without `pos_embed` (its token count is the grid's) and `norm.*`."""
        d, hidden = self.width, self.mlp_hidden
        block = {
            "norm1.weight": (d,),
            "norm1.bias": (d,),
            "attn.qkv.weight": (3 * d, d),
            "attn.qkv.bias": (3 * d,),
            "attn.proj.weight": (d, d),
            "attn.proj.bias": (d,),
            "norm2.weight": (d,),
            "norm2.bias": (d,),
            "mlp.fc1.weight": (hidden, d),
            "mlp.fc1.bias": (hidden,),
            "mlp.fc2.weight": (d, hidden),
            "mlp.fc2.bias": (d,),
        }
        shapes = {TIMM_VIT_MARKER: (d, 3, self.patch_size, self.patch_size), "patch_embed.proj.bias": (d,)}
        for i in range(self.depth):
            shapes.update({f"blocks.{i}.{name}": shape for name, shape in block.items()})
        return shapes


def is_timm_vit(state_dict: Mapping[str, Any]) -> bool:
    """Whether a state dict (torch names) is a timm ViT's: told by its patch embedding, which a ResNet lacks."""
    return TIMM_VIT_MARKER in state_dict


def is_ignored_timm_vit_key(name: str) -> bool:
    """The class token, classifier, pooled-feature norm and MAE's mask token and decoder: not in a backbone."""
    return name in _TIMM_VIT_IGNORED or name.startswith(_TIMM_VIT_IGNORED_PREFIXES)


def ignored_timm_vit_keys(state_dict: Mapping[str, Any]) -> list[str]:
    """The names `convert_timm_vit` skips, sorted."""
    return sorted(name for name in state_dict if is_ignored_timm_vit_key(name))


def timm_vit_size(state_dict: Mapping[str, Any]) -> VitSize:
    """The size a timm ViT state dict declares: width and patch from `patch_embed.proj.weight`,
    depth from the `blocks.{i}.` names, MLP width from `blocks.0.mlp.fc1.weight` (4 x width without it)."""
    if not is_timm_vit(state_dict):
        raise WeightsFileError(
            f"not a timm ViT state dict: it has no {TIMM_VIT_MARKER} (names: {_describe(state_dict)})"
        )
    shape = tuple(np.shape(state_dict[TIMM_VIT_MARKER]))
    if len(shape) != 4 or shape[2] != shape[3]:
        raise WeightsFileError(f"{TIMM_VIT_MARKER} has shape {shape}; a ViT's is [width, 3, patch, patch]")
    blocks = [int(match[1]) for name in state_dict if (match := _TIMM_BLOCK_KEY.match(name))]
    fc1 = state_dict.get("blocks.0.mlp.fc1.weight")
    return VitSize(
        depth=max(blocks) + 1 if blocks else 0,
        width=shape[0],
        mlp_hidden=int(np.shape(fc1)[0]) if fc1 is not None and np.ndim(fc1) == 2 else 4 * shape[0],
        patch_size=shape[2],
    )


def timm_position_grid(state_dict: Mapping[str, Any]) -> tuple[int, bool]:
    """(G, class token) of timm's `pos_embed` `[1, (1 +) G*G, width]`: the grid's side and whether the class token's
    entry comes first."""
    shape = tuple(np.shape(state_dict["pos_embed"]))
    if len(shape) == 3 and shape[0] == 1:
        for class_token in (False, True):
            tokens = shape[1] - class_token
            if tokens > 0 and math.isqrt(tokens) ** 2 == tokens:
                return math.isqrt(tokens), class_token
    raise WeightsFileError(
        f"pos_embed has shape {shape}; timm's is [1, G*G, width] or [1, 1 + G*G, width] "
        "(class token first) for a G x G grid of patches"
    )


def _fit_hint(unexpected: list[str], file_size: VitSize, model_size: VitSize | None) -> str:
    if model_size is not None and file_size != model_size:
        name = _STANDARD_VITS.get((file_size.width, file_size.depth), ("",))[0]
        config = f" ({_VITDET_CONFIGS[name]} is {name})" if name in _VITDET_CONFIGS else ""
        hint = (
            f"the file is a ViT of {file_size}: set model.backbone.depth/embed_dim/num_heads/mlp_ratio "
            f"to its size{config}, or use weights of the model's size"
        )
        if file_size.patch_size != model_size.patch_size:
            hint += (
                f"; patch {file_size.patch_size} checkpoints (DINOv2, EVA-02, MAE ViT-H/14) need their "
                "patch-embedding kernel resized to 16x16, which this importer does not do"
            )
        return hint
    if unexpected:
        return (
            "the backbone's blocks are timm's plain pre-norm Block (norm1, attn.qkv, attn.proj, norm2, "
            "mlp.fc1, mlp.fc2); more tensors mean another architecture (e.g. DINOv2's LayerScale ls1/ls2, "
            "EVA-02's rotary embeddings), which it cannot take"
        )
    return "every block needs all of them (ViTs built with qkv_bias=False do not fit); is the file complete?"


def _check_timm_vit(state_dict: Mapping[str, Any], size: VitSize, fits: str, model_size: VitSize | None) -> None:
    """Raises WeightsFileError unless `state_dict` holds exactly a timm ViT of `size` (ignored names aside)."""
    expected: dict[str, tuple[int, ...] | None] = dict(size.timm_shapes())
    expected["pos_embed"] = None
    if "pos_embed" in state_dict:
        side, class_token = timm_position_grid(state_dict)
        expected["pos_embed"] = (1, side * side + class_token, size.width)
    # A final norm is optional, but then whole.
    if "norm.weight" in state_dict or "norm.bias" in state_dict:
        expected.update({"norm.weight": (size.width,), "norm.bias": (size.width,)})
    present = {name for name in state_dict if not is_ignored_timm_vit_key(name)}
    missing, unexpected = sorted(set(expected) - present), sorted(present - set(expected))
    misshapen = [
        f"{name} {tuple(np.shape(state_dict[name]))} for {expected[name]}"
        for name in sorted(set(expected) & present)
        if tuple(np.shape(state_dict[name])) != expected[name]
    ]
    if missing or unexpected or misshapen:
        problems = [
            f"{len(missing)} missing ({_describe(missing)})" if missing else "",
            f"{len(unexpected)} unexpected ({_describe(unexpected)})" if unexpected else "",
            f"{len(misshapen)} misshapen ({_describe(misshapen)})" if misshapen else "",
        ]
        raise WeightsFileError(
            f"the state dict does not fit {fits}: {'; '.join(p for p in problems if p)} tensors; "
            f"{_fit_hint(unexpected, timm_vit_size(state_dict), model_size)}"
        )


@dataclasses.dataclass(frozen=True)
class _VitModelLayout:
    size: VitSize
    num_heads: int
    grid: tuple[int, int]  # the position embedding's
    # Each block parameter -> (its name inside a block, the timm block index of each of its stacked slices).
    blocks: dict[str, tuple[str, np.ndarray]]


def _vit_model_layout(shapes: Mapping[str, tuple[int, ...]]) -> _VitModelLayout:
    """Reads how `detector.models.vit.ViT` placed its blocks from its flat parameter shapes (scanned or not)."""
    scanned, unscanned, unknown = {}, {}, []
    for name in shapes:
        if name in _VIT_TRUNK_PARAMS:
            continue
        if (match := _SCANNED_BLOCK_PARAM.match(name)) and match[2] in _VIT_BLOCK_TENSORS:
            scanned[name] = (match[1] == "windowed", match[2])
        elif (match := _UNSCANNED_BLOCK_PARAM.match(name)) and match[3] in _VIT_BLOCK_TENSORS:
            unscanned[name] = (int(match[1]), None if match[2] is None else int(match[2]), match[3])
        else:
            unknown.append(name)
    lacking = [name for name in _VIT_TRUNK_PARAMS if name not in shapes]
    if unknown or lacking or not (scanned or unscanned):
        raise WeightsFileError(
            "the model's ViT is not laid out as this importer expects (detector.models.vit.ViT): "
            f"parameters no timm tensor maps to: {_describe(unknown) or 'none'}; "
            f"lacking: {_describe(lacking) or 'none'}"
        )
    blocks = {}
    if scanned:
        num_stages = next(shapes[name][0] for name in scanned)
        windowed = [shapes[name][1] for name, (is_windowed, _) in scanned.items() if is_windowed]
        layers = windowed[0] if windowed else 0
        every = layers + 1
        for name, (is_windowed, inner) in scanned.items():
            stages = np.arange(num_stages) * every
            index = stages[:, None] + np.arange(layers) if is_windowed else stages + layers
            blocks[name] = (inner, index)
    else:
        num_stages = 1 + max(stage for stage, _, _ in unscanned.values())
        layers = 1 + max((layer for _, layer, _ in unscanned.values() if layer is not None), default=-1)
        every = layers + 1
        for name, (stage, layer, inner) in unscanned.items():
            blocks[name] = (inner, np.array(stage * every + (layers if layer is None else layer)))
    for name, (_, index) in blocks.items():
        if shapes[name][: index.ndim] != index.shape:
            raise WeightsFileError(
                f"the model's ViT parameter {name} has shape {shapes[name]}; stacks of {index.shape}"
            )
    qkv = next(shapes[name] for name, (inner, _) in blocks.items() if inner == "attn/qkv/kernel")
    fc1 = next(shapes[name] for name, (inner, _) in blocks.items() if inner == "mlp/fc1/kernel")
    return _VitModelLayout(
        size=VitSize(
            depth=num_stages * every,
            width=shapes["pos_embed"][-1],
            mlp_hidden=fc1[-1],
            patch_size=shapes["patch_embed/kernel"][0],
        ),
        num_heads=qkv[-2],
        grid=tuple(shapes["pos_embed"][1:3]),
        blocks=blocks,
    )


def resize_position_embedding(pos_embed: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """`[1, G, G', D]` -> `[1, grid[0], grid[1], D]` float32, resampled as `ViT` resamples it to an input's grid.

    `jax.image.resize(method='bicubic')`: Keys' cubic kernel (a = -0.5) on
    half-pixel centres (align_corners=False), widened to antialias when
    shrinking, taps beyond the grid dropped and the rest renormalised. That is
    torch's `F.interpolate(mode='bicubic', align_corners=False,
    antialias=True)`, timm's `resample_abs_pos_embed` default; ViTDet's
    `get_abs_pos` uses antialias=False (a = -0.75, edges repeated), slightly
    different. The model's forward pass resizes with this one, so loading does too.
    """
    if tuple(pos_embed.shape[1:3]) == tuple(grid):
        return np.asarray(pos_embed, np.float32)
    # On the host: a few thousand values, before any sharded computation exists.
    on_host = jax.device_put(np.asarray(pos_embed, np.float32), jax.devices("cpu")[0])
    return np.asarray(jax.image.resize(on_host, (1, *grid, pos_embed.shape[-1]), method="bicubic"), np.float32)


def convert_timm_vit(state_dict: Mapping[str, Any], backbone_params) -> dict:
    """A timm ViT state dict -> values for `backbone_params`, a `ViT`'s parameters (initialised or abstract).

    The model's parameters tell what the file cannot: the head count (how
    qkv and proj split), which blocks are windowed and how `nn.scan` stacks
    them, and the position embedding's grid, to which `pos_embed` is resized
    (`resize_position_embedding`) when its own differs. Returns a nested dict
    of float32 numpy arrays shaped like `backbone_params` (layout in the module
    docstring). Raises WeightsFileError naming missing, unexpected (other than
    `ignored_timm_vit_keys`) or misshapen tensors.
    """
    flat = traverse_util.flatten_dict(backbone_params, sep="/")
    shapes = {name: tuple(_leaf_value(leaf).shape) for name, leaf in flat.items()}
    model = _vit_model_layout(shapes)
    _check_timm_vit(state_dict, model.size, f"the model's ViT ({model.size})", model.size)

    def tensor(name: str) -> np.ndarray:
        return np.asarray(state_dict[name], np.float32)

    side, class_token = timm_position_grid(state_dict)
    pos_embed = tensor("pos_embed")[:, int(class_token) :].reshape(1, side, side, model.size.width)
    params = {
        "patch_embed/kernel": tensor(TIMM_VIT_MARKER).transpose(2, 3, 1, 0),
        "patch_embed/bias": tensor("patch_embed.proj.bias"),
        "pos_embed": resize_position_embedding(pos_embed, model.grid),
        "norm/scale": tensor("norm.weight")
        if "norm.weight" in state_dict
        else np.ones(shapes["norm/scale"], np.float32),
        "norm/bias": tensor("norm.bias") if "norm.bias" in state_dict else np.zeros(shapes["norm/bias"], np.float32),
    }
    for name, (inner, index) in model.blocks.items():
        timm_name, convert = _VIT_BLOCK_TENSORS[inner]
        slices = [convert(tensor(f"blocks.{i}.{timm_name}"), model.num_heads) for i in index.ravel()]
        params[name] = np.stack(slices).reshape(shapes[name])
    return traverse_util.unflatten_dict({name: np.ascontiguousarray(value) for name, value in params.items()}, sep="/")


def flatten_backbone_params(backbone_params) -> dict[str, np.ndarray]:
    """Nested params -> {'stage1_block1/Conv_0/kernel': array, ...}, the flat `.npz` layout."""
    return {path: np.asarray(value) for path, value in traverse_util.flatten_dict(backbone_params, sep="/").items()}


def save_backbone_params(backbone_params, path: str | os.PathLike) -> None:
    """Writes backbone params as a flat `.npz` that `load_backbone_params` reads."""
    np.savez(path, **flatten_backbone_params(backbone_params))


def _has_torch_names(tensors: Mapping[str, Any]) -> bool:
    # Our layout names paths with '/', torchvision's and timm's with '.' only.
    with_slash = sum("/" in name for name in tensors)
    if with_slash and with_slash != len(tensors):
        raise WeightsFileError(
            "the file mixes 'module/param' names (this project's layout) with "
            "'module.param' names (torchvision's or timm's); convert it again"
        )
    return not with_slash


def _model_stage_sizes(flat_backbone: Mapping[str, Any]) -> tuple[int, ...]:
    blocks: dict[int, int] = {}
    for path in flat_backbone:
        match = re.match(r"^stage(\d+)_block(\d+)/", path)
        if match:
            blocks[int(match[1])] = max(blocks.get(int(match[1]), 0), int(match[2]))
    return tuple(blocks[stage] for stage in sorted(blocks))


def _leaf_value(leaf):
    return leaf.unbox(apply_constraint=False) if isinstance(leaf, nn.meta.AxisMetadata) else leaf


def _like(model_leaf, value: np.ndarray):
    """`value` in the form of `model_leaf`: its dtype, its sharding if it is a jax.Array, its box if boxed."""
    if isinstance(model_leaf, nn.meta.AxisMetadata):
        return model_leaf.replace_boxed(_like(_leaf_value(model_leaf), value))
    value = np.asarray(value, dtype=model_leaf.dtype)
    if isinstance(model_leaf, jax.Array):
        # Every process builds only its own shards, so this works on any mesh and any number of hosts.
        return jax.make_array_from_callback(value.shape, model_leaf.sharding, lambda index: value[index])
    return value


def _from_torch_names(tensors: Mapping[str, Any], backbone_params) -> dict[str, np.ndarray]:
    """A torchvision ResNet or timm ViT state dict -> the flat layout of `backbone_params`, or WeightsFileError."""
    flat_model = traverse_util.flatten_dict(backbone_params, sep="/")
    model_is_vit = "pos_embed" in flat_model
    if is_timm_vit(tensors):
        if not model_is_vit:
            raise WeightsFileError(
                f"it holds a timm ViT ({TIMM_VIT_MARKER}) but the model's backbone is a ResNet; "
                "use a ViT config (configs/vitdet_*.py) or a ResNet's weights"
            )
        return flatten_backbone_params(convert_timm_vit(tensors, backbone_params))
    if model_is_vit:
        raise WeightsFileError(
            f"not a timm ViT state dict (no {TIMM_VIT_MARKER}; names: {_describe(tensors)}), "
            "which the model's ViT backbone needs: pass a timm-layout ViT checkpoint (MAE, DeiT, ...)"
        )
    return flatten_backbone_params(convert_torchvision_resnet(tensors, _model_stage_sizes(flat_model)))


def load_backbone_params(params, path: str | os.PathLike):
    """`params` (a whole model's) with its `backbone` subtree replaced by the weights in `path`.

    What `config.model.backbone.pretrained` names, for either backbone; the
    file's names tell its layout: '/'-separated ones are this project's flat
    `.npz` layout (a converted ResNet, or `save_backbone_params` of any
    backbone), loaded as they are; '.'-separated ones are a torch state dict,
    converted here for the model's parameters: a timm ViT (it has
    `patch_embed.proj.weight`; directly or as the converter's `.npz`) with
    `convert_timm_vit`, else a torchvision ResNet for the model's stage sizes.
    Every backbone leaf of `params` then gets a value of the same shape, and
    the file must hold nothing else (ignored names aside). Leaves keep their
    dtype, and jax.Array leaves their sharding (so this can follow a sharded
    initialisation); boxed (logically partitioned) leaves stay boxed.
    Raises WeightsFileError naming what does not fit.
    """
    path = os.fspath(path)
    if "backbone" not in params:
        raise WeightsFileError(f"cannot load {path}: the model parameters have no 'backbone'")
    flat_model = traverse_util.flatten_dict(params["backbone"], sep="/")
    tensors = read_state_dict(path)
    try:
        if _has_torch_names(tensors):
            tensors = _from_torch_names(tensors, params["backbone"])
    except WeightsFileError as e:
        raise WeightsFileError(f"{path}: {e}") from None
    missing, unexpected = sorted(set(flat_model) - set(tensors)), sorted(set(tensors) - set(flat_model))
    if missing or unexpected:
        problems = [
            f"{len(missing)} missing ({_describe(missing)})" if missing else "",
            f"{len(unexpected)} unexpected ({_describe(unexpected)})" if unexpected else "",
        ]
        hint = ""
        if any("GroupNorm" in name for name in missing) and any(
            FrozenBatchNorm.__name__ in name for name in unexpected
        ):
            hint = (
                "; the model uses GroupNorm, pretrained BatchNorm weights need config.model.backbone.norm='frozen_bn'"
            )
        raise WeightsFileError(
            f"{path} does not fit the model's backbone: {'; '.join(p for p in problems if p)} tensors{hint}"
        )
    loaded = {}
    for name, model_leaf in flat_model.items():
        model_shape = tuple(_leaf_value(model_leaf).shape)
        if tuple(tensors[name].shape) != model_shape:
            raise WeightsFileError(
                f"{path}: tensor {name} has shape {tuple(tensors[name].shape)}; the model's is {model_shape}"
            )
        loaded[name] = _like(model_leaf, tensors[name])
    return {**params, "backbone": traverse_util.unflatten_dict(loaded, sep="/")}


def _group_names(names: Iterable[str]) -> str:
    """'cls_token, decoder_blocks.* (96), head.* (2)': names grouped by their first component."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(name.split(".")[0], []).append(name)
    return ", ".join(
        first if members == [first] else f"{first}.* ({len(members)})" for first, members in sorted(groups.items())
    )


def _convert_torchvision(state_dict: Mapping[str, Any], input_path: str, output_path: str) -> str:
    stage_sizes = torchvision_stage_sizes(state_dict)
    backbone = flatten_backbone_params(convert_torchvision_resnet(state_dict, stage_sizes))
    save_backbone_params(backbone, output_path)

    ignored = ignored_torchvision_keys(state_dict)
    counters = [name for name in ignored if name.endswith("num_batches_tracked")]
    others = [name for name in ignored if name not in counters]
    ignored_text = ", ".join(others + ([f"{len(counters)} num_batches_tracked counters"] if counters else []))
    block = "bottleneck" if "layer1.0.conv3.weight" in state_dict else "basic"
    width = backbone["stem_conv/kernel"].shape[-1]
    num_values = sum(value.size for value in backbone.values())
    return "\n".join(
        [
            f"{input_path}: ResNet with {block} blocks, stage sizes {stage_sizes}, width {width}",
            f"converted {len(state_dict) - len(ignored)} tensors into {len(backbone)} arrays "
            f"({num_values / 1e6:.2f}M values; BatchNorms folded into frozen scale/bias)",
            f"ignored: {ignored_text or 'nothing'}",
            f"wrote {output_path}; train with --config.model.backbone.norm=frozen_bn "
            f"--config.model.backbone.pretrained={output_path}",
        ]
    )


def _convert_timm_vit(state_dict: Mapping[str, Any], input_path: str, output_path: str) -> str:
    size = timm_vit_size(state_dict)
    _check_timm_vit(state_dict, size, f"a timm ViT of {size} (read from {TIMM_VIT_MARKER} and blocks.*)", None)
    side, class_token = timm_position_grid(state_dict)
    # timm's names and layout, so one file serves any head split, stacking and grid (see the module docstring).
    kept = {
        name: np.asarray(value, np.float32) for name, value in state_dict.items() if not is_ignored_timm_vit_key(name)
    }
    kept["pos_embed"] = kept["pos_embed"][:, int(class_token) :]
    np.savez(output_path, **kept)

    name, heads = _STANDARD_VITS.get((size.width, size.depth), ("", 0))
    heads_text = f"{heads} for {name}" if heads else "set model.backbone.num_heads"
    config = f"--config={_VITDET_CONFIGS[name]} " if name in _VITDET_CONFIGS and size.patch_size == 16 else ""
    pixels = side * size.patch_size
    lines = [
        f"{input_path}: timm ViT, {size}; heads not stored ({heads_text}); position embedding: "
        f"{side}x{side} grid ({pixels} px){', after a class token' if class_token else ''}",
        f"kept {len(kept)} tensors ({sum(v.size for v in kept.values()) / 1e6:.2f}M values) in timm's names and "
        "layout, the position embedding without the class token: the model's head count, block stacking and "
        "grid are applied when it loads them",
        f"ignored: {_group_names(ignored_timm_vit_keys(state_dict)) or 'nothing'}",
    ]
    if "norm.weight" not in kept:
        lines.append("no final norm (norm.*) in the file: the backbone's final LayerNorm starts as the identity")
    lines.append(
        f"wrote {output_path}; train a ViT of this size with {config}--config.model.backbone.pretrained={output_path} "
        f"(pretrain_image_size={pixels} keeps the {side}x{side} grid; another is resized bicubically on loading)"
    )
    return "\n".join(lines)


def convert_pretrained_file(input_path: str | os.PathLike, output_path: str | os.PathLike) -> str:
    """Converts a torchvision ResNet or timm ViT state dict file to a flat `.npz`; returns what it did, as text.

    What `python -m detector.convert_pretrained` runs; a timm ViT is told by
    `patch_embed.proj.weight`. A ResNet is converted to this project's layout
    (stage sizes and width from the state dict, BatchNorms folded into frozen
    scale/bias). A ViT keeps timm's names: the tensors the backbone uses, as
    float32, `pos_embed` at its own grid without the class token's entry; the
    mapping needs the model's head count and block layout, so it happens in
    `load_backbone_params`, and one file serves every input size. Ignored
    tensors are listed.
    """
    input_path, output_path = os.fspath(input_path), os.fspath(output_path)
    state_dict = read_state_dict(input_path)
    try:
        if not _has_torch_names(state_dict):
            raise WeightsFileError(
                "its names are this project's layout already: pass it to --config.model.backbone.pretrained as it is"
            )
        if is_timm_vit(state_dict):
            return _convert_timm_vit(state_dict, input_path, output_path)
        return _convert_torchvision(state_dict, input_path, output_path)
    except WeightsFileError as e:
        raise WeightsFileError(f"{input_path}: {e}") from None
