"""torchvision ResNet state dicts -> parameters of `detector.models.resnet.ResNet(norm='frozen_bn')`.

torchvision's `resnet50()` state dict (`conv1.weight`, `bn1.*`,
`layer{1-4}.{i}.conv{1,2,3}.weight`, `.bn{1,2,3}.*`, `.downsample.{0,1}.*`)
maps onto the backbone's parameters:

  conv1 -> stem_conv            bn1 -> stem_norm
  layerS.I.convK -> stageS_block{I+1}/Conv_{K-1}
  layerS.I.bnK -> stageS_block{I+1}/FrozenBatchNorm_{K-1}
  layerS.I.downsample.0 / .1 -> .../Conv_{last} / .../FrozenBatchNorm_{last}

Convolution weights `[out, in, kh, kw]` become kernels `[kh, kw, in, out]`;
each BatchNorm folds into the per-channel `scale`, `bias` of
`detector.models.layers.FrozenBatchNorm`. The classifier (`fc.*`) and the
`num_batches_tracked` counters are not part of a backbone and are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np
from flax import traverse_util

from detector.errors import WeightsFileError
from detector.models.layers import FrozenBatchNorm
from detector.models.resnet import STEM_NORM_NAME
from detector.models.weights.files import describe_names

# torch.nn.BatchNorm2d's default, which torchvision's ResNets keep.
BATCH_NORM_EPS = 1e-5
BATCH_NORM_TENSORS = ("weight", "bias", "running_mean", "running_var")
_LAYER_KEY = re.compile(r"^layer(\d+)\.(\d+)\.")


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


def model_stage_sizes(flat_backbone: Mapping[str, Any]) -> tuple[int, ...]:
    """Blocks per stage of a ResNet backbone's flat parameters, from their `stage{S}_block{I}/` paths."""
    blocks: dict[int, int] = {}
    for path in flat_backbone:
        match = re.match(r"^stage(\d+)_block(\d+)/", path)
        if match:
            blocks[int(match[1])] = max(blocks.get(int(match[1]), 0), int(match[2]))
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
            f"{len(missing)} missing ({describe_names(missing)})" if missing else "",
            f"{len(unexpected)} unexpected ({describe_names(unexpected)})" if unexpected else "",
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
