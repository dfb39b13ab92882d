"""A weights file into a model's parameters: `load_backbone_params`, what `config.model.backbone.pretrained` runs."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import traverse_util

from detector.errors import WeightsFileError
from detector.models.layers import FrozenBatchNorm
from detector.models.weights.files import describe_names, flatten_backbone_params, has_torch_names, read_state_dict
from detector.models.weights.sources import is_vit_state_dict, patch_embedding_names, source_checkpoints, vit_layout
from detector.models.weights.torchvision_resnet import convert_torchvision_resnet, model_stage_sizes
from detector.models.weights.vit import convert_timm_vit


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
    if is_vit_state_dict(tensors):
        if not model_is_vit:
            raise WeightsFileError(
                f"it holds a ViT ({vit_layout(tensors)} layout) but the model's backbone is a ResNet; "
                "use a ViT config (configs/vitdet_*.py) or a ResNet's weights"
            )
        return flatten_backbone_params(convert_timm_vit(tensors, backbone_params, backbone_config))
    if model_is_vit:
        raise WeightsFileError(
            f"not a ViT state dict (no {patch_embedding_names()}; names: {describe_names(tensors)}), which the "
            f"model's ViT backbone needs: pass a checkpoint of {source_checkpoints()}"
        )
    flat_model = traverse_util.flatten_dict(backbone_params, sep="/")
    return flatten_backbone_params(convert_torchvision_resnet(tensors, model_stage_sizes(flat_model)))


def load_backbone_params(params, path: str | os.PathLike, backbone_config: Mapping[str, Any] | None = None):
    """`params` (a whole model's) with its `backbone` subtree replaced by the weights in `path`.

    What `config.model.backbone.pretrained` names, for either backbone; the
    file's names tell its layout: '/'-separated ones are this project's flat
    `.npz` layout (a converted ResNet, or `save_backbone_params` of any
    backbone), loaded as they are; '.'-separated ones are a torch state dict,
    converted here for the model's parameters: a ViT (in a layout one of
    `sources.SOURCES` recognises; directly or as the converter's `.npz`) with
    `convert_timm_vit`, else a torchvision ResNet for the model's stage sizes.
    Every backbone leaf of `params` then
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
        if has_torch_names(tensors):
            tensors = _from_torch_names(tensors, params["backbone"], backbone_config)
    except WeightsFileError as e:
        raise WeightsFileError(f"{path}: {e}") from None
    adapters = {name for name in flat_model if name.rsplit("/", 1)[-1].startswith("lora_") and name not in tensors}
    missing = sorted(set(flat_model) - set(tensors) - adapters)
    unexpected = sorted(set(tensors) - set(flat_model))
    if missing or unexpected:
        problems = [
            f"{len(missing)} missing ({describe_names(missing)})" if missing else "",
            f"{len(unexpected)} unexpected ({describe_names(unexpected)})" if unexpected else "",
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
