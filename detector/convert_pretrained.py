"""Converts torchvision ResNet weights to this project's backbone layout, once, ahead of training.

  python -m detector.convert_pretrained --input=resnet50.pth --output=resnet50_backbone.npz

then train with `--config.model.backbone.norm=frozen_bn
--config.model.backbone.pretrained=resnet50_backbone.npz`. The input is a
torchvision state dict as `.pth`/`.pt` (needs torch), `.safetensors` or
`.npz`; the output is a flat `.npz` (`stage1_block1/Conv_0/kernel`, ...)
that needs neither torch nor a conversion at training time. Stage sizes
and width come from the state dict, so ResNet-18/34/101/152 convert too.
Nothing is downloaded.
"""

from __future__ import annotations

from absl import flags

from detector import cli
from detector.errors import ConfigError
from detector.models import weight_import

_INPUT = flags.DEFINE_string("input", None, "torchvision ResNet state dict: .pth, .pt, .safetensors or .npz.")
_OUTPUT = flags.DEFINE_string("output", None, "Where to write the converted backbone (.npz).")
flags.mark_flags_as_required(["input", "output"])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise ConfigError(f"unexpected arguments: {' '.join(argv[1:])}; pass options as --flag=value")
    if not _OUTPUT.value.endswith(".npz"):
        raise ConfigError(
            f"--output={_OUTPUT.value}: the converted backbone is written as .npz; give a name ending in .npz"
        )
    print(weight_import.convert_torchvision_file(_INPUT.value, _OUTPUT.value))


if __name__ == "__main__":
    cli.run(main)
