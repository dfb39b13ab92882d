"""The converter behind `python -m detector.convert_pretrained`: a checkpoint file -> a flat `.npz` and a report."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from detector.errors import WeightsFileError
from detector.models.weights.canonical import PATCH_EMBEDDING, ROPE_PERIODS, timm_position_grid
from detector.models.weights.files import (
    flatten_backbone_params,
    has_torch_names,
    read_state_dict,
    save_backbone_params,
)
from detector.models.weights.sources import canonical_vit_state_dict, ignored_vit_keys, is_vit_state_dict, vit_layout
from detector.models.weights.torchvision_resnet import (
    convert_torchvision_resnet,
    ignored_torchvision_keys,
    torchvision_stage_sizes,
)
from detector.models.weights.vit_checks import (
    STANDARD_VITS,
    VITDET_CONFIGS,
    check_vit_file,
    rope_temperature_of,
    timm_vit_size,
    vit_family,
)


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
    check_vit_file(tensors, size, family, f"a ViT of {size} (read from {PATCH_EMBEDDING} and blocks.*)", "")
    name, heads = STANDARD_VITS.get((size.width, size.depth), ("", 0))
    rope = ""
    if ROPE_PERIODS in tensors:
        head_dim = size.width // heads if heads else None
        rope = f", rope='dinov3', rope_temperature={rope_temperature_of(tensors[ROPE_PERIODS], head_dim):g}"
    elif not family.absolute_position:
        rope = ", rope='dinov3' (DINOv3; its rope_temperature=100.0, norm_epsilon=1e-05)"
    # Canonical names and layout, so one file serves any head split, stacking and grid (see `vit`'s docstring).
    np.savez(output_path, **tensors)

    heads_text = f"{heads} for {name}" if heads else "set model.backbone.num_heads"
    config = f"--config={VITDET_CONFIGS[name]} " if name in VITDET_CONFIGS and size.patch_size == 16 else ""
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
        f"ignored: {_group_names(ignored_vit_keys(state_dict)) or 'nothing'}",
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

    What `python -m detector.convert_pretrained` runs; a ViT is told by the
    names of one of the sources (`sources.SOURCES`). A ResNet is converted to this
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
        if not has_torch_names(state_dict):
            raise WeightsFileError(
                "its names are this project's layout already: pass it to --config.model.backbone.pretrained as it is"
            )
        if is_vit_state_dict(state_dict):
            return _convert_timm_vit(state_dict, input_path, output_path)
        return _convert_torchvision(state_dict, input_path, output_path)
    except WeightsFileError as e:
        raise WeightsFileError(f"{input_path}: {e}") from None
