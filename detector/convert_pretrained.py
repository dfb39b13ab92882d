"""Converts torchvision ResNet or timm/transformers ViT weights for this project's backbones, once, before training.

  python -m detector.convert_pretrained --input=resnet50.pth --output=resnet50_backbone.npz
  python -m detector.convert_pretrained --input=vit_base_mae.safetensors --output=vit_b.npz
  python -m detector.convert_pretrained --input=dinov3_vitl16.safetensors --output=dinov3_l.npz

then train with `--config.model.backbone.pretrained=OUTPUT` (a ResNet also
with `--config.model.backbone.norm=frozen_bn`). The input is a state dict
as `.pth`/`.pt` (needs torch), `.safetensors` or `.npz`: a torchvision
ResNet, a timm ViT (MAE, DeiT, `vit_*_dinov2`, `vit_*_reg4_dinov2`,
`vit_*_dinov3`, `eva02_*`), one of DINOv3's own, or a transformers
ViTModel, ViTMAEModel, Dinov2Model, Dinov2WithRegistersModel or
DINOv3ViTModel, told by its patch embedding. The output is a flat `.npz`
that needs neither torch nor safetensors at training time: a ResNet in the
backbone's layout (stage sizes and width from the state dict, so
ResNet-18/34/101/152 convert too); a ViT in timm's names with the unused
tensors dropped, mapped onto the model's blocks (head count, scanned
stacks) and its position grid when loaded, so one file serves every input
size and window layout. The report names the ViT family's config keys
(patch_size, class_token, register_tokens, layer_scale, mlp, qkv_bias, ...);
what no tensor holds (RoPE kind without RoPE buffers, LayerNorm epsilon) is
set in the config (see `detector.models.weights`). Nothing is downloaded.
"""

from __future__ import annotations

from absl import flags

from detector import cli
from detector.errors import ConfigError
from detector.models import weights

_INPUT = flags.DEFINE_string(
    "input",
    None,
    "torchvision ResNet, or timm/transformers ViT (DINOv2, DINOv3, EVA-02, MAE, ...) state dict: "
    ".pth, .pt, .safetensors or .npz.",
)
_OUTPUT = flags.DEFINE_string("output", None, "Where to write the converted backbone (.npz).")
flags.mark_flags_as_required(["input", "output"])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise ConfigError(f"unexpected arguments: {' '.join(argv[1:])}; pass options as --flag=value")
    if not _OUTPUT.value.endswith(".npz"):
        raise ConfigError(
            f"--output={_OUTPUT.value}: the converted backbone is written as .npz; give a name ending in .npz"
        )
    print(weights.convert_pretrained_file(_INPUT.value, _OUTPUT.value))


if __name__ == "__main__":
    cli.run(main)
