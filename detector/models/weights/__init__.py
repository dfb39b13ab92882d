"""Pretrained backbone weights: other projects' checkpoint files -> this project's backbone parameters.

`load_backbone_params` is what `config.model.backbone.pretrained` runs,
`convert_pretrained_file` what `python -m detector.convert_pretrained` runs.
A file's names tell what it holds: this project's flat layout
(`stem_conv/kernel`), loaded as it is; a torchvision ResNet, converted; or a
ViT in the layout of one of the checkpoint sources, renamed to one canonical
form (timm's `VisionTransformer` names) and then mapped onto
`detector.models.vit.ViT`. Nothing is downloaded.

  files.py                  reading .npz, .safetensors, .pth/.pt; this project's flat .npz
  torchvision_resnet.py     torchvision ResNet state dicts -> ResNet(norm='frozen_bn') parameters
  canonical.py              the canonical ViT names; `Source`, what a checkpoint source declares
  sources.py                the registry of ViT sources: which one a file is in, its canonical tensors
    timm_vit.py             timm VisionTransformer and Eva (MAE, DeiT, DINOv2, DINOv3, EVA-02)
    dinov3_release.py       DINOv3's own checkpoints (storage_tokens, rope_embed.periods)
    transformers_dinov2.py  transformers Dinov2Model, Dinov2WithRegistersModel
    transformers_dinov3.py  transformers DINOv3ViTModel
    transformers_vit.py     transformers ViTModel, ViTMAEModel
  vit_checks.py             a canonical ViT's size and family, whether it fits a model, the config keys that fix it
  vit.py                    canonical ViT tensors -> ViT parameters (head split, scanned stacks, position grid)
  loading.py                a file into a model's parameters (dtype, sharding and boxes kept)
  converter.py              a file -> a flat .npz and the report of what it holds

Each source module declares one `Source`: its rename tables, how its files
are recognised and which of their tensors no backbone uses; adding a source
is such a module and a line in `sources.SOURCES`.
"""

from detector.models.weights.canonical import Source
from detector.models.weights.converter import convert_pretrained_file
from detector.models.weights.files import flatten_backbone_params, read_state_dict, save_backbone_params
from detector.models.weights.loading import load_backbone_params
from detector.models.weights.sources import (
    SOURCES,
    canonical_vit_state_dict,
    ignored_vit_keys,
    is_vit_state_dict,
    vit_layout,
)
from detector.models.weights.torchvision_resnet import (
    convert_torchvision_resnet,
    ignored_torchvision_keys,
    torchvision_stage_sizes,
)
from detector.models.weights.vit import convert_timm_vit, resize_position_embedding

__all__ = [
    "SOURCES",
    "Source",
    "canonical_vit_state_dict",
    "convert_pretrained_file",
    "convert_timm_vit",
    "convert_torchvision_resnet",
    "flatten_backbone_params",
    "ignored_torchvision_keys",
    "ignored_vit_keys",
    "is_vit_state_dict",
    "load_backbone_params",
    "read_state_dict",
    "resize_position_embedding",
    "save_backbone_params",
    "torchvision_stage_sizes",
    "vit_layout",
]
