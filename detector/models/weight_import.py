"""Pretrained backbone weights: torchvision ResNet and timm/transformers ViT state dicts -> backbone parameters.

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

ViT. Every supported layout is first renamed to one canonical form, timm's
`VisionTransformer` names (`canonical_vit_state_dict`), then mapped onto
`detector.models.vit.ViT` (D = width, H = heads, i = block, G = grid side):

  layouts (told by the patch embedding's name):
    timm VisionTransformer: MAE, DeiT, AugReg, `vit_*_patch14_dinov2`, `..._reg4_dinov2`
    timm Eva: `vit_*_patch16_dinov3` (+ `_qkvb`), `eva02_*_patch14_*`:
        gamma_{1,2} -> ls{1,2}.gamma; attn.{q,k,v}_proj -> attn.qkv / q_bias, v_bias
        (DINOv3's own files: storage_tokens -> reg_token, rope_embed.periods -> rope.periods)
    transformers Dinov2Model / Dinov2WithRegistersModel: embeddings.{cls_token,
        register_tokens, position_embeddings, patch_embeddings.projection}, encoder.layer.i ->
        blocks.i, attention.attention.{query,key,value} or attention.{q,k,v}_proj -> attn.qkv,
        attention.output.dense or o_proj -> attn.proj, layer_scale{1,2}.lambda1 -> ls{1,2}.gamma,
        mlp.weights_in/out or gate_proj/up_proj/down_proj -> mlp.fc1_g/fc1_x/fc2, layernorm -> norm
    transformers DINOv3ViTModel: the same, without position embeddings, (model.)layer.i ->
        blocks.i, embeddings.patch_embeddings -> patch_embed.proj, rope_embeddings.inv_freq ->
        rope.periods (1 / inv_freq)
  canonical -> ViT parameters:
  patch_embed.proj.weight [D, 3, p, p]    -> patch_embed/kernel [p, p, 3, D]  (.bias -> /bias)
  pos_embed [1, (1 +) G*G, D]             -> pos_embed [1, g, g, D]: the class token's entry split off
      (class_pos_embed), the rest read as the G x G grid row by row, resized (see
      `resize_position_embedding`) to the model's g = pretrain_image_size / p if G != g
  class entry of pos_embed [1, 1, D]      -> class_pos_embed (zeros when the file's class token has none)
  cls_token [1, 1, D], reg_token [1, R, D] -> cls_token, reg_token
  blocks.i.norm{1,2}.{weight,bias}        -> norm{1,2}/{scale,bias}
  blocks.i.attn.qkv.weight [3D, D]        -> attn/qkv/kernel [D, 3, H, D/H]  (q, k, v concatenated if apart)
  blocks.i.attn.qkv.bias [3D]             -> attn/qkv/bias [3, H, D/H]; attn.q_bias, v_bias [D] with k's 0
  blocks.i.attn.proj.weight [D, D]        -> attn/out/kernel [H, D/H, D]     (.bias -> /bias)
  blocks.i.ls{1,2}.gamma [D]              -> ls{1,2}
  blocks.i.mlp.fc1.weight [h, D]          -> mlp/fc1/kernel [D, h]           (GELU; .bias -> /bias)
  blocks.i.mlp.fc1_{g,x}.weight [h, D]    -> mlp/fc1/kernel [D, 2, h], index 0 = g (SwiGLU; packed
      [2h, D] fc1 of timm's GluMlp/SwiGLUPacked is split in halves, the gate first)
  blocks.i.mlp.norm.{weight,bias} [h]     -> mlp/norm/{scale,bias}           (EVA-02's scale_mlp)
  blocks.i.mlp.fc2.weight [D, h]          -> mlp/fc2/kernel [h, D]           (.bias -> /bias)
  norm.{weight,bias}                      -> norm/{scale,bias}

With k = global_attention_every, block i = s*k + l is slice [s, l] of the
scanned `stages/windowed/...` stacks for l < k - 1 and slice [s] of
`stages/global/...` for l = k - 1 (`stage{s}/windowed{l}/...` and
`stage{s}/global/...` when not scanned). The head count, the stacking and the
grid are config values no tensor of the file holds, so a ViT is mapped when it
is loaded into a model's parameters, not when it is converted.

Every tensor of the file is used or deliberately dropped. Always dropped:
`mask_token`, `head.*`, `fc_norm.*`, `lm_head.*`, `decoder*` (MAE's decoder).
Dropped when the model has none: `cls_token` with its position entry,
`reg_token` (ViTDet-style windowed blocks cannot carry prefix tokens).
`rope.periods` is checked against the model's own formula (`vit.rope_angles`:
temperature ** (i / n)) and dropped: other periods would load another network.
Anything else the model does not use is a WeightsFileError naming it and the
config key that makes the model fit (`layer_scale`, `mlp`, `mlp_norm`,
`qkv_bias`, `absolute_position`, `register_tokens`, `patch_size`,
`final_norm`, ...). A file without `norm.*` (timm's average-pooling ViTs,
EVA-02 as registered, keep `fc_norm` instead, which normalises the pooled
vector only) computes its features with no final normalisation: it loads
into a model with `final_norm=False` only, which has none either. No tensor
holds the LayerNorm epsilon (DINOv3: `norm_epsilon=1e-5`) or the RoPE kind
of files without RoPE buffers (DINOv3: `rope='dinov3'`,
`rope_temperature=100`; EVA-02: `rope='eva02'`, `rope_reference_grid=16`):
the config sets them.

Files: torchvision, timm or transformers layout in `.pth`/`.pt` (needs torch),
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
_HF_DINOV2_MARKER = "embeddings.patch_embeddings.projection.weight"
_HF_DINOV3_MARKER = "embeddings.patch_embeddings.weight"
# What a ViT checkpoint holds beyond a detection backbone: the classifier and
# pooled-feature norm, the masked-image-modelling mask token, MAE's decoder.
_VIT_IGNORED = ("mask_token", "embeddings.mask_token")
_VIT_IGNORED_PREFIXES = ("head.", "fc_norm.", "decoder", "lm_head.", "pooler.")
_TIMM_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.")
# The head count shapes no tensor (qkv is [3D, D] however it is split), so
# the converter can only name it for timm's standard sizes: (width, depth) -> (name, heads).
_STANDARD_VITS = {
    (192, 12): ("ViT-Ti", 3),
    (384, 12): ("ViT-S", 6),
    (768, 12): ("ViT-B", 12),
    (1024, 24): ("ViT-L", 16),
    (1280, 32): ("ViT-H", 16),
    (1536, 40): ("ViT-g", 24),
    (4096, 40): ("ViT-7B", 32),
}
_VITDET_CONFIGS = {
    "ViT-B": "configs/vitdet_b_coco.py",
    "ViT-L": "configs/vitdet_l_coco.py",
    "ViT-H": "configs/vitdet_h_coco.py",
}
# Renames of each layout onto the canonical (timm VisionTransformer) names, applied in order.
# `attn.{q,k,v}.*` and `mlp.fc1_packed.*` are intermediate: `_canonical_blocks` merges them.
_BLOCK_RENAMES = (
    (r"\.gamma_([12])$", r".ls\1.gamma"),  # timm Eva
    (r"\.attn\.([qkv])_proj\.", r".attn.\1."),  # timm Eva unfused (EVA-02 B/L)
    (r"\.attention\.attention\.query\.", ".attn.q."),  # transformers Dinov2 (as published)
    (r"\.attention\.attention\.key\.", ".attn.k."),
    (r"\.attention\.attention\.value\.", ".attn.v."),
    (r"\.attention\.output\.dense\.", ".attn.proj."),
    (r"\.attention\.([qkv])_proj\.", r".attn.\1."),  # transformers 5 Dinov2, DINOv3ViT
    (r"\.attention\.o_proj\.", ".attn.proj."),
    (r"\.layer_scale([12])\.lambda1$", r".ls\1.gamma"),
    (r"\.mlp\.weights_in\.", ".mlp.fc1_packed."),  # transformers Dinov2 SwiGLU (ViT-g)
    (r"\.mlp\.weights_out\.", ".mlp.fc2."),
    (r"\.mlp\.gate_proj\.", ".mlp.fc1_g."),
    (r"\.mlp\.down_proj\.", ".mlp.fc2."),
)
_TRUNK_RENAMES = {
    "timm": (
        (r"^storage_tokens$", "reg_token"),  # DINOv3's own checkpoints
        (r"^rope_embed\.periods$", "rope.periods"),
    ),
    "transformers Dinov2": (
        (r"^embeddings\.cls_token$", "cls_token"),
        (r"^embeddings\.register_tokens$", "reg_token"),
        (r"^embeddings\.position_embeddings$", "pos_embed"),
        (r"^embeddings\.patch_embeddings\.projection\.", "patch_embed.proj."),
        (r"^encoder\.layer\.(\d+)\.", r"blocks.\1."),
        (r"^layernorm\.", "norm."),
    ),
    "transformers DINOv3ViT": (
        (r"^embeddings\.cls_token$", "cls_token"),
        (r"^embeddings\.register_tokens$", "reg_token"),
        (r"^embeddings\.patch_embeddings\.", "patch_embed.proj."),
        (r"^(?:model\.)?layer\.(\d+)\.", r"blocks.\1."),
        (r"^rope_embeddings\.inv_freq$", "rope.inv_freq"),
    ),
}
# Buffers that hold RoPE's periods (the model recomputes them: `_check_rope_periods`).
_ROPE_PERIODS = "rope.periods"


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


def _gated_kernel(weights: tuple[np.ndarray, np.ndarray], num_heads: int) -> np.ndarray:
    # (fc1_g, fc1_x) [hidden, D] each -> [D, 2, hidden], index 0 the gate.
    return np.stack([w.T for w in weights], axis=1)


def _gated_bias(biases: tuple[np.ndarray, np.ndarray], num_heads: int) -> np.ndarray:
    return np.stack(biases)


# Inside a block: our parameter -> (canonical tensor(s) under `blocks.{i}.`, conversion given the head count).
_VIT_BLOCK_TENSORS = {
    "norm1/scale": ("norm1.weight", _same),
    "norm1/bias": ("norm1.bias", _same),
    "attn/qkv/kernel": ("attn.qkv.weight", _qkv_kernel),
    "attn/qkv/bias": ("attn.qkv.bias", _qkv_bias),  # or q_bias/v_bias: see `_qkv_bias_value`
    "attn/out/kernel": ("attn.proj.weight", _out_kernel),
    "attn/out/bias": ("attn.proj.bias", _same),
    "ls1": ("ls1.gamma", _same),
    "norm2/scale": ("norm2.weight", _same),
    "norm2/bias": ("norm2.bias", _same),
    "mlp/fc1/kernel": ("mlp.fc1.weight", _transposed),
    "mlp/fc1/bias": ("mlp.fc1.bias", _same),
    "mlp/norm/scale": ("mlp.norm.weight", _same),
    "mlp/norm/bias": ("mlp.norm.bias", _same),
    "mlp/fc2/kernel": ("mlp.fc2.weight", _transposed),
    "mlp/fc2/bias": ("mlp.fc2.bias", _same),
    "ls2": ("ls2.gamma", _same),
}
_SWIGLU_BLOCK_TENSORS = {
    "mlp/fc1/kernel": (("mlp.fc1_g.weight", "mlp.fc1_x.weight"), _gated_kernel),
    "mlp/fc1/bias": (("mlp.fc1_g.bias", "mlp.fc1_x.bias"), _gated_bias),
}
# The ViT's parameters outside its blocks; the first two and the final norm always exist.
_VIT_TRUNK_PARAMS = (
    "patch_embed/kernel",
    "patch_embed/bias",
    "pos_embed",
    "class_pos_embed",
    "cls_token",
    "reg_token",
    "norm/scale",
    "norm/bias",
)
_SCANNED_BLOCK_PARAM = re.compile(r"^stages/(windowed|global)/(.+)$")
_UNSCANNED_BLOCK_PARAM = re.compile(r"^stage(\d+)/(?:windowed(\d+)|global)/(.+)$")


@dataclasses.dataclass(frozen=True)
class VitSize:
    """What fixes a ViT's tensor shapes: blocks, model width, MLP hidden units, patch side in pixels."""

    depth: int
    width: int
    mlp_hidden: int
    patch_size: int

    def __str__(self) -> str:
        return f"depth {self.depth}, width {self.width}, MLP {self.mlp_hidden}, patch {self.patch_size}"


@dataclasses.dataclass(frozen=True)
class VitFamily:
    """What a ViT's tensors say of its architecture beyond its size, with the config key of each field."""

    class_token: bool = False
    register_tokens: int = 0
    absolute_position: bool = True
    layer_scale: bool = False
    mlp: str = "gelu"
    mlp_norm: bool = False
    qkv_bias: str = "all"  # 'all', 'qv', 'none'; a model's is 'bias' when its config is not known
    final_norm: bool = True  # a LayerNorm `norm` after the last block

    def config_keys(self) -> str:
        """`class_token=True, register_tokens=4, ...`: the config values for this family (all of them)."""
        return ", ".join(
            [
                f"class_token={self.class_token}",
                f"register_tokens={self.register_tokens}",
                f"absolute_position={self.absolute_position}",
                f"layer_scale={'1e-05' if self.layer_scale else '0.0'}",
                f"mlp={self.mlp!r}",
                f"mlp_norm={self.mlp_norm}",
                f"qkv_bias={self.qkv_bias!r}",
                f"final_norm={self.final_norm}",
            ]
        )


def _vit_shapes(size: VitSize, family: VitFamily) -> dict[str, tuple[int, ...]]:
    """The canonical tensor shapes of a ViT, without `pos_embed`/`class_pos_embed` (grid-sized)."""
    d, hidden = size.width, size.mlp_hidden
    block = {"norm1.weight": (d,), "norm1.bias": (d,), "attn.qkv.weight": (3 * d, d)}
    if family.qkv_bias in ("all", "bias"):
        block["attn.qkv.bias"] = (3 * d,)
    elif family.qkv_bias == "qv":
        block.update({"attn.q_bias": (d,), "attn.v_bias": (d,)})
    block.update({"attn.proj.weight": (d, d), "attn.proj.bias": (d,), "norm2.weight": (d,), "norm2.bias": (d,)})
    if family.mlp == "swiglu":
        for part in ("fc1_g", "fc1_x"):
            block.update({f"mlp.{part}.weight": (hidden, d), f"mlp.{part}.bias": (hidden,)})
    else:
        block.update({"mlp.fc1.weight": (hidden, d), "mlp.fc1.bias": (hidden,)})
    if family.mlp_norm:
        block.update({"mlp.norm.weight": (hidden,), "mlp.norm.bias": (hidden,)})
    block.update({"mlp.fc2.weight": (d, hidden), "mlp.fc2.bias": (d,)})
    if family.layer_scale:
        block.update({"ls1.gamma": (d,), "ls2.gamma": (d,)})
    shapes = {TIMM_VIT_MARKER: (d, 3, size.patch_size, size.patch_size), "patch_embed.proj.bias": (d,)}
    if family.class_token:
        shapes["cls_token"] = (1, 1, d)
    if family.register_tokens:
        shapes["reg_token"] = (1, family.register_tokens, d)
    for i in range(size.depth):
        shapes.update({f"blocks.{i}.{name}": shape for name, shape in block.items()})
    return shapes


def vit_layout(state_dict: Mapping[str, Any]) -> str | None:
    """'timm', 'transformers Dinov2' or 'transformers DINOv3ViT' (told by the patch embedding's name), else None."""
    for layout, marker in (
        ("timm", TIMM_VIT_MARKER),
        ("transformers Dinov2", _HF_DINOV2_MARKER),
        ("transformers DINOv3ViT", _HF_DINOV3_MARKER),
    ):
        if marker in state_dict:
            return layout
    return None


def is_timm_vit(state_dict: Mapping[str, Any]) -> bool:
    """Whether a state dict (torch names) is a ViT's, in timm's or transformers' names: told by its patch embedding."""
    return vit_layout(state_dict) is not None


def is_ignored_timm_vit_key(name: str) -> bool:
    """The classifier, pooled-feature norm, mask token and MAE's decoder: in no backbone, whatever its config."""
    return name in _VIT_IGNORED or name.startswith(_VIT_IGNORED_PREFIXES)


def ignored_timm_vit_keys(state_dict: Mapping[str, Any]) -> list[str]:
    """The names the converter always skips, sorted."""
    return sorted(name for name in state_dict if is_ignored_timm_vit_key(name))


def _rename(name: str, rules) -> str:
    for pattern, replacement in rules:
        name = re.sub(pattern, replacement, name)
    return name


def canonical_vit_state_dict(state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Any supported ViT layout -> the canonical names (timm VisionTransformer's, extended), float32 numpy.

    Unchanged names pass through, so a canonical dict (the converter's output)
    maps onto itself. Ignored tensors (`is_ignored_timm_vit_key`) are left out.
    q/k/v projections are concatenated into `attn.qkv.weight`, their biases into
    `attn.qkv.bias` when all three exist or kept as `attn.q_bias`/`attn.v_bias`
    when k has none; packed SwiGLU fc1 (`[2h, D]`, gate first) is split into
    `mlp.fc1_g`/`mlp.fc1_x`; `pos_embed` loses its class-token entry, which
    becomes `class_pos_embed [1, 1, D]`; an inverse-frequency RoPE buffer
    becomes `rope.periods`.
    """
    layout = vit_layout(state_dict) or "timm"
    gated = any(".mlp.gate_proj." in name for name in state_dict)
    block_rules = (*_BLOCK_RENAMES, (r"\.mlp\.up_proj\.", ".mlp.fc1_x." if gated else ".mlp.fc1."))
    tensors: dict[str, np.ndarray] = {}
    for name, value in state_dict.items():
        if is_ignored_timm_vit_key(name):
            continue
        canonical = _rename(_rename(name, _TRUNK_RENAMES[layout]), block_rules)
        if canonical in tensors:
            raise WeightsFileError(f"two tensors of the file map to {canonical} (one is {name}); it mixes layouts")
        tensors[canonical] = np.asarray(value, np.float32)
    if "rope.inv_freq" in tensors:
        tensors[_ROPE_PERIODS] = 1.0 / tensors.pop("rope.inv_freq")
    if "pos_embed" in tensors:
        side, class_entry = timm_position_grid(tensors)
        if class_entry:
            tensors["class_pos_embed"] = tensors["pos_embed"][:, :1]
            tensors["pos_embed"] = tensors["pos_embed"][:, 1:]
    blocks = sorted({int(m[1]) for name in tensors if (m := _TIMM_BLOCK_KEY.match(name))})
    for i in blocks:
        _canonical_block(tensors, f"blocks.{i}.")
    return tensors


def _canonical_block(tensors: dict[str, np.ndarray], block: str) -> None:
    """Merges one block's q/k/v and packed fc1 tensors in place (see `canonical_vit_state_dict`)."""
    weights = [f"{block}attn.{p}.weight" for p in "qkv"]
    if all(name in tensors for name in weights):
        tensors[f"{block}attn.qkv.weight"] = np.concatenate([tensors.pop(name) for name in weights])
    biases = {p: tensors.pop(f"{block}attn.{p}.bias", tensors.pop(f"{block}attn.{p}_bias", None)) for p in "qkv"}
    if all(b is not None for b in biases.values()):
        tensors[f"{block}attn.qkv.bias"] = np.concatenate(list(biases.values()))
    else:
        for p, bias in biases.items():
            if bias is not None:
                tensors[f"{block}attn.{p}_bias"] = bias
    packed = tensors.pop(f"{block}mlp.fc1_packed.weight", None)
    packed_bias = tensors.pop(f"{block}mlp.fc1_packed.bias", None)
    fc1, fc2 = tensors.get(f"{block}mlp.fc1.weight"), tensors.get(f"{block}mlp.fc2.weight")
    if packed is None and fc1 is not None and fc2 is not None and fc1.shape[0] == 2 * fc2.shape[-1] != fc2.shape[0]:
        # timm's SwiGLUPacked (DINOv2 ViT-g): fc1 twice as wide as fc2's input.
        packed, packed_bias = tensors.pop(f"{block}mlp.fc1.weight"), tensors.pop(f"{block}mlp.fc1.bias", None)
    if packed is not None:
        tensors[f"{block}mlp.fc1_g.weight"], tensors[f"{block}mlp.fc1_x.weight"] = np.split(packed, 2)
        if packed_bias is not None:
            tensors[f"{block}mlp.fc1_g.bias"], tensors[f"{block}mlp.fc1_x.bias"] = np.split(packed_bias, 2)


def timm_vit_size(state_dict: Mapping[str, Any]) -> VitSize:
    """The size a canonical ViT state dict declares: width and patch from `patch_embed.proj.weight`,
    depth from the `blocks.{i}.` names, MLP width from block 0's fc1 (or fc1_g; 4 x width without either)."""
    if TIMM_VIT_MARKER not in state_dict:
        raise WeightsFileError(
            f"not a ViT state dict: it has no {TIMM_VIT_MARKER}, {_HF_DINOV2_MARKER} or {_HF_DINOV3_MARKER} "
            f"(names: {_describe(state_dict)})"
        )
    shape = tuple(np.shape(state_dict[TIMM_VIT_MARKER]))
    if len(shape) != 4 or shape[2] != shape[3]:
        raise WeightsFileError(f"{TIMM_VIT_MARKER} has shape {shape}; a ViT's is [width, 3, patch, patch]")
    blocks = [int(match[1]) for name in state_dict if (match := _TIMM_BLOCK_KEY.match(name))]
    fc1 = state_dict.get("blocks.0.mlp.fc1.weight", state_dict.get("blocks.0.mlp.fc1_g.weight"))
    return VitSize(
        depth=max(blocks) + 1 if blocks else 0,
        width=shape[0],
        mlp_hidden=int(np.shape(fc1)[0]) if fc1 is not None and np.ndim(fc1) == 2 else 4 * shape[0],
        patch_size=shape[2],
    )


def vit_family(tensors: Mapping[str, Any]) -> VitFamily:
    """The family a canonical ViT state dict declares, read from its trunk and block 0's names."""
    reg = tensors.get("reg_token")
    if "blocks.0.attn.qkv.bias" in tensors:
        qkv_bias = "all"
    elif "blocks.0.attn.q_bias" in tensors or "blocks.0.attn.v_bias" in tensors:
        qkv_bias = "qv"
    else:
        qkv_bias = "none"
    return VitFamily(
        class_token="cls_token" in tensors,
        register_tokens=int(np.shape(reg)[1]) if reg is not None and np.ndim(reg) == 3 else 0,
        absolute_position="pos_embed" in tensors,
        layer_scale="blocks.0.ls1.gamma" in tensors,
        mlp="swiglu" if "blocks.0.mlp.fc1_g.weight" in tensors else "gelu",
        mlp_norm="blocks.0.mlp.norm.weight" in tensors,
        qkv_bias=qkv_bias,
        final_norm="norm.weight" in tensors or "norm.bias" in tensors,
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


def _rope_temperature_of(periods: np.ndarray, head_dim: int | None = None) -> float:
    """The temperature T of periods `T ** (i / n)`, i < n (DINOv3's schedule), or WeightsFileError if they are not."""
    periods = np.asarray(periods, np.float64).ravel()
    n = periods.size
    if n < 2 or (head_dim is not None and n != head_dim // 4) or np.any(periods <= 0):
        raise WeightsFileError(
            f"{_ROPE_PERIODS} (RoPE periods) has {n} values; a ViT with head width {head_dim} has head_dim / 4"
        )
    temperature = float(periods[1] ** n)
    expected = temperature ** (np.arange(n) / n)
    if not np.allclose(periods, expected, rtol=1e-5, atol=0):
        raise WeightsFileError(
            f"{_ROPE_PERIODS} (RoPE periods) are not temperature ** (i / {n}) for any temperature: a RoPE "
            "this model does not compute"
        )
    return temperature


def _check_rope_periods(periods: np.ndarray, backbone_config: Mapping[str, Any] | None, head_dim: int) -> None:
    """The file's RoPE periods against the model's own formula (`rope_angles`), when the config says which."""
    temperature = _rope_temperature_of(periods, head_dim)
    if backbone_config is None:
        return
    if backbone_config.get("rope", "") != "dinov3":
        raise WeightsFileError(
            f"the file holds DINOv3 RoPE periods ({_ROPE_PERIODS}, temperature {temperature:g}) but "
            f"model.backbone.rope={backbone_config.get('rope', '')!r}: set rope='dinov3', "
            f"rope_temperature={temperature:g}, absolute_position=False"
        )
    expected = float(backbone_config.get("rope_temperature", 10000.0)) ** (np.arange(head_dim // 4) / (head_dim // 4))
    if not np.allclose(np.asarray(periods, np.float64), expected, rtol=1e-5, atol=0):
        raise WeightsFileError(
            f"the file's RoPE periods ({_ROPE_PERIODS}) are those of temperature {temperature:g}, the model's "
            f"model.backbone.rope_temperature={backbone_config.get('rope_temperature')}: set it to {temperature:g}"
        )


def _family_hint(file_size: VitSize, file_family: VitFamily, model_size: VitSize, model_family: VitFamily) -> str:
    """'set model.backbone.X=..., Y=...' for what differs between the file and the model, or ''."""
    if file_size != model_size:
        name = _STANDARD_VITS.get((file_size.width, file_size.depth), ("",))[0]
        config = f" ({_VITDET_CONFIGS[name]} is {name})" if name in _VITDET_CONFIGS else ""
        hint = (
            f"the file is a ViT of {file_size}: set model.backbone.depth/embed_dim/num_heads/mlp_ratio "
            f"(or mlp_hidden) to its size{config}, or use weights of the model's size"
        )
        if file_size.patch_size != model_size.patch_size:
            hint += f"; set model.backbone.patch_size={file_size.patch_size}"
        return hint
    keys = []
    if model_family.class_token and not file_family.class_token:
        keys.append("class_token=False (the file has no cls_token)")
    if model_family.register_tokens and model_family.register_tokens != file_family.register_tokens:
        keys.append(f"register_tokens={file_family.register_tokens}")
    if model_family.absolute_position != file_family.absolute_position:
        rope = "" if file_family.absolute_position else " (no pos_embed: a RoPE ViT such as DINOv3, rope='dinov3')"
        keys.append(f"absolute_position={file_family.absolute_position}{rope}")
    if model_family.layer_scale != file_family.layer_scale:
        keys.append(f"layer_scale={'1e-05 (any value: the file sets it)' if file_family.layer_scale else '0.0'}")
    if model_family.mlp != file_family.mlp:
        keys.append(f"mlp={file_family.mlp!r}")
    if model_family.mlp_norm != file_family.mlp_norm:
        keys.append(f"mlp_norm={file_family.mlp_norm}")
    if (model_family.qkv_bias == "none") != (file_family.qkv_bias == "none"):
        keys.append(f"qkv_bias={file_family.qkv_bias!r}")
    if model_family.final_norm != file_family.final_norm:
        keys.append(
            "final_norm=False (the file has no norm.*: its source does not normalise the last block's tokens)"
            if model_family.final_norm
            else "final_norm=True (the file has a final norm.*)"
        )
    return f"the file's ViT differs from the model's: set model.backbone.{', '.join(keys)}" if keys else ""


# Tensor names -> the config key that makes a model have (or not have) them.
_TENSOR_HINTS = (
    (re.compile(r"\.ls[12]\.gamma$"), "LayerScale (ls1/ls2.gamma) needs model.backbone.layer_scale > 0, e.g. 1e-5"),
    (re.compile(r"\.mlp\.fc1_[gx]\."), "a gated MLP (fc1_g/fc1_x) needs model.backbone.mlp='swiglu'"),
    (re.compile(r"\.mlp\.norm\."), "a norm over the MLP's hidden units needs model.backbone.mlp_norm=True"),
    (
        re.compile(r"\.attn\.(qkv\.bias|[qv]_bias)$"),
        "qkv biases are set by model.backbone.qkv_bias ('all', 'qv', 'none')",
    ),
    (re.compile(r"^pos_embed$"), "a position embedding needs model.backbone.absolute_position=True"),
    (re.compile(r"rope"), "a RoPE buffer this importer does not recompute (it knows DINOv3's periods)"),
)


def _tensor_hint(names: Iterable[str]) -> str:
    """What the config keys say about these tensor names, or that the file is incomplete."""
    hints = []
    for pattern, hint in _TENSOR_HINTS:
        if any(pattern.search(name) for name in names) and hint not in hints:
            hints.append(hint)
    return "; ".join(hints) or "every block needs the same tensors; is the file complete?"


def _check_vit_file(tensors: Mapping[str, Any], size: VitSize, family: VitFamily, fits: str, hint: str) -> None:
    """Raises WeightsFileError unless canonical `tensors` hold exactly a ViT of `size` and `family`."""
    expected: dict[str, tuple[int, ...] | None] = dict(_vit_shapes(size, family))
    if family.absolute_position:
        expected["pos_embed"] = None
        if "pos_embed" in tensors:
            side, _ = timm_position_grid(tensors)
            expected["pos_embed"] = (1, side * side, size.width)
    if "class_pos_embed" in tensors and family.class_token and family.absolute_position:
        expected["class_pos_embed"] = (1, 1, size.width)
    if family.final_norm:
        expected.update({"norm.weight": (size.width,), "norm.bias": (size.width,)})
    if _ROPE_PERIODS in tensors:
        expected[_ROPE_PERIODS] = tuple(np.shape(tensors[_ROPE_PERIODS]))
    present = set(tensors)
    missing, unexpected = sorted(set(expected) - present), sorted(present - set(expected))
    misshapen = [
        f"{name} {tuple(np.shape(tensors[name]))} for {expected[name]}"
        for name in sorted(set(expected) & present)
        if expected[name] is not None and tuple(np.shape(tensors[name])) != expected[name]
    ]
    if missing or unexpected or misshapen:
        problems = [
            f"{len(missing)} missing ({_describe(missing)})" if missing else "",
            f"{len(unexpected)} unexpected ({_describe(unexpected)})" if unexpected else "",
            f"{len(misshapen)} misshapen ({_describe(misshapen)})" if misshapen else "",
        ]
        hint = hint or _tensor_hint(unexpected + missing)
        raise WeightsFileError(
            f"the state dict does not fit {fits}: {'; '.join(p for p in problems if p)} tensors; {hint}"
        )


@dataclasses.dataclass(frozen=True)
class _VitModelLayout:
    size: VitSize
    family: VitFamily
    num_heads: int
    grid: tuple[int, int] | None  # the position embedding's
    # Each block parameter -> (its name inside a block, the canonical block index of each of its stacked slices).
    blocks: dict[str, tuple[str, np.ndarray]]


def _vit_model_layout(shapes: Mapping[str, tuple[int, ...]]) -> _VitModelLayout:
    """Reads how `detector.models.vit.ViT` placed its blocks from its flat parameter shapes (scanned or not).

    LoRA adapters (`lora_a`, `lora_b`) are no pretrained tensors' and are left out.
    """
    scanned, unscanned, unknown = {}, {}, []
    for name in shapes:
        if name in _VIT_TRUNK_PARAMS or name.rsplit("/", 1)[-1].startswith("lora_"):
            continue
        if (match := _SCANNED_BLOCK_PARAM.match(name)) and match[2] in _VIT_BLOCK_TENSORS:
            scanned[name] = (match[1] == "windowed", match[2])
        elif (match := _UNSCANNED_BLOCK_PARAM.match(name)) and match[3] in _VIT_BLOCK_TENSORS:
            unscanned[name] = (int(match[1]), None if match[2] is None else int(match[2]), match[3])
        else:
            unknown.append(name)
    lacking = [name for name in ("patch_embed/kernel", "patch_embed/bias") if name not in shapes]
    if ("norm/scale" in shapes) != ("norm/bias" in shapes):
        lacking.append("norm/bias" if "norm/scale" in shapes else "norm/scale")
    if unknown or lacking or not (scanned or unscanned):
        raise WeightsFileError(
            "the model's ViT is not laid out as this importer expects (detector.models.vit.ViT): "
            f"parameters no pretrained tensor maps to: {_describe(unknown) or 'none'}; "
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

    def block_shape(inner: str) -> tuple[int, ...] | None:
        found = [(shapes[name], index) for name, (i, index) in blocks.items() if i == inner]
        return tuple(found[0][0][found[0][1].ndim :]) if found else None

    qkv, fc1 = block_shape("attn/qkv/kernel"), block_shape("mlp/fc1/kernel")
    inner_names = {inner for inner, _ in blocks.values()}
    reg = shapes.get("reg_token")
    family = VitFamily(
        class_token="cls_token" in shapes,
        register_tokens=reg[1] if reg else 0,
        absolute_position="pos_embed" in shapes,
        layer_scale="ls1" in inner_names,
        mlp="swiglu" if len(fc1) == 3 else "gelu",
        mlp_norm="mlp/norm/scale" in inner_names,
        qkv_bias="bias" if "attn/qkv/bias" in inner_names else "none",
        final_norm="norm/scale" in shapes,
    )
    return _VitModelLayout(
        size=VitSize(
            depth=num_stages * every,
            width=shapes["patch_embed/kernel"][-1],
            mlp_hidden=fc1[-1],
            patch_size=shapes["patch_embed/kernel"][0],
        ),
        family=family,
        num_heads=qkv[-2],
        grid=tuple(shapes["pos_embed"][1:3]) if "pos_embed" in shapes else None,
        blocks=blocks,
    )


def resize_position_embedding(pos_embed: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """`[1, G, G', D]` -> `[1, grid[0], grid[1], D]` float32, resampled as `ViT` resamples it to an input's grid.

    `jax.image.resize(method='bicubic')`: Keys' cubic kernel (a = -0.5) on
    half-pixel centres (align_corners=False), widened to antialias when
    shrinking, taps beyond the grid dropped and the rest renormalised. That is
    torch's `F.interpolate(mode='bicubic', align_corners=False,
    antialias=True)`, timm's `resample_abs_pos_embed` default (and
    transformers' Dinov2WithRegisters'); ViTDet's `get_abs_pos` and
    transformers' Dinov2Model use antialias=False (a = -0.75, edges
    repeated), slightly different. The model's forward pass resizes with
    this one, so loading does too.
    """
    if tuple(pos_embed.shape[1:3]) == tuple(grid):
        return np.asarray(pos_embed, np.float32)
    # On the host: a few thousand values, before any sharded computation exists.
    on_host = jax.device_put(np.asarray(pos_embed, np.float32), jax.devices("cpu")[0])
    return np.asarray(jax.image.resize(on_host, (1, *grid, pos_embed.shape[-1]), method="bicubic"), np.float32)


def _qkv_bias_value(tensors: Mapping[str, np.ndarray], block: str, num_heads: int, qkv_bias: str) -> np.ndarray:
    """`attn/qkv/bias [3, H, Dh]` from `attn.qkv.bias`, or from q_bias/v_bias with k's zero."""
    if f"{block}attn.qkv.bias" in tensors:
        bias = tensors[f"{block}attn.qkv.bias"].reshape(3, -1)
        if qkv_bias == "qv" and np.any(bias[1]):
            raise WeightsFileError(
                f"{block}attn.qkv.bias has a non-zero k part, which model.backbone.qkv_bias='qv' masks out: "
                "set qkv_bias='all'"
            )
        return _qkv_bias(bias.ravel(), num_heads)
    q, v = tensors[f"{block}attn.q_bias"], tensors[f"{block}attn.v_bias"]
    return _qkv_bias(np.concatenate([q, np.zeros_like(q), v]), num_heads)


def convert_timm_vit(
    state_dict: Mapping[str, Any], backbone_params, backbone_config: Mapping[str, Any] | None = None
) -> dict:
    """A ViT state dict (any layout of `canonical_vit_state_dict`) -> values for `backbone_params`, a `ViT`'s
    parameters (initialised or abstract), LoRA adapters left out.

    The model's parameters tell what the file cannot: the head count (how
    qkv and proj split), which blocks are windowed and how `nn.scan` stacks
    them, the position embedding's grid, to which `pos_embed` is resized
    (`resize_position_embedding`) when its own differs, and whether the model
    has class and register tokens: without them the file's are dropped, as
    intended for windowed attention. `backbone_config` (`config.model.backbone`),
    when given, adds what no parameter shows: the RoPE kind and temperature,
    checked against RoPE periods in the file, and qkv_bias 'all' vs 'qv'.
    Returns a nested dict of float32 numpy arrays shaped like
    `backbone_params` (layout in the module docstring). Raises
    WeightsFileError naming missing, unexpected or misshapen tensors, with
    the config keys that make the model fit the file.
    """
    flat = traverse_util.flatten_dict(backbone_params, sep="/")
    shapes = {name: tuple(_leaf_value(leaf).shape) for name, leaf in flat.items()}
    model = _vit_model_layout(shapes)
    tensors = canonical_vit_state_dict(state_dict)
    model_family = model.family
    if backbone_config is not None and model_family.qkv_bias == "bias":
        model_family = dataclasses.replace(model_family, qkv_bias=backbone_config.get("qkv_bias", "all"))
    file_size, file_family = timm_vit_size(tensors), vit_family(tensors)
    # What the model deliberately goes without: the file's prefix tokens and their position.
    dropped = set()
    if not model_family.class_token:
        dropped |= {"cls_token", "class_pos_embed"}
    elif not model_family.absolute_position:
        dropped.add("class_pos_embed")
    if not model_family.register_tokens:
        dropped.add("reg_token")
    kept = {name: value for name, value in tensors.items() if name not in dropped}
    # A file with q/v-only biases loads into an 'all' model (k bias 0), one with a zero k bias into a 'qv' model.
    if model_family.qkv_bias == "none" or file_family.qkv_bias == "none":
        bias = "none" if model_family.qkv_bias == "none" else "all"
    else:
        bias = file_family.qkv_bias
    hint = _family_hint(file_size, file_family, model.size, model_family)
    _check_vit_file(
        kept, model.size, dataclasses.replace(model_family, qkv_bias=bias), f"the model's ViT ({model.size})", hint
    )
    if _ROPE_PERIODS in kept:
        _check_rope_periods(kept[_ROPE_PERIODS], backbone_config, model.size.width // model.num_heads)
    if backbone_config is not None and not backbone_config.get("rope") and not file_family.absolute_position:
        raise WeightsFileError(
            "the file has no position embedding (a RoPE ViT such as DINOv3) but model.backbone.rope='': "
            "set rope='dinov3', rope_temperature=100.0, absolute_position=False"
        )

    params = {
        "patch_embed/kernel": kept[TIMM_VIT_MARKER].transpose(2, 3, 1, 0),
        "patch_embed/bias": kept["patch_embed.proj.bias"],
    }
    if model_family.final_norm:
        params.update({"norm/scale": kept["norm.weight"], "norm/bias": kept["norm.bias"]})
    if model.grid is not None:
        side, _ = timm_position_grid(kept)
        pos_embed = kept["pos_embed"].reshape(1, side, side, model.size.width)
        params["pos_embed"] = resize_position_embedding(pos_embed, model.grid)
    if model_family.class_token:
        params["cls_token"] = kept["cls_token"]
        if "class_pos_embed" in shapes:
            # timm's DINOv2-with-registers adds no position to its class token: zeros compute the same.
            params["class_pos_embed"] = kept.get("class_pos_embed", np.zeros(shapes["class_pos_embed"], np.float32))
    if model_family.register_tokens:
        params["reg_token"] = kept["reg_token"]
    for name, (inner, index) in model.blocks.items():
        canonical, convert = (
            _SWIGLU_BLOCK_TENSORS[inner]
            if model_family.mlp == "swiglu" and inner in _SWIGLU_BLOCK_TENSORS
            else _VIT_BLOCK_TENSORS[inner]
        )
        slices = []
        for i in index.ravel():
            block = f"blocks.{i}."
            if inner == "attn/qkv/bias":
                slices.append(_qkv_bias_value(kept, block, model.num_heads, model_family.qkv_bias))
            elif isinstance(canonical, tuple):
                slices.append(convert(tuple(kept[block + c] for c in canonical), model.num_heads))
            else:
                slices.append(convert(kept[block + canonical], model.num_heads))
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


def _from_torch_names(
    tensors: Mapping[str, Any], backbone_params, backbone_config: Mapping[str, Any] | None = None
) -> dict[str, np.ndarray]:
    """A torchvision ResNet or ViT state dict -> the flat layout of `backbone_params`, or WeightsFileError."""
    model_is_vit = "patch_embed" in backbone_params
    if is_timm_vit(tensors):
        if not model_is_vit:
            raise WeightsFileError(
                f"it holds a ViT ({vit_layout(tensors)} layout) but the model's backbone is a ResNet; "
                "use a ViT config (configs/vitdet_*.py) or a ResNet's weights"
            )
        return flatten_backbone_params(convert_timm_vit(tensors, backbone_params, backbone_config))
    if model_is_vit:
        raise WeightsFileError(
            f"not a ViT state dict (no {TIMM_VIT_MARKER}, {_HF_DINOV2_MARKER} or {_HF_DINOV3_MARKER}; "
            f"names: {_describe(tensors)}), which the model's ViT backbone needs: pass a timm-layout ViT checkpoint "
            "(MAE, DeiT, DINOv2, DINOv3, EVA-02) or a transformers Dinov2Model/DINOv3ViTModel one"
        )
    flat_model = traverse_util.flatten_dict(backbone_params, sep="/")
    return flatten_backbone_params(convert_torchvision_resnet(tensors, _model_stage_sizes(flat_model)))


def load_backbone_params(params, path: str | os.PathLike, backbone_config: Mapping[str, Any] | None = None):
    """`params` (a whole model's) with its `backbone` subtree replaced by the weights in `path`.

    What `config.model.backbone.pretrained` names, for either backbone; the
    file's names tell its layout: '/'-separated ones are this project's flat
    `.npz` layout (a converted ResNet, or `save_backbone_params` of any
    backbone), loaded as they are; '.'-separated ones are a torch state dict,
    converted here for the model's parameters: a ViT (timm's
    `patch_embed.proj.weight` or transformers' patch embedding; directly or
    as the converter's `.npz`) with `convert_timm_vit`, else a torchvision
    ResNet for the model's stage sizes. Every backbone leaf of `params` then
    gets a value of the same shape, and the file must hold nothing else
    (ignored names aside), except LoRA adapters (`lora_a`, `lora_b`), which
    no pretrained file holds and which keep the values `params` has.
    `backbone_config` (`config.model.backbone`) lets the ViT import check
    what no parameter shows (RoPE, qkv_bias 'qv'); see `convert_timm_vit`.
    Leaves keep their dtype, and jax.Array leaves their sharding (so this can
    follow a sharded initialisation); boxed (logically partitioned) leaves
    stay boxed. Raises WeightsFileError naming what does not fit.
    """
    path = os.fspath(path)
    if "backbone" not in params:
        raise WeightsFileError(f"cannot load {path}: the model parameters have no 'backbone'")
    flat_model = traverse_util.flatten_dict(params["backbone"], sep="/")
    tensors = read_state_dict(path)
    try:
        if _has_torch_names(tensors):
            tensors = _from_torch_names(tensors, params["backbone"], backbone_config)
    except WeightsFileError as e:
        raise WeightsFileError(f"{path}: {e}") from None
    adapters = {name for name in flat_model if name.rsplit("/", 1)[-1].startswith("lora_") and name not in tensors}
    missing = sorted(set(flat_model) - set(tensors) - adapters)
    unexpected = sorted(set(tensors) - set(flat_model))
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
        if name in adapters:
            loaded[name] = model_leaf
            continue
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
    layout = vit_layout(state_dict)
    tensors = canonical_vit_state_dict(state_dict)
    size, family = timm_vit_size(tensors), vit_family(tensors)
    _check_vit_file(tensors, size, family, f"a ViT of {size} (read from {TIMM_VIT_MARKER} and blocks.*)", "")
    name, heads = _STANDARD_VITS.get((size.width, size.depth), ("", 0))
    rope = ""
    if _ROPE_PERIODS in tensors:
        head_dim = size.width // heads if heads else None
        rope = f", rope='dinov3', rope_temperature={_rope_temperature_of(tensors[_ROPE_PERIODS], head_dim):g}"
    elif not family.absolute_position:
        rope = ", rope='dinov3' (DINOv3; its rope_temperature=100.0, norm_epsilon=1e-05)"
    # Canonical names and layout, so one file serves any head split, stacking and grid (see the module docstring).
    np.savez(output_path, **tensors)

    heads_text = f"{heads} for {name}" if heads else "set model.backbone.num_heads"
    config = f"--config={_VITDET_CONFIGS[name]} " if name in _VITDET_CONFIGS and size.patch_size == 16 else ""
    position = "none (RoPE)"
    pixels = 0
    if family.absolute_position:
        side, _ = timm_position_grid(tensors)
        pixels = side * size.patch_size
        position = (
            f"{side}x{side} grid ({pixels} px){', with a class-token entry' if 'class_pos_embed' in tensors else ''}"
        )
    mlp_hidden = "" if family.mlp == "gelu" and size.mlp_hidden == 4 * size.width else f", mlp_hidden={size.mlp_hidden}"
    lines = [
        f"{input_path}: {layout} ViT, {size}; heads not stored ({heads_text}); position embedding: {position}",
        f"its family: model.backbone.patch_size={size.patch_size}, {family.config_keys()}{mlp_hidden}{rope}",
        f"kept {len(tensors)} tensors ({sum(v.size for v in tensors.values()) / 1e6:.2f}M values) in timm's names "
        "and layout (q/k/v and gated MLP merged, the class token's position entry as class_pos_embed): the "
        "model's head count, block stacking and grid are applied when it loads them; a model without class or "
        "register tokens drops the file's",
        f"ignored: {_group_names(ignored_timm_vit_keys(state_dict)) or 'nothing'}",
    ]
    if "norm.weight" not in tensors:
        lines.append(
            "no final norm (norm.*) in the file: its source does not normalise the last block's tokens (fc_norm, "
            "dropped, normalises its pooled vector only), so the backbone must not either: final_norm=False"
        )
    grid_text = (
        f" (pretrain_image_size={pixels} keeps the {pixels // size.patch_size} grid; another is resized bicubically "
        "on loading)"
        if pixels
        else ""
    )
    lines.append(
        f"wrote {output_path}; train a ViT of this size and family with {config}"
        f"--config.model.backbone.pretrained={output_path}{grid_text}"
    )
    return "\n".join(lines)


def convert_pretrained_file(input_path: str | os.PathLike, output_path: str | os.PathLike) -> str:
    """Converts a torchvision ResNet or ViT state dict file to a flat `.npz`; returns what it did, as text.

    What `python -m detector.convert_pretrained` runs; a ViT is told by its
    patch embedding (timm's or transformers'). A ResNet is converted to this
    project's layout (stage sizes and width from the state dict, BatchNorms
    folded into frozen scale/bias). A ViT is written in the canonical timm
    names (`canonical_vit_state_dict`), as float32, checked to be a complete
    ViT of the family its tensors declare, which the report names as config
    keys; the mapping needs the model's head count and block layout, so it
    happens in `load_backbone_params`, and one file serves every input size.
    Ignored tensors are listed.
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
