"""ImageNet-pretrained ResNet weights: torchvision state dicts -> this project's ResNet parameters.

torchvision's `resnet50()` state dict (`conv1.weight`, `bn1.*`,
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

Files: torchvision layout in `.pth`/`.pt` (needs torch), `.safetensors`
(needs safetensors) or `.npz`; or this project's layout as a flat `.npz`
with `stem_conv/kernel`-style keys, as `python -m detector.convert_pretrained`
writes it. Nothing is downloaded.
"""

from __future__ import annotations

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
    unknown suffix or a missing reader package.
    """
    path = os.fspath(path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SUFFIXES:
        raise WeightsFileError(
            f"{path}: unknown weights file type {suffix or '(no suffix)'!r}; use one of {', '.join(SUFFIXES)}"
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(f"pretrained weights file not found: {path}")
    if suffix == ".npz":
        with np.load(path, allow_pickle=False) as npz:
            tensors = {name: npz[name] for name in npz.files}
    elif suffix == ".safetensors":
        try:
            from safetensors.numpy import load_file
        except ImportError:
            raise WeightsFileError(
                f"{path}: reading .safetensors needs the safetensors package "
                "(pip install safetensors, or pip install '.[pretrained]')"
            ) from None
        tensors = load_file(path)
    else:
        tensors = _torch_tensors_as_numpy(path)
    if tensors and all(name.startswith("module.") for name in tensors):
        tensors = {name[len("module.") :]: value for name, value in tensors.items()}
    return tensors


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


def flatten_backbone_params(backbone_params) -> dict[str, np.ndarray]:
    """Nested params -> {'stage1_block1/Conv_0/kernel': array, ...}, the flat `.npz` layout."""
    return {path: np.asarray(value) for path, value in traverse_util.flatten_dict(backbone_params, sep="/").items()}


def save_backbone_params(backbone_params, path: str | os.PathLike) -> None:
    """Writes backbone params as a flat `.npz` that `load_backbone_params` reads."""
    np.savez(path, **flatten_backbone_params(backbone_params))


def _is_torchvision_layout(tensors: Mapping[str, Any]) -> bool:
    # Our layout names paths with '/', torchvision's with '.' only.
    with_slash = sum("/" in name for name in tensors)
    if with_slash and with_slash != len(tensors):
        raise WeightsFileError(
            "the file mixes 'module/param' names (this project's layout) with "
            "'module.param' names (torchvision's); convert it again"
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


def load_backbone_params(params, path: str | os.PathLike):
    """`params` (a whole model's) with its `backbone` subtree replaced by the weights in `path`.

    `path` holds a torchvision ResNet state dict (converted here for the
    model's stage sizes) or a flat `.npz` in this project's layout (from
    `python -m detector.convert_pretrained`); which one is told by the names.
    Every backbone leaf of `params` must be in the file with the same shape,
    and the file must hold nothing else. Leaves keep their dtype, and
    jax.Array leaves their sharding (so this can follow a sharded
    initialisation); boxed (logically partitioned) leaves stay boxed.
    Raises WeightsFileError naming what does not fit.
    """
    path = os.fspath(path)
    if "backbone" not in params:
        raise WeightsFileError(f"cannot load {path}: the model parameters have no 'backbone'")
    flat_model = traverse_util.flatten_dict(params["backbone"], sep="/")
    tensors = read_state_dict(path)
    try:
        if _is_torchvision_layout(tensors):
            tensors = flatten_backbone_params(convert_torchvision_resnet(tensors, _model_stage_sizes(flat_model)))
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


def convert_torchvision_file(input_path: str | os.PathLike, output_path: str | os.PathLike) -> str:
    """Converts a torchvision ResNet state dict file to a flat backbone `.npz`; returns what it did, as text.

    What `python -m detector.convert_pretrained` runs: stage sizes and width
    come from the state dict, BatchNorms are folded into frozen scale/bias,
    the classifier and BatchNorm counters are ignored (and listed).
    """
    state_dict = read_state_dict(input_path)
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
